//! Publish, barrier and subscribe, over core NATS or in process.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;

use crate::local::LocalBus;
use crate::nats::NatsBus;
use crate::BusError;

/// Message headers as (name, value) pairs.
pub type Headers = Vec<(String, String)>;

/// A received message.
#[derive(Clone, Debug)]
pub struct BusMessage {
    pub subject: String,
    pub headers: Headers,
    pub payload: Bytes,
}

impl BusMessage {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// The transport. Cheap to clone.
#[derive(Clone)]
pub enum Bus {
    Nats(NatsBus),
    Local(LocalBus),
}

impl Bus {
    /// Connect to NATS (retrying in the background after the first failure is reported).
    pub async fn nats(url: &str, name: &str) -> Result<Bus, BusError> {
        Bus::nats_with(url, name, &crate::nats::NatsAuth::default()).await
    }

    /// Like [`Bus::nats`], with a CA, credentials or an nkey.
    pub async fn nats_with(
        url: &str,
        name: &str,
        auth: &crate::nats::NatsAuth,
    ) -> Result<Bus, BusError> {
        NatsBus::connect(url, name, auth).await.map(Bus::Nats)
    }

    /// An in-process bus; `capacity` bounds each subscriber's queue (older messages are
    /// dropped for a subscriber that falls behind, and counted).
    pub fn local(capacity: usize) -> Bus {
        Bus::Local(LocalBus::new(capacity))
    }

    /// Queue a message for sending. Order is kept per bus.
    pub async fn publish(
        &self,
        subject: String,
        headers: &[(&str, &str)],
        payload: Bytes,
    ) -> Result<(), BusError> {
        match self {
            Bus::Nats(b) => b.publish(subject, headers, payload).await,
            Bus::Local(b) => {
                b.publish(subject, headers, payload);
                Ok(())
            }
        }
    }

    /// Wait until every message published before this call has reached the server
    /// (NATS: a round trip through the server on the same connection).
    pub async fn barrier(&self) -> Result<(), BusError> {
        match self {
            Bus::Nats(b) => b.barrier().await,
            Bus::Local(_) => Ok(()),
        }
    }

    pub async fn subscribe(&self, pattern: &str) -> Result<Subscription, BusError> {
        match self {
            Bus::Nats(b) => b.subscribe(pattern).await,
            Bus::Local(b) => Ok(b.subscribe(pattern)),
        }
    }

    /// The largest message the transport accepts: NATS's `max_payload` as the server
    /// announced it (it can change on reconnect); unbounded in process.
    pub fn max_payload(&self) -> Option<usize> {
        match self {
            Bus::Nats(b) => Some(b.max_payload()),
            Bus::Local(_) => None,
        }
    }

    /// True while the transport is connected (always true in process).
    pub fn is_connected(&self) -> bool {
        match self {
            Bus::Nats(b) => b.is_connected(),
            Bus::Local(_) => true,
        }
    }

    /// NATS' connection losses and reconnections (`None` in process: nothing is lost).
    pub fn link_events(&self) -> Option<&std::sync::Arc<crate::LinkEvents>> {
        match self {
            Bus::Nats(b) => Some(b.link_events()),
            Bus::Local(_) => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Bus::Nats(_) => "nats",
            Bus::Local(_) => "in-process",
        }
    }
}

/// A stream of messages matching a subscription pattern.
pub struct Subscription {
    pub(crate) inner: Pin<Box<dyn Stream<Item = BusMessage> + Send>>,
}

impl Stream for Subscription {
    type Item = BusMessage;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BusMessage>> {
        self.inner.as_mut().poll_next(cx)
    }
}
