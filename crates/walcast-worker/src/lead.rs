//! Leading a source, the same for the default source and the added ones
//! (docs/architecture.md "Several databases: a leader per source"): elect, and for each
//! term won lead the source until its fence closes, the source is given up (over this
//! worker's share) or removed, or the process stops.
//!
//! Only how a source is elected is chosen per source ([`Election`]): the default source
//! by the process's `LEASE_MODE` (a lease row in its database, which is the control
//! database, or a Kubernetes Lease), an added source by a lease row in its own database,
//! tried only within this worker's fair share (see [`crate::share`]). A term, its fence,
//! its takeover of a stale leader's sessions and what ends it are the same for both.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::beacon::WorkerBeacon;
use walcast_lease::kubernetes::KubeLeaseError;
use walcast_lease::{Fence, LeaseStatus};
use walcast_pipeline::PipelineHealth;

use crate::config::SourceSpec;
use crate::election::Election;
use crate::leader::Leader;

/// How long a source that failed (or was given up) waits before this worker tries it again.
pub const RETRY_AFTER: Duration = Duration::from_secs(15);
/// How long an admitted attempt counts against the share before it led (the lease
/// statement takes milliseconds; a loaded machine, more).
pub(crate) const RESERVE: Duration = Duration::from_secs(1);

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One source's state in this worker.
pub struct SourceState {
    pub name: String,
    pub slot: String,
    pub health: Arc<PipelineHealth>,
    pub lease: Arc<LeaseStatus>,
    pub(crate) leading_since: Mutex<Option<Instant>>,
    /// Not tried again before then (failed, or given up for another worker).
    resting_until: Mutex<Option<Instant>>,
    /// An attempt to take its lease that may win is under way until then: it counts
    /// against this worker's share, so electors admitted together do not all win.
    pub(crate) reserved_until: Mutex<Option<Instant>>,
    /// Ends the current term (to give the source up).
    pub(crate) give_up: Mutex<Option<CancellationToken>>,
}

impl SourceState {
    pub(crate) fn new(spec: &SourceSpec) -> SourceState {
        SourceState {
            name: spec.name.clone(),
            slot: spec.slot_name.clone(),
            health: Arc::new(PipelineHealth::new(&spec.slot_name)),
            lease: Arc::new(LeaseStatus::default()),
            leading_since: Mutex::new(None),
            resting_until: Mutex::new(None),
            reserved_until: Mutex::new(None),
            give_up: Mutex::new(None),
        }
    }

    pub(crate) fn resting(&self, now: Instant) -> bool {
        lock(&self.resting_until).is_some_and(|t| now < t)
    }

    /// Reserved, not led yet, and not lost (the attempt found another holder).
    pub(crate) fn reserved(&self, now: Instant) -> bool {
        lock(&self.leading_since).is_none()
            && lock(&self.reserved_until).is_some_and(|t| now < t)
            && self.likely_free()
    }

    /// Whether an attempt now could win: the lease was last seen free, expired, or not
    /// at all (one held by a live worker is not worth a reservation).
    pub(crate) fn likely_free(&self) -> bool {
        let lease = self.lease.report();
        lease.holder.is_none() || lease.expires_in.is_none_or(|d| d < RESERVE)
    }

    pub(crate) fn rest(&self, d: Duration) {
        *lock(&self.resting_until) = Some(Instant::now() + d);
    }

    /// Since when this worker leads the source, if it does.
    pub(crate) fn leading_since(&self) -> Option<Instant> {
        *lock(&self.leading_since)
    }

    /// Its part of a health beacon.
    pub fn beacon(&self) -> WorkerBeacon {
        worker_beacon(&self.name, self.health.report())
    }
}

/// The beacon part of `source`'s pipeline, from its health.
pub fn worker_beacon(source: &str, r: walcast_pipeline::PipelineHealthReport) -> WorkerBeacon {
    WorkerBeacon {
        source: source.to_string(),
        leader: r.leader,
        cdc_active: r.cdc_active,
        slot: r.slot,
        lag_bytes: r.lag_bytes,
        changes_total: r.changes_total,
        skipped_changes_total: r.skipped_changes_total,
        last_error: r.last_error,
    }
}

/// Elect and lead `state`'s source with `leader` until `stop`, as work for the source
/// (its metrics carry `source`); its pipeline is reported not active until it leads.
/// Errs only when the Kubernetes API cannot be reached at all.
pub(crate) async fn lead(
    state: Arc<SourceState>,
    leader: Arc<Leader>,
    election: Election,
    stop: CancellationToken,
) -> Result<(), KubeLeaseError> {
    let expiry = stop.child_token();
    let tracker = TaskTracker::new();
    crate::leader::spawn_front_expiry(
        &tracker,
        &state.name,
        leader.registrar().matcher().clone(),
        expiry.clone(),
    );
    let name = state.name.clone();
    let elected = walcast_core::source_scope::within(&name, async {
        state.health.set_active(false);
        let term = |fence: Fence| lead_term(state.clone(), leader.clone(), fence);
        match election {
            Election::None => {
                term(Fence::unfenced(stop.child_token())).await;
                Ok(())
            }
            Election::Postgres(cfg, gate) => {
                let status = state.lease.clone();
                walcast_lease::postgres::run_gated(cfg, status, stop.clone(), gate, term).await;
                Ok(())
            }
            Election::Kubernetes(cfg) => {
                let status = state.lease.clone();
                walcast_lease::kubernetes::run(cfg, status, stop.clone(), term).await
            }
        }
    })
    .await;
    expiry.cancel();
    tracker.close();
    tracker.wait().await;
    elected
}

/// One term of a source: lead until the fence closes, the source is given up or removed.
async fn lead_term(state: Arc<SourceState>, leader: Arc<Leader>, fence: Fence) {
    tracing::info!(source = %state.name, term = fence.term(), "leading the source");
    *lock(&state.give_up) = Some(fence.token().clone());
    *lock(&state.leading_since) = Some(Instant::now());
    leader.clone().term(fence).await;
    *lock(&state.leading_since) = None;
    *lock(&state.give_up) = None;
    if leader.stops_process() {
        return; // a failure for good stops the process, which reports it
    }
    if let Some(e) = leader.take_failure() {
        tracing::error!(source = %state.name, error = %e, "the source's pipeline stopped; this worker tries it again later");
        state.rest(RETRY_AFTER);
    }
}
