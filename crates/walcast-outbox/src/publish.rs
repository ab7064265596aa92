//! Sending events to JetStream and telling transient failures from permanent ones.

use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::{self, stream, ErrorCode};
use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use walcast_pipeline::{JetStreamPublisher, Position, PublishError as FencedError};

use crate::config::OutboxConfig;
use crate::event::OutboxEvent;

/// Why a publish failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Retry it (no answer in time, connection lost, JetStream busy or restarting).
    Transient(String),
    /// JetStream will never take it: quarantine it. `kind` labels the metric.
    Permanent { kind: &'static str, error: String },
    /// The relay's leadership term ended (its fence closed): nothing was sent, and the
    /// relay stops.
    Fenced(String),
}

impl Failure {
    pub fn message(&self) -> &str {
        match self {
            Failure::Transient(e) | Failure::Permanent { error: e, .. } | Failure::Fenced(e) => e,
        }
    }
}

/// Classify a publish error. `StreamNotFound` (no stream listens on the subject) is
/// transient here: the caller re-creates the stream and only then calls it permanent.
pub fn classify(e: &PublishError) -> Failure {
    let text = e.to_string();
    match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => Failure::Permanent {
            kind: "too_large",
            error: text,
        },
        PublishErrorKind::Other => {
            let code = std::error::Error::source(e)
                .and_then(|s| s.downcast_ref::<jetstream::Error>())
                .map(|j| j.error_code());
            match code {
                Some(ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM) => Failure::Permanent {
                    kind: "too_large",
                    error: text,
                },
                _ => Failure::Transient(text),
            }
        }
        _ => Failure::Transient(text),
    }
}

/// How events reach JetStream: through the pipeline's fence (the relay), or directly
/// (`walcast outbox redrive`, an operator's command that no lease governs).
enum Sender {
    Fenced(JetStreamPublisher),
    Direct(jetstream::Context),
}

/// The outbox stream and the way events are sent to it.
pub struct Publisher {
    sender: Sender,
    cfg: OutboxConfig,
    stream_ready: bool,
}

/// The relay's JetStream settings: a PubAck timeout, and at most `max_in_flight`
/// answers outstanding.
fn configure(
    cfg: &OutboxConfig,
    builder: jetstream::context::ContextBuilder<jetstream::context::Yes>,
) -> jetstream::context::ContextBuilder<jetstream::context::Yes> {
    builder
        .timeout(cfg.ack_timeout)
        .max_ack_inflight(cfg.max_in_flight.max(1))
        .backpressure_on_inflight(true)
}

impl Publisher {
    /// Sending directly on `client` (tools beside the relay).
    pub fn new(client: async_nats::Client, cfg: OutboxConfig) -> Publisher {
        let js = configure(&cfg, jetstream::ContextBuilder::new()).build(client);
        Publisher {
            sender: Sender::Direct(js),
            cfg,
            stream_ready: false,
        }
    }

    /// Sending through the pipeline's fenced publisher (the relay): each event carries
    /// the term, and none is sent once the term ended.
    pub fn fenced(
        publisher: &walcast_pipeline::Publisher,
        cfg: OutboxConfig,
    ) -> Result<Publisher, FencedError> {
        let js = publisher.jetstream(|b| configure(&cfg, b))?;
        Ok(Publisher {
            sender: Sender::Fenced(js),
            cfg,
            stream_ready: false,
        })
    }

    fn js(&self) -> &jetstream::Context {
        match &self.sender {
            Sender::Fenced(p) => p.context(),
            Sender::Direct(js) => js,
        }
    }

    fn stream_config(&self) -> stream::Config {
        stream::Config {
            name: self.cfg.stream.clone(),
            subjects: self.cfg.subjects.clone(),
            num_replicas: self.cfg.replicas,
            max_age: self.cfg.max_age,
            duplicate_window: self.cfg.duplicate_window,
            storage: stream::StorageType::File,
            ..Default::default()
        }
    }

    /// Create the stream, or update it to the configured settings (once per session,
    /// and again after JetStream said no stream listens on a subject).
    pub async fn ensure_stream(&mut self) -> Result<(), Failure> {
        if self.stream_ready {
            return Ok(());
        }
        self.js()
            .create_or_update_stream(self.stream_config())
            .await
            .map_err(|e| Failure::Transient(format!("creating stream {}: {e}", self.cfg.stream)))?;
        tracing::info!(stream = %self.cfg.stream, subjects = ?self.cfg.subjects, "outbox stream ready");
        self.stream_ready = true;
        Ok(())
    }

    /// Create the stream with the configured settings if it is missing; leave an existing
    /// one as it is (for tools beside the relay, such as `walcast outbox redrive`, which
    /// must not change the settings the relay gave it).
    pub async fn ensure_stream_exists(&mut self) -> Result<(), Failure> {
        if self.stream_ready {
            return Ok(());
        }
        self.js()
            .get_or_create_stream(self.stream_config())
            .await
            .map_err(|e| Failure::Transient(format!("stream {}: {e}", self.cfg.stream)))?;
        self.stream_ready = true;
        Ok(())
    }

    /// The stream is to be checked again before the next publish.
    pub fn stream_lost(&mut self) {
        self.stream_ready = false;
    }

    pub fn stream_checked(&self) -> bool {
        self.stream_ready
    }

    /// Send one event (waits only when `max_in_flight` acks are outstanding); the future
    /// resolves to JetStream's answer. An event NATS cannot carry as it is (a header or
    /// subject [`OutboxEvent::validate`] refuses) is a permanent failure, `invalid`:
    /// nothing reaches async-nats, whose header conversions panic on a line break.
    pub async fn send(&self, ev: &OutboxEvent) -> Result<PublishAckFuture, Failure> {
        let headers = message_headers(ev)?;
        let payload = Bytes::from(ev.payload.clone());
        match &self.sender {
            Sender::Direct(js) => js
                .publish_with_headers(ev.subject(), headers, payload)
                .await
                .map_err(|e| classify(&e)),
            Sender::Fenced(p) => {
                let at = Position::commit(ev.commit_lsn);
                p.publish(ev.subject(), at, headers, payload)
                    .await
                    .map_err(|e| match e {
                        FencedError::JetStream(e) => classify(&e),
                        FencedError::Fenced(f) => Failure::Fenced(f.to_string()),
                        other => Failure::Transient(other.to_string()),
                    })
            }
        }
    }
}

/// The event's headers as NATS headers, each converted fallibly (the names are checked
/// by [`OutboxEvent::validate`]; converting them again is cheap next to the map).
fn message_headers(ev: &OutboxEvent) -> Result<HeaderMap, Failure> {
    let invalid = |error: String| Failure::Permanent {
        kind: "invalid",
        error,
    };
    ev.validate().map_err(|e| invalid(e.to_string()))?;
    let mut headers = HeaderMap::new();
    ev.for_each_header(|name, value| {
        let n = HeaderName::from_str(name).map_err(|e| invalid(format!("header {name:?}: {e}")))?;
        let v =
            HeaderValue::from_str(value).map_err(|e| invalid(format!("header {name:?}: {e}")))?;
        headers.insert(n, v);
        Ok(())
    })?;
    Ok(headers)
}
