//! The driver: one loop, shared by both sources, between a [`Source`] of wal2json lines and
//! the [`Consumer`]s of decoded transactions.
//!
//! It owns what both sources used to repeat: framing lines into transactions
//! ([`crate::txn`]), the table filter (the union of the consumers' tables), the initial
//! load and the periodic re-check of the consumers' state, slot statistics, `/health`,
//! the fence checks, and the acknowledgement rule: a position is acknowledged only after
//! every consumer's barrier confirmed what it was handed, so a crash replays and never
//! skips. When a consumer's tables change inside a transaction, the source is
//! acknowledged up to that commit and restarted from there with the new filter.

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use futures_util::FutureExt;

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_lease::{Action, Fence};
use walcast_wal2json::{Change, Lsn, Message};

use crate::consumer::{Consumer, Handled, Item, Refresh};
use crate::error::ConsumerError;
use crate::health::{PipelineHealth, SkippedChange};
use crate::signed::{self, Forged, MessageKey};
use crate::source::{Filter, Input, Source};
use crate::txn::{Step, TxnContext, TxnReader};
use crate::{telemetry, PipelineError};

/// Slot statistics are read at most this often (and at once after a busy checkpoint).
const STATS_INTERVAL: Duration = Duration::from_millis(500);

/// How a read of the source ended.
enum Stop {
    Cancelled,
    /// A consumer's tables changed: restart the source with the new filter.
    Restart,
}

/// What the driver is built with.
pub struct DriverOptions<'a> {
    /// The slot's SQL connection (`POSTGRES_REPLICATION_URL`), for its statistics (`None`:
    /// none are reported, as in tests without a database).
    pub client: Option<&'a Client>,
    pub slot: String,
    pub health: &'a PipelineHealth,
    pub fence: Fence,
    /// How often consumers re-check their state ([`Refresh::Check`]).
    pub refresh: Duration,
    /// The slot's confirmed position at start.
    pub confirmed: Lsn,
    /// The key `walcast.*` messages are signed with ([`crate::signed`]; `None`: none could
    /// be read, every such message is skipped as forged).
    pub message_key: Option<MessageKey>,
}

pub struct Driver<'a> {
    opts: DriverOptions<'a>,
    consumers: Vec<Box<dyn Consumer + 'a>>,
    txns: TxnReader,
    /// Acknowledged to the server.
    confirmed: Lsn,
    /// Handed to the consumers, safe to acknowledge once their barriers pass.
    handled: Lsn,
    /// Lines were handed over since the last barrier.
    unsettled: bool,
    /// A consumer's tables changed in the current transaction.
    tables_changed: bool,
    refreshed_at: Instant,
    stats_at: Option<Instant>,
}

impl<'a> Driver<'a> {
    pub fn new(opts: DriverOptions<'a>, consumers: Vec<Box<dyn Consumer + 'a>>) -> Driver<'a> {
        Driver {
            confirmed: opts.confirmed,
            handled: opts.confirmed,
            opts,
            consumers,
            txns: TxnReader::new(),
            unsettled: false,
            tables_changed: false,
            refreshed_at: Instant::now(),
            stats_at: None,
        }
    }

    /// Load every consumer's state, then read until cancelled (or a failure the caller
    /// retries), restarting the source whenever the filter changes.
    pub async fn run<S: Source>(
        mut self,
        source: &mut S,
        cancel: &CancellationToken,
    ) -> Result<(), PipelineError> {
        for c in &mut self.consumers {
            c.refresh(Refresh::Start).await.map_err(failed(c.name()))?;
        }
        self.refreshed_at = Instant::now();
        loop {
            self.opts.fence.check(Action::Read)?;
            let filter = self.filter();
            tracing::info!(filter = %filter, from = %self.confirmed, "reading the slot");
            source.start(self.confirmed, &filter).await?;
            // Reading: active from now on, not only after the first round (a first poll
            // of a long backlog can take a while).
            self.opts.health.set_active(true);
            self.opts.health.set_error(None);
            self.reset();
            match self.read(source, cancel).await? {
                Stop::Cancelled => return Ok(()),
                Stop::Restart => source.stop().await,
            }
        }
    }

    /// The union of the consumers' tables, schemas and message prefixes.
    fn filter(&self) -> Filter {
        let tables = self.consumers.iter().flat_map(|c| c.tables()).collect();
        let schemas = self.consumers.iter().flat_map(|c| c.schemas()).collect();
        let prefixes = self.consumers.iter().flat_map(|c| c.message_prefixes());
        Filter::new(tables, schemas, prefixes.collect())
    }

    fn reset(&mut self) {
        self.txns.reset();
        self.tables_changed = false;
        self.consumers.iter_mut().for_each(|c| c.reset());
    }

    fn has_pending(&self) -> bool {
        self.consumers.iter().any(|c| c.has_pending())
    }

    async fn read<S: Source>(
        &mut self,
        source: &mut S,
        cancel: &CancellationToken,
    ) -> Result<Stop, PipelineError> {
        loop {
            let input = tokio::select! {
                // Lines already received come first; held work is done as soon as nothing
                // more is waiting.
                biased;
                _ = cancel.cancelled() => {
                    self.settle(source, self.handled, false).await?;
                    source.stop().await;
                    return Ok(Stop::Cancelled);
                }
                input = source.next() => input?,
                _ = std::future::ready(()), if S::FLUSH_WHILE_WAITING && self.has_pending() => {
                    for c in &mut self.consumers {
                        c.flush().await.map_err(failed(c.name()))?;
                    }
                    continue;
                }
            };
            match input {
                Input::Line(data) => {
                    if self.line(&data).await? {
                        self.settle(source, self.handled, false).await?;
                        return Ok(Stop::Restart);
                    }
                }
                Input::CaughtUp(lsn) => {
                    if !self.txns.in_transaction() {
                        self.handled = self.handled.max(lsn);
                    }
                }
                Input::Checkpoint { busy, reply } => {
                    if self.checkpoint(source, busy, reply).await? {
                        return Ok(Stop::Restart);
                    }
                }
            }
        }
    }

    /// Read a line and hand it to every consumer. `true`: a transaction committed that
    /// changed a consumer's tables.
    async fn line(&mut self, data: &[u8]) -> Result<bool, PipelineError> {
        let text = std::str::from_utf8(data).map_err(|e| {
            PipelineError::decode(e, &String::from_utf8_lossy(&data[..data.len().min(300)]))
        })?;
        self.unsettled = true;
        let step = self.txns.read(text).inspect_err(|_| {
            metrics::counter!(telemetry::DECODE_ERRORS).increment(1);
        })?;
        let commit = match step {
            Step::Begin => {
                if let Some(txn) = self.txns.txn() {
                    self.tables_changed |=
                        dispatch(&mut self.consumers, self.opts.health, Item::Begin(txn)).await?;
                }
                return Ok(false);
            }
            Step::Change(change) => {
                self.opts.health.record_change();
                let Some(txn) = self.txns.txn() else {
                    return Ok(false);
                };
                let key = self.opts.message_key.as_ref();
                let forged = |m: &Message<'_>, why| report_forged(self.opts.health, txn, m, why);
                let Some(change) = trusted(change, key, txn.commit_lsn, forged) else {
                    return Ok(false);
                };
                let item = Item::Change(txn, &change);
                self.tables_changed |=
                    dispatch(&mut self.consumers, self.opts.health, item).await?;
                return Ok(false);
            }
            Step::Outside(_) => return Ok(false),
            Step::Undecodable { line, error } => {
                metrics::counter!(telemetry::DECODE_ERRORS).increment(1);
                let lsn = self.txns.txn().map(|t| t.commit_lsn);
                self.opts
                    .health
                    .report_skip(&line, lsn, "undecodable", &error);
                return Ok(false);
            }
            Step::Commit(txn) => txn,
        };
        self.tables_changed |=
            dispatch(&mut self.consumers, self.opts.health, Item::Commit(&commit)).await?;
        self.handled = self.handled.max(commit.commit_lsn);
        Ok(std::mem::take(&mut self.tables_changed))
    }

    /// Acknowledge what was handled, check the fence, refresh statistics and health, and
    /// re-check the consumers' state when due. `true`: restart with a new filter.
    async fn checkpoint<S: Source>(
        &mut self,
        source: &mut S,
        busy: bool,
        reply: bool,
    ) -> Result<bool, PipelineError> {
        self.opts.fence.check(Action::Read)?;
        self.settle(source, self.handled, reply).await?;
        let due = busy || self.stats_at.is_none_or(|t| t.elapsed() >= STATS_INTERVAL);
        if let Some(client) = self.opts.client.filter(|_| due) {
            self.stats_at = Some(Instant::now());
            crate::slot::report_position(client, &self.opts.slot, self.opts.health).await?;
        }
        self.opts.health.set_active(true);
        self.opts.health.set_error(None);
        if self.txns.in_transaction() || self.refreshed_at.elapsed() < self.opts.refresh {
            return Ok(false);
        }
        self.refreshed_at = Instant::now();
        let mut changed = false;
        for c in &mut self.consumers {
            let when = Refresh::Check {
                confirmed: self.confirmed,
            };
            if c.refresh(when).await.map_err(failed(c.name()))? {
                tracing::info!(consumer = c.name(), "tables changed on re-check");
                changed = true;
            }
        }
        Ok(changed)
    }

    /// Every consumer's barrier (if anything was handed over since the last), then
    /// acknowledge `upto`. `reply`: send a status even if nothing advanced.
    async fn settle<S: Source>(
        &mut self,
        source: &mut S,
        upto: Lsn,
        reply: bool,
    ) -> Result<(), PipelineError> {
        if upto <= self.confirmed && !reply {
            return Ok(());
        }
        if upto > self.confirmed && self.unsettled {
            for c in &mut self.consumers {
                c.barrier().await.map_err(failed(c.name()))?;
            }
            self.unsettled = false;
        }
        // Checked after the barriers (which can take a while), right before the status.
        self.opts.fence.check(Action::Ack)?;
        self.confirmed = source.ack(upto.max(self.confirmed)).await?;
        Ok(())
    }
}

/// Hand an item to every consumer, in order. `true`: one's tables changed. A consumer
/// that panics on an item is isolated: the panic is caught, logged, counted and reported
/// as a skip of that item for that consumer (the same item would panic again on every
/// replay, so retrying would stall the slot or kill the process for good).
async fn dispatch(
    consumers: &mut [Box<dyn Consumer + '_>],
    health: &PipelineHealth,
    item: Item<'_>,
) -> Result<bool, PipelineError> {
    let mut changed = false;
    for c in consumers {
        let name = c.name();
        // `handle` called inside the future: a panic before its future exists is caught too.
        let handled = AssertUnwindSafe(async { c.handle(item).await });
        match handled.catch_unwind().await {
            Ok(handled) => changed |= handled.map_err(failed(name))? == Handled::TablesChanged,
            Err(panic) => report_panic(health, name, item, panic.as_ref()),
        }
    }
    Ok(changed)
}

/// A consumer's error as the pipeline's, naming the consumer.
fn failed(consumer: &'static str) -> impl Fn(ConsumerError) -> PipelineError {
    move |source| PipelineError::Consumer { consumer, source }
}

/// What an item is, for logs.
fn describe(item: Item<'_>) -> (String, Lsn) {
    match item {
        Item::Begin(t) => ("begin".into(), t.commit_lsn),
        Item::Commit(t) => ("commit".into(), t.commit_lsn),
        Item::Change(t, change) => {
            let what = match change {
                Change::Insert(r) | Change::Update(r) | Change::Delete(r) => {
                    format!("{}.{}", r.schema, r.table)
                }
                Change::Truncate(tr) => format!("{}.{}", tr.schema, tr.table),
                Change::Message(m) => format!("message {}", m.prefix),
                Change::Begin(_) | Change::Commit(_) => "marker".into(),
            };
            (what, t.commit_lsn)
        }
    }
}

/// A consumer panicked on an item: log, count, report the item as skipped.
fn report_panic(
    health: &PipelineHealth,
    consumer: &'static str,
    item: Item<'_>,
    panic: &(dyn std::any::Any + Send),
) {
    let message = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    metrics::counter!(telemetry::CONSUMER_PANICS, "consumer" => consumer).increment(1);
    let (what, lsn) = describe(item);
    let error = format!("{consumer} panicked: {message}");
    health.report_skip(&what, Some(lsn), "consumer_panic", &error);
}

/// The change as consumers may see it: a `walcast.*` message only when its MAC verifies,
/// with the MAC taken off (see [`crate::signed`]); `None` (after `forged`) otherwise.
/// Anything else as it is.
fn trusted<'a>(
    change: Change<'a>,
    key: Option<&MessageKey>,
    commit_lsn: Lsn,
    forged: impl FnOnce(&Message<'a>, Forged),
) -> Option<Change<'a>> {
    let Change::Message(mut m) = change else {
        return Some(change);
    };
    if !signed::must_be_signed(&m.prefix) {
        return Some(Change::Message(m));
    }
    let content = std::mem::take(&mut m.content);
    match signed::verify(key, &m.prefix, content, commit_lsn) {
        Ok(body) => {
            m.content = body;
            Some(Change::Message(m))
        }
        Err(why) => {
            forged(&m, why);
            None
        }
    }
}

/// A `walcast.*` message whose MAC does not verify: never trusted. Logged (warn), counted
/// by prefix, and shown on `/health` like a skipped change.
fn report_forged(health: &PipelineHealth, txn: &TxnContext, m: &Message<'_>, why: Forged) {
    // The label is the prefix (wal2json passes only the prefixes consumers asked for),
    // bounded anyway.
    let prefix: String = m.prefix.chars().take(64).collect();
    metrics::counter!(telemetry::MESSAGES_FORGED, "prefix" => prefix.clone()).increment(1);
    tracing::warn!(
        prefix = %prefix,
        lsn = ?m.lsn,
        xid = ?txn.xid,
        commit_lsn = %txn.commit_lsn,
        reason = why.reason(),
        error = %why,
        "logical message skipped: not signed by walcast (forged)"
    );
    health.record_skip(
        SkippedChange {
            table: prefix,
            commit_lsn: Some(txn.commit_lsn),
            reason: format!("forged_message: {}", why.reason()),
        },
        false,
    );
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
