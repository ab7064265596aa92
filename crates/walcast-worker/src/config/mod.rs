//! Options shared by the binaries. Every option is a `--flag` and an environment variable,
//! each default defined once (a const of the crate that owns the setting).

mod cdc;
mod changes;
mod control;
mod db;
mod help;
mod http;
mod nats;
mod outbox;

pub use cdc::{CdcArgs, LeaseArgs, RlsModeArg};
pub use changes::ChangeStreamArgs;
pub use control::{RolesArgs, SecretsArgs};
pub use db::{DbArgs, SourceSpec, DEFAULT_SLOT_NAME};
pub use help::{is_secret_env, secret_envs_shown};
pub use http::{HttpArgs, DEFAULT_PORT};
pub use nats::NatsAuthArgs;
pub use outbox::{OutboxArgs, OutboxStreamArgs};

pub use crate::telemetry::{LogArgs, LogFormat};

/// Connection strings (URLs and `key=value`) with their secrets hidden, for logs and the
/// effective configuration.
pub use walcast_core::redact::redact_url;
