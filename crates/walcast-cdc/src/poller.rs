//! The SQL polling source: `pg_logical_slot_peek_changes`, publish, then
//! `pg_replication_slot_advance` to the commit LSN of the last transaction published.
//!
//! Every peek re-decodes the WAL from the slot's `restart_lsn`, so many small polls are
//! slow. The row limit adapts: a poll that comes back full, or a slot more than 1 MiB
//! behind, switches to `max_batch` at once (ramping up in steps would decode a backlog
//! several times over); polls that come back mostly empty halve it back towards
//! `min_batch`. The limit is checked by Postgres only
//! between WAL records and a transaction's changes are all emitted while decoding its
//! commit record, so a transaction is never split, however large (tested with 50,000 rows).

use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_lease::Action;
use walcast_wal2json::Lsn;

use crate::health::CdcHealth;
use crate::pipeline::{LineOutcome, Pipeline};
use crate::registry;
use crate::source::{registry_drift, table_filter, WAL2JSON_OPTIONS};
use crate::CdcError;

/// WAL behind the slot beyond which a poll starts at the largest batch.
const BACKLOG_BYTES: u64 = 1 << 20;

#[derive(Clone, Debug)]
pub struct PollerConfig {
    pub slot: String,
    pub min_batch: usize,
    pub max_batch: usize,
    pub idle: Duration,
    pub filter_refresh: Duration,
}

fn peek_sql() -> String {
    let mut sql = String::from("SELECT data FROM pg_logical_slot_peek_changes($1, NULL, $2");
    for (k, v) in WAL2JSON_OPTIONS {
        sql.push_str(&format!(", '{k}', '{v}'"));
    }
    sql.push_str(", 'add-tables', $3)");
    sql
}

pub struct Poller<'a> {
    cfg: &'a PollerConfig,
    client: &'a Client,
    pipeline: &'a mut Pipeline,
    health: &'a CdcHealth,
    confirmed: Lsn,
    limit: usize,
    filter: String,
    refreshed_at: Instant,
    stats_at: Option<Instant>,
}

impl<'a> Poller<'a> {
    pub async fn new(
        cfg: &'a PollerConfig,
        client: &'a Client,
        pipeline: &'a mut Pipeline,
        health: &'a CdcHealth,
        confirmed: Lsn,
    ) -> Result<Poller<'a>, CdcError> {
        let mut p = Poller {
            cfg,
            client,
            pipeline,
            health,
            confirmed,
            limit: cfg.min_batch.max(1),
            filter: String::new(),
            refreshed_at: Instant::now(),
            stats_at: None,
        };
        p.refresh_tables().await?;
        Ok(p)
    }

    /// Load the registry at start. Later edits arrive in WAL order (the registry table is
    /// always decoded) and are applied by the pipeline exactly where they happened.
    async fn refresh_tables(&mut self) -> Result<(), CdcError> {
        let tables = registry::list(self.pipeline.catalog(), None).await?;
        self.pipeline.set_tables(&tables);
        self.apply_filter();
        self.refreshed_at = Instant::now();
        Ok(())
    }

    fn apply_filter(&mut self) {
        let tables = self.pipeline.tables();
        let filter = table_filter(&tables);
        if filter != self.filter {
            tracing::info!(tables = tables.len(), filter = %filter, "table filter updated");
            self.filter = filter;
        }
    }

    /// The periodic re-read: a safety net against drift (see [`registry_drift`]).
    async fn check_registry(&mut self) -> Result<(), CdcError> {
        self.refreshed_at = Instant::now();
        let current = self.pipeline.tables();
        if let Some(tables) =
            registry_drift(self.pipeline.catalog(), &current, self.confirmed).await?
        {
            self.pipeline.set_tables(&tables);
            self.apply_filter();
        }
        Ok(())
    }

    /// One peek/publish/advance round. Returns the number of rows read.
    pub async fn poll_once(&mut self) -> Result<usize, CdcError> {
        if self.refreshed_at.elapsed() >= self.cfg.filter_refresh {
            self.check_registry().await?;
        }
        let started = Instant::now();
        // Everything committed before this point is in the peek's output, if the peek
        // is not cut short by the row limit (the peek reads at least this far).
        let flushed: String = self
            .client
            .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
            .await?
            .get(0);
        let flushed: Lsn = flushed.parse().map_err(|_| CdcError::Decode {
            error: "bad flush LSN".into(),
            line: flushed.clone(),
        })?;
        if flushed.0.saturating_sub(self.confirmed.0) > BACKLOG_BYTES {
            self.limit = self.cfg.max_batch.max(self.cfg.min_batch.max(1));
        }
        let limit = i32::try_from(self.limit).unwrap_or(i32::MAX);
        let stream = self
            .client
            .query_raw(
                peek_sql().as_str(),
                [
                    &self.cfg.slot as &(dyn tokio_postgres::types::ToSql + Sync),
                    &limit,
                    &self.filter,
                ],
            )
            .await?;
        // Boxed so that dropping it below really ends the query: rows left unread after
        // an early break are then discarded instead of blocking the connection.
        let mut stream = Box::pin(stream);
        self.pipeline.reset();
        let mut rows = 0usize;
        let mut last_commit: Option<Lsn> = None;
        let mut cut_short = false;
        let mut first_row = None;
        while let Some(row) = stream.try_next().await? {
            if first_row.is_none() {
                first_row = Some(started.elapsed());
            }
            rows += 1;
            let data: &str = row.try_get(0)?;
            if let LineOutcome::Committed {
                commit_lsn,
                registry_changed,
            } = self.pipeline.on_line(data).await?
            {
                last_commit = Some(commit_lsn);
                if registry_changed {
                    // Decode what follows with the new filter: acknowledge up to here,
                    // refresh, and peek again from this commit.
                    cut_short = true;
                    break;
                }
            }
        }
        drop(stream);
        let streamed = started.elapsed();
        let full = rows >= self.limit;
        let mut target = last_commit;
        if !full && !cut_short && flushed > target.unwrap_or_default() {
            target = Some(flushed);
        }
        if let Some(target) = target.filter(|t| *t > self.confirmed) {
            if last_commit.is_some() {
                self.pipeline.barrier().await?;
            }
            let t = Instant::now();
            self.advance(target).await?;
            tracing::debug!(
                rows,
                limit = self.limit,
                first_row_ms = first_row.map(|d| d.as_millis() as u64),
                stream_ms = streamed.as_millis() as u64,
                advance_ms = t.elapsed().as_millis() as u64,
                "poll"
            );
        }
        if cut_short {
            self.apply_filter();
        }
        self.adapt(rows, full);
        metrics::histogram!(crate::telemetry::POLL_SECONDS).record(started.elapsed().as_secs_f64());
        metrics::histogram!(crate::telemetry::POLL_ROWS).record(rows as f64);
        self.update_stats(rows > 0).await?;
        Ok(rows)
    }

    async fn advance(&mut self, target: Lsn) -> Result<(), CdcError> {
        self.pipeline.fence().check(Action::Ack)?;
        let row = self
            .client
            .query_one(
                "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
                &[&self.cfg.slot, &target.to_string()],
            )
            .await?;
        let end: Option<String> = row.get(0);
        self.confirmed = end.and_then(|e| e.parse().ok()).unwrap_or(target);
        Ok(())
    }

    fn adapt(&mut self, rows: usize, full: bool) {
        let (min, max) = (
            self.cfg.min_batch.max(1),
            self.cfg.max_batch.max(self.cfg.min_batch.max(1)),
        );
        if full {
            // A backlog: every peek re-decodes from restart_lsn (which moves only at the
            // server's running-xacts records), so ramping up in steps decodes the backlog
            // several times over. Go straight to the largest batch.
            self.limit = max;
        } else if rows < self.limit / 4 {
            self.limit = (self.limit / 2).max(min);
        }
    }

    /// Slot position and lag for `/health` and metrics, at most twice a second (and at
    /// once after a busy poll, so a lost slot is noticed quickly).
    async fn update_stats(&mut self, busy: bool) -> Result<(), CdcError> {
        if !busy
            && self
                .stats_at
                .is_some_and(|t| t.elapsed() < Duration::from_millis(500))
        {
            return Ok(());
        }
        self.stats_at = Some(Instant::now());
        crate::slot::report_position(self.client, &self.cfg.slot, self.health).await
    }
}

impl crate::source::Source for Poller<'_> {
    /// Poll until cancelled.
    async fn run(mut self, cancel: &CancellationToken) -> Result<(), CdcError> {
        while !cancel.is_cancelled() {
            self.pipeline.fence().check(Action::Read)?;
            let rows = self.poll_once().await?;
            self.health.set_active(true);
            self.health.set_error(None);
            if rows == 0 {
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(self.cfg.idle) => {}
                }
            }
        }
        Ok(())
    }
}
