//! The heartbeat: a transactional logical message written on the source database every
//! `CDC_HEARTBEAT_INTERVAL_MS`, so the slot always has a recent commit of its own
//! database to acknowledge.
//!
//! The sources already acknowledge every position the server says was read (the
//! stream's keepalives, the poller's flush position), so WAL written elsewhere — other
//! tables, other databases of the instance, a managed service's own writes — does not
//! pile up behind an idle slot (measured by the pipeline's `idle` tests). The heartbeat is
//! the belt to those braces, as Debezium and Sequin write one: it does not depend on the
//! server sending keepalives at the right moments, and each beat is a commit in the
//! slot's own database that moves `confirmed_flush_lsn` whatever else happens.
//!
//! It runs beside the session, for the leadership term only: it checks the fence right
//! before each write and ends with the term, so a stale leader writes nothing more. It
//! never holds the pipeline: its own connection (`DATABASE_URL` of the source, a normal
//! one, not the replication connection), each beat bounded in time; a failure is logged,
//! counted (`walcast_cdc_heartbeats_total{result="error"}`) and tried again at the next
//! tick, on a new connection.
//!
//! **Forging one is harmless.** Any login may call
//! `pg_logical_emit_message(true, 'walcast.heartbeat', …)`. No consumer asks for this
//! prefix, so wal2json never passes the message on: the driver sees only an empty
//! transaction, a position to acknowledge, as after any commit of a table nobody reads
//! (and were it passed on, it would be an unsigned `walcast.*` message, skipped as forged
//! by [`crate::signed`]). A forger can make the slot advance sooner, which it does by
//! committing anything; tested in `tests/pipeline/main.rs`.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::MissedTickBehavior;
use tokio_postgres::Client;
use walcast_lease::{Action, Fence};

use crate::{PipelineError, PipelineHealth};

/// The prefix of the heartbeat's logical message (signed messages' namespace, never
/// decoded: see the module's documentation).
pub const PREFIX: &str = "walcast.heartbeat";

/// One beat: a transactional (so committed, so acknowledged) empty message.
const BEAT_SQL: &str = "SELECT pg_logical_emit_message(true, 'walcast.heartbeat', '')";

/// A beat (connecting included) that takes longer fails: the next starts afresh.
const BEAT_TIMEOUT_FLOOR: Duration = Duration::from_secs(5);

/// The heartbeat task of one leadership term; stopped when dropped.
pub(crate) struct Heartbeat(JoinHandle<()>);

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Start beating every `every` on `url` until the term's fence closes or its token is
/// cancelled, counting each beat in `health`. `None` when `every` is zero (off).
pub(crate) fn start(
    url: &str,
    every: Duration,
    fence: &Fence,
    health: &Arc<PipelineHealth>,
) -> Option<Heartbeat> {
    if every.is_zero() {
        return None;
    }
    tracing::info!(
        interval_ms = every.as_millis() as u64,
        "heartbeat on: a logical message on the source database at each interval"
    );
    let beats = beat_until_fenced(url.to_string(), every, fence.clone(), health.clone());
    let task = walcast_core::source_scope::spawn(beats);
    Some(Heartbeat(task))
}

/// How long one beat may take: the interval, at least `BEAT_TIMEOUT_FLOOR`.
pub fn beat_timeout(every: Duration) -> Duration {
    every.max(BEAT_TIMEOUT_FLOOR)
}

async fn beat_until_fenced(
    url: String,
    every: Duration,
    fence: Fence,
    health: Arc<PipelineHealth>,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // The first tick is at once: the first beat waits a whole interval.
    tick.tick().await;
    let mut client: Option<Client> = None;
    loop {
        tokio::select! {
            _ = fence.cancelled() => return,
            _ = tick.tick() => {}
        }
        let outcome = tokio::time::timeout(beat_timeout(every), beat(&mut client, &url, &fence));
        let error = match outcome.await {
            Ok(Ok(())) => None,
            Ok(Err(Beat::Fenced)) => return,
            Ok(Err(Beat::Failed(e))) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {:?}", beat_timeout(every))),
        };
        health.record_heartbeat(error.is_none());
        if let Some(error) = error {
            // A new connection next time (a hung one is dropped with its query).
            client = None;
            tracing::warn!(%error, "heartbeat failed; trying again at the next interval");
        }
    }
}

/// Why a beat was not written.
enum Beat {
    /// The term ended: stop beating.
    Fenced,
    Failed(PipelineError),
}

impl From<PipelineError> for Beat {
    fn from(e: PipelineError) -> Beat {
        Beat::Failed(e)
    }
}

impl From<tokio_postgres::Error> for Beat {
    fn from(e: tokio_postgres::Error) -> Beat {
        Beat::Failed(e.into())
    }
}

/// Write one beat, connecting first when needed; the fence checked right before.
async fn beat(client: &mut Option<Client>, url: &str, fence: &Fence) -> Result<(), Beat> {
    if client.as_ref().is_none_or(Client::is_closed) {
        *client = Some(crate::connect(url).await?);
    }
    let Some(db) = client.as_ref() else {
        return Ok(());
    };
    fence.check(Action::Heartbeat).map_err(|_| Beat::Fenced)?;
    db.batch_execute(BEAT_SQL).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_beat_may_take_the_interval_and_never_less_than_the_floor() {
        assert_eq!(beat_timeout(Duration::from_millis(100)), BEAT_TIMEOUT_FLOOR);
        assert_eq!(
            beat_timeout(Duration::from_secs(30)),
            Duration::from_secs(30)
        );
    }

    #[test]
    fn the_prefix_is_the_one_written() {
        assert!(BEAT_SQL.contains(&format!("'{PREFIX}'")));
        assert!(crate::signed::must_be_signed(PREFIX));
    }
}
