//! The driver: one loop, shared by both sources, between a [`Source`] of wal2json lines and
//! the [`Consumer`]s of decoded transactions.
//!
//! It owns what both sources share: framing lines into transactions
//! ([`crate::txn`]), the table filter (the union of the consumers' tables), the initial
//! load and the periodic re-check of the consumers' state, slot statistics, `/health`,
//! the fence checks, and the acknowledgement rule: the slot is acknowledged at the lowest
//! position every consumer has made durable ([`Consumer::settle`]), so a crash replays and
//! never skips.
//!
//! Consumers do not wait for each other: each has its own position (the last transaction
//! handed to it, the last it settled), settling never waits on a slow part, and a consumer
//! whose own buffer is full ([`Consumer::accepting`]) is detached: it is handed nothing
//! more while the others go on, the slot's acknowledgement stays at its position, and
//! once it accepts again the source is read again from there, each consumer handed only
//! the transactions it has not had. When a consumer's tables change inside a transaction,
//! the source is restarted after that commit with the new filter (again each consumer
//! skipping what it already had).

use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use crate::health::ConsumerProgress;

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

/// At a graceful stop, how long each consumer's blocking barrier may take.
const STOP_BARRIER: Duration = Duration::from_secs(10);

/// How a read of the source ended.
enum Stop {
    Cancelled,
    /// Restart the source: a consumer's tables changed (the new filter) or a detached
    /// consumer accepts again. The reason is the metric's label.
    Restart(&'static str),
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

/// A consumer and how far it got.
struct Part<'a> {
    consumer: Box<dyn Consumer + 'a>,
    /// The commit of the last transaction handed to it (or the source's caught-up
    /// position): it never gets a transaction committed at or before this again.
    handed: Lsn,
    /// Durable, as its last [`Consumer::settle`] said.
    settled: Lsn,
    /// Items were handed to it since its last settle.
    unsettled: bool,
    /// Its last settle reached what it had been handed: with nothing handed since, it
    /// is durable up to `handed` without asking.
    clean: bool,
    /// It refused more ([`Consumer::accepting`]): handed nothing until it accepts again.
    detached: bool,
    /// Not handed the current transaction (it had it already, or is detached).
    skip: bool,
}

impl Part<'_> {
    fn name(&self) -> &'static str {
        self.consumer.name()
    }
}

pub struct Driver<'a> {
    opts: DriverOptions<'a>,
    parts: Vec<Part<'a>>,
    txns: TxnReader,
    /// Acknowledged to the server.
    confirmed: Lsn,
    /// Read: the last commit (or caught-up position) of the source.
    handled: Lsn,
    /// A consumer's tables changed in the current transaction.
    tables_changed: bool,
    refreshed_at: Instant,
    stats_at: Option<Instant>,
}

impl<'a> Driver<'a> {
    pub fn new(opts: DriverOptions<'a>, consumers: Vec<Box<dyn Consumer + 'a>>) -> Driver<'a> {
        let parts = consumers
            .into_iter()
            .map(|consumer| Part {
                consumer,
                handed: opts.confirmed,
                settled: opts.confirmed,
                unsettled: false,
                clean: true,
                detached: false,
                skip: false,
            })
            .collect();
        Driver {
            confirmed: opts.confirmed,
            handled: opts.confirmed,
            opts,
            parts,
            txns: TxnReader::new(),
            tables_changed: false,
            refreshed_at: Instant::now(),
            stats_at: None,
        }
    }

    /// Load every consumer's state, then read until cancelled (or a failure the caller
    /// retries), restarting the source whenever the filter changes or a detached
    /// consumer accepts again.
    pub async fn run<S: Source>(
        mut self,
        source: &mut S,
        cancel: &CancellationToken,
    ) -> Result<(), PipelineError> {
        for p in &mut self.parts {
            let name = p.name();
            p.consumer
                .refresh(Refresh::Start)
                .await
                .map_err(failed(name))?;
        }
        self.refreshed_at = Instant::now();
        loop {
            self.opts.fence.check(Action::Read)?;
            let filter = self.filter();
            let from = self.restart_point();
            tracing::info!(filter = %filter, from = %from, confirmed = %self.confirmed, "reading the slot");
            source.start(from, &filter).await?;
            // Reading: active from now on, not only after the first round (a first poll
            // of a long backlog can take a while).
            self.opts.health.set_active(true);
            self.opts.health.set_error(None);
            self.reset();
            match self.read(source, cancel).await? {
                Stop::Cancelled => return Ok(()),
                Stop::Restart(reason) => {
                    metrics::counter!(telemetry::SOURCE_RESTARTS, "reason" => reason).increment(1);
                    tracing::info!(reason, "restarting the source");
                    source.stop().await
                }
            }
        }
    }

    /// Where to read from: the acknowledged position when a consumer is detached (it
    /// needs what came after its own position), else the lowest position handed over (a
    /// stream starts there; the polling source always reads from the acknowledged one).
    fn restart_point(&self) -> Lsn {
        if self.parts.iter().any(|p| p.detached) {
            return self.confirmed;
        }
        let handed = self.parts.iter().map(|p| p.handed).min();
        handed.unwrap_or(self.handled).max(self.confirmed)
    }

    /// The union of the consumers' tables, schemas and message prefixes.
    fn filter(&self) -> Filter {
        let consumers = || self.parts.iter().map(|p| &p.consumer);
        let tables = consumers().flat_map(|c| c.tables()).collect();
        let schemas = consumers().flat_map(|c| c.schemas()).collect();
        let prefixes = consumers().flat_map(|c| c.message_prefixes());
        Filter::new(tables, schemas, prefixes.collect())
    }

    fn reset(&mut self) {
        self.txns.reset();
        self.tables_changed = false;
        for p in &mut self.parts {
            p.skip = false;
            p.consumer.reset();
        }
    }

    fn has_pending(&self) -> bool {
        self.parts.iter().any(|p| p.consumer.has_pending())
    }

    async fn read<S: Source>(
        &mut self,
        source: &mut S,
        cancel: &CancellationToken,
    ) -> Result<Stop, PipelineError> {
        loop {
            // Each line counts against the task's cooperative budget: lines already
            // buffered come without touching the socket, and a long backlog must still
            // let the runtime run what shares the task or the thread.
            tokio::task::consume_budget().await;
            let input = tokio::select! {
                // Lines already received come first; held work is done as soon as nothing
                // more is waiting.
                biased;
                _ = cancel.cancelled() => {
                    self.drain(source).await?;
                    source.stop().await;
                    return Ok(Stop::Cancelled);
                }
                input = source.next() => input?,
                _ = std::future::ready(()), if S::FLUSH_WHILE_WAITING && self.has_pending() => {
                    for p in &mut self.parts {
                        let name = p.name();
                        p.consumer.flush().await.map_err(failed(name))?;
                    }
                    continue;
                }
            };
            match input {
                Input::Line(data) => {
                    if self.line(&data).await? {
                        self.settle(source, false).await?;
                        return Ok(Stop::Restart("filter"));
                    }
                }
                Input::CaughtUp(lsn) => self.caught_up(lsn),
                Input::Checkpoint { busy, reply } => {
                    if let Some(reason) = self.checkpoint(source, busy, reply).await? {
                        return Ok(Stop::Restart(reason));
                    }
                }
            }
        }
    }

    /// Everything before `lsn` was read: between transactions, every attached consumer
    /// has had all of it.
    fn caught_up(&mut self, lsn: Lsn) {
        if self.txns.in_transaction() {
            return;
        }
        self.handled = self.handled.max(lsn);
        for p in self.parts.iter_mut().filter(|p| !p.detached) {
            p.handed = p.handed.max(lsn);
        }
    }

    /// Read a line and hand it to every consumer that takes it. `true`: a transaction
    /// committed that changed a consumer's tables.
    async fn line(&mut self, data: &[u8]) -> Result<bool, PipelineError> {
        let text = std::str::from_utf8(data).map_err(|e| {
            PipelineError::decode(e, &String::from_utf8_lossy(&data[..data.len().min(300)]))
        })?;
        let step = self.txns.read(text).inspect_err(|_| {
            metrics::counter!(telemetry::DECODE_ERRORS).increment(1);
        })?;
        let commit = match step {
            Step::Begin => {
                if let Some(txn) = self.txns.txn() {
                    begin(&mut self.parts, txn.commit_lsn);
                    self.tables_changed |=
                        dispatch(&mut self.parts, self.opts.health, Item::Begin(txn)).await?;
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
                self.tables_changed |= dispatch(&mut self.parts, self.opts.health, item).await?;
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
            dispatch(&mut self.parts, self.opts.health, Item::Commit(&commit)).await?;
        for p in self.parts.iter_mut().filter(|p| !p.skip) {
            p.handed = p.handed.max(commit.commit_lsn);
        }
        self.handled = self.handled.max(commit.commit_lsn);
        Ok(std::mem::take(&mut self.tables_changed))
    }

    /// Acknowledge what was settled, check the fence, refresh statistics and health, and
    /// re-check the consumers' state when due. `Some(reason)`: restart (a new filter, or
    /// a detached consumer accepts again).
    async fn checkpoint<S: Source>(
        &mut self,
        source: &mut S,
        busy: bool,
        reply: bool,
    ) -> Result<Option<&'static str>, PipelineError> {
        self.opts.fence.check(Action::Read)?;
        self.settle(source, reply).await?;
        let due = busy || self.stats_at.is_none_or(|t| t.elapsed() >= STATS_INTERVAL);
        if let Some(client) = self.opts.client.filter(|_| due) {
            self.stats_at = Some(Instant::now());
            crate::slot::report_position(client, &self.opts.slot, self.opts.health).await?;
        }
        self.opts.health.set_active(true);
        self.opts.health.set_error(None);
        if self.txns.in_transaction() {
            return Ok(None);
        }
        if self.reattach() {
            return Ok(Some("reattach"));
        }
        if self.refreshed_at.elapsed() < self.opts.refresh {
            return Ok(None);
        }
        self.refreshed_at = Instant::now();
        let mut changed = None;
        for p in &mut self.parts {
            let when = Refresh::Check {
                confirmed: self.confirmed,
            };
            let name = p.name();
            if p.consumer.refresh(when).await.map_err(failed(name))? {
                tracing::info!(consumer = name, "tables changed on re-check");
                changed = Some("filter");
            }
        }
        Ok(changed)
    }

    /// Detached consumers that accept again: `true` if any (the source is then read
    /// again from the acknowledged position).
    fn reattach(&mut self) -> bool {
        let mut any = false;
        for p in self.parts.iter_mut().filter(|p| p.detached) {
            if p.consumer.accepting() {
                p.detached = false;
                any = true;
                tracing::info!(consumer = p.name(), from = %p.handed, "consumer accepts again: reading the WAL again from its position");
            }
        }
        any
    }

    /// Ask each consumer how far it is durable (without waiting on anything slow), then
    /// acknowledge the lowest position. `reply`: send a status even if nothing advanced.
    async fn settle<S: Source>(
        &mut self,
        source: &mut S,
        reply: bool,
    ) -> Result<(), PipelineError> {
        for p in &mut self.parts {
            if !std::mem::take(&mut p.unsettled) && p.clean {
                p.settled = p.handed;
                continue;
            }
            let name = p.name();
            let settled = p.consumer.settle(p.handed).await.map_err(failed(name))?;
            p.clean = settled >= p.handed;
            p.settled = settled.min(p.handed).max(p.settled);
        }
        self.acknowledge(source, reply).await
    }

    /// A graceful stop: every consumer's blocking barrier (each bounded), then
    /// acknowledge what they made durable.
    async fn drain<S: Source>(&mut self, source: &mut S) -> Result<(), PipelineError> {
        for p in &mut self.parts {
            let name = p.name();
            match tokio::time::timeout(STOP_BARRIER, p.consumer.barrier()).await {
                Ok(Ok(())) => p.settled = p.settled.max(p.handed),
                Ok(Err(e)) if e.retry() == crate::Retry::Fenced => return Err(failed(name)(e)),
                Ok(Err(e)) => {
                    tracing::warn!(consumer = name, error = %e, "barrier failed at stop: its position stays where it was settled")
                }
                Err(_) => tracing::warn!(
                    consumer = name,
                    "barrier did not end in time at stop: its position stays where it was settled"
                ),
            }
        }
        self.acknowledge(source, false).await
    }

    /// Acknowledge the lowest settled position (never past what was read).
    async fn acknowledge<S: Source>(
        &mut self,
        source: &mut S,
        reply: bool,
    ) -> Result<(), PipelineError> {
        let lowest = self.parts.iter().map(|p| p.settled).min();
        let upto = lowest.unwrap_or(self.handled).min(self.handled);
        self.report_progress();
        if upto <= self.confirmed && !reply {
            return Ok(());
        }
        // Checked right before the status.
        self.opts.fence.check(Action::Ack)?;
        self.confirmed = source.ack(upto.max(self.confirmed)).await?;
        Ok(())
    }

    /// Each consumer's distance behind what was read, in metrics and on `/health`.
    fn report_progress(&self) {
        for p in &self.parts {
            let lag = self.handled.0.saturating_sub(p.settled.0);
            let name = p.name();
            metrics::gauge!(telemetry::CONSUMER_LAG, "consumer" => name).set(lag as f64);
            let detached = if p.detached { 1.0 } else { 0.0 };
            metrics::gauge!(telemetry::CONSUMER_DETACHED_NOW, "consumer" => name).set(detached);
            let progress = ConsumerProgress {
                settled: p.settled,
                lag_bytes: lag,
                detached: p.detached,
            };
            self.opts.health.set_consumer(name, progress);
        }
    }
}

/// A transaction begins: which consumers take it. One that had it already (read again
/// after a restart) or is detached does not; one whose buffer is full is detached now.
fn begin(parts: &mut [Part<'_>], commit_lsn: Lsn) {
    for p in parts.iter_mut() {
        if !p.detached && !p.consumer.accepting() {
            p.detached = true;
            metrics::counter!(telemetry::CONSUMER_DETACHED, "consumer" => p.name()).increment(1);
            tracing::warn!(consumer = p.name(), at = %p.handed, "consumer cannot take more: detached; the others go on, the slot keeps its WAL");
        }
        p.skip = p.detached || commit_lsn <= p.handed;
        p.unsettled |= !p.skip;
    }
}

/// Hand an item to every consumer that takes the transaction, in order. `true`: one's tables changed. A consumer
/// that panics on an item is isolated: the panic is caught, logged, counted and reported
/// as a skip of that item for that consumer (the same item would panic again on every
/// replay, so retrying would stall the slot or kill the process for good).
async fn dispatch(
    parts: &mut [Part<'_>],
    health: &PipelineHealth,
    item: Item<'_>,
) -> Result<bool, PipelineError> {
    let mut changed = false;
    for p in parts.iter_mut().filter(|p| !p.skip) {
        let c = &mut p.consumer;
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
mod tests;
