//! The SQL polling source: `pg_logical_slot_peek_changes`, publish, then
//! `pg_replication_slot_advance` to the commit LSN of the last transaction published.
//!
//! Every peek re-decodes the WAL from the slot's `restart_lsn`, so many small polls are
//! slow. The row limit adapts: it grows (×4, up to `max_batch`) while polls come back full
//! and shrinks while they come back mostly empty. The limit is checked by Postgres only
//! between WAL records and a transaction's changes are all emitted while decoding its
//! commit record, so a transaction is never split, however large (tested with 50,000 rows).

use std::time::{Duration, Instant};

use futures_util::TryStreamExt;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_wal2json::Lsn;

use crate::health::CdcHealth;
use crate::pipeline::{LineOutcome, Pipeline};
use crate::registry::{self, TableRef, REGISTRY_SCHEMA, REGISTRY_TABLE};
use crate::CdcError;

/// The wal2json options every source uses (`add-tables` is appended).
pub const WAL2JSON_OPTIONS: &[(&str, &str)] = &[
    ("format-version", "2"),
    ("include-transaction", "1"),
    ("include-xids", "1"),
    ("include-timestamp", "1"),
    ("include-lsn", "1"),
    ("include-pk", "1"),
    ("include-type-oids", "1"),
    ("include-typmod", "0"),
];

#[derive(Clone, Debug)]
pub struct PollerConfig {
    pub slot: String,
    pub min_batch: usize,
    pub max_batch: usize,
    pub idle: Duration,
    pub filter_refresh: Duration,
}

/// The `add-tables` value: every enabled table plus our registry.
pub fn table_filter(tables: &[TableRef]) -> String {
    let mut names: Vec<(&str, &str)> = tables
        .iter()
        .map(|t| (t.schema.as_str(), t.table.as_str()))
        .collect();
    names.push((REGISTRY_SCHEMA, REGISTRY_TABLE));
    names.sort();
    names.dedup();
    walcast_wal2json::add_tables_option(names)
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
        let tables = registry::list(self.client, None).await?;
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

    /// The periodic re-read: a safety net against drift. The registry is read in one
    /// snapshot with the WAL position; it is applied only when we have decoded past that
    /// position (so in-band edits are all applied), and then normally changes nothing.
    async fn check_registry(&mut self) -> Result<(), CdcError> {
        self.refreshed_at = Instant::now();
        let tx_sql = "SELECT pg_current_wal_lsn()::text";
        let tables = registry::list(self.client, None).await?;
        let at: String = self.client.query_one(tx_sql, &[]).await?.get(0);
        let at: Lsn = at.parse().unwrap_or(Lsn(u64::MAX));
        if self.confirmed < at {
            return Ok(());
        }
        if tables != self.pipeline.tables() {
            tracing::warn!("realtime registry differs from the decoded state; reloading it");
            self.pipeline.set_tables(&tables);
            self.apply_filter();
        }
        Ok(())
    }

    /// Poll until cancelled.
    pub async fn run(mut self, cancel: &CancellationToken) -> Result<(), CdcError> {
        while !cancel.is_cancelled() {
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
        while let Some(row) = stream.try_next().await? {
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
        let full = rows >= self.limit;
        let mut target = last_commit;
        if !full && !cut_short && flushed > target.unwrap_or_default() {
            target = Some(flushed);
        }
        if let Some(target) = target.filter(|t| *t > self.confirmed) {
            if last_commit.is_some() {
                self.pipeline.barrier().await?;
            }
            self.advance(target).await?;
        }
        if cut_short {
            self.apply_filter();
        }
        self.adapt(rows, full);
        metrics::histogram!("walcast_cdc_poll_duration_seconds")
            .record(started.elapsed().as_secs_f64());
        metrics::histogram!("walcast_cdc_poll_rows").record(rows as f64);
        self.update_stats(rows > 0).await?;
        Ok(rows)
    }

    async fn advance(&mut self, target: Lsn) -> Result<(), CdcError> {
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
            self.limit = (self.limit.saturating_mul(4)).min(max);
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
        let row = self
            .client
            .query_opt(
                "SELECT wal_status, confirmed_flush_lsn::text,
                        coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8
                   FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.cfg.slot],
            )
            .await?;
        let Some(row) = row else {
            return Err(CdcError::SlotMissing(self.cfg.slot.clone()));
        };
        let status: Option<String> = row.get(0);
        if status.as_deref() == Some("lost") {
            return Err(CdcError::SlotLost(self.cfg.slot.clone()));
        }
        let confirmed: Option<String> = row.get(1);
        if let Some(c) = confirmed.and_then(|c| c.parse().ok()) {
            self.health.set_slot_position(c, row.get(2));
        }
        Ok(())
    }
}
