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

use std::collections::VecDeque;
use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::TryStreamExt;
use tokio_postgres::{Client, RowStream};
use walcast_wal2json::Lsn;

use crate::error::{DecodeError, PipelineError};
use crate::source::{Filter, Input, ReadConfig, Source, WAL2JSON_OPTIONS};

/// WAL behind the slot beyond which a poll starts at the largest batch.
const BACKLOG_BYTES: u64 = 1 << 20;

fn peek_sql() -> String {
    let mut sql = String::from("SELECT data FROM pg_logical_slot_peek_changes($1, NULL, $2");
    for (k, v) in WAL2JSON_OPTIONS {
        sql.push_str(&format!(", '{k}', '{v}'"));
    }
    sql.push_str(", 'add-tables', $3, 'add-msg-prefixes', $4)");
    sql
}

/// One peek in progress.
struct Peek {
    /// Boxed so that dropping it really ends the query: rows left unread after an early
    /// stop are then discarded instead of blocking the connection.
    rows: Pin<Box<RowStream>>,
    started: Instant,
    /// Everything committed before the peek started is in its output, unless the row
    /// limit cuts it short.
    flushed: Lsn,
    count: usize,
    first_row: Option<Duration>,
}

/// The polling [`Source`]: each peek's lines, then (if the peek was not cut short by its
/// row limit) "caught up to the flush position", then a checkpoint at which the driver
/// acknowledges with `pg_replication_slot_advance`.
pub struct Poller<'a> {
    cfg: &'a ReadConfig,
    client: &'a Client,
    confirmed: Lsn,
    limit: usize,
    filter: Filter,
    peek: Option<Peek>,
    queued: VecDeque<Input>,
    /// The last peek returned nothing: wait `idle` before the next.
    idle: bool,
}

impl<'a> Poller<'a> {
    pub fn new(cfg: &'a ReadConfig, client: &'a Client, confirmed: Lsn) -> Poller<'a> {
        Poller {
            cfg,
            client,
            confirmed,
            limit: cfg.min_batch.max(1),
            filter: Filter::default(),
            peek: None,
            queued: VecDeque::new(),
            idle: false,
        }
    }

    /// Start a peek (after the idle pause when the last one was empty).
    async fn begin_peek(&mut self) -> Result<(), PipelineError> {
        if std::mem::take(&mut self.idle) {
            tokio::time::sleep(self.cfg.idle).await;
        }
        let started = Instant::now();
        let flushed: String = self
            .client
            .query_one("SELECT pg_current_wal_flush_lsn()::text", &[])
            .await?
            .get(0);
        let flushed: Lsn = flushed.parse().map_err(|_| {
            PipelineError::decode(
                DecodeError::Lsn(flushed.clone()),
                "pg_current_wal_flush_lsn()",
            )
        })?;
        if flushed.0.saturating_sub(self.confirmed.0) > BACKLOG_BYTES {
            self.limit = self.cfg.max_batch.max(self.cfg.min_batch.max(1));
        }
        let limit = i32::try_from(self.limit).unwrap_or(i32::MAX);
        let rows = self
            .client
            .query_raw(
                peek_sql().as_str(),
                [
                    &self.cfg.slot as &(dyn tokio_postgres::types::ToSql + Sync),
                    &limit,
                    &self.filter.tables,
                    &self.filter.messages,
                ],
            )
            .await?;
        self.peek = Some(Peek {
            rows: Box::pin(rows),
            started,
            flushed,
            count: 0,
            first_row: None,
        });
        Ok(())
    }

    /// The peek returned its last row: caught up (unless it was full), then a checkpoint.
    fn end_peek(&mut self, peek: Peek) {
        let full = peek.count >= self.limit;
        if !full {
            self.queued.push_back(Input::CaughtUp(peek.flushed));
        }
        self.queued.push_back(Input::Checkpoint {
            busy: peek.count > 0,
            reply: false,
        });
        tracing::debug!(
            rows = peek.count,
            limit = self.limit,
            first_row_ms = peek.first_row.map(|d| d.as_millis() as u64),
            stream_ms = peek.started.elapsed().as_millis() as u64,
            "poll"
        );
        self.adapt(peek.count, full);
        metrics::histogram!(crate::telemetry::POLL_SECONDS)
            .record(peek.started.elapsed().as_secs_f64());
        metrics::histogram!(crate::telemetry::POLL_ROWS).record(peek.count as f64);
        self.idle = peek.count == 0;
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
}

impl Source for Poller<'_> {
    /// A peek's rows are batched for authorization up to `RLS_MAX_BATCH` and flushed at
    /// its end (the checkpoint's barrier).
    const FLUSH_WHILE_WAITING: bool = false;

    async fn start(&mut self, _from: Lsn, filter: &Filter) -> Result<(), PipelineError> {
        // Every peek starts at the slot's confirmed position.
        if *filter != self.filter {
            tracing::info!(filter = %filter, messages = %filter.messages, "filter updated");
            self.filter = filter.clone();
        }
        Ok(())
    }

    async fn next(&mut self) -> Result<Input, PipelineError> {
        loop {
            if let Some(input) = self.queued.pop_front() {
                return Ok(input);
            }
            let Some(peek) = self.peek.as_mut() else {
                self.begin_peek().await?;
                continue;
            };
            match peek.rows.try_next().await? {
                Some(row) => {
                    peek.first_row.get_or_insert_with(|| peek.started.elapsed());
                    peek.count += 1;
                    let data: &str = row.try_get(0)?;
                    return Ok(Input::Line(Bytes::copy_from_slice(data.as_bytes())));
                }
                None => {
                    if let Some(peek) = self.peek.take() {
                        self.end_peek(peek);
                    }
                }
            }
        }
    }

    /// Called mid-peek only before a restart or at the end: the peek is dropped first (the
    /// advance could not run on the connection behind it), the next one starts at the new
    /// position.
    async fn ack(&mut self, upto: Lsn) -> Result<Lsn, PipelineError> {
        if self.peek.take().is_some() {
            self.queued.clear();
        }
        if upto <= self.confirmed {
            return Ok(self.confirmed);
        }
        let row = self
            .client
            .query_one(
                "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
                &[&self.cfg.slot, &upto.to_string()],
            )
            .await?;
        let end: Option<String> = row.get(0);
        self.confirmed = end.and_then(|e| e.parse().ok()).unwrap_or(upto);
        Ok(self.confirmed)
    }

    /// Drop the peek in progress (its remaining rows are read again from the confirmed
    /// position, with the new filter).
    async fn stop(&mut self) {
        self.peek = None;
        self.queued.clear();
    }
}
