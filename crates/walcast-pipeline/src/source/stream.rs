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

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};
use walcast_pgrepl::{ReplEvent, ReplicationClient, ReplicationStream};
use walcast_wal2json::Lsn;

use crate::source::{Filter, Input, Source};
use crate::PipelineError;

#[derive(Clone, Debug)]
pub struct StreamConfig {
    pub slot: String,
    /// Replication connection URL (`replication=database` is added).
    pub url: String,
    /// How often progress is acknowledged to the server (and `/health` refreshed).
    pub ack_interval: Duration,
}

/// The streaming [`Source`]: each `XLogData` a line, each keepalive "caught up to its
/// position" (and a checkpoint when the server asks for a reply), and a checkpoint every
/// `ack_interval`.
pub struct Streamer<'a> {
    cfg: &'a StreamConfig,
    stream: Option<ReplicationStream>,
    tick: Option<Interval>,
    queued: VecDeque<Input>,
}

impl<'a> Streamer<'a> {
    pub fn new(cfg: &'a StreamConfig) -> Streamer<'a> {
        Streamer {
            cfg,
            stream: None,
            tick: None,
            queued: VecDeque::new(),
        }
    }
}

impl Source for Streamer<'_> {
    const FLUSH_WHILE_WAITING: bool = true;

    async fn start(&mut self, from: Lsn, filter: &Filter) -> Result<(), PipelineError> {
        tracing::info!(filter = %filter, messages = %filter.messages, from = %from, "starting replication stream");
        let repl = ReplicationClient::connect(&self.cfg.url).await?;
        let options = filter.options();
        self.stream = Some(repl.start_logical(&self.cfg.slot, from, &options).await?);
        // The first tick is at once: the driver reports the stream as active.
        let mut tick = tokio::time::interval(self.cfg.ack_interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        self.tick = Some(tick);
        self.queued.clear();
        Ok(())
    }

    async fn next(&mut self) -> Result<Input, PipelineError> {
        if let Some(input) = self.queued.pop_front() {
            return Ok(input);
        }
        let (Some(stream), Some(tick)) = (self.stream.as_mut(), self.tick.as_mut()) else {
            return Err(PipelineError::StreamEnded);
        };
        tokio::select! {
            biased;
            _ = tick.tick() => Ok(Input::Checkpoint { busy: false, reply: false }),
            event = stream.next_event() => match event? {
                None => Err(PipelineError::StreamEnded),
                Some(ReplEvent::XLogData { data, .. }) => Ok(Input::Line(data)),
                Some(ReplEvent::Keepalive { wal_end, reply_requested, .. }) => {
                    if reply_requested {
                        self.queued.push_back(Input::Checkpoint { busy: false, reply: true });
                    }
                    Ok(Input::CaughtUp(wal_end))
                }
            },
        }
    }

    async fn ack(&mut self, upto: Lsn) -> Result<Lsn, PipelineError> {
        if let Some(stream) = self.stream.as_mut() {
            stream.send_status(upto, false).await?;
        }
        Ok(upto)
    }

    async fn stop(&mut self) {
        if let Some(stream) = self.stream.take() {
            let _ = stream.stop().await;
        }
        self.tick = None;
    }
}
