//! The change stream's sender: a task of its own that owns the JetStream side, so that
//! nothing the consumer's methods do waits on JetStream (as the outbox relay's sender).
//!
//! The consumer hands it each committed transaction's messages, in commit order, through
//! an unbounded channel (the consumer bounds what is outstanding: its `accepting`). The
//! task sends each without waiting for its answer (at most `max_in_flight` outstanding)
//! and takes the answers in order: acknowledged; refused for good (too large for the
//! stream: skipped, reported, counted); or — a transient failure (no answer in time,
//! NATS or JetStream down) — resent with everything after it, in order, after a capped
//! exponential backoff (JetStream's duplicate window drops what had already landed). It
//! counts the messages done on a watch channel the consumer reads without waiting. A
//! fenced publish ends the task; the consumer reports it at its next call.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_nats::jetstream::context::{PublishError as JsError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, stream, ErrorCode};
use async_nats::{HeaderMap, HeaderValue};
use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio::sync::{mpsc, watch};
use walcast_core::{Backoff, ChangeId};
use walcast_pipeline::{JetStreamPublisher, PipelineHealth, Position, PublishError};

use crate::config::ChangeStreamConfig;
use crate::telemetry;

/// Header names of a change-stream message besides the publisher's.
pub mod headers {
    /// JetStream's de-duplication id: [`walcast_core::ChangeId::msg_id`].
    pub const NATS_MSG_ID: &str = "Nats-Msg-Id";
    /// The event id an inbox records: [`walcast_core::ChangeId::uuid`].
    pub const EVENT_ID: &str = "Walcast-Event-Id";
    pub const PROJECT: &str = "Walcast-Project";
    pub const COMMIT_LSN: &str = "Walcast-Commit-Lsn";
}

/// One message of the change stream.
#[derive(Clone, Debug)]
pub struct StreamMessage {
    pub subject: String,
    pub id: ChangeId,
    pub payload: Bytes,
    /// `schema.table`, for reports.
    pub table: String,
}

type Answer = BoxFuture<'static, Result<PublishAck, JsError>>;

/// The consumer's handle on its sender task (aborted on drop).
pub(crate) struct SenderHandle {
    tx: mpsc::UnboundedSender<StreamMessage>,
    done: watch::Receiver<u64>,
    failure: Arc<Mutex<Option<PublishError>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SenderHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SenderHandle {
    pub(crate) fn spawn(
        cfg: ChangeStreamConfig,
        js: JetStreamPublisher,
        health: Arc<PipelineHealth>,
        stored: Stored,
    ) -> SenderHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(0);
        let failure = Arc::new(Mutex::new(None));
        let task = Sender {
            retry: Backoff {
                base: std::time::Duration::from_millis(100),
                cap: std::time::Duration::from_secs(10),
            },
            cfg,
            js,
            health,
            done: done_tx,
            in_flight: VecDeque::new(),
            attempt: 0,
            stream_ready: false,
            stored,
            last_fresh: None,
        };
        let shared = failure.clone();
        let task = walcast_core::source_scope::spawn(async move {
            if let Err(e) = task.serve(rx).await {
                tracing::warn!(error = %e, "change-stream sender stopped");
                *shared.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        });
        SenderHandle {
            tx,
            done,
            failure,
            task,
        }
    }

    /// Queue a message (never waits). `false`: the task has ended.
    pub(crate) fn send(&self, m: StreamMessage) -> bool {
        self.tx.send(m).is_ok()
    }

    /// Messages done so far (acknowledged or skipped), without waiting.
    pub(crate) fn done(&self) -> u64 {
        *self.done.borrow()
    }

    /// Wait until `n` messages are done; `false` if the task ended first.
    pub(crate) async fn wait_done(&mut self, n: u64) -> bool {
        self.done.wait_for(|d| *d >= n).await.is_ok()
    }

    /// Why the task ended (taken once).
    pub(crate) fn take_failure(&self) -> Option<PublishError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

struct InFlight {
    message: StreamMessage,
    answer: Option<Answer>,
    sent: Instant,
}

struct Sender {
    cfg: ChangeStreamConfig,
    js: JetStreamPublisher,
    health: Arc<PipelineHealth>,
    done: watch::Sender<u64>,
    in_flight: VecDeque<InFlight>,
    attempt: u32,
    retry: Backoff,
    stream_ready: bool,
    /// The newest position JetStream stored a message of (not as a duplicate), kept
    /// across the sessions of this process.
    stored: Stored,
    /// The last position this sender stored (not as a duplicate).
    last_fresh: Option<(walcast_core::Lsn, u32)>,
}

/// See [`Sender`]'s `stored`.
pub(crate) type Stored = Arc<Mutex<Option<(walcast_core::Lsn, u32)>>>;

/// The [`Stored`] of a source's messages to a stream in this process: kept across its
/// sessions and leadership terms (a lost publish is often resent by the next session).
pub(crate) fn stored_for(stream: &str, source: &str) -> Stored {
    type All = Mutex<std::collections::HashMap<(String, String), Stored>>;
    static ALL: std::sync::OnceLock<All> = std::sync::OnceLock::new();
    let all = ALL.get_or_init(Default::default);
    let mut all = all.lock().unwrap_or_else(|p| p.into_inner());
    all.entry((stream.to_string(), source.to_string()))
        .or_default()
        .clone()
}

/// What the first outstanding message's answer says.
enum Answered {
    Ack(PublishAck),
    /// Never storable (too large for the stream): skipped.
    Refused(String),
    Transient(String),
}

impl Sender {
    async fn serve(
        mut self,
        mut rx: mpsc::UnboundedReceiver<StreamMessage>,
    ) -> Result<(), PublishError> {
        let max = self.cfg.max_in_flight.max(1);
        loop {
            let room = self.in_flight.len() < max;
            let Some(first) = self.in_flight.front_mut() else {
                match rx.recv().await {
                    Some(m) => self.push(m).await?,
                    None => return Ok(()),
                }
                continue;
            };
            let answered = match first.answer.as_mut() {
                None => Answered::Transient("not sent".into()),
                Some(answer) => tokio::select! {
                    biased;
                    m = rx.recv(), if room => {
                        match m {
                            Some(m) => self.push(m).await?,
                            None => return Ok(()),
                        }
                        continue;
                    }
                    result = answer => classify(result),
                },
            };
            match answered {
                Answered::Ack(ack) => self.acknowledged(ack.duplicate),
                Answered::Refused(why) => self.refused(&why),
                Answered::Transient(why) => self.resend(&why).await?,
            }
        }
    }

    async fn push(&mut self, message: StreamMessage) -> Result<(), PublishError> {
        let answer = self.send(&message).await?;
        self.in_flight.push_back(InFlight {
            message,
            answer,
            sent: Instant::now(),
        });
        Ok(())
    }

    /// Send one message; `Ok(None)`: not sent now (retried with the others). Only the
    /// fence's refusal is an error.
    async fn send(&mut self, m: &StreamMessage) -> Result<Option<Answer>, PublishError> {
        if !self.stream_ready {
            match ensure_stream(self.js.context(), &self.cfg).await {
                Ok(()) => self.stream_ready = true,
                Err(e) => {
                    tracing::warn!(stream = %self.cfg.stream, error = %e, "change stream: cannot create or update the stream; retrying");
                    return Ok(None);
                }
            }
        }
        let mut h = HeaderMap::new();
        h.insert(
            headers::NATS_MSG_ID,
            HeaderValue::from(m.id.msg_id().as_str()),
        );
        h.insert(headers::EVENT_ID, HeaderValue::from(m.id.uuid().as_str()));
        h.insert(headers::PROJECT, HeaderValue::from(m.id.project.as_str()));
        let lsn = m.id.commit_lsn.to_string();
        h.insert(headers::COMMIT_LSN, HeaderValue::from(lsn.as_str()));
        let at = Position::change(m.id.commit_lsn, m.id.seq);
        match self
            .js
            .publish(m.subject.clone(), at, h, m.payload.clone())
            .await
        {
            Ok(ack) => Ok(Some(Box::pin(std::future::IntoFuture::into_future(ack)))),
            Err(e @ PublishError::Fenced(_)) => Err(e),
            Err(e) => {
                tracing::debug!(error = %e, "change stream: publish failed");
                Ok(None)
            }
        }
    }

    fn done_one(&mut self) -> Option<InFlight> {
        let f = self.in_flight.pop_front()?;
        self.done.send_modify(|d| *d += 1);
        self.attempt = 0;
        Some(f)
    }

    fn acknowledged(&mut self, duplicate: bool) {
        let Some(f) = self.done_one() else { return };
        self.check_order(&f.message.id, duplicate);
        let dup = if duplicate { "true" } else { "false" };
        metrics::counter!(telemetry::CHANGE_STREAM_PUBLISHED, "duplicate" => dup).increment(1);
        metrics::histogram!(telemetry::CHANGE_STREAM_ACK_SECONDS)
            .record(f.sent.elapsed().as_secs_f64());
    }

    /// Count a change stored after a later one (README "Change streams", Order): stored
    /// now (not a duplicate) below a position stored before in this process, or a
    /// duplicate (stored earlier) above the last one this sender stored now.
    fn check_order(&mut self, id: &ChangeId, duplicate: bool) {
        let at = (id.commit_lsn, id.seq);
        let mut stored = self.stored.lock().unwrap_or_else(|p| p.into_inner());
        let reordered = match duplicate {
            false => stored.is_some_and(|s| s > at),
            true => self.last_fresh.take_if(|f| *f < at).is_some(),
        };
        if !duplicate {
            *stored = (*stored).max(Some(at));
            self.last_fresh = Some(at);
        }
        if reordered {
            metrics::counter!(telemetry::CHANGE_STREAM_REORDERED).increment(1);
            tracing::warn!(msg_id = %id, duplicate, "change stream: a change was stored after a later one (a publish was lost and resent)");
        }
    }

    fn refused(&mut self, why: &str) {
        let Some(f) = self.done_one() else { return };
        metrics::counter!(telemetry::CHANGE_STREAM_FAILURES, "kind" => "too_large").increment(1);
        self.health.report_skip(
            &f.message.table,
            Some(f.message.id.commit_lsn),
            "payload_too_large",
            &format!("change stream refused it: {why}"),
        );
    }

    /// Wait, then resend every outstanding message in order (those after the failed one
    /// may have landed: the duplicate window drops them).
    async fn resend(&mut self, why: &str) -> Result<(), PublishError> {
        metrics::counter!(telemetry::CHANGE_STREAM_FAILURES, "kind" => "transient").increment(1);
        let wait = self.retry.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        tracing::warn!(
            error = why,
            retry_in_ms = wait.as_millis() as u64,
            pending = self.in_flight.len(),
            "change-stream publish failed; resending"
        );
        tokio::time::sleep(wait).await;
        self.stream_ready = false;
        // Drop every old answer first: each holds one of the context's in-flight permits.
        for f in self.in_flight.iter_mut() {
            f.answer = None;
        }
        let mut pending = std::mem::take(&mut self.in_flight);
        for f in pending.iter_mut() {
            f.sent = Instant::now();
            f.answer = self.send(&f.message).await?;
            if f.answer.is_none() {
                break;
            }
        }
        self.in_flight = pending;
        Ok(())
    }
}

/// Create the stream, or update it to the settings (JetStream's `Context` only: the
/// sender's answers are not `Sync`).
async fn ensure_stream(js: &jetstream::Context, cfg: &ChangeStreamConfig) -> Result<(), String> {
    let config = stream::Config {
        name: cfg.stream.clone(),
        subjects: vec![walcast_bus::subject::CHANGES_ALL.to_string()],
        num_replicas: cfg.replicas,
        max_age: cfg.max_age,
        max_bytes: cfg.max_bytes,
        duplicate_window: cfg.duplicate_window,
        storage: stream::StorageType::File,
        ..Default::default()
    };
    js.create_or_update_stream(config)
        .await
        .map_err(|e| e.to_string())?;
    tracing::info!(stream = %cfg.stream, "change stream ready");
    Ok(())
}

fn classify(result: Result<PublishAck, JsError>) -> Answered {
    let e = match result {
        Ok(ack) => return Answered::Ack(ack),
        Err(e) => e,
    };
    let text = e.to_string();
    let too_large = match e.kind() {
        PublishErrorKind::MaxPayloadExceeded => true,
        PublishErrorKind::Other => std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .is_some_and(|j| j.error_code() == ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM),
        _ => false,
    };
    match too_large {
        true => Answered::Refused(text),
        false => Answered::Transient(text),
    }
}
