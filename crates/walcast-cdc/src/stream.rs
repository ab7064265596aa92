//! The streaming source: `START_REPLICATION … LOGICAL` on a replication connection.
//!
//! The walsender decodes each WAL record once and pushes every transaction as it commits,
//! so there is no re-decoding from `restart_lsn` and no poll interval. Acknowledgement
//! follows the same rule as the poller: a standby status update reports as flushed only
//! the commit LSN of transactions whose changes a bus round trip confirmed, so a crash
//! replays and never skips. A keepalive received between transactions means everything
//! before its position was sent and handled, so that position is acknowledged too (the
//! slot keeps moving through WAL of tables we do not stream).
//!
//! A registry edit (a table enabled or disabled) changes the `add-tables` filter: the
//! stream is acknowledged up to that commit, stopped, and restarted from there with the
//! new filter, so nothing is lost or decoded with the wrong filter.

use std::time::{Duration, Instant};

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use walcast_lease::Action;
use walcast_pgrepl::{ReplEvent, ReplicationClient, ReplicationStream};
use walcast_wal2json::Lsn;

use crate::health::CdcHealth;
use crate::pipeline::{LineOutcome, Pipeline};
use crate::registry;
use crate::source::{registry_drift, table_filter, WAL2JSON_OPTIONS};
use crate::CdcError;

#[derive(Clone, Debug)]
pub struct StreamConfig {
    pub slot: String,
    /// Replication connection URL (`replication=database` is added).
    pub url: String,
    /// How often progress is acknowledged to the server (and `/health` refreshed).
    pub ack_interval: Duration,
    /// How often the registry is re-read as a safety net.
    pub filter_refresh: Duration,
}

enum Stop {
    Cancelled,
    FilterChanged,
}

pub struct Streamer<'a> {
    cfg: &'a StreamConfig,
    client: &'a Client,
    pipeline: &'a mut Pipeline,
    health: &'a CdcHealth,
    /// Last position reported to the server as flushed.
    confirmed: Lsn,
}

impl<'a> Streamer<'a> {
    pub fn new(
        cfg: &'a StreamConfig,
        client: &'a Client,
        pipeline: &'a mut Pipeline,
        health: &'a CdcHealth,
        confirmed: Lsn,
    ) -> Streamer<'a> {
        Streamer {
            cfg,
            client,
            pipeline,
            health,
            confirmed,
        }
    }

    async fn stream_once(&mut self, cancel: &CancellationToken) -> Result<Stop, CdcError> {
        let filter = table_filter(&self.pipeline.tables());
        tracing::info!(filter = %filter, from = %self.confirmed, "starting replication stream");
        let repl = ReplicationClient::connect(&self.cfg.url).await?;
        let mut options: Vec<(&str, &str)> = WAL2JSON_OPTIONS.to_vec();
        options.push(("add-tables", &filter));
        let mut stream = repl
            .start_logical(&self.cfg.slot, self.confirmed, &options)
            .await?;
        self.pipeline.reset();
        self.health.set_active(true);
        self.health.set_error(None);
        // Handed to the bus and safe to acknowledge once a barrier confirms it.
        let mut handled = self.confirmed;
        let mut tick = tokio::time::interval(self.cfg.ack_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stats_at = Instant::now();
        let mut refreshed_at = Instant::now();
        loop {
            tokio::select! {
                // Lines already received come first; held changes are authorized and
                // published as soon as nothing more is waiting (or a batch is full).
                biased;
                _ = cancel.cancelled() => {
                    self.ack(&mut stream, handled).await?;
                    let _ = stream.stop().await;
                    return Ok(Stop::Cancelled);
                }
                _ = tick.tick() => {
                    self.pipeline.fence().check(Action::Read)?;
                    self.ack(&mut stream, handled).await?;
                    if stats_at.elapsed() >= Duration::from_millis(500) {
                        stats_at = Instant::now();
                        crate::slot::report_position(self.client, &self.cfg.slot, self.health).await?;
                    }
                    if refreshed_at.elapsed() >= self.cfg.filter_refresh {
                        refreshed_at = Instant::now();
                        let current = self.pipeline.tables();
                        if let Some(tables) = registry_drift(self.pipeline.catalog(), &current, self.confirmed).await? {
                            self.pipeline.set_tables(&tables);
                            let _ = stream.stop().await;
                            return Ok(Stop::FilterChanged);
                        }
                    }
                }
                event = stream.next_event() => match event? {
                    None => return Err(CdcError::StreamEnded),
                    Some(ReplEvent::XLogData { data, .. }) => {
                        let text = std::str::from_utf8(&data).map_err(|e| CdcError::Decode {
                            error: format!("not UTF-8: {e}"),
                            line: String::from_utf8_lossy(&data[..data.len().min(300)]).into_owned(),
                        })?;
                        if let LineOutcome::Committed { commit_lsn, registry_changed } =
                            self.pipeline.on_line(text).await?
                        {
                            handled = handled.max(commit_lsn);
                            if registry_changed {
                                self.ack(&mut stream, handled).await?;
                                let _ = stream.stop().await;
                                return Ok(Stop::FilterChanged);
                            }
                        }
                    }
                    Some(ReplEvent::Keepalive { wal_end, reply_requested, .. }) => {
                        if !self.pipeline.in_transaction() {
                            handled = handled.max(wal_end);
                        }
                        if reply_requested {
                            self.ack(&mut stream, handled).await?;
                            self.pipeline.fence().check(Action::Ack)?;
                            stream.send_status(self.confirmed, false).await?;
                        }
                    }
                },
                _ = std::future::ready(()), if self.pipeline.has_pending() => {
                    self.pipeline.flush().await?;
                }
            }
        }
    }

    /// Report `upto` as flushed once the bus confirmed everything handed to it.
    async fn ack(&mut self, stream: &mut ReplicationStream, upto: Lsn) -> Result<(), CdcError> {
        if upto <= self.confirmed {
            return Ok(());
        }
        self.pipeline.barrier().await?;
        // Checked after the barrier (which can take a while), right before the status.
        self.pipeline.fence().check(Action::Ack)?;
        stream.send_status(upto, false).await?;
        self.confirmed = upto;
        Ok(())
    }
}

impl crate::source::Source for Streamer<'_> {
    async fn run(mut self, cancel: &CancellationToken) -> Result<(), CdcError> {
        let tables = registry::list(self.pipeline.catalog(), None).await?;
        self.pipeline.set_tables(&tables);
        loop {
            match self.stream_once(cancel).await? {
                Stop::Cancelled => return Ok(()),
                Stop::FilterChanged => continue,
            }
        }
    }
}
