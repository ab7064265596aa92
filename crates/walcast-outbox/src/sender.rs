//! What the relay's sender does with each event: the relay hands its committed events to
//! the pipeline's pipelined JetStream sender ([`walcast_pipeline::jetstream::sender`]),
//! which sends them in order, many in flight, and resends on transient failures. Here:
//! how an event is sent (the outbox stream made sure of first), and what its answer
//! means — counted and timed when stored, quarantined when refused for good (a database
//! error there stops the sender: the event is not counted done, so its position is not
//! confirmed).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_pipeline::jetstream::{self, Failure, Stop};

use crate::config::OutboxConfig;
use crate::error::RelayError;
use crate::event::OutboxEvent;
use crate::health::OutboxHealth;
use crate::publish::Publisher;
use crate::{quarantine, telemetry, time};

/// The relay's handle on its sender task.
pub(crate) type SenderHandle = jetstream::SenderHandle<RelayOut>;

/// The bytes an event counts for in the relay's bound (its payload, subject, headers).
pub(crate) fn event_bytes(ev: &OutboxEvent) -> u64 {
    let headers: usize = ev.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    (ev.payload.len() + ev.subject_len() + headers + ev.id.len()) as u64
}

/// Start the relay's sender: events sent through `publisher`, `bytes` the bytes of the
/// events handed to it and not yet done (the relay adds, the sender subtracts).
pub(crate) fn spawn(
    cfg: OutboxConfig,
    publisher: Publisher,
    health: Arc<OutboxHealth>,
    bytes: Arc<AtomicU64>,
) -> SenderHandle {
    let limits = jetstream::SenderLimits {
        max_in_flight: cfg.max_in_flight,
        ack_timeout: cfg.ack_timeout,
        retry: cfg.retry,
    };
    let out = RelayOut {
        cfg,
        publisher,
        health,
        bytes,
        db: None,
        metrics: Metrics::register(),
    };
    SenderHandle::spawn(out, limits)
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

/// The outbox side of the relay's sender.
pub(crate) struct RelayOut {
    cfg: OutboxConfig,
    publisher: Publisher,
    health: Arc<OutboxHealth>,
    bytes: Arc<AtomicU64>,
    /// For the quarantine, connected when first needed.
    db: Option<Client>,
    metrics: Metrics,
}

impl RelayOut {
    /// An event is done: its bytes leave the relay's bound.
    fn release(&self, ev: &OutboxEvent) {
        let bytes = event_bytes(ev);
        let _ = self
            .bytes
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                Some(b.saturating_sub(bytes))
            });
    }

    async fn quarantine(
        &mut self,
        event: &OutboxEvent,
        kind: &'static str,
        error: String,
    ) -> Result<(), RelayError> {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => kind).increment(1);
        tracing::error!(id = %event.id, subject = %event.subject(), error, "outbox event refused for good: quarantined");
        if self.db.as_ref().is_none_or(Client::is_closed) {
            self.db = Some(walcast_pgtls::connect(&self.cfg.database_url).await?);
        }
        let db = self.db.as_ref().ok_or(RelayError::NotStarted)?;
        quarantine::put(db, event, &error).await?;
        metrics::counter!(telemetry::QUARANTINED).increment(1);
        self.health.quarantined();
        self.release(event);
        Ok(())
    }
}

impl jetstream::Outgoing for RelayOut {
    type Item = OutboxEvent;
    type Error = RelayError;
    const NAME: &'static str = "outbox";

    fn client(&self) -> async_nats::Client {
        self.publisher.client().clone()
    }

    fn send<'a>(
        &'a mut self,
        event: &'a OutboxEvent,
        reply: String,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        Box::pin(async move {
            self.publisher.ensure_stream().await?;
            self.publisher.send_to(event, reply).await
        })
    }

    fn stream_lost(&mut self) {
        self.publisher.stream_lost();
    }

    fn subject(&self, event: &OutboxEvent) -> String {
        event.subject()
    }

    fn stored(&mut self, event: OutboxEvent, duplicate: bool, waited: Duration) {
        self.release(&event);
        let m = &self.metrics;
        if duplicate {
            &m.duplicates
        } else {
            &m.published
        }
        .increment(1);
        m.ack_seconds.record(waited.as_secs_f64());
        if let Some(ms) = time::epoch_ms(&event.committed_at) {
            let secs = (time::now_ms() - ms).max(0) as f64 / 1000.0;
            m.commit_to_ack_seconds.record(secs);
        }
        self.health.published(1);
        self.health.set_error(None);
    }

    fn refused<'a>(
        &'a mut self,
        event: &'a OutboxEvent,
        kind: &'static str,
        error: String,
    ) -> BoxFuture<'a, Result<(), RelayError>> {
        Box::pin(self.quarantine(event, kind, error))
    }

    fn retrying(&mut self, error: &str, wait: Duration, pending: usize) {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => "transient").increment(1);
        tracing::warn!(
            error,
            retry_in_ms = wait.as_millis() as u64,
            pending,
            "outbox publish failed; retrying"
        );
        self.health.set_error(Some(format!("publishing: {error}")));
    }

    fn stopped(&self, why: Stop) -> RelayError {
        match why {
            Stop::Fenced(e) => RelayError::Fenced(e.to_string()),
            Stop::AnswersClosed => RelayError::AnswersClosed,
        }
    }

    fn oldest(&mut self, first: Option<&OutboxEvent>) {
        let oldest = first.and_then(|ev| time::epoch_ms(&ev.committed_at));
        self.health.set_oldest_pending(oldest);
        let age = oldest.map_or(0.0, |ms| (time::now_ms() - ms).max(0) as f64 / 1000.0);
        self.metrics.oldest_unpublished_seconds.set(age);
    }
}
