//! Why the relay stops a session.

use walcast_pipeline::{ConsumerError, Retry};

/// Why the relay stopped a session.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("database: {0}")]
    Connect(#[from] walcast_pgtls::ConnectError),
    #[error("no database connection (not started)")]
    NotStarted,
    /// The leadership term ended while events were outstanding.
    #[error("{0}")]
    Fenced(String),
    /// The sender task is gone (the session is ending).
    #[error("the outbox sender stopped")]
    SenderStopped,
    /// The subscription JetStream's answers come on ended (the NATS client is gone).
    #[error("JetStream's answers stopped coming: the NATS connection closed")]
    AnswersClosed,
    /// Whether an event's project is on this source could not be told.
    #[error("cannot tell the source's projects: {0}")]
    Gate(String),
}

impl From<RelayError> for ConsumerError {
    fn from(e: RelayError) -> ConsumerError {
        let retry = match e {
            RelayError::Fenced(_) => Retry::Fenced,
            _ => Retry::Backoff,
        };
        ConsumerError::new(retry, e)
    }
}
