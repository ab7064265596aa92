//! End-to-end tests: real Postgres with wal2json and real nats-server from the test kit,
//! the walcast binaries and processes as users run them. One test binary (one link of the
//! workspace); each module owns one area.

#[macro_use]
mod support;

mod changes;
mod client_subjects;
mod crash;
mod db_binary;
mod drain;
mod fenced_consumers;
mod front_exhaust;
mod front_gaps;
mod front_hostile;
mod front_pending_commands;
mod front_pending_joins;
mod front_slow;
mod hostile_classes;
mod hostile_limits;
mod hostile_matching;
mod hostile_messages;
mod lease;
mod management;
mod many_sources;
mod nats_outage;
mod nats_permissions;
mod operator_figures;
mod ops_figures;
mod outbox;
mod outbox_failover;
mod outbox_naive;
mod outbox_quorum;
mod pipeline;
mod presence;
mod private_projects;
mod project_limits;
mod project_rates;
mod projects;
mod registry;
mod replication_role;
mod revoked_sessions;
mod rls;
mod secrets;
mod secrets_at_rest;
mod security;
mod slot;
mod snapshots;
mod snapshots_api;
mod source_metrics;
mod sources;
mod sse_snapshot;
mod subs;
mod tenant_code;
