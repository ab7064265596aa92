//! What stops the consumer, as kinds a caller can branch on.

use async_nats::jetstream::context::{GetStreamError, GetStreamErrorKind};
use async_nats::jetstream::stream::ConsumerError;
use async_nats::jetstream::ErrorCode;

/// An error that ends [`InboxConsumer::bind`](crate::InboxConsumer::bind),
/// [`InboxConsumer::run`](crate::InboxConsumer::run) or an [`Inbox`](crate::Inbox)
/// operation. A failing handler is not one: its delivery is rolled back and tried again.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InboxError {
    /// A setting is invalid; nothing was contacted. Fix the configuration.
    #[error("invalid inbox consumer configuration: {0}")]
    Config(String),
    /// The JetStream stream could not be read: it does not exist yet (see
    /// [`InboxError::is_stream_not_found`]; the relay creates it when it starts) or the
    /// request failed.
    #[error("JetStream stream {stream:?}: {source}")]
    Stream {
        /// The stream's name.
        stream: String,
        /// What JetStream or the client said.
        #[source]
        source: GetStreamError,
    },
    /// The durable consumer could not be created or updated (for example a setting the
    /// server does not allow changing on an existing durable).
    #[error("JetStream durable consumer {durable:?} on stream {stream:?}: {source}")]
    Consumer {
        /// The stream's name.
        stream: String,
        /// The durable consumer's name.
        durable: String,
        /// What JetStream or the client said.
        #[source]
        source: ConsumerError,
    },
    /// The Postgres connection of [`InboxConsumer::run`](crate::InboxConsumer::run) is
    /// closed (the server went away, the session was terminated): connect again and bind
    /// a new consumer. The delivery being handled and the rest of its batch were nak'd;
    /// whether its commit happened, the inbox tells on the redelivery.
    #[error("Postgres connection lost: {context}: {source}")]
    ConnectionLost {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
    /// A Postgres statement of this crate failed: the inbox table is missing or
    /// unusable, or the connection failed (see [`InboxError::is_connection_lost`]).
    #[error("Postgres: {context}: {source}")]
    Postgres {
        /// What was being done.
        context: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },
}

impl InboxError {
    pub(crate) fn postgres(context: &'static str, source: tokio_postgres::Error) -> InboxError {
        InboxError::Postgres { context, source }
    }

    /// The stream does not exist (yet): JetStream error code 10059.
    pub fn is_stream_not_found(&self) -> bool {
        matches!(self, InboxError::Stream { source, .. }
            if matches!(source.kind(), GetStreamErrorKind::JetStream(e)
                if e.error_code() == ErrorCode::STREAM_NOT_FOUND))
    }

    /// The Postgres connection is closed: connect again (and bind a new consumer).
    pub fn is_connection_lost(&self) -> bool {
        match self {
            InboxError::ConnectionLost { .. } => true,
            InboxError::Postgres { source, .. } => source.is_closed(),
            _ => false,
        }
    }
}
