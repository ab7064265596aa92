//! The one way a consumer sends anything: a [`Publisher`], made by the session for each
//! consumer, holding the bus and the leadership term's fence so that no consumer holds
//! either.
//!
//! Every message it sends is
//! - **fenced**: the term's fence is checked right before the hand-over to the bus, so a
//!   leader that lost its lease sends nothing more (what a fence cannot do is in
//!   docs/architecture.md "Leader election and fencing": a message already handed to the
//!   NATS client before a freeze);
//! - **stamped**: `Walcast-Origin` (this process), `Walcast-Term` (the term, which fronts
//!   use to drop a late message of an older leader) and `Walcast-Lsn` (the commit
//!   position; `Walcast-Seq`, the change's place in its transaction, when given).
//!
//! Core NATS messages go through [`Publisher::publish`] and [`Publisher::barrier`];
//! JetStream messages (which need the server's acknowledgement per message) through the
//! [`JetStreamPublisher`] that [`Publisher::jetstream`] builds on the same connection.

use std::sync::Arc;

use async_nats::jetstream::context::{ContextBuilder, PublishAckFuture, Yes};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use walcast_bus::source::HEADER_SOURCE;
use walcast_bus::{Bus, BusError, HEADER_LSN, HEADER_ORIGIN, HEADER_SEQ, HEADER_TERM};
use walcast_lease::{Action, Fence, Fenced};
use walcast_wal2json::Lsn;

use crate::error::{ConsumerError, Retry};
use crate::telemetry;

/// Where a message comes from in the WAL: its transaction's commit position and, for a
/// change, its place in the transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub lsn: Lsn,
    pub seq: Option<u32>,
}

impl Position {
    /// A message about a whole transaction (a notice, a broadcast).
    pub fn commit(lsn: Lsn) -> Position {
        Position { lsn, seq: None }
    }

    /// The `seq`-th change of the transaction committed at `lsn`.
    pub fn change(lsn: Lsn, seq: u32) -> Position {
        Position {
            lsn,
            seq: Some(seq),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The term ended: nothing was sent.
    #[error(transparent)]
    Fenced(#[from] Fenced),
    #[error(transparent)]
    Bus(#[from] BusError),
    #[error("JetStream publish failed: {0}")]
    JetStream(#[source] async_nats::jetstream::context::PublishError),
    /// A message for JetStream could not be handed to the NATS client (too large, an
    /// invalid subject, or the client is gone).
    #[error("publish failed: {0}")]
    Send(#[source] async_nats::PublishError),
    /// JetStream was asked of an in-process bus.
    #[error("JetStream needs NATS (NATS_URL); the bus is in-process")]
    NoJetStream,
}

impl PublishError {
    /// Whether retrying can help. A message over the server's `max_payload` will never
    /// go through as it is: the consumer must handle that one itself (cut it down, or
    /// skip and report it) before returning an error.
    pub fn retry(&self) -> Retry {
        match self {
            PublishError::Fenced(_) => Retry::Fenced,
            PublishError::NoJetStream => Retry::Never,
            PublishError::Bus(_) | PublishError::JetStream(_) | PublishError::Send(_) => {
                Retry::Backoff
            }
        }
    }
}

impl From<PublishError> for ConsumerError {
    fn from(e: PublishError) -> ConsumerError {
        ConsumerError::new(e.retry(), e)
    }
}

/// What [`Publisher`]s of one session share.
struct Term {
    bus: Bus,
    fence: Fence,
    origin: String,
    term: String,
    /// The source's name, stamped as `Walcast-Source`; `None` for the default source.
    source: Option<String>,
}

/// A consumer's way to the bus (see the module docs). Cheap to clone.
#[derive(Clone)]
pub struct Publisher {
    term: Arc<Term>,
    /// The consumer, for metrics and logs.
    consumer: &'static str,
}

impl Publisher {
    /// The session's publisher (the driver names one per consumer with
    /// [`Publisher::for_consumer`]).
    pub fn new(bus: Bus, fence: Fence, origin: impl Into<String>) -> Publisher {
        Publisher::for_source(bus, fence, origin, walcast_bus::source::DEFAULT_SOURCE)
    }

    /// The session's publisher for the pipeline of `source` (see
    /// [`walcast_bus::source`]): every message names it in `Walcast-Source`, except the
    /// default source's, which go as they always did.
    pub fn for_source(
        bus: Bus,
        fence: Fence,
        origin: impl Into<String>,
        source: &str,
    ) -> Publisher {
        let term = fence.term().to_string();
        let source = (!walcast_bus::source::is_default(source)).then(|| source.to_string());
        Publisher {
            term: Arc::new(Term {
                bus,
                fence,
                origin: origin.into(),
                term,
                source,
            }),
            consumer: "session",
        }
    }

    /// The source this publisher's messages name (`None`: the default).
    pub fn source(&self) -> Option<&str> {
        self.term.source.as_deref()
    }

    /// The same publisher, labelled with the consumer that uses it.
    pub fn for_consumer(&self, consumer: &'static str) -> Publisher {
        Publisher {
            term: self.term.clone(),
            consumer,
        }
    }

    /// The leadership term messages are stamped with.
    pub fn term(&self) -> u64 {
        self.term.fence.term()
    }

    /// This process, as `Walcast-Origin` names it.
    pub fn origin(&self) -> &str {
        &self.term.origin
    }

    /// The largest message the bus takes (NATS' `max_payload`; `None` in process).
    pub fn max_payload(&self) -> Option<usize> {
        self.term.bus.max_payload()
    }

    /// Check the fence now (for work that is only worth doing while we lead).
    pub fn check(&self, action: Action) -> Result<(), Fenced> {
        self.term.fence.check(action).inspect_err(|_| {
            metrics::counter!(telemetry::PUBLISH_FENCED, "consumer" => self.consumer).increment(1);
        })
    }

    /// Send one message on core NATS (order kept per connection), stamped with origin,
    /// term and `at`, plus `extra` headers. The fence is checked right before the
    /// hand-over.
    pub async fn publish(
        &self,
        subject: String,
        at: Position,
        extra: &[(&str, &str)],
        payload: Bytes,
    ) -> Result<(), PublishError> {
        let lsn = at.lsn.to_string();
        let seq = at.seq.map(|s| s.to_string());
        let mut headers: Vec<(&str, &str)> = Vec::with_capacity(5 + extra.len());
        headers.push((HEADER_ORIGIN, &self.term.origin));
        headers.push((HEADER_TERM, &self.term.term));
        if let Some(source) = &self.term.source {
            headers.push((HEADER_SOURCE, source));
        }
        headers.push((HEADER_LSN, &lsn));
        if let Some(seq) = &seq {
            headers.push((HEADER_SEQ, seq));
        }
        headers.extend_from_slice(extra);
        self.check(Action::Publish)?;
        Ok(self.term.bus.publish(subject, &headers, payload).await?)
    }

    /// Wait until everything published so far reached the NATS server.
    pub async fn barrier(&self) -> Result<(), PublishError> {
        Ok(self.term.bus.barrier().await?)
    }

    /// A JetStream publisher on the bus's NATS connection, its context configured by
    /// `configure` (timeouts, acknowledgements in flight).
    pub fn jetstream(
        &self,
        configure: impl FnOnce(ContextBuilder<Yes>) -> ContextBuilder<Yes>,
    ) -> Result<JetStreamPublisher, PublishError> {
        let Bus::Nats(nats) = &self.term.bus else {
            return Err(PublishError::NoJetStream);
        };
        let js = configure(ContextBuilder::new()).build(nats.client().clone());
        Ok(JetStreamPublisher {
            js,
            client: nats.client().clone(),
            publisher: self.clone(),
        })
    }
}

/// JetStream through the fence (see [`Publisher::jetstream`]).
pub struct JetStreamPublisher {
    js: async_nats::jetstream::Context,
    /// The context's client (for [`JetStreamPublisher::publish_with_reply`]).
    client: async_nats::Client,
    publisher: Publisher,
}

impl JetStreamPublisher {
    /// The context, to manage streams with (never to publish: that is
    /// [`JetStreamPublisher::publish`]'s).
    pub fn context(&self) -> &async_nats::jetstream::Context {
        &self.js
    }

    /// The NATS client under the context, to subscribe with (never to publish).
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Send one message with `headers` plus origin, term and `at`; the fence is checked
    /// right before. The future resolves to JetStream's acknowledgement.
    pub async fn publish(
        &self,
        subject: String,
        at: Position,
        mut headers: HeaderMap,
        payload: Bytes,
    ) -> Result<PublishAckFuture, PublishError> {
        self.stamp(&mut headers, at)?;
        self.js
            .publish_with_headers(subject, headers, payload)
            .await
            .map_err(PublishError::JetStream)
    }

    /// The same as [`JetStreamPublisher::publish`], with JetStream's acknowledgement sent
    /// to `reply`, a subject of the caller's own subscription: for a sender that keeps
    /// many messages in flight and takes their answers from one subscription, without a
    /// future, a timer and a reply inbox per message.
    pub async fn publish_with_reply(
        &self,
        subject: String,
        reply: String,
        at: Position,
        mut headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), PublishError> {
        self.stamp(&mut headers, at)?;
        self.client
            .publish_with_reply_and_headers(subject, reply, headers, payload)
            .await
            .map_err(PublishError::Send)
    }

    /// Origin, term, source and position added to `headers`; then the fence checked.
    fn stamp(&self, headers: &mut HeaderMap, at: Position) -> Result<(), PublishError> {
        let p = &self.publisher;
        let name = HeaderName::from_static;
        headers.insert(name(HEADER_ORIGIN), header(&p.term.origin));
        headers.insert(name(HEADER_TERM), header(&p.term.term));
        if let Some(source) = &p.term.source {
            headers.insert(name(HEADER_SOURCE), header(source));
        }
        headers.insert(name(HEADER_LSN), header(&at.lsn.to_string()));
        if let Some(seq) = at.seq {
            headers.insert(name(HEADER_SEQ), header(&seq.to_string()));
        }
        Ok(p.check(Action::Publish)?)
    }
}

/// A header value we produced (an origin is checked at start, the rest are digits).
fn header(value: &str) -> HeaderValue {
    HeaderValue::from(value)
}
