//! Fencing: the proof, on this process's own monotonic clock, that a term may still act.
//!
//! A leader may act (publish, acknowledge, take the slot over) only until `duration -
//! margin` after it *sent* its last renewal that succeeded. Every other worker waits at
//! least a full `duration` after that renewal was *applied* before it takes over, so the
//! fence closes before anyone else can lead, whatever happened to this process in
//! between: a leader frozen (SIGSTOP, a stall, a pause) past its deadline finds the fence
//! closed when it wakes and stops without publishing or acknowledging anything more.
//! A released lease is the exception: another worker takes it at once, so a leader that
//! releases revokes its fence before it sends the release.
//!
//! [`Fence`] is a cheap handle (an atomic deadline) cloned into everything that acts for
//! the term. [`Fence::check`] costs one clock read; the first check that finds the fence
//! closed revokes it for good and cancels the term's token, so the whole term winds down.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::telemetry;

/// Deadline value of a revoked fence.
const REVOKED: u64 = 0;
/// Deadline value of a fence that never closes (no election).
const NEVER: u64 = u64::MAX;

/// Is the fence open at `now` (microseconds on the fence's clock)?
pub fn open(deadline_us: u64, now_us: u64) -> bool {
    deadline_us != REVOKED && now_us < deadline_us
}

/// The deadline after a renewal that succeeded: `proposed`, unless the fence was revoked
/// (a closed term never reopens) or already reaches further (a late answer to an older
/// renewal never shortens it). `None`: leave it as it is.
pub fn extended(current_us: u64, proposed_us: u64) -> Option<u64> {
    (current_us != REVOKED && proposed_us > current_us).then_some(proposed_us)
}

/// What a closed fence refused, for the log and the `action` label of
/// `walcast_lease_fenced_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Handing a change to the bus.
    Publish,
    /// Acknowledging a position to Postgres (standby status, slot advance).
    Ack,
    /// Taking the slot over, creating or recreating it.
    Slot,
    /// Reading on: a source checks between reads, so it stops at the deadline even when
    /// it has nothing to publish or acknowledge.
    Read,
    /// Writing the pipeline's heartbeat (a logical message on the source database).
    Heartbeat,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Publish => "publish",
            Action::Ack => "ack",
            Action::Slot => "slot",
            Action::Read => "read",
            Action::Heartbeat => "heartbeat",
        }
    }
}

/// A closed fence refused an action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("leadership term {term} is fenced: lease not renewed in time, refusing to {}", action.as_str())]
pub struct Fenced {
    pub term: u64,
    pub action: Action,
}

struct Inner {
    term: u64,
    token: CancellationToken,
    /// The clock's origin: deadlines are microseconds after it (`REVOKED` is 0, so the
    /// origin lies a little in the past).
    origin: Instant,
    deadline_us: AtomicU64,
}

/// One leadership term's fence. Clones share it.
#[derive(Clone)]
pub struct Fence(Arc<Inner>);

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("term", &self.0.term)
            .field("open", &self.is_open())
            .field("expires_in", &self.expires_in())
            .finish()
    }
}

impl Fence {
    /// A fence for term `term`, open until `deadline`, cancelling `token` once it closes.
    pub fn new(term: u64, token: CancellationToken, deadline: Instant) -> Fence {
        let origin = Instant::now()
            .checked_sub(Duration::from_secs(1))
            .unwrap_or_else(Instant::now);
        let f = Fence(Arc::new(Inner {
            term,
            token,
            origin,
            deadline_us: AtomicU64::new(REVOKED),
        }));
        f.0.deadline_us
            .store(f.micros(deadline).max(1), Ordering::SeqCst);
        f
    }

    /// A fence that never closes, for running without election (`LEASE_MODE=none`, tools
    /// and benchmarks): only `token` ends the term.
    pub fn unfenced(token: CancellationToken) -> Fence {
        Fence(Arc::new(Inner {
            term: 0,
            token,
            origin: Instant::now(),
            deadline_us: AtomicU64::new(NEVER),
        }))
    }

    fn micros(&self, at: Instant) -> u64 {
        let us = at.saturating_duration_since(self.0.origin).as_micros();
        u64::try_from(us).unwrap_or(NEVER - 1)
    }

    /// The term number (the lease's fencing number; 0 without election).
    pub fn term(&self) -> u64 {
        self.0.term
    }

    /// The term's token: cancelled when the fence closes, when leadership is lost
    /// otherwise, or on shutdown.
    pub fn token(&self) -> &CancellationToken {
        &self.0.token
    }

    /// Resolves when the term ends.
    pub async fn cancelled(&self) {
        self.0.token.cancelled().await
    }

    /// Open now, without side effects.
    pub fn is_open(&self) -> bool {
        let d = self.0.deadline_us.load(Ordering::SeqCst);
        d == NEVER || open(d, self.micros(Instant::now()))
    }

    /// Check before acting. A closed fence is revoked for good, the term's token is
    /// cancelled, and the refusal is counted and logged.
    pub fn check(&self, action: Action) -> Result<(), Fenced> {
        if self.is_open() {
            return Ok(());
        }
        let first = self.0.deadline_us.swap(REVOKED, Ordering::SeqCst) != REVOKED;
        if first {
            tracing::error!(
                term = self.0.term,
                action = action.as_str(),
                "lease not renewed before the fence deadline: this term publishes and acknowledges nothing more"
            );
        }
        metrics::counter!(telemetry::FENCED, "action" => action.as_str()).increment(1);
        self.0.token.cancel();
        Err(Fenced {
            term: self.0.term,
            action,
        })
    }

    /// A renewal succeeded: open until `deadline`, unless revoked meanwhile.
    pub fn extend(&self, deadline: Instant) -> bool {
        let proposed = self.micros(deadline).max(1);
        self.0
            .deadline_us
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| {
                if d == NEVER {
                    None
                } else {
                    extended(d, proposed)
                }
            })
            .is_ok()
    }

    /// Close the fence now (leadership lost, or released) and end the term.
    pub fn revoke(&self) {
        if self.0.deadline_us.load(Ordering::SeqCst) != NEVER {
            self.0.deadline_us.store(REVOKED, Ordering::SeqCst);
        }
        self.0.token.cancel();
    }

    /// When the fence closes unless renewed; `None` when revoked or never closing.
    pub fn deadline(&self) -> Option<Instant> {
        match self.0.deadline_us.load(Ordering::SeqCst) {
            REVOKED | NEVER => None,
            d => Some(self.0.origin + Duration::from_micros(d)),
        }
    }

    /// Time left before the fence closes (zero once closed); `None` without a deadline.
    pub fn expires_in(&self) -> Option<Duration> {
        if self.0.deadline_us.load(Ordering::SeqCst) == NEVER {
            return None;
        }
        Some(self.deadline().map_or(Duration::ZERO, |d| {
            d.saturating_duration_since(Instant::now())
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_strictly_before_the_deadline_and_never_when_revoked() {
        assert!(open(1000, 999));
        assert!(!open(1000, 1000));
        assert!(!open(1000, 5000));
        assert!(!open(REVOKED, 0));
    }

    #[test]
    fn renewals_only_extend_and_never_reopen() {
        assert_eq!(extended(1000, 2000), Some(2000));
        // A late answer to an older renewal does not shorten the term.
        assert_eq!(extended(2000, 1500), None);
        assert_eq!(extended(REVOKED, 5000), None);
    }

    #[test]
    fn a_fence_closes_at_its_deadline_cancels_its_term_and_stays_closed() {
        let token = CancellationToken::new();
        let f = Fence::new(7, token.clone(), Instant::now() + Duration::from_millis(30));
        assert!(f.check(Action::Publish).is_ok());
        assert!(!token.is_cancelled());
        std::thread::sleep(Duration::from_millis(40));
        let err = f.check(Action::Ack).unwrap_err();
        assert_eq!((err.term, err.action), (7, Action::Ack));
        assert!(token.is_cancelled(), "a closed fence ends its term");
        // A renewal that succeeds now cannot reopen it.
        assert!(!f.extend(Instant::now() + Duration::from_secs(60)));
        assert!(f.check(Action::Publish).is_err());
        assert_eq!(f.expires_in(), Some(Duration::ZERO));
    }

    #[test]
    fn renewals_move_the_deadline_for_every_clone() {
        let f = Fence::new(1, CancellationToken::new(), Instant::now());
        let g = f.clone();
        assert!(!g.is_open());
        // Not yet revoked (nobody checked): a renewal in time keeps the term.
        assert!(f.extend(Instant::now() + Duration::from_secs(10)));
        assert!(g.check(Action::Publish).is_ok());
        assert!(g.expires_in().unwrap() > Duration::from_secs(9));
        f.revoke();
        assert!(g.check(Action::Publish).is_err());
        assert!(g.token().is_cancelled());
    }

    #[test]
    fn an_unfenced_term_stays_open_until_cancelled() {
        let token = CancellationToken::new();
        let f = Fence::unfenced(token.clone());
        assert!(f.check(Action::Publish).is_ok());
        assert!(!f.extend(Instant::now()));
        assert_eq!(f.expires_in(), None);
        assert_eq!(f.term(), 0);
        token.cancel();
        assert!(f.check(Action::Ack).is_ok(), "only the token ends it");
    }
}
