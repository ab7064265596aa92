//! What can go wrong on the bus, and whether trying again can help ([`BusError::retry`]).
//!
//! The NATS failures keep async-nats' own error (its kind and its source) as their
//! [`source`](std::error::Error::source); the messages read as they always did.

use std::time::Duration;

use async_nats::client::{FlushError, FlushErrorKind, PublishErrorKind, RequestErrorKind};
use async_nats::{PublishError, RequestError, SubscribeError, SubscribeErrorKind};

#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("cannot connect to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("publish failed: {0}")]
    Publish(#[source] PublishError),
    /// The message is larger than the server accepts: retrying cannot help.
    #[error(
        "publish failed: the message has {size} bytes, over the server's max_payload of {max}"
    )]
    PayloadTooLarge { size: usize, max: usize },
    /// A request/reply message could not be encoded as JSON.
    #[error("publish failed: {0}")]
    Encode(#[source] serde_json::Error),
    /// The cdc-worker's answer to a subscription request is not one.
    #[error("publish failed: bad registration reply: {0}")]
    BadReply(#[source] serde_json::Error),
    /// The subscription request could not be delivered or was not answered.
    #[error("publish failed: no cdc-worker answered the subscription request: {0}")]
    Request(#[source] RequestError),
    /// No cdc-worker answered the subscription request within the caller's timeout.
    #[error("publish failed: no cdc-worker answered the subscription request in time")]
    RequestTimeout,
    /// The in-process cdc-worker did not register the subscriptions within the timeout.
    #[error("publish failed: subscription registration timed out")]
    RegisterTimeout,
    #[error("subscribe failed: {0}")]
    Subscribe(#[source] SubscribeError),
    /// A subscription we serve ended (its connection was closed); names which one.
    #[error("subscribe failed: {0} closed")]
    Closed(&'static str),
    /// Subscription requests on an in-process bus go to the worker's handler, which the
    /// caller did not give.
    #[error("subscribe failed: an in-process bus needs the worker's subscription handler")]
    NoSubsHandler,
    #[error("barrier not confirmed by the NATS server within {0:?}")]
    BarrierTimeout(Duration),
    #[error("barrier failed: {0}")]
    Barrier(#[source] BarrierError),
}

/// Why a barrier failed (see [`crate::Bus::barrier`]).
#[derive(Debug, thiserror::Error)]
pub enum BarrierError {
    /// Publishing the barrier's token failed.
    #[error("{0}")]
    Publish(#[source] PublishError),
    /// Flushing the connection failed.
    #[error("{0}")]
    Flush(#[source] FlushError),
    /// The barrier's own subscription ended (the connection was closed).
    #[error("barrier subscription closed")]
    Closed,
}

/// Whether doing the same call again, later, can succeed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// The cause can pass: the connection is down and reconnecting, nothing answered in
    /// time, no cdc-worker is listening yet (none leads). Retry after a pause.
    Transient,
    /// The same call fails the same way: the message is too large or cannot be encoded,
    /// a subject is invalid, the configuration is wrong, or the NATS client was closed
    /// (async-nats reconnects by itself forever, so a closed client is one shut down).
    Never,
}

impl BusError {
    /// Whether trying again can help (see [`Retry`]).
    pub fn retry(&self) -> Retry {
        match self {
            BusError::Publish(e) => publish_retry(e.kind()),
            BusError::Request(e) => match e.kind() {
                RequestErrorKind::TimedOut
                | RequestErrorKind::NoResponders
                | RequestErrorKind::Other => Retry::Transient,
                RequestErrorKind::InvalidSubject | RequestErrorKind::MaxPayloadExceeded => {
                    Retry::Never
                }
            },
            BusError::Subscribe(e) => match e.kind() {
                // Other: the command could not reach the connection (client closed).
                SubscribeErrorKind::InvalidSubject
                | SubscribeErrorKind::InvalidQueueName
                | SubscribeErrorKind::Other => Retry::Never,
            },
            BusError::Barrier(e) => e.retry(),
            BusError::RequestTimeout | BusError::RegisterTimeout | BusError::BarrierTimeout(_) => {
                Retry::Transient
            }
            // Connect: the connection itself is retried in the background; failing here
            // means the URL, the credentials files or the TLS settings are unusable.
            BusError::Connect { .. }
            | BusError::PayloadTooLarge { .. }
            | BusError::Encode(_)
            | BusError::BadReply(_)
            | BusError::Closed(_)
            | BusError::NoSubsHandler => Retry::Never,
        }
    }
}

impl BarrierError {
    fn retry(&self) -> Retry {
        match self {
            BarrierError::Publish(e) => publish_retry(e.kind()),
            // FlushError: the connection dropped before the flush completed.
            BarrierError::Flush(e) => match e.kind() {
                FlushErrorKind::FlushError => Retry::Transient,
                FlushErrorKind::SendError => Retry::Never,
            },
            BarrierError::Closed => Retry::Never,
        }
    }
}

/// Send: the command could not reach the connection, which happens only once the client
/// was closed (while reconnecting, publishes wait in its queue).
fn publish_retry(kind: PublishErrorKind) -> Retry {
    match kind {
        PublishErrorKind::MaxPayloadExceeded
        | PublishErrorKind::InvalidSubject
        | PublishErrorKind::Send => Retry::Never,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn the_nats_error_is_kept_as_the_source_with_its_kind() {
        let e = BusError::Publish(PublishError::new(PublishErrorKind::InvalidSubject));
        assert_eq!(e.to_string(), "publish failed: invalid subject");
        let source = e.source().expect("a source");
        let nats = source
            .downcast_ref::<PublishError>()
            .expect("async-nats' error");
        assert_eq!(nats.kind(), PublishErrorKind::InvalidSubject);
        assert_eq!(e.retry(), Retry::Never);
    }

    #[test]
    fn retry_tells_passing_causes_from_lasting_ones() {
        let no_worker = BusError::Request(RequestError::new(RequestErrorKind::NoResponders));
        assert_eq!(no_worker.retry(), Retry::Transient);
        let dropped = BusError::Barrier(BarrierError::Flush(FlushError::new(
            FlushErrorKind::FlushError,
        )));
        assert_eq!(dropped.retry(), Retry::Transient);
        assert_eq!(dropped.to_string(), "barrier failed: flush failed");
        assert_eq!(BusError::RequestTimeout.retry(), Retry::Transient);
        let big = BusError::PayloadTooLarge { size: 2, max: 1 };
        assert_eq!(big.retry(), Retry::Never);
        assert_eq!(BusError::Closed("admin subscription").retry(), Retry::Never);
        assert_eq!(
            BusError::Closed("admin subscription").to_string(),
            "subscribe failed: admin subscription closed"
        );
    }
}
