//! What an elector knows about the lease, for `/health` and the metrics.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::fence::Fence;
use crate::telemetry;

#[derive(Default)]
struct State {
    /// Our term's fence while we lead.
    fence: Option<Fence>,
    /// The holder as last seen (us while we lead).
    holder: Option<String>,
    /// The term as last seen.
    term: Option<u64>,
    /// While following: when the holder's lease runs out, as far as we can tell.
    expires_at: Option<Instant>,
}

/// Shared view of an elector. Cheap to read.
#[derive(Default)]
pub struct LeaseStatus(Mutex<State>);

/// A snapshot of [`LeaseStatus`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseReport {
    /// We hold the lease and our fence is open.
    pub leader: bool,
    /// The term (fencing number) of the lease as last seen.
    pub term: Option<u64>,
    /// Its holder as last seen (`None`: free or unknown).
    pub holder: Option<String>,
    /// Leading: time left before our fence closes unless renewed. Following: time left
    /// before the holder's lease runs out, as last read.
    pub expires_in: Option<Duration>,
}

impl LeaseStatus {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// We lead, with this fence.
    pub(crate) fn leading(&self, identity: &str, fence: &Fence) {
        let mut s = self.state();
        s.fence = Some(fence.clone());
        s.holder = Some(identity.to_string());
        s.term = Some(fence.term());
        s.expires_at = None;
        metrics::gauge!(telemetry::LEADER).set(1.0);
        metrics::gauge!(telemetry::TERM).set(fence.term() as f64);
    }

    /// We stopped leading.
    pub(crate) fn following(&self) {
        let mut s = self.state();
        s.fence = None;
        metrics::gauge!(telemetry::LEADER).set(0.0);
    }

    /// What we read while following.
    pub(crate) fn observed(
        &self,
        holder: Option<&str>,
        term: Option<u64>,
        expires_in: Option<Duration>,
    ) {
        let mut s = self.state();
        s.holder = holder.map(str::to_owned);
        if term.is_some() {
            s.term = term;
        }
        s.expires_at = expires_in.map(|d| Instant::now() + d);
    }

    pub fn report(&self) -> LeaseReport {
        let s = self.state();
        match &s.fence {
            Some(f) => LeaseReport {
                leader: f.is_open(),
                term: Some(f.term()),
                holder: s.holder.clone(),
                expires_in: f.expires_in(),
            },
            None => LeaseReport {
                leader: false,
                term: s.term,
                holder: s.holder.clone(),
                expires_in: s
                    .expires_at
                    .map(|t| t.saturating_duration_since(Instant::now())),
            },
        }
    }

    /// True while we lead with an open fence.
    pub fn get(&self) -> bool {
        self.report().leader
    }
}
