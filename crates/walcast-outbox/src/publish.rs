//! Sending events to JetStream and telling transient failures from permanent ones.
//!
//! Events go out as core NATS publishes whose reply subject is one of the publisher's
//! own (`<inbox>.<token>`, under one wildcard subscription), so JetStream's answers
//! come back on that subscription, each naming its event by its token: no reply inbox,
//! future or timer per event. The caller keeps the window (how many are in flight) and
//! the deadlines.

use async_nats::jetstream::{self, stream, ErrorCode};
use async_nats::{PublishErrorKind as SendErrorKind, StatusCode, Subscriber};
use futures_util::StreamExt;
use serde::Deserialize;
use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use walcast_pipeline::{JetStreamPublisher, Position, PublishError as FencedError};

use crate::config::OutboxConfig;
use crate::event::{Name, OutboxEvent};

/// Why a publish failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Retry it (no answer in time, connection lost, JetStream busy or restarting).
    Transient(String),
    /// No stream listens on the event's subject (NATS had no responder): the caller
    /// re-creates the stream, and calls it permanent only if it happens again.
    NoStream(String),
    /// JetStream will never take it: quarantine it. `kind` labels the metric.
    Permanent { kind: &'static str, error: String },
    /// The relay's leadership term ended (its fence closed): nothing was sent, and the
    /// relay stops.
    Fenced(String),
}

impl Failure {
    pub fn message(&self) -> &str {
        match self {
            Failure::Transient(e)
            | Failure::NoStream(e)
            | Failure::Permanent { error: e, .. }
            | Failure::Fenced(e) => e,
        }
    }
}

/// JetStream stored the event (`duplicate`: it had it already, within the duplicate
/// window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub duplicate: bool,
}

/// JetStream's answer to one event.
pub type Answer = Result<Stored, Failure>;

/// Names a sent event: its answer comes with the same token.
pub type Token = u64;

/// A JetStream error in an answer: a message over the stream's size limit will never be
/// taken; anything else may pass later.
fn classify_jetstream(e: &jetstream::Error) -> Failure {
    match e.error_code() {
        ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => Failure::Permanent {
            kind: "too_large",
            error: e.to_string(),
        },
        _ => Failure::Transient(e.to_string()),
    }
}

/// A publish the NATS client refused before sending it.
fn classify_send(e: &async_nats::PublishError) -> Failure {
    let error = e.to_string();
    match e.kind() {
        SendErrorKind::MaxPayloadExceeded => Failure::Permanent {
            kind: "too_large",
            error,
        },
        SendErrorKind::InvalidSubject => Failure::Permanent {
            kind: "invalid",
            error,
        },
        SendErrorKind::Send => Failure::Transient(error),
    }
}

/// What an answer's payload holds: an error, or the stored message's sequence.
#[derive(Deserialize)]
struct Reply {
    #[serde(default)]
    error: Option<jetstream::Error>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
}

/// The answer an acknowledgement message carries.
fn read_answer(msg: &async_nats::Message) -> Answer {
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(Failure::NoStream(format!(
            "no stream listens on the subject ({})",
            msg.subject
        )));
    }
    match serde_json::from_slice::<Reply>(&msg.payload) {
        Ok(Reply { error: Some(e), .. }) => Err(classify_jetstream(&e)),
        Ok(Reply {
            seq: Some(_),
            duplicate,
            ..
        }) => Ok(Stored { duplicate }),
        _ => Err(Failure::Transient(format!(
            "unreadable JetStream answer (status {:?})",
            msg.status
        ))),
    }
}

/// The subscription JetStream's answers come back on.
struct Acks {
    /// `<inbox>`: an event's reply subject is `<inbox>.<token>`.
    prefix: String,
    sub: Subscriber,
    next: Token,
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
    /// The connection events go out on (the answers' subscription is on it too).
    client: async_nats::Client,
    acks: Option<Acks>,
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
        let js = configure(&cfg, jetstream::ContextBuilder::new()).build(client.clone());
        Publisher {
            sender: Sender::Direct(js),
            client,
            acks: None,
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
            client: js.client().clone(),
            sender: Sender::Fenced(js),
            acks: None,
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

    /// The answers' subscription, made at the first send.
    async fn acks(&mut self) -> Result<&mut Acks, Failure> {
        if self.acks.is_none() {
            let prefix = self.client.new_inbox();
            let sub = self
                .client
                .subscribe(format!("{prefix}.*"))
                .await
                .map_err(|e| Failure::Transient(format!("subscribing to the answers: {e}")))?;
            self.acks = Some(Acks {
                prefix,
                sub,
                next: 0,
            });
        }
        self.acks
            .as_mut()
            .ok_or_else(|| Failure::Transient("no answer subscription".into()))
    }

    /// Send one event (never waits for its answer; the caller bounds how many are out):
    /// its answer comes from [`Publisher::next_answer`] with the token returned. An
    /// event NATS cannot carry as it is (a header or subject [`OutboxEvent::validate`]
    /// refuses) is a permanent failure, `invalid`: nothing reaches async-nats, whose
    /// header conversions panic on a line break. Every way an event is made checks it
    /// (`from_message`, `from_row` as it is read; this, for one from the quarantine).
    pub async fn send(&mut self, ev: &OutboxEvent) -> Result<Token, Failure> {
        // The relay's events were checked as they were read from the WAL
        // (`OutboxEvent::from_message`, `from_row`); redrive's come from the quarantine
        // table, and are checked here.
        let check = matches!(self.sender, Sender::Direct(_));
        let headers = message_headers(ev, check)?;
        let payload = Bytes::from(ev.payload.clone());
        let acks = self.acks().await?;
        let token = acks.next;
        acks.next += 1;
        let reply = format!("{}.{token}", acks.prefix);
        match &self.sender {
            Sender::Direct(_) => self
                .client
                .publish_with_reply_and_headers(ev.subject(), reply, headers, payload)
                .await
                .map_err(|e| classify_send(&e))?,
            Sender::Fenced(p) => {
                let at = Position::commit(ev.commit_lsn);
                p.publish_with_reply(ev.subject(), reply, at, headers, payload)
                    .await
                    .map_err(|e| match e {
                        FencedError::Send(e) => classify_send(&e),
                        FencedError::Fenced(f) => Failure::Fenced(f.to_string()),
                        other => Failure::Transient(other.to_string()),
                    })?
            }
        }
        Ok(token)
    }

    /// Wait, at most the answer timeout, for the answer to `token`, dropping any other
    /// (for a sender with one event out at a time).
    pub async fn answer_to(&mut self, token: Token) -> Answer {
        let wait = self.cfg.ack_timeout;
        let answer = tokio::time::timeout(wait, async {
            loop {
                match self.next_answer().await {
                    Some((t, answer)) if t == token => return answer,
                    Some(_) => continue,
                    None => return Err(Failure::Transient("the NATS connection closed".into())),
                }
            }
        });
        answer.await.unwrap_or_else(|_| {
            let ms = wait.as_millis();
            Err(Failure::Transient(format!(
                "no answer from JetStream in {ms} ms"
            )))
        })
    }

    /// The next answer JetStream sent, in the order they come (cancel-safe). Waits
    /// forever before the first send; `None` if the subscription ended (the connection
    /// is gone for good).
    pub async fn next_answer(&mut self) -> Option<(Token, Answer)> {
        let Some(acks) = self.acks.as_mut() else {
            return std::future::pending().await;
        };
        loop {
            let msg = acks.sub.next().await?;
            let token = msg.subject.rsplit('.').next().and_then(|t| t.parse().ok());
            if let Some(token) = token {
                return Some((token, read_answer(&msg)));
            }
        }
    }
}

/// The event's headers as NATS headers: ours by their constant names, the user's
/// converted fallibly; with `check`, the event is first put through
/// [`OutboxEvent::validate`] (which every event read from the WAL passed already).
fn message_headers(ev: &OutboxEvent, check: bool) -> Result<HeaderMap, Failure> {
    let invalid = |error: String| Failure::Permanent {
        kind: "invalid",
        error,
    };
    if check {
        ev.validate().map_err(|e| invalid(e.to_string()))?;
    }
    let mut headers = HeaderMap::new();
    ev.for_each_header(|name, value| {
        let n = match name {
            Name::Ours(n) => HeaderName::from_static(n),
            Name::User(n) => {
                HeaderName::from_str(n).map_err(|e| invalid(format!("header {n:?}: {e}")))?
            }
        };
        let v = HeaderValue::from_str(value)
            .map_err(|e| invalid(format!("header {:?}: {e}", name.as_str())))?;
        headers.insert(n, v);
        Ok(())
    })?;
    Ok(headers)
}
