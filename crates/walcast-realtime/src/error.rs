//! Every error of realtime delivery, in one module that imports no other of the crate
//! (so that any module can use them without an import circle). Each keeps its cause as
//! a source; [`RealtimeError::retry`] says whether retrying can help.

use walcast_control::{ControlError, RealtimeTablesError};
use walcast_pgtls::db_message;
use walcast_pipeline::change_event::EventError;
use walcast_pipeline::{ConsumerError, PipelineError, PublishError, Retry};

#[derive(Debug, thiserror::Error)]
pub enum RealtimeError {
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    #[error("realtime tables: {0}")]
    RealtimeTables(#[from] RealtimeTablesError),
    /// A read of the control database (the projects of a source, a check session).
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("building event: {0}")]
    Event(#[from] EventError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A row change arrived outside a transaction (wal2json options not as asked).
    #[error("row change of {0} outside a transaction (is include-transaction on?)")]
    OutsideTransaction(String),
    /// The RLS checker has no connection to check with (a bug, not a configuration).
    #[error("no RLS connection: {0}")]
    RlsUnavailable(&'static str),
    /// A batch's row-level security checks ran past its deadline (the project's lag
    /// bound): they were cancelled, and the batch is skipped as lagging.
    #[error("row-level security checks ran past the lag bound and were cancelled")]
    CheckDeadline,
    /// The catalog snapshot does not show the state at the position being judged (see
    /// `catalog/change.rs`): what depends on it is withheld.
    #[error("catalog state does not match the WAL position (position {view}, snapshot epoch {snapshot:?}, {})", if *.ahead { "snapshot ahead" } else { "snapshot behind" })]
    CatalogMoved {
        view: String,
        snapshot: Option<i64>,
        ahead: bool,
    },
}

impl RealtimeError {
    /// Whether retrying can help: a closed fence ends the term; everything else here is
    /// a fault of the moment (a connection, a catalog read racing DDL) or, once
    /// retried, shows itself again in the logs and `/health`.
    pub fn retry(&self) -> Retry {
        match self {
            RealtimeError::Publish(e) => e.retry(),
            RealtimeError::Pipeline(e) => e.retry(),
            _ => Retry::Backoff,
        }
    }
}

impl From<walcast_pgtls::ConnectError> for RealtimeError {
    fn from(e: walcast_pgtls::ConnectError) -> RealtimeError {
        match e {
            walcast_pgtls::ConnectError::Tls(e) => RealtimeError::Tls(e),
            walcast_pgtls::ConnectError::Postgres(e) => RealtimeError::Db(e),
        }
    }
}

impl From<walcast_lease::Fenced> for RealtimeError {
    fn from(e: walcast_lease::Fenced) -> RealtimeError {
        RealtimeError::Publish(PublishError::Fenced(e))
    }
}

impl From<RealtimeError> for ConsumerError {
    fn from(e: RealtimeError) -> ConsumerError {
        ConsumerError::new(e.retry(), e)
    }
}
