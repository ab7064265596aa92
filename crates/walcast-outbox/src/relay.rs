//! The relay: a [`Consumer`] of decoded transactions that sends each committed outbox
//! event to JetStream and lets the slot be acknowledged past a transaction only once
//! JetStream acknowledged (or, refusing it for good, the quarantine holds) every event
//! of it.
//!
//! Events are sent at their transaction's commit, in commit order, without waiting for
//! each answer (at most `max_in_flight` outstanding); the barrier waits for the answers.
//! A transient failure is retried after a capped exponential backoff, resending from the
//! first unacknowledged event on, in order (JetStream's duplicate window drops what had
//! already landed). A permanent one (too large, no stream for the subject) goes to the
//! quarantine and the others carry on.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};
use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_pipeline::{
    Consumer, ConsumerError, Handled, Item, PipelineHealth, Refresh, Retry, TxnContext,
};
use walcast_wal2json::{Change, RowChange};

use crate::config::OutboxConfig;
use crate::event::{partition_outbox, OutboxEvent, MESSAGE_PREFIX};
use crate::health::OutboxHealth;
use crate::publish::{classify, Failure, Publisher};
use crate::{quarantine, telemetry, time, PARTS_SCHEMA};

/// Tests inject a crash between JetStream's acknowledgement and the slot's with
/// `WALCAST_FAILPOINT=outbox-after-ack` (read once; never set it in production).
fn failpoint_after_ack() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WALCAST_FAILPOINT").is_ok_and(|v| v == "outbox-after-ack"))
}

/// The outbox-table list, decoded so a new outbox is known from its creation on.
const TABLES: (&str, &str) = ("walcast", "outbox_tables");

/// An event sent (or to send) and its answer to come.
struct InFlight {
    event: OutboxEvent,
    ack: Option<PublishAckFuture>,
    /// Why it could not even be sent.
    failed: Option<Failure>,
    sent: Instant,
    /// JetStream said no stream listens on its subject after the stream was re-checked.
    stream_checked: bool,
}

pub struct Relay {
    cfg: OutboxConfig,
    publisher: Publisher,
    health: Arc<OutboxHealth>,
    pipeline_health: Arc<PipelineHealth>,
    db: Option<Client>,
    /// Outbox id → project.
    outboxes: HashMap<i32, String>,
    /// Events of the transaction being read.
    txn: Vec<OutboxEvent>,
    in_flight: VecDeque<InFlight>,
}

/// Why the relay stopped a session.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("database: {0}")]
    Connect(#[from] walcast_pgtls::ConnectError),
    #[error("no database connection (not started)")]
    NotStarted,
    /// The leadership term ended while events were outstanding.
    #[error("{0}")]
    Fenced(String),
}

impl From<RelayError> for ConsumerError {
    fn from(e: RelayError) -> ConsumerError {
        let retry = match e {
            RelayError::Fenced(_) => Retry::Fenced,
            _ => Retry::Backoff,
        };
        ConsumerError::new(retry, e)
    }
}

impl Relay {
    pub fn new(
        cfg: OutboxConfig,
        publisher: Publisher,
        health: Arc<OutboxHealth>,
        pipeline_health: Arc<PipelineHealth>,
    ) -> Relay {
        Relay {
            publisher,
            cfg,
            health,
            pipeline_health,
            db: None,
            outboxes: HashMap::new(),
            txn: Vec::new(),
            in_flight: VecDeque::new(),
        }
    }

    fn db(&self) -> Result<&Client, RelayError> {
        self.db.as_ref().ok_or(RelayError::NotStarted)
    }

    async fn load_outboxes(&mut self) -> Result<(), RelayError> {
        let rows = self
            .db()?
            .query("SELECT id, project FROM walcast.outbox_tables", &[])
            .await?;
        self.outboxes = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        Ok(())
    }

    async fn read_quarantine_size(&self) -> Result<(), RelayError> {
        let n = quarantine::size(self.db()?).await?;
        self.health.set_quarantine_size(n);
        metrics::gauge!(telemetry::QUARANTINE_SIZE).set(n as f64);
        Ok(())
    }

    fn malformed(&self, what: &str, txn: &TxnContext, error: &str) {
        metrics::counter!(telemetry::MALFORMED).increment(1);
        self.pipeline_health
            .report_skip(what, Some(txn.commit_lsn), "outbox_malformed", error);
    }

    /// An inserted row: a new outbox, or an event of one.
    async fn row(&mut self, txn: &TxnContext, row: &RowChange<'_>) -> Result<(), RelayError> {
        if (row.schema.as_ref(), row.table.as_ref()) == TABLES {
            let get = |name: &str| {
                row.columns
                    .iter()
                    .find(|c| c.name == name)
                    .and_then(|c| c.value)
                    .and_then(|v| serde_json::from_str::<serde_json::Value>(v.get()).ok())
            };
            if let (Some(id), Some(project)) = (get("id"), get("project")) {
                if let (Some(id), Some(p)) = (id.as_i64(), project.as_str()) {
                    self.outboxes.insert(id as i32, p.to_string());
                }
            }
            return Ok(());
        }
        if row.schema != PARTS_SCHEMA {
            return Ok(());
        }
        let Some(id) = partition_outbox(&row.table) else {
            return Ok(());
        };
        if !self.outboxes.contains_key(&id) {
            self.load_outboxes().await?;
        }
        let Some(project) = self.outboxes.get(&id) else {
            let what = format!("{PARTS_SCHEMA}.{}", row.table);
            self.malformed(&what, txn, "no outbox table has this partition");
            return Ok(());
        };
        match OutboxEvent::from_row(project, &row.columns, txn.commit_lsn, &txn.commit_timestamp) {
            Ok(ev) => self.txn.push(ev),
            Err(e) => self.malformed(
                &format!("{PARTS_SCHEMA}.{}", row.table),
                txn,
                &e.to_string(),
            ),
        }
        Ok(())
    }

    async fn change(&mut self, txn: &TxnContext, change: &Change<'_>) -> Result<(), RelayError> {
        match change {
            Change::Message(m) if m.transactional && m.prefix == MESSAGE_PREFIX => {
                match OutboxEvent::from_message(&m.content, txn.commit_lsn, &txn.commit_timestamp) {
                    Ok(ev) => self.txn.push(ev),
                    Err(e) => self.malformed(MESSAGE_PREFIX, txn, &e.to_string()),
                }
                Ok(())
            }
            Change::Insert(row) => self.row(txn, row).await,
            _ => Ok(()),
        }
    }

    /// Send the committed transaction's events, after making room if too many answers
    /// are outstanding.
    async fn commit(&mut self) -> Result<(), RelayError> {
        for event in std::mem::take(&mut self.txn) {
            while self.in_flight.len() >= self.cfg.max_in_flight.max(1) {
                self.settle_first().await?;
            }
            let mut f = InFlight {
                event,
                ack: None,
                failed: None,
                sent: Instant::now(),
                stream_checked: false,
            };
            self.send(&mut f).await;
            self.in_flight.push_back(f);
        }
        self.update_oldest();
        Ok(())
    }

    async fn send(&mut self, f: &mut InFlight) {
        f.sent = Instant::now();
        f.ack = None;
        f.failed = None;
        if let Err(e) = self.publisher.ensure_stream().await {
            f.failed = Some(e);
            return;
        }
        match self.publisher.send(&f.event).await {
            Ok(ack) => f.ack = Some(ack),
            Err(failure) => f.failed = Some(failure),
        }
    }

    fn update_oldest(&self) {
        let oldest = self
            .in_flight
            .front()
            .and_then(|f| time::epoch_ms(&f.event.committed_at));
        self.health.set_oldest_pending(oldest);
        let age = oldest.map_or(0.0, |ms| (time::now_ms() - ms).max(0) as f64 / 1000.0);
        metrics::gauge!(telemetry::OLDEST_UNPUBLISHED_SECONDS).set(age);
    }
}

impl Relay {
    /// The answer for the first outstanding event: acknowledged, quarantined, or (a
    /// transient failure) resent with everything after it, after a backoff, until one of
    /// the first two.
    async fn settle_first(&mut self) -> Result<(), RelayError> {
        let mut attempt = 0u32;
        loop {
            let Some(first) = self.in_flight.front_mut() else {
                return Ok(());
            };
            let outcome = match (first.ack.take(), first.failed.take()) {
                (Some(ack), _) => ack.await.map_err(|e| {
                    if e.kind() == PublishErrorKind::StreamNotFound {
                        if first.stream_checked {
                            return Failure::Permanent {
                                kind: "no_stream",
                                error: format!("no stream listens on {}", first.event.subject()),
                            };
                        }
                        first.stream_checked = true;
                    }
                    classify(&e)
                }),
                (None, Some(failure)) => Err(failure),
                (None, None) => Err(Failure::Transient("not sent".into())),
            };
            match outcome {
                Ok(ack) => return self.acknowledged(ack.duplicate),
                Err(Failure::Permanent { kind, error }) => {
                    return self.quarantine(kind, &error).await
                }
                Err(Failure::Fenced(error)) => return Err(RelayError::Fenced(error)),
                Err(Failure::Transient(error)) => {
                    self.retry(&error, attempt).await;
                    attempt = attempt.saturating_add(1);
                }
            }
        }
    }

    fn acknowledged(&mut self, duplicate: bool) -> Result<(), RelayError> {
        let Some(f) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let dup = if duplicate { "true" } else { "false" };
        metrics::counter!(telemetry::PUBLISHED, "duplicate" => dup).increment(1);
        metrics::histogram!(telemetry::ACK_SECONDS).record(f.sent.elapsed().as_secs_f64());
        if let Some(ms) = time::epoch_ms(&f.event.committed_at) {
            let secs = (time::now_ms() - ms).max(0) as f64 / 1000.0;
            metrics::histogram!(telemetry::COMMIT_TO_ACK_SECONDS).record(secs);
        }
        self.health.published(1);
        self.health.set_error(None);
        Ok(())
    }

    async fn quarantine(&mut self, kind: &'static str, error: &str) -> Result<(), RelayError> {
        let Some(f) = self.in_flight.front() else {
            return Ok(());
        };
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => kind).increment(1);
        tracing::error!(id = %f.event.id, subject = %f.event.subject(), error, "outbox event refused for good: quarantined");
        quarantine::put(self.db()?, &f.event, error).await?;
        metrics::counter!(telemetry::QUARANTINED).increment(1);
        self.health.quarantined();
        self.in_flight.pop_front();
        Ok(())
    }

    /// Wait, then resend every outstanding event in order (the ones after the failed one
    /// may have landed: the duplicate window drops them).
    async fn retry(&mut self, error: &str, attempt: u32) {
        metrics::counter!(telemetry::PUBLISH_FAILURES, "kind" => "transient").increment(1);
        let wait = self.cfg.retry.delay(attempt);
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
            self.send(f).await;
        }
        self.in_flight = pending;
    }
}

impl Consumer for Relay {
    fn name(&self) -> &'static str {
        "outbox"
    }

    fn tables(&self) -> Vec<(String, String)> {
        vec![(TABLES.0.to_string(), TABLES.1.to_string())]
    }

    fn schemas(&self) -> Vec<String> {
        vec![PARTS_SCHEMA.to_string()]
    }

    fn message_prefixes(&self) -> Vec<String> {
        vec![MESSAGE_PREFIX.to_string()]
    }

    fn refresh(&mut self, when: Refresh) -> BoxFuture<'_, Result<bool, ConsumerError>> {
        Box::pin(async move {
            if matches!(when, Refresh::Start) || self.db.as_ref().is_none_or(Client::is_closed) {
                let db = walcast_pgtls::connect(&self.cfg.database_url).await;
                self.db = Some(db.map_err(RelayError::from)?);
            }
            self.load_outboxes().await?;
            self.read_quarantine_size().await?;
            Ok(false)
        })
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        Box::pin(async move {
            match item {
                Item::Begin(_) => self.txn.clear(),
                Item::Change(txn, change) => self.change(txn, change).await?,
                Item::Commit(_) => self.commit().await?,
            }
            Ok(Handled::Continue)
        })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move {
            let settled = !self.in_flight.is_empty();
            while !self.in_flight.is_empty() {
                self.settle_first().await?;
            }
            self.update_oldest();
            if settled && failpoint_after_ack() {
                tracing::error!("failpoint outbox-after-ack: aborting after JetStream's acks, before the slot advances");
                std::process::abort();
            }
            Ok(())
        })
    }

    fn reset(&mut self) {
        self.txn.clear();
        self.in_flight.clear();
        self.update_oldest();
    }
}
