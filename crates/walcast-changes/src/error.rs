//! The change-stream consumer's error. Each keeps its cause as a source;
//! [`ChangesError::retry`] says whether retrying can help.

use walcast_control::{ControlError, RealtimeTablesError};
use walcast_pgtls::db_message;
use walcast_pipeline::change_event::EventError;
use walcast_pipeline::{ConsumerError, PipelineError, PublishError, Retry};

#[derive(Debug, thiserror::Error)]
pub enum ChangesError {
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    #[error("change-stream tables: {0}")]
    Tables(#[from] RealtimeTablesError),
    /// A read of the control database (the projects of a source).
    #[error(transparent)]
    Control(#[from] ControlError),
    #[error("building event: {0}")]
    Event(#[from] EventError),
    #[error(transparent)]
    Publish(#[from] PublishError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
}

impl ChangesError {
    /// Whether retrying can help: a closed fence ends the term; everything else here is
    /// a fault of the moment (a connection, a catalog read racing DDL) or, once retried,
    /// shows itself again in the logs and `/health`.
    pub fn retry(&self) -> Retry {
        match self {
            ChangesError::Publish(e) => e.retry(),
            ChangesError::Pipeline(e) => e.retry(),
            _ => Retry::Backoff,
        }
    }
}

impl From<walcast_pgtls::ConnectError> for ChangesError {
    fn from(e: walcast_pgtls::ConnectError) -> ChangesError {
        match e {
            walcast_pgtls::ConnectError::Tls(e) => ChangesError::Tls(e),
            walcast_pgtls::ConnectError::Postgres(e) => ChangesError::Db(e),
        }
    }
}

impl From<ChangesError> for ConsumerError {
    fn from(e: ChangesError) -> ConsumerError {
        ConsumerError::new(e.retry(), e)
    }
}
