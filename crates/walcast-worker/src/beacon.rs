//! This process's health beacon (see [`walcast_bus::beacon`]): once a second, what
//! `/health` says, cut down to what the inspector's health panel shows, published on the
//! bus for every front to collect.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::beacon::Beacon;

use crate::http::OpsState;

/// How often a process publishes its beacon.
pub const BEACON_EVERY: Duration = Duration::from_secs(1);

/// The beacon of process `process` from its ops state.
pub fn beacon(process: &str, state: &OpsState) -> Beacon {
    let worker = state
        .cdc
        .as_ref()
        .map(|c| crate::lead::worker_beacon(walcast_bus::source::DEFAULT_SOURCE, c.report()));
    let front = state.front.as_ref().map(|f| f.health().beacon());
    let at_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Beacon {
        process: process.to_string(),
        at_ms,
        bus_connected: state.bus.is_connected(),
        worker,
        front,
        sources: state
            .sources
            .as_ref()
            .map(|s| s.all().iter().map(|s| s.beacon()).collect())
            .unwrap_or_default(),
    }
}

/// Publish this process's beacon every [`BEACON_EVERY`] until `cancel`. A failed publish
/// is logged at debug level: the next one replaces it.
pub fn spawn(tracker: &TaskTracker, process: String, state: OpsState, cancel: CancellationToken) {
    tracker.spawn(async move {
        let mut tick = tokio::time::interval(BEACON_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            let b = beacon(&process, &state);
            if let Err(e) = state.bus.publish(b.subject(), &[], b.encode()).await {
                tracing::debug!(error = %e, "health beacon not published");
            }
        }
    });
}
