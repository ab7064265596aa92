//! The relay's sender: a task of its own that owns the JetStream side, so that nothing
//! the relay's consumer methods do waits on JetStream.
//!
//! The relay hands it the committed events, in commit order and a run of them at a time
//! (one wake-up for many events while a backlog drains), through an unbounded channel
//! (the relay bounds what is outstanding: [`crate::Relay`]'s `accepting`). The
//! task sends each event without waiting for its answer (at most `max_in_flight`
//! outstanding; later events stay queued, unsent, in order) and takes the answers in
//! order: acknowledged, quarantined (refused for good), or — a transient failure —
//! resent with everything after it, in order, after a capped exponential backoff
//! (JetStream's duplicate window drops what had already landed). It counts the events
//! done (acknowledged or quarantined) on a watch channel the relay reads without
//! waiting. A fenced publish or a database error while quarantining ends the task; the
//! relay reports it at its next call.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use std::pin::Pin;

use tokio::sync::{mpsc, watch};
use tokio::time::Sleep;
use tokio_postgres::Client;

use crate::config::OutboxConfig;
use crate::error::RelayError;
use crate::event::OutboxEvent;
use crate::health::OutboxHealth;
use crate::publish::{Answer, Failure, Publisher, Stored, Token};
use crate::{quarantine, telemetry, time};

/// Events in flight, at most, whatever `max_in_flight` says: the answers' subscription
/// buffers 65,536 messages (async-nats' default), and a burst of answers past that would
/// be dropped, timed out and resent, again and again.
pub const MAX_IN_FLIGHT_CAP: usize = 16_384;

/// The bytes an event counts for in the relay's bound (its payload, subject, headers).
pub(crate) fn event_bytes(ev: &OutboxEvent) -> u64 {
    let headers: usize = ev.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    (ev.payload.len() + ev.subject_len() + headers + ev.id.len()) as u64
}

/// The task's metrics, registered once (not looked up by name for every event).
struct Metrics {
    published: metrics::Counter,
    duplicates: metrics::Counter,
    ack_seconds: metrics::Histogram,
    commit_to_ack_seconds: metrics::Histogram,
    oldest_unpublished_seconds: metrics::Gauge,
}

impl Metrics {
    fn register() -> Metrics {
        Metrics {
            published: metrics::counter!(telemetry::PUBLISHED, "duplicate" => "false"),
            duplicates: metrics::counter!(telemetry::PUBLISHED, "duplicate" => "true"),
            ack_seconds: metrics::histogram!(telemetry::ACK_SECONDS),
            commit_to_ack_seconds: metrics::histogram!(telemetry::COMMIT_TO_ACK_SECONDS),
            oldest_unpublished_seconds: metrics::gauge!(telemetry::OLDEST_UNPUBLISHED_SECONDS),
        }
    }
}

/// What the relay and the task share.
#[derive(Default)]
pub(crate) struct Shared {
    /// Bytes of the events handed to the task and not yet done.
    pub(crate) bytes: AtomicU64,
    /// Why the task ended (taken once by the relay).
    pub(crate) failure: Mutex<Option<RelayError>>,
}

impl Shared {
    pub(crate) fn take_failure(&self) -> Option<RelayError> {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

/// The relay's handle on its sender task (aborted on drop).
pub(crate) struct SenderHandle {
    tx: mpsc::UnboundedSender<Vec<OutboxEvent>>,
    done: watch::Receiver<u64>,
    pub(crate) shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for SenderHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl SenderHandle {
    /// Start the task (inside a Tokio runtime).
    pub(crate) fn spawn(
        cfg: OutboxConfig,
        publisher: Publisher,
        health: Arc<OutboxHealth>,
    ) -> SenderHandle {
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(0);
        let shared = Arc::new(Shared::default());
        let task = Sender {
            cfg,
            publisher,
            health,
            shared: shared.clone(),
            done: done_tx,
            in_flight: VecDeque::new(),
            queued: VecDeque::new(),
            attempt: 0,
            db: None,
            metrics: Metrics::register(),
            timer: Box::pin(tokio::time::sleep(std::time::Duration::from_secs(3600))),
        };
        let task = walcast_core::source_scope::spawn(task.run(rx));
        SenderHandle {
            tx,
            done,
            shared,
            task,
        }
    }

    /// Queue events, in order (never waits); `bytes`: their [`event_bytes`], summed by
    /// the caller as it collected them. `false`: the task has ended.
    pub(crate) fn send(&self, events: Vec<OutboxEvent>, bytes: u64) -> bool {
        debug_assert_eq!(bytes, events.iter().map(event_bytes).sum::<u64>());
        self.shared.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.tx.send(events).is_ok()
    }

    /// Events done so far (acknowledged or quarantined), without waiting.
    pub(crate) fn done(&self) -> u64 {
        *self.done.borrow()
    }

    /// Wait until `n` events are done; `false` if the task ended first.
    pub(crate) async fn wait_done(&mut self, n: u64) -> bool {
        self.done.wait_for(|d| *d >= n).await.is_ok()
    }
}

/// An event sent (or to send again) and its answer.
struct InFlight {
    event: OutboxEvent,
    /// What its answer will name (`None`: the send itself failed; `answer` says why).
    token: Option<Token>,
    /// `None` until it came.
    answer: Option<Answer>,
    sent: Instant,
    /// Its transaction's commit time (ms since the epoch), read once.
    committed_ms: Option<i64>,
    /// What it counts for in the relay's byte bound ([`event_bytes`]), computed once.
    bytes: u64,
    /// JetStream said no stream listens on its subject after the stream was re-checked.
    stream_checked: bool,
}

struct Sender {
    cfg: OutboxConfig,
    publisher: Publisher,
    health: Arc<OutboxHealth>,
    shared: Arc<Shared>,
    done: watch::Sender<u64>,
    in_flight: VecDeque<InFlight>,
    /// Events received and not sent yet (past `max_in_flight`), in order.
    queued: VecDeque<OutboxEvent>,
    /// Transient failures in a row of the first outstanding event.
    attempt: u32,
    /// For the quarantine, connected when first needed.
    db: Option<Client>,
    metrics: Metrics,
    /// Fires at or before the first outstanding event's deadline (moved only when it
    /// must be, not for every event).
    timer: Pin<Box<Sleep>>,
}

/// What the task does next.
enum Next {
    /// The next event to send.
    Event(OutboxEvent),
    /// Events from the relay (`None`: it is gone).
    Received(Option<Vec<OutboxEvent>>),
    Answer(Answer),
    /// The answers' subscription ended.
    Closed,
}

impl Sender {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Vec<OutboxEvent>>) {
        if let Err(e) = self.serve(&mut rx).await {
            tracing::warn!(error = %e, "outbox sender stopped");
            *self
                .shared
                .failure
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(e);
        }
    }

    async fn serve(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<Vec<OutboxEvent>>,
    ) -> Result<(), RelayError> {
        let max = self.cfg.max_in_flight.clamp(1, MAX_IN_FLIGHT_CAP);
        loop {
            match self.next(rx, self.in_flight.len() < max).await {
                Next::Event(ev) => self.push(ev).await,
                Next::Received(Some(events)) => self.queued.extend(events),
                Next::Received(None) => return Ok(()),
                Next::Closed => return Err(RelayError::AnswersClosed),
                Next::Answer(Ok(Stored { duplicate })) => self.acknowledged(duplicate),
                Next::Answer(Err(Failure::Permanent { kind, error })) => {
                    self.quarantine(kind, &error).await?
                }
                Next::Answer(Err(Failure::Fenced(error))) => return Err(RelayError::Fenced(error)),
                Next::Answer(Err(Failure::Transient(error) | Failure::NoStream(error))) => {
                    self.retry(&error).await
                }
            }
        }
    }

    /// The next event (when there is room for one), or the first outstanding event's
    /// answer, whichever comes first. Answers to later events are filed meanwhile.
    async fn next(
        &mut self,
        rx: &mut mpsc::UnboundedReceiver<Vec<OutboxEvent>>,
        room: bool,
    ) -> Next {
        if room {
            if let Some(ev) = self.queued.pop_front() {
                return Next::Event(ev);
            }
        }
        loop {
            let Some(first) = self.in_flight.front_mut() else {
                return Next::Received(rx.recv().await);
            };
            if let Some(answer) = first.answer.take() {
                return Next::Answer(judge(first, answer));
            }
            let deadline = tokio::time::Instant::from_std(first.sent + self.cfg.ack_timeout);
            if self.timer.deadline() > deadline {
                self.timer.as_mut().reset(deadline);
            }
            tokio::select! {
                biased;
                events = rx.recv(), if room => return Next::Received(events),
                answer = self.publisher.next_answer() => match answer {
                    Some((token, answer)) => self.file(token, answer),
                    None => return Next::Closed,
                },
                () = self.timer.as_mut() => {
                    if tokio::time::Instant::now() >= deadline {
                        let waited = self.cfg.ack_timeout.as_millis();
                        return Next::Answer(Err(Failure::Transient(format!(
                            "no answer from JetStream in {waited} ms"
                        ))));
                    }
                    self.timer.as_mut().reset(deadline);
                }
            }
        }
    }

    /// Keep an answer with its event (an answer to an event resent since, or a second
    /// one, is dropped: the resend has its own token).
    fn file(&mut self, token: Token, answer: Answer) {
        let entry = self.in_flight.iter_mut().find(|f| f.token == Some(token));
        if let Some(f) = entry {
            if f.answer.is_none() {
                f.answer = Some(answer);
            }
        }
    }

    async fn push(&mut self, event: OutboxEvent) {
        let (token, answer) = match self.send(&event).await {
            Ok(token) => (Some(token), None),
            Err(failure) => (None, Some(Err(failure))),
        };
        let first = self.in_flight.is_empty();
        self.in_flight.push_back(InFlight {
            committed_ms: time::epoch_ms(&event.committed_at),
            bytes: event_bytes(&event),
            event,
            token,
            answer,
            sent: Instant::now(),
            stream_checked: false,
        });
        if first {
            self.update_oldest();
        }
    }

    async fn send(&mut self, event: &OutboxEvent) -> Result<Token, Failure> {
        self.publisher.ensure_stream().await?;
        self.publisher.send(event).await
    }

    /// The first outstanding event is done: count it.
    fn done_one(&mut self) -> Option<InFlight> {
        let f = self.in_flight.pop_front()?;
        let bytes = f.bytes;
        let _ = self
            .shared
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(bytes))
            });
        self.done.send_modify(|d| *d += 1);
        self.attempt = 0;
        self.update_oldest();
        Some(f)
    }

    fn acknowledged(&mut self, duplicate: bool) {
        let Some(f) = self.done_one() else {
            return;
        };
        let m = &self.metrics;
        if duplicate {
            &m.duplicates
        } else {
            &m.published
        }
        .increment(1);
        m.ack_seconds.record(f.sent.elapsed().as_secs_f64());
        if let Some(ms) = f.committed_ms {
            let secs = (time::now_ms() - ms).max(0) as f64 / 1000.0;
            m.commit_to_ack_seconds.record(secs);
        }
        self.health.published(1);
        self.health.set_error(None);
    }

    async fn quarantine(&mut self, kind: &'static str, error: &str) -> Result<(), RelayError> {
        // (The answer future is not `Sync`: no reference to the entry across an await.)
        let Some(event) = self.in_flight.front().map(|f| f.event.clone()) else {
            return Ok(());
        };
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => kind).increment(1);
        tracing::error!(id = %event.id, subject = %event.subject(), error, "outbox event refused for good: quarantined");
        if self.db.as_ref().is_none_or(Client::is_closed) {
            self.db = Some(walcast_pgtls::connect(&self.cfg.database_url).await?);
        }
        let db = self.db.as_ref().ok_or(RelayError::NotStarted)?;
        quarantine::put(db, &event, error).await?;
        metrics::counter!(telemetry::QUARANTINED).increment(1);
        self.health.quarantined();
        self.done_one();
        Ok(())
    }

    /// Wait, then resend every outstanding event in order (the ones after the failed one
    /// may have landed: the duplicate window drops them). Events still queued wait (in
    /// `queued` and the channel, after them).
    async fn retry(&mut self, error: &str) {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => "transient").increment(1);
        let wait = self.cfg.retry.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        tracing::warn!(
            error,
            retry_in_ms = wait.as_millis() as u64,
            pending = self.in_flight.len(),
            "outbox publish failed; retrying"
        );
        self.health.set_error(Some(format!("publishing: {error}")));
        self.update_oldest();
        tokio::time::sleep(wait).await;
        self.publisher.stream_lost();
        let mut pending = std::mem::take(&mut self.in_flight);
        for f in pending.iter_mut() {
            f.sent = Instant::now();
            (f.token, f.answer) = match self.send(&f.event).await {
                Ok(token) => (Some(token), None),
                Err(failure) => (None, Some(Err(failure))),
            };
        }
        self.in_flight = pending;
    }

    fn update_oldest(&self) {
        let oldest = self.in_flight.front().and_then(|f| f.committed_ms);
        self.health.set_oldest_pending(oldest);
        let age = oldest.map_or(0.0, |ms| (time::now_ms() - ms).max(0) as f64 / 1000.0);
        self.metrics.oldest_unpublished_seconds.set(age);
    }
}

/// The first outstanding event's answer, with "no stream" permanent the second time in
/// a row (the stream was re-created in between).
fn judge(first: &mut InFlight, answer: Answer) -> Answer {
    match answer {
        Err(Failure::NoStream(_)) if first.stream_checked => Err(Failure::Permanent {
            kind: "no_stream",
            error: format!("no stream listens on {}", first.event.subject()),
        }),
        Err(Failure::NoStream(error)) => {
            first.stream_checked = true;
            Err(Failure::NoStream(error))
        }
        other => other,
    }
}
