//! Sending outbox events to JetStream: the stream's settings, each event's headers, and
//! the answers on one subscription (see [`walcast_pipeline::jetstream`], whose failures
//! and answers these are).

use async_nats::jetstream::{self, stream};
use std::str::FromStr;

use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;

use walcast_pipeline::jetstream::Answers;
pub use walcast_pipeline::jetstream::{Answer, Failure, Stored, Token};
use walcast_pipeline::{JetStreamPublisher, Position, PublishError as FencedError};

use crate::config::OutboxConfig;
use crate::event::{Name, OutboxEvent};

/// How events reach JetStream: through the pipeline's fence (the relay), or directly
/// (`walcast outbox redrive`, an operator's command that no lease governs).
enum Via {
    Fenced(JetStreamPublisher),
    Direct(jetstream::Context),
}

/// The outbox stream and the way events are sent to it.
pub struct Publisher {
    via: Via,
    /// The connection events go out on (the answers' subscription is on it too).
    client: async_nats::Client,
    /// For [`Publisher::send`]'s answers (a pipelined sender keeps its own).
    answers: Option<Answers>,
    cfg: OutboxConfig,
    stream_ready: bool,
}

/// The relay's JetStream context (it manages the stream; events go out with their
/// answers to a subscription of the sender's own): requests time out with the answers.
fn configure(
    cfg: &OutboxConfig,
    builder: jetstream::context::ContextBuilder<jetstream::context::Yes>,
) -> jetstream::context::ContextBuilder<jetstream::context::Yes> {
    builder.timeout(cfg.ack_timeout)
}

impl Publisher {
    /// Sending directly on `client` (tools beside the relay).
    pub fn new(client: async_nats::Client, cfg: OutboxConfig) -> Publisher {
        let js = configure(&cfg, jetstream::ContextBuilder::new()).build(client.clone());
        Publisher {
            via: Via::Direct(js),
            client,
            answers: None,
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
            via: Via::Fenced(js),
            answers: None,
            cfg,
            stream_ready: false,
        })
    }

    fn js(&self) -> &jetstream::Context {
        match &self.via {
            Via::Fenced(p) => p.context(),
            Via::Direct(js) => js,
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

    /// The connection events go out on.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// Send one event (never waits for its answer; the caller bounds how many are out):
    /// its answer comes from [`Publisher::next_answer`] with the token returned.
    pub async fn send(&mut self, ev: &OutboxEvent) -> Result<Token, Failure> {
        if self.answers.is_none() {
            self.answers = Some(Answers::subscribe(&self.client).await?);
        }
        let Some(answers) = self.answers.as_mut() else {
            return Err(Failure::Transient("no answer subscription".into()));
        };
        let (token, reply) = answers.next_reply();
        self.send_to(ev, reply).await?;
        Ok(token)
    }

    /// Send one event with JetStream's answer to `reply`. An event NATS cannot carry as
    /// it is (a header or subject [`OutboxEvent::validate`] refuses) is a permanent
    /// failure, `invalid`: nothing reaches async-nats, whose header conversions panic on
    /// a line break. Every way an event is made checks it (`from_message`, `from_row` as
    /// it is read; this, for one from the quarantine).
    pub async fn send_to(&mut self, ev: &OutboxEvent, reply: String) -> Result<(), Failure> {
        // The relay's events were checked as they were read from the WAL
        // (`OutboxEvent::from_message`, `from_row`); redrive's come from the quarantine
        // table, and are checked here.
        let check = matches!(self.via, Via::Direct(_));
        let headers = message_headers(ev, check)?;
        let payload = Bytes::from(ev.payload.clone());
        match &self.via {
            Via::Direct(_) => self
                .client
                .publish_with_reply_and_headers(ev.subject(), reply, headers, payload)
                .await
                .map_err(|e| Failure::from_send(&e)),
            Via::Fenced(p) => {
                let at = Position::commit(ev.commit_lsn);
                p.publish_with_reply(ev.subject(), reply, at, headers, payload)
                    .await
                    .map_err(Failure::from_publish)
            }
        }
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

    /// The next answer JetStream sent to [`Publisher::send`]'s events, in the order they
    /// come (cancel-safe). Waits forever before the first send; `None` if the
    /// subscription ended (the connection is gone for good).
    pub async fn next_answer(&mut self) -> Option<(Token, Answer)> {
        match self.answers.as_mut() {
            Some(a) => a.next().await,
            None => std::future::pending().await,
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
