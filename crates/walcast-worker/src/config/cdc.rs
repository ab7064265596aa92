//! The cdc-worker's options: reading the slot, realtime delivery's limits, leader
//! election, and (in their own modules) the outbox relay and change streams.

use std::time::Duration;

use clap::{Args, ValueEnum};
use walcast_lease::LeaseMode;
use walcast_pipeline::config as pipeline;
use walcast_pipeline::{PipelineConfig, ReadConfig, SourceKind};
use walcast_realtime::{RealtimeConfig, RlsMode, RlsOptions};

use super::changes::ChangeStreamArgs;
use super::db::{DbArgs, SourceSpec, DEFAULT_SLOT_NAME};
use super::outbox::OutboxArgs;

#[derive(Args, Clone, Debug)]
pub struct CdcArgs {
    /// Where changes are read from: `stream` (replication protocol, START_REPLICATION) or
    /// `poll` (SQL peek/advance, the reference-compatible mode).
    #[arg(long = "cdc-source", env = "CDC_SOURCE", default_value = "stream")]
    pub source: SourceKind,
    /// Stream mode: how often progress is acknowledged to Postgres, in milliseconds.
    #[arg(long, env = "CDC_ACK_INTERVAL_MS", default_value_t = pipeline::DEFAULT_ACK_INTERVAL.as_millis() as u64)]
    pub ack_interval_ms: u64,
    /// The leader of each source writes a heartbeat (a transactional logical message,
    /// prefix `walcast.heartbeat`) on its database this often, in milliseconds, so its
    /// slot always has a recent commit to acknowledge even when the tables it reads are
    /// idle; 0: off. A failed beat is logged, counted and tried again at the next one.
    #[arg(long, env = "CDC_HEARTBEAT_INTERVAL_MS", default_value_t = pipeline::DEFAULT_HEARTBEAT_INTERVAL.as_millis() as u64)]
    pub heartbeat_interval_ms: u64,
    /// Name of the logical replication slot (created with wal2json when missing).
    #[arg(long, env = "CDC_SLOT_NAME", default_value = DEFAULT_SLOT_NAME)]
    pub slot_name: String,
    /// Delivery lanes: each project's changes are authorized and published by a lane of
    /// its own (its own RLS checker and connections, opened when first needed), in order
    /// within the project and independently of the others, up to this many lanes;
    /// beyond, projects share lanes by hash.
    #[arg(long, env = "CDC_NUM_SHARDS", default_value_t = walcast_realtime::DEFAULT_SHARDS, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub num_shards: u16,
    /// How long a project's changes may wait for delivery (its RLS checks too slow to keep
    /// up): older ones are not checked nor delivered; its subscribers get a `system`
    /// error saying so. Other projects are never held.
    #[arg(long, env = "REALTIME_MAX_LAG_MS", default_value_t = walcast_realtime::DEFAULT_MAX_LAG_MS)]
    pub max_lag_ms: u64,
    /// Bytes of changes a project may have waiting for delivery; past it, new ones are
    /// skipped the same way.
    #[arg(long, env = "REALTIME_MAX_LAG_BYTES", default_value_t = walcast_realtime::DEFAULT_MAX_LAG_BYTES)]
    pub max_lag_bytes: usize,
    /// A change whose values (new and old row, as JSON) are larger is delivered the way
    /// Supabase does: large values dropped, the primary key kept, `errors: ["Error 413:
    /// Payload Too Large"]`. The bus's own `max_payload` lowers it further.
    #[arg(long, env = "MAX_RECORD_BYTES", default_value_t = walcast_realtime::DEFAULT_MAX_RECORD_BYTES)]
    pub max_record_bytes: usize,
    /// Messages kept per front for resending what a front missed (NATS dropped them while
    /// its link was down); the oldest go first past this, CDC_RESEND_MAX_BYTES or
    /// CDC_RESEND_MAX_SECS.
    #[arg(long, env = "CDC_RESEND_MAX_MESSAGES", default_value_t = walcast_realtime::DEFAULT_RESEND_MESSAGES)]
    pub resend_max_messages: usize,
    /// Bytes kept per front for resending.
    #[arg(long, env = "CDC_RESEND_MAX_BYTES", default_value_t = walcast_realtime::DEFAULT_RESEND_BYTES)]
    pub resend_max_bytes: usize,
    /// Seconds a message is kept for resending.
    #[arg(long, env = "CDC_RESEND_MAX_SECS", default_value_t = walcast_realtime::DEFAULT_RESEND_SECS)]
    pub resend_max_secs: u64,
    /// Changes authorized together: one statement per (table, role, claims) covers them all.
    #[arg(long, env = "CDC_RLS_BATCH", default_value_t = walcast_realtime::DEFAULT_RLS_BATCH)]
    pub rls_batch: usize,
    /// `batched` (default) or `naive`: one check per subscriber per change, one statement
    /// per round trip. Naive exists to measure what batching saves; do not run it.
    #[arg(long, env = "CDC_RLS_MODE", default_value = "batched")]
    pub rls_mode: RlsModeArg,
    /// Connections per shard over which a batch with many (role, claims) groups is
    /// spread, so one project's checks can use more than one database core.
    #[arg(long, env = "CDC_RLS_CONNECTIONS", default_value_t = walcast_realtime::DEFAULT_RLS_CONNECTIONS, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub rls_connections: u16,
    /// statement_timeout of each RLS check, in milliseconds: a slow policy denies its
    /// subscribers instead of stalling the stream.
    #[arg(long, env = "CDC_RLS_CHECK_TIMEOUT_MS", default_value_t = walcast_realtime::DEFAULT_RLS_CHECK_TIMEOUT_MS)]
    pub rls_check_timeout_ms: u64,
    /// Rows per peek to start with; the poller grows it while polls come back full.
    #[arg(long, env = "CDC_POLL_BATCH", default_value_t = pipeline::DEFAULT_POLL_BATCH)]
    pub poll_batch: usize,
    /// Upper bound of the adaptive peek size (bounds server-side work per poll).
    #[arg(long, env = "CDC_POLL_MAX_BATCH", default_value_t = pipeline::DEFAULT_POLL_MAX_BATCH)]
    pub poll_max_batch: usize,
    /// Wait after an empty poll, in milliseconds.
    #[arg(long, env = "CDC_POLL_IDLE_MS", default_value_t = pipeline::DEFAULT_POLL_IDLE.as_millis() as u64)]
    pub poll_idle_ms: u64,
    /// Re-read the realtime table registry at least this often, in milliseconds
    /// (registry edits are also seen in WAL order, at once).
    #[arg(long, env = "TABLE_FILTER_REFRESH_MS", default_value_t = pipeline::DEFAULT_FILTER_REFRESH.as_millis() as u64)]
    pub table_filter_refresh_ms: u64,
    /// Distinct subscription classes (table, event, filter, columns and role) the worker
    /// keeps per project: a join that would add one more is refused with an error.
    #[arg(long, env = "CDC_MAX_CLASSES_PER_PROJECT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_CLASSES_PER_PROJECT)]
    pub max_classes_per_project: usize,
    /// Distinct subscription classes with a subscription of one front.
    #[arg(long, env = "CDC_MAX_CLASSES_PER_FRONT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_CLASSES_PER_FRONT)]
    pub max_classes_per_front: usize,
    /// Bytes of compiled filter patterns (`like`, `ilike`, `match`, `imatch`: each its
    /// automata and search cache) the worker keeps for one project's classes: a join
    /// that would add more is refused with an error.
    #[arg(long, env = "CDC_MAX_FILTER_BYTES_PER_PROJECT", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_FILTER_BYTES_PER_PROJECT)]
    pub max_filter_bytes_per_project: usize,
    /// The same, for every project's classes together.
    #[arg(long, env = "CDC_MAX_FILTER_BYTES", default_value_t = walcast_realtime::subscriptions::matcher::DEFAULT_MAX_FILTER_BYTES)]
    pub max_filter_bytes: usize,
    /// Start even when max_slot_wal_keep_size is -1 (a stalled slot can then fill the disk).
    #[arg(long, env = "CDC_ALLOW_UNBOUNDED_WAL", default_value_t = false)]
    pub allow_unbounded_wal: bool,
    #[command(flatten)]
    pub lease: LeaseArgs,
    #[command(flatten)]
    pub outbox: OutboxArgs,
    #[command(flatten)]
    pub changes: ChangeStreamArgs,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RlsModeArg {
    Batched,
    Naive,
}

#[derive(Args, Clone, Debug)]
pub struct LeaseArgs {
    /// Leader election: `auto` (Kubernetes in a cluster, else Postgres), `kubernetes`,
    /// `postgres` (a lease row in `walcast.leases`), or `none` (always leader:
    /// development only).
    #[arg(long, env = "LEASE_MODE", default_value = "auto")]
    pub lease_mode: LeaseMode,
    /// Name of the lease (workers with the same name compete); defaults to the slot name
    /// (in Kubernetes mode made a valid object name: `walcast_cdc_slot` → `walcast-cdc-slot`).
    #[arg(long, env = "LEASE_NAME")]
    pub lease_name: Option<String>,
    /// Kubernetes namespace of the Lease object.
    #[arg(long, env = "LEASE_NAMESPACE", default_value = "default")]
    pub lease_namespace: String,
    /// Lease duration in seconds (at least 3): the holder renews every third of it and
    /// stops acting (fenced) a fifth of it before the lease could expire; a holder that
    /// stops renewing is replaced about one duration after its last renewal.
    #[arg(long, env = "LEASE_DURATION_SECS", default_value_t = 15)]
    pub lease_duration_secs: u64,
    /// Kubernetes mode: the API server's URL, used without credentials (e.g.
    /// `http://127.0.0.1:8001` through `kubectl proxy`); unset, the kubeconfig, else the
    /// in-cluster configuration (service account).
    #[arg(long, env = "LEASE_KUBE_API_URL", hide_env_values = true)]
    pub lease_kube_api_url: Option<String>,
    /// Kubernetes mode: the kubeconfig files (`:`-separated, merged as kubectl does);
    /// unset, `~/.kube/config`. A kubeconfig that cannot be read is an error.
    #[arg(long = "kubeconfig", env = "KUBECONFIG")]
    pub lease_kubeconfig: Option<std::ffi::OsString>,
    /// Kubernetes mode: the kubeconfig context to use; unset, its current context.
    #[arg(long, env = "LEASE_KUBE_CONTEXT")]
    pub lease_kube_context: Option<String>,
}

impl LeaseArgs {
    pub fn duration(&self) -> Duration {
        Duration::from_secs(self.lease_duration_secs.max(3))
    }
}

impl CdcArgs {
    /// The matcher's class limits.
    pub fn class_limits(&self) -> walcast_realtime::subscriptions::matcher::ClassLimits {
        walcast_realtime::subscriptions::matcher::ClassLimits {
            per_project: self.max_classes_per_project,
            per_front: self.max_classes_per_front,
            filter_bytes_per_project: self.max_filter_bytes_per_project,
            filter_bytes: self.max_filter_bytes,
        }
    }

    /// The default source: `DATABASE_URL` and `CDC_SLOT_NAME`.
    pub fn default_source(&self, db: &DbArgs) -> SourceSpec {
        SourceSpec {
            name: walcast_bus::source::DEFAULT_SOURCE.to_string(),
            database_url: db.database_url.clone(),
            replication_url: db.replication_url().to_string(),
            slot_name: self.slot_name.clone(),
            check_url: db.check_database_url.clone(),
        }
    }

    /// The pipeline's settings (slot, source, reading) for the default source.
    pub fn to_config(&self, db: &DbArgs, origin: &str) -> PipelineConfig {
        self.source_config(&self.default_source(db), origin)
    }

    /// The pipeline's settings for `source`.
    pub fn source_config(&self, source: &SourceSpec, origin: &str) -> PipelineConfig {
        PipelineConfig {
            database_url: source.database_url.clone(),
            replication_url: source.replication_url.clone(),
            source_name: source.name.clone(),
            allow_unbounded_wal: self.allow_unbounded_wal,
            source: self.source,
            ack_interval: Duration::from_millis(self.ack_interval_ms),
            heartbeat: Duration::from_millis(self.heartbeat_interval_ms),
            origin: origin.to_string(),
            take_over_slot: self.lease.lease_mode != LeaseMode::None,
            read: ReadConfig {
                slot: source.slot_name.clone(),
                min_batch: self.poll_batch,
                max_batch: self.poll_max_batch,
                idle: Duration::from_millis(self.poll_idle_ms),
                filter_refresh: Duration::from_millis(self.table_filter_refresh_ms),
            },
        }
    }

    /// Realtime delivery's settings (row-level security, record size).
    pub fn realtime_config(&self, db: &DbArgs) -> RealtimeConfig {
        let check = db.check_database_url.as_deref().unwrap_or_default();
        self.realtime_config_for(&db.database_url, check)
    }

    /// Realtime delivery's settings: its catalog on `database_url`, its checks on
    /// `check_url` (the check login).
    pub fn realtime_config_for(&self, database_url: &str, check_url: &str) -> RealtimeConfig {
        RealtimeConfig {
            projects: None,
            database_url: database_url.to_string(),
            check_url: check_url.to_string(),
            max_record_bytes: self.max_record_bytes,
            lanes: walcast_realtime::LaneLimits {
                max_lag: Duration::from_millis(self.max_lag_ms),
                max_bytes: self.max_lag_bytes,
            },
            links: walcast_realtime::LinkOptions {
                max_messages: self.resend_max_messages,
                max_bytes: self.resend_max_bytes,
                max_age: Duration::from_secs(self.resend_max_secs),
            },
            rls: RlsOptions {
                mode: match self.rls_mode {
                    RlsModeArg::Batched => RlsMode::Batched,
                    RlsModeArg::Naive => RlsMode::Naive,
                },
                max_batch: self.rls_batch.max(1),
                shards: usize::from(self.num_shards),
                timeout_ms: self.rls_check_timeout_ms,
                connections: usize::from(self.rls_connections),
            },
        }
    }
}
