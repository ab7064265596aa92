//! The lease rule, pure, on an injected clock.
//!
//! A lease record has a holder and a version that changes on every write (Kubernetes:
//! `holderIdentity` and `resourceVersion`). Writes are compare-and-set on the version, so
//! two electors can never both win the same write. Time is each elector's own monotonic
//! clock; no clock is ever compared with another's:
//!
//! * a holder is leader until `duration - margin` after the moment it *sent* its last
//!   successful renewal, and steps down (stops reading) then if no renewal succeeded;
//! * an elector takes over a lease held by someone else only after it has seen the same
//!   version, unchanged, for a full `duration` on its own clock.
//!
//! The taker first saw the holder's last version after that write happened, and the write
//! was sent before the holder's deadline started counting, so the taker's takeover comes
//! after the holder's deadline: never two leaders at once (property-tested below with
//! arbitrary interleavings), provided the clocks run at the same rate.

use std::time::Duration;

/// Time on one elector's monotonic clock, in milliseconds.
pub type Millis = u64;

/// The record as last read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub holder: Option<String>,
    pub version: u64,
}

/// What one elector remembers.
#[derive(Clone, Debug, Default)]
pub struct Local {
    /// The version we last saw held by someone else, and when we first saw it.
    pub seen: Option<(u64, Millis)>,
    /// When we sent our last successful write (acquire or renew), while we hold it.
    pub renewed_at: Option<Millis>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write the record with us as holder (no record, a free one, or an expired one).
    Acquire,
    /// We hold it: write it again to extend.
    Renew,
    /// Someone else holds it and it has not been silent for a full duration yet.
    Wait,
}

#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub duration: Duration,
    /// Safety margin: a leader stops this long before its lease could expire.
    pub margin: Duration,
}

impl Timing {
    fn duration_ms(&self) -> Millis {
        self.duration.as_millis() as Millis
    }

    fn leader_window_ms(&self) -> Millis {
        self.duration.saturating_sub(self.margin).as_millis() as Millis
    }
}

/// Decide what to do after reading `observed` (None: no record yet) at `now`. Updates
/// `local.seen` to remember versions held by others.
pub fn decide(
    now: Millis,
    me: &str,
    observed: Option<&Observed>,
    local: &mut Local,
    timing: Timing,
) -> Decision {
    let Some(rec) = observed else {
        local.seen = None;
        return Decision::Acquire;
    };
    match rec.holder.as_deref() {
        None | Some("") => {
            local.seen = None;
            Decision::Acquire
        }
        Some(h) if h == me && local.renewed_at.is_some() => Decision::Renew,
        _ => {
            // Held by another (or by a previous incarnation of us: treat it the same).
            match local.seen {
                Some((v, since)) if v == rec.version => {
                    if now.saturating_sub(since) >= timing.duration_ms() {
                        Decision::Acquire
                    } else {
                        Decision::Wait
                    }
                }
                _ => {
                    local.seen = Some((rec.version, now));
                    Decision::Wait
                }
            }
        }
    }
}

/// Record a successful write sent at `sent_at`.
pub fn won(local: &mut Local, sent_at: Millis) {
    local.renewed_at = Some(sent_at);
    local.seen = None;
}

/// Record that we do not hold the lease (a lost write, or another holder seen).
pub fn lost(local: &mut Local) {
    local.renewed_at = None;
}

/// Are we leader at `now`? False once `duration - margin` has passed since the last
/// successful write was sent: the caller must have stopped reading by then.
pub fn is_leader(local: &Local, now: Millis, timing: Timing) -> bool {
    local
        .renewed_at
        .is_some_and(|t| now < t.saturating_add(timing.leader_window_ms()))
}

/// When (on our clock) we must have stopped reading unless a renewal succeeds first.
pub fn deadline(local: &Local, timing: Timing) -> Option<Millis> {
    local
        .renewed_at
        .map(|t| t.saturating_add(timing.leader_window_ms()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const T: Timing = Timing {
        duration: Duration::from_millis(1000),
        margin: Duration::from_millis(200),
    };

    #[test]
    fn free_or_missing_records_are_acquired() {
        let mut l = Local::default();
        assert_eq!(decide(0, "a", None, &mut l, T), Decision::Acquire);
        let free = Observed {
            holder: None,
            version: 3,
        };
        assert_eq!(decide(0, "a", Some(&free), &mut l, T), Decision::Acquire);
    }

    #[test]
    fn a_held_lease_is_taken_only_after_a_full_silent_duration() {
        let mut l = Local::default();
        let held = Observed {
            holder: Some("b".into()),
            version: 7,
        };
        assert_eq!(decide(100, "a", Some(&held), &mut l, T), Decision::Wait);
        assert_eq!(decide(1099, "a", Some(&held), &mut l, T), Decision::Wait);
        // A renewal by b resets the wait.
        let renewed = Observed {
            holder: Some("b".into()),
            version: 8,
        };
        assert_eq!(decide(1100, "a", Some(&renewed), &mut l, T), Decision::Wait);
        assert_eq!(decide(2099, "a", Some(&renewed), &mut l, T), Decision::Wait);
        assert_eq!(
            decide(2100, "a", Some(&renewed), &mut l, T),
            Decision::Acquire
        );
    }

    #[test]
    fn a_holder_renews_and_stops_before_expiry() {
        let mut l = Local::default();
        won(&mut l, 0);
        let mine = Observed {
            holder: Some("a".into()),
            version: 1,
        };
        assert_eq!(decide(10, "a", Some(&mine), &mut l, T), Decision::Renew);
        assert!(is_leader(&l, 799, T));
        assert!(!is_leader(&l, 800, T));
        assert_eq!(deadline(&l, T), Some(800));
    }

    /// One step of the simulation: elector `who` reads and acts at the current time, with
    /// its read and its write both possibly delayed (network), and time moving on.
    #[derive(Clone, Debug)]
    struct Step {
        who: usize,
        advance: u64,
        write_delay: u64,
        write_fails: bool,
    }

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        prop::collection::vec(
            (0usize..3, 0u64..700, 0u64..400, prop::bool::weighted(0.2)).prop_map(
                |(who, advance, write_delay, write_fails)| Step {
                    who,
                    advance,
                    write_delay,
                    write_fails,
                },
            ),
            1..300,
        )
    }

    proptest! {
        /// Three electors over a compare-and-set store, arbitrary interleavings, delays and
        /// failed writes: at no moment do two of them consider themselves leader.
        #[test]
        fn never_two_leaders(plan in steps()) {
            let names = ["a", "b", "c"];
            let mut store: Option<Observed> = None;
            let mut locals = vec![Local::default(); 3];
            let mut now: Millis = 0;
            for step in plan {
                now += step.advance;
                let me = names[step.who];
                let read = store.clone();
                let version_read = read.as_ref().map(|r| r.version);
                let d = decide(now, me, read.as_ref(), &mut locals[step.who], T);
                if d == Decision::Wait {
                    if read.as_ref().and_then(|r| r.holder.as_deref()) != Some(me) {
                        lost(&mut locals[step.who]);
                    }
                } else {
                    // The write reaches the store after a delay; time passes meanwhile.
                    let sent = now;
                    now += step.write_delay;
                    let current = store.as_ref().map(|r| r.version);
                    if !step.write_fails && current == version_read {
                        let v = current.map_or(1, |v| v + 1);
                        store = Some(Observed { holder: Some(me.to_string()), version: v });
                        won(&mut locals[step.who], sent);
                    } else {
                        lost(&mut locals[step.who]);
                    }
                }
                let leaders = locals.iter().filter(|l| is_leader(l, now, T)).count();
                prop_assert!(leaders <= 1, "{leaders} leaders at {now}: {locals:?} store {store:?}");
            }
        }
    }
}
