//! The relay: a [`Consumer`] of decoded transactions that sends each committed outbox
//! event to JetStream and lets the slot be acknowledged past a transaction only once
//! JetStream acknowledged (or, refusing it for good, the quarantine holds) every event
//! of it.
//!
//! Nothing here waits on JetStream: at each commit the transaction's events go to the
//! relay's sender task (the pipeline's pipelined JetStream sender, with `sender.rs`'s
//! outbox side), which sends them in commit order, takes the answers, retries and
//! quarantines. [`Consumer::settle`] reports, without waiting, the
//! commit of the last transaction whose every event is done, so while JetStream cannot
//! take events the slot's acknowledgement stays there (the WAL from it is retained) and
//! the other consumers carry on. Past `max_queued` events or `max_queued_bytes` bytes
//! outstanding the relay stops accepting transactions ([`Consumer::accepting`]); the
//! driver hands it the rest again from the slot once it accepts again, and the relay
//! skips what it already had.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_pipeline::{
    Consumer, ConsumerError, Handled, Item, PipelineHealth, Refresh, TxnContext,
};
use walcast_wal2json::{Change, Lsn, RowChange};

use crate::config::OutboxConfig;
use crate::event::{partition_outbox, OutboxEvent, MESSAGE_PREFIX};
use crate::health::OutboxHealth;
use crate::publish::Publisher;
use crate::sender::{event_bytes, SenderHandle};
use crate::{quarantine, telemetry, PARTS_SCHEMA};

/// Tests inject a crash between JetStream's acknowledgement and the slot's with
/// `WALCAST_FAILPOINT=outbox-after-ack` (read once; never set it in production).
fn failpoint_after_ack() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("WALCAST_FAILPOINT").is_ok_and(|v| v == "outbox-after-ack"))
}

/// The outbox-table list, decoded so a new outbox is known from its creation on.
const TABLES: (&str, &str) = ("walcast", "outbox_tables");

/// Committed events held before they go to the sender as one run, at most.
const HANDOFF_MAX: usize = 256;

/// A transaction with events, handed to the sender.
struct PendingTxn {
    /// The relay's handed position before it (durable once this one's events are not).
    prev: Lsn,
    /// Events handed to the sender up to and including this transaction's.
    end: u64,
}

pub struct Relay {
    cfg: OutboxConfig,
    /// Until the sender task starts (at the first event), which then owns it.
    publisher: Option<Publisher>,
    sender: Option<SenderHandle>,
    /// Bytes of the events handed to the sender and not yet done (it subtracts).
    sender_bytes: Arc<AtomicU64>,
    health: Arc<OutboxHealth>,
    pipeline_health: Arc<PipelineHealth>,
    db: Option<Client>,
    /// Outbox id → project.
    outboxes: HashMap<i32, String>,
    /// Events of the transaction being read.
    txn: Vec<OutboxEvent>,
    /// The transaction being read was handed before: its items are skipped.
    skipping: bool,
    /// The newest commit (or caught-up position) handed to the relay.
    seen: Lsn,
    /// Events handed to the sender.
    submitted: u64,
    /// Transactions with events not all done yet, in commit order.
    pending: VecDeque<PendingTxn>,
    /// Committed events not handed to the sender yet (counted in `submitted`), and their
    /// bytes: handed over as one run when the driver has nothing more waiting, at
    /// [`HANDOFF_MAX`] events, and before settling or a barrier.
    outbound: Vec<OutboxEvent>,
    outbound_bytes: u64,
    /// The queue gauges, registered once (set at every collect).
    queued_gauges: (metrics::Gauge, metrics::Gauge),
}

pub use crate::error::RelayError;

impl Relay {
    pub fn new(
        cfg: OutboxConfig,
        publisher: Publisher,
        health: Arc<OutboxHealth>,
        pipeline_health: Arc<PipelineHealth>,
    ) -> Relay {
        Relay {
            publisher: Some(publisher),
            sender: None,
            sender_bytes: Arc::default(),
            cfg,
            health,
            pipeline_health,
            db: None,
            outboxes: HashMap::new(),
            txn: Vec::new(),
            skipping: false,
            seen: Lsn::ZERO,
            submitted: 0,
            pending: VecDeque::new(),
            outbound: Vec::new(),
            outbound_bytes: 0,
            queued_gauges: (
                metrics::gauge!(telemetry::QUEUED_EVENTS),
                metrics::gauge!(telemetry::QUEUED_BYTES),
            ),
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

    /// Drop the transaction's events of projects the relay's gate refuses (another
    /// source's), each counted and reported like a malformed one.
    async fn gate(&mut self, txn: &TxnContext) -> Result<(), RelayError> {
        let Some(gate) = self.cfg.projects.0.clone() else {
            return Ok(());
        };
        let mut kept = Vec::with_capacity(self.txn.len());
        for ev in std::mem::take(&mut self.txn) {
            match gate.admits(&ev.project).await {
                Ok(true) => kept.push(ev),
                Ok(false) => self.malformed(
                    MESSAGE_PREFIX,
                    txn,
                    &format!("project {:?} is not on this source", ev.project),
                ),
                Err(e) => return Err(RelayError::Gate(e)),
            }
        }
        self.txn = kept;
        Ok(())
    }

    /// The committed transaction's events, for the sender (never waits); its commit is
    /// the relay's newest handed position.
    fn commit(&mut self, txn: &TxnContext) -> Result<(), RelayError> {
        let events = std::mem::take(&mut self.txn);
        let prev = self.seen;
        self.seen = self.seen.max(txn.commit_lsn);
        if events.is_empty() {
            return Ok(());
        }
        self.submitted += events.len() as u64;
        self.outbound_bytes += events.iter().map(event_bytes).sum::<u64>();
        self.outbound.extend(events);
        self.pending.push_back(PendingTxn {
            prev,
            end: self.submitted,
        });
        if self.outbound.len() >= HANDOFF_MAX {
            self.hand_off()?;
        }
        Ok(())
    }

    /// The events held to the sender (started at the first), in order; never waits.
    fn hand_off(&mut self) -> Result<(), RelayError> {
        if self.outbound.is_empty() {
            return Ok(());
        }
        if self.sender.is_none() {
            let publisher = self.publisher.take().ok_or(RelayError::SenderStopped)?;
            let (cfg, health) = (self.cfg.clone(), self.health.clone());
            let sender = crate::sender::spawn(cfg, publisher, health, self.sender_bytes.clone());
            self.sender = Some(sender);
        }
        let sender = self.sender.as_ref().ok_or(RelayError::SenderStopped)?;
        let bytes = std::mem::take(&mut self.outbound_bytes);
        let events = std::mem::take(&mut self.outbound);
        debug_assert_eq!(bytes, events.iter().map(event_bytes).sum::<u64>());
        self.sender_bytes.fetch_add(bytes, Ordering::Relaxed);
        if !sender.send(events) {
            return Err(self.sender_failure());
        }
        Ok(())
    }

    /// Why the sender task ended.
    fn sender_failure(&self) -> RelayError {
        self.sender
            .as_ref()
            .and_then(SenderHandle::take_failure)
            .unwrap_or(RelayError::SenderStopped)
    }

    /// Events committed and not yet done (held or at the sender), and their bytes.
    fn outstanding(&self) -> (u64, u64) {
        let Some(s) = &self.sender else {
            return (self.submitted, self.outbound_bytes);
        };
        let bytes = self.sender_bytes.load(Ordering::Relaxed);
        (
            self.submitted.saturating_sub(s.done()),
            bytes + self.outbound_bytes,
        )
    }

    /// Forget the transactions whose every event is done; `true` if one had events. An
    /// error if the sender ended (fenced, or the quarantine's database failed).
    fn collect(&mut self) -> Result<bool, RelayError> {
        let Some(sender) = &self.sender else {
            return Ok(false);
        };
        if let Some(failure) = sender.take_failure() {
            return Err(failure);
        }
        let done = sender.done();
        let mut advanced = false;
        while self.pending.front().is_some_and(|t| t.end <= done) {
            self.pending.pop_front();
            advanced = true;
        }
        let (events, bytes) = self.outstanding();
        self.queued_gauges.0.set(events as f64);
        self.queued_gauges.1.set(bytes as f64);
        self.health.set_queued(events, bytes);
        Ok(advanced)
    }

    /// The position up to which every event handed over is done: the commit before the
    /// first transaction with an event outstanding, or `handed`.
    fn durable(&self, handed: Lsn) -> Lsn {
        self.pending.front().map_or(handed, |t| t.prev.min(handed))
    }

    /// Tests crash here (the failpoint) right after JetStream's acknowledgements let the
    /// position advance, before the slot does.
    fn failpoint(&self, advanced: bool) {
        if advanced && failpoint_after_ack() {
            tracing::error!("failpoint outbox-after-ack: aborting after JetStream's acks, before the slot advances");
            std::process::abort();
        }
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
                Item::Begin(txn) => {
                    self.txn.clear();
                    // Handed again (the driver re-read the WAL): its events are queued
                    // or done already.
                    self.skipping = txn.commit_lsn <= self.seen;
                }
                Item::Change(..) if self.skipping => {}
                Item::Change(txn, change) => self.change(txn, change).await?,
                Item::Commit(_) if self.skipping => self.skipping = false,
                Item::Commit(txn) => {
                    self.gate(txn).await?;
                    self.commit(txn)?
                }
            }
            Ok(Handled::Continue)
        })
    }

    fn has_pending(&self) -> bool {
        !self.outbound.is_empty()
    }

    fn flush(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move { Ok(self.hand_off()?) })
    }

    fn settle(&mut self, handed: Lsn) -> BoxFuture<'_, Result<Lsn, ConsumerError>> {
        Box::pin(async move {
            self.hand_off()?;
            let advanced = self.collect()?;
            self.failpoint(advanced);
            self.seen = self.seen.max(handed);
            Ok(self.durable(handed))
        })
    }

    fn accepting(&self) -> bool {
        let (events, bytes) = self.outstanding();
        events < self.cfg.max_queued.max(1) as u64 && bytes < self.cfg.max_queued_bytes.max(1)
    }

    /// Waits until every event handed over is done (the driver bounds it).
    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move {
            self.hand_off()?;
            let n = self.submitted;
            if let Some(sender) = &mut self.sender {
                if !sender.wait_done(n).await {
                    return Err(self.sender_failure().into());
                }
            }
            let advanced = self.collect()?;
            self.failpoint(advanced);
            Ok(())
        })
    }

    /// A partial transaction is forgotten (its items come again); what was committed
    /// stays queued: the driver does not hand it again (and if it does, it is skipped).
    fn reset(&mut self) {
        self.txn.clear();
        self.skipping = false;
    }
}
