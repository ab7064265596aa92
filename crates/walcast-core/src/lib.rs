//! # walcast-core
//!
//! The few words every walcast crate shares, each defined once, with no IO and no heavy
//! dependency (so that depending on it costs nothing):
//!
//! - [`Lsn`]: a Postgres WAL position (`pg_lsn`);
//! - [`DEFAULT_PROJECT`], [`DEFAULT_SCHEMA`]: the project every single-tenant deployment
//!   is, and the schema its tables live in;
//! - [`sql`]: identifier quoting and parsing (values are never quoted: always bound);
//! - [`timestamp`]: Postgres timestamp text → RFC 3339 UTC milliseconds (commit times);
//! - [`Backoff`]: the one retry schedule (doubling from a base up to a cap);
//! - `source_scope` (feature `source_scope`, with tokio): which source a task works
//!   for, so the metrics it records carry a `source` label.
//! - [`ChangeId`]: the identity of a change-stream message (`Nats-Msg-Id`, event id).
//! - [`redact`]: connection strings (URLs, `key=value`) with their secrets hidden, for
//!   logs and the effective configuration.

#![forbid(unsafe_code)]

mod backoff;
pub mod change_id;
mod lsn;
pub mod pg_snapshot;
pub mod redact;
#[cfg(feature = "source_scope")]
pub mod source_scope;
pub mod sql;
pub mod timestamp;

pub use backoff::Backoff;
pub use change_id::ChangeId;
pub use lsn::{Lsn, ParseLsnError};

/// The project of a deployment without a project directory, and of tokens without a
/// `project` claim.
pub const DEFAULT_PROJECT: &str = "default";

/// The schema of the default project's tables (and of a table named without one).
pub const DEFAULT_SCHEMA: &str = "public";
