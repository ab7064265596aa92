//! What `/health` reports about the pipeline, shared between the poller and the HTTP side.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use serde::Serialize;
use walcast_wal2json::Lsn;

/// A range of WAL whose changes were lost because the slot was invalidated.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LostRange {
    /// Last position we had confirmed (changes after it were never published).
    pub from: Option<Lsn>,
    /// Where the recreated slot starts.
    pub to: Lsn,
}

/// The last change that was skipped or cut down instead of delivered whole.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct SkippedChange {
    /// `schema.table` (or the line's start when it could not be decoded).
    pub table: String,
    /// Commit LSN of its transaction.
    pub commit_lsn: Option<Lsn>,
    /// Why (`payload_too_large`, `undecodable`, `event`).
    pub reason: String,
}

/// How far one consumer got (see the driver).
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ConsumerProgress {
    /// Everything before this position is durable where the consumer sends it.
    pub settled: Lsn,
    /// WAL bytes between what was read and `settled`.
    pub lag_bytes: u64,
    /// Its own buffer is full: it is handed nothing until it accepts again.
    pub detached: bool,
}

/// How far one part of a consumer got (e.g. realtime delivery of one project).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PartLag {
    /// Age of its oldest change not yet delivered, in milliseconds (0: none waiting).
    pub lag_ms: u64,
    /// Changes waiting.
    pub queued: u64,
    /// Changes skipped because it lagged past its bound, since start.
    pub skipped_total: u64,
}

/// The source's running snapshot (`walcast snapshot`), on `/health`.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct SnapshotProgress {
    pub id: i64,
    pub project: String,
    /// `schema.table`.
    pub table: String,
    pub rows_done: i64,
    /// `pg_class.reltuples` when it was queued (an estimate; 0 when unknown).
    pub rows_estimate: i64,
    pub chunks_done: i64,
}

#[derive(Default)]
pub struct PipelineHealth {
    snapshot: Mutex<Option<SnapshotProgress>>,
    consumers: Mutex<std::collections::BTreeMap<&'static str, ConsumerProgress>>,
    parts: Mutex<std::collections::BTreeMap<String, PartLag>>,
    skipped_total: AtomicU64,
    oversized_total: AtomicU64,
    last_skipped: Mutex<Option<SkippedChange>>,
    slot: Mutex<String>,
    active: AtomicBool,
    leader: AtomicBool,
    confirmed_flush: AtomicU64,
    lag_bytes: AtomicI64,
    retained_bytes: AtomicI64,
    slot_lost_total: AtomicU64,
    last_loss: Mutex<Option<LostRange>>,
    last_error: Mutex<Option<String>>,
    ddl_tracking: Mutex<Option<&'static str>>,
    changes_total: AtomicU64,
    heartbeats_total: AtomicU64,
    heartbeat_failures_total: AtomicU64,
}

/// The JSON body of `/health` for the CDC part.
#[derive(Serialize, Debug, Clone)]
pub struct PipelineHealthReport {
    pub cdc_active: bool,
    pub slot: String,
    pub confirmed_flush_lsn: Option<Lsn>,
    pub lag_bytes: i64,
    /// WAL the server keeps for the slot: from its `restart_lsn` to the current position
    /// (at least `lag_bytes`' worth once a running-transactions record was decoded).
    pub retained_bytes: i64,
    pub leader: bool,
    pub slot_lost_total: u64,
    pub last_slot_loss: Option<LostRange>,
    pub last_error: Option<String>,
    /// Changes that could not be delivered at all (a deterministic failure: retrying
    /// would stall the slot forever), since start.
    pub skipped_changes_total: u64,
    /// Changes delivered without their large values (`Error 413`), since start.
    pub oversized_changes_total: u64,
    pub last_skipped_change: Option<SkippedChange>,
    /// How privilege and schema changes are applied: `event_trigger` (at their WAL
    /// position) or `per_batch` (no event trigger: each batch re-reads the catalog).
    pub ddl_tracking: Option<&'static str>,
    /// Changes read from the WAL since start (every table any consumer reads).
    pub changes_total: u64,
    /// Heartbeats written on the source database (`CDC_HEARTBEAT_INTERVAL_MS`), since start.
    pub heartbeats_total: u64,
    /// Heartbeats that failed (logged; tried again at the next interval), since start.
    pub heartbeat_failures_total: u64,
    /// Each consumer's progress (the slot is acknowledged at the lowest).
    pub consumers: std::collections::BTreeMap<&'static str, ConsumerProgress>,
    /// Parts of consumers that lag (e.g. `realtime/<project>`); absent when none waits.
    pub lagging: std::collections::BTreeMap<String, PartLag>,
    /// The snapshot running on this source, if one is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<SnapshotProgress>,
}

/// Lagging parts shown on `/health` at most (the metrics have them all).
pub const MAX_LAGGING_PARTS: usize = 100;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl PipelineHealth {
    /// A change that no retry can deliver: log, count (`walcast_cdc_changes_skipped_total`
    /// by `reason`), show on `/health`, move on. Consumers report their own skips here.
    pub fn report_skip(
        &self,
        table: &str,
        commit_lsn: Option<Lsn>,
        reason: &'static str,
        error: &str,
    ) {
        metrics::counter!(crate::telemetry::CHANGES_SKIPPED, "reason" => reason).increment(1);
        tracing::error!(
            table,
            ?commit_lsn,
            reason,
            error,
            "change skipped: it cannot be delivered"
        );
        self.record_skip(
            SkippedChange {
                table: table.to_string(),
                commit_lsn,
                reason: reason.to_string(),
            },
            false,
        );
    }

    pub fn new(slot: &str) -> PipelineHealth {
        let h = PipelineHealth::default();
        *lock(&h.slot) = slot.to_string();
        h
    }

    pub fn set_active(&self, active: bool) {
        self.active.store(active, Ordering::SeqCst);
        metrics::gauge!(crate::telemetry::ACTIVE).set(if active { 1.0 } else { 0.0 });
    }

    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::SeqCst)
    }

    /// Whether this process leads the pipeline's source. Once it no longer does, its slot
    /// lag and consumer gauges say 0 (the new leader reports them; `/health` keeps the
    /// last seen), so that no alert stays on a value this worker no longer measures.
    pub fn set_leader(&self, leader: bool) {
        self.leader.store(leader, Ordering::SeqCst);
        if !leader {
            metrics::gauge!(crate::telemetry::SLOT_LAG).set(0.0);
            metrics::gauge!(crate::telemetry::SLOT_RETAINED).set(0.0);
            for &name in lock(&self.consumers).keys() {
                metrics::gauge!(crate::telemetry::CONSUMER_LAG, "consumer" => name).set(0.0);
                metrics::gauge!(crate::telemetry::CONSUMER_DETACHED_NOW, "consumer" => name)
                    .set(0.0);
            }
        }
    }

    /// The slot's confirmed position, the WAL after it (`lag_bytes`) and the WAL the
    /// server keeps for it (`retained_bytes`, from its `restart_lsn`).
    pub fn set_slot_position(&self, confirmed: Lsn, lag_bytes: i64, retained_bytes: i64) {
        self.confirmed_flush.store(confirmed.0, Ordering::SeqCst);
        self.lag_bytes.store(lag_bytes, Ordering::SeqCst);
        self.retained_bytes.store(retained_bytes, Ordering::SeqCst);
        metrics::gauge!(crate::telemetry::SLOT_LAG).set(lag_bytes as f64);
        metrics::gauge!(crate::telemetry::SLOT_RETAINED).set(retained_bytes as f64);
    }

    pub fn record_slot_loss(&self, range: LostRange) {
        self.slot_lost_total.fetch_add(1, Ordering::SeqCst);
        *lock(&self.last_loss) = Some(range);
    }

    /// Record how DDL is tracked; true if that changed.
    pub fn set_ddl_tracking(&self, mode: &'static str) -> bool {
        lock(&self.ddl_tracking).replace(mode) != Some(mode)
    }

    pub fn set_error(&self, error: Option<String>) {
        *lock(&self.last_error) = error;
    }

    /// A consumer's progress, as the driver sees it.
    pub fn set_consumer(&self, name: &'static str, progress: ConsumerProgress) {
        lock(&self.consumers).insert(name, progress);
    }

    /// A part of a consumer lags (`Some`), or no longer does (`None`). At most
    /// [`MAX_LAGGING_PARTS`] are kept.
    pub fn set_part_lag(&self, part: &str, lag: Option<PartLag>) {
        let mut parts = lock(&self.parts);
        match lag {
            Some(lag) if parts.len() < MAX_LAGGING_PARTS || parts.contains_key(part) => {
                parts.insert(part.to_string(), lag);
            }
            Some(_) => {}
            None => {
                parts.remove(part);
            }
        }
    }

    /// A heartbeat was written (`ok`) or failed: counted here and in
    /// `walcast_cdc_heartbeats_total{result}`.
    pub fn record_heartbeat(&self, ok: bool) {
        let (counter, result) = match ok {
            true => (&self.heartbeats_total, "ok"),
            false => (&self.heartbeat_failures_total, "error"),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::telemetry::HEARTBEATS, "result" => result).increment(1);
    }

    /// A change was read from the WAL.
    pub fn record_change(&self) {
        self.changes_total.fetch_add(1, Ordering::Relaxed);
    }

    /// A change was skipped (`oversized: false`) or delivered reduced (`true`).
    pub fn record_skip(&self, skip: SkippedChange, oversized: bool) {
        let counter = if oversized {
            &self.oversized_total
        } else {
            &self.skipped_total
        };
        counter.fetch_add(1, Ordering::SeqCst);
        *lock(&self.last_skipped) = Some(skip);
    }

    /// The running snapshot's progress (`None`: none runs).
    pub fn set_snapshot(&self, progress: Option<SnapshotProgress>) {
        *lock(&self.snapshot) = progress;
    }

    pub fn report(&self) -> PipelineHealthReport {
        let confirmed = self.confirmed_flush.load(Ordering::SeqCst);
        PipelineHealthReport {
            cdc_active: self.is_active(),
            slot: lock(&self.slot).clone(),
            confirmed_flush_lsn: (confirmed != 0).then_some(Lsn(confirmed)),
            lag_bytes: self.lag_bytes.load(Ordering::SeqCst),
            retained_bytes: self.retained_bytes.load(Ordering::SeqCst),
            leader: self.leader.load(Ordering::SeqCst),
            slot_lost_total: self.slot_lost_total.load(Ordering::SeqCst),
            last_slot_loss: lock(&self.last_loss).clone(),
            last_error: lock(&self.last_error).clone(),
            skipped_changes_total: self.skipped_total.load(Ordering::SeqCst),
            oversized_changes_total: self.oversized_total.load(Ordering::SeqCst),
            last_skipped_change: lock(&self.last_skipped).clone(),
            ddl_tracking: *lock(&self.ddl_tracking),
            changes_total: self.changes_total.load(Ordering::Relaxed),
            heartbeats_total: self.heartbeats_total.load(Ordering::Relaxed),
            heartbeat_failures_total: self.heartbeat_failures_total.load(Ordering::Relaxed),
            consumers: lock(&self.consumers).clone(),
            lagging: lock(&self.parts).clone(),
            snapshot: lock(&self.snapshot).clone(),
        }
    }
}
