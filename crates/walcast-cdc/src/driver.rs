//! The driver: one loop, shared by both sources, between a [`Source`] of wal2json lines and
//! the [`Consumer`]s of decoded transactions.
//!
//! It owns what both sources used to repeat: framing lines into transactions
//! ([`crate::frame`]), the table filter (the union of the consumers' tables), the initial
//! load and the periodic re-check of the consumers' state, slot statistics, `/health`,
//! the fence checks, and the acknowledgement rule: a position is acknowledged only after
//! every consumer's barrier confirmed what it was handed, so a crash replays and never
//! skips. When a consumer's tables change inside a transaction, the source is
//! acknowledged up to that commit and restarted from there with the new filter.

use std::time::{Duration, Instant};

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_lease::{Action, Fence};
use walcast_wal2json::Lsn;

use crate::consumer::{Consumer, Handled, Item, Refresh};
use crate::frame::{Framed, Framer};
use crate::health::{CdcHealth, SkippedChange};
use crate::source::{Filter, Input, Source};
use crate::{telemetry, CdcError};

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
    pub health: &'a CdcHealth,
    pub fence: Fence,
    /// How often consumers re-check their state ([`Refresh::Check`]).
    pub refresh: Duration,
    /// The slot's confirmed position at start.
    pub confirmed: Lsn,
}

pub struct Driver<'a> {
    opts: DriverOptions<'a>,
    consumers: Vec<Box<dyn Consumer + 'a>>,
    framer: Framer,
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
            framer: Framer::new(),
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
    ) -> Result<(), CdcError> {
        for c in &mut self.consumers {
            c.refresh(Refresh::Start).await?;
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
        self.framer.reset();
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
    ) -> Result<Stop, CdcError> {
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
                        c.flush().await?;
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
                    if !self.framer.in_transaction() {
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

    /// Frame a line and hand it to every consumer. `true`: a transaction committed that
    /// changed a consumer's tables.
    async fn line(&mut self, data: &[u8]) -> Result<bool, CdcError> {
        let text = std::str::from_utf8(data).map_err(|e| CdcError::Decode {
            error: format!("not UTF-8: {e}"),
            line: String::from_utf8_lossy(&data[..data.len().min(300)]).into_owned(),
        })?;
        self.unsettled = true;
        let framed = self.framer.frame(text).inspect_err(|_| {
            metrics::counter!(telemetry::DECODE_ERRORS).increment(1);
        })?;
        let commit = match framed {
            Framed::Begin => {
                if let Some(txn) = self.framer.txn() {
                    self.tables_changed |= dispatch(&mut self.consumers, Item::Begin(txn)).await?;
                }
                return Ok(false);
            }
            Framed::Change(change) => {
                self.opts.health.record_change();
                if let Some(txn) = self.framer.txn() {
                    let item = Item::Change(txn, &change);
                    self.tables_changed |= dispatch(&mut self.consumers, item).await?;
                }
                return Ok(false);
            }
            Framed::Outside(_) => return Ok(false),
            Framed::Undecodable { line, error } => {
                metrics::counter!(telemetry::DECODE_ERRORS).increment(1);
                let lsn = self.framer.txn().map(|t| t.commit_lsn);
                report_skip(self.opts.health, &line, lsn, "undecodable", &error);
                return Ok(false);
            }
            Framed::Commit(txn) => txn,
        };
        self.tables_changed |= dispatch(&mut self.consumers, Item::Commit(&commit)).await?;
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
    ) -> Result<bool, CdcError> {
        self.opts.fence.check(Action::Read)?;
        self.settle(source, self.handled, reply).await?;
        let due = busy || self.stats_at.is_none_or(|t| t.elapsed() >= STATS_INTERVAL);
        if let Some(client) = self.opts.client.filter(|_| due) {
            self.stats_at = Some(Instant::now());
            crate::slot::report_position(client, &self.opts.slot, self.opts.health).await?;
        }
        self.opts.health.set_active(true);
        self.opts.health.set_error(None);
        if self.framer.in_transaction() || self.refreshed_at.elapsed() < self.opts.refresh {
            return Ok(false);
        }
        self.refreshed_at = Instant::now();
        let mut changed = false;
        for c in &mut self.consumers {
            let when = Refresh::Check {
                confirmed: self.confirmed,
            };
            if c.refresh(when).await? {
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
    ) -> Result<(), CdcError> {
        if upto <= self.confirmed && !reply {
            return Ok(());
        }
        if upto > self.confirmed && self.unsettled {
            for c in &mut self.consumers {
                c.barrier().await?;
            }
            self.unsettled = false;
        }
        // Checked after the barriers (which can take a while), right before the status.
        self.opts.fence.check(Action::Ack)?;
        self.confirmed = source.ack(upto.max(self.confirmed)).await?;
        Ok(())
    }
}

/// Hand an item to every consumer, in order. `true`: one's tables changed.
async fn dispatch(
    consumers: &mut [Box<dyn Consumer + '_>],
    item: Item<'_>,
) -> Result<bool, CdcError> {
    let mut changed = false;
    for c in consumers {
        changed |= c.handle(item).await? == Handled::TablesChanged;
    }
    Ok(changed)
}

/// A change that no retry can deliver: log, count, report, move on.
pub fn report_skip(
    health: &CdcHealth,
    table: &str,
    commit_lsn: Option<Lsn>,
    reason: &'static str,
    error: &str,
) {
    metrics::counter!(telemetry::CHANGES_SKIPPED, "reason" => reason).increment(1);
    tracing::error!(
        table,
        ?commit_lsn,
        reason,
        error,
        "change skipped: it cannot be delivered"
    );
    health.record_skip(
        SkippedChange {
            table: table.to_string(),
            commit_lsn,
            reason: reason.to_string(),
        },
        false,
    );
}

#[cfg(test)]
#[path = "driver_tests.rs"]
mod tests;
