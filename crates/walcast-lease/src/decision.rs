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
        self.leader_window().as_millis() as Millis
    }

    /// How long after sending a renewal that succeeded the holder may act:
    /// `duration - margin`.
    pub fn leader_window(&self) -> Duration {
        self.duration.saturating_sub(self.margin)
    }

    /// The timing walcast uses with a lease of `duration`: the leader stops a fifth of it
    /// before its lease could expire (room for clock rate differences and in-flight
    /// messages), and renews every third of it (two renewals may fail before it stops).
    pub fn for_duration(duration: Duration) -> Timing {
        Timing {
            duration,
            margin: duration / 5,
        }
    }

    /// How often the holder renews, and a follower reads the lease.
    pub fn renew_every(&self) -> Duration {
        (self.duration / 3).max(Duration::from_millis(10))
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

/// The Postgres lease row as read. `live` is judged by the database's own clock:
/// `clock_timestamp() < renewed_at + duration`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// The holder's session tag (`application_name` of its sessions); `None`: free.
    pub session: Option<String>,
    /// The fencing number: one more on every acquisition.
    pub term: u64,
    pub live: bool,
}

/// What an elector that does not lead does after reading the row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RowDecision {
    /// No row yet: insert one with us as holder (term 1; a conflict means we lost).
    Insert,
    /// Write us as holder with `term + 1`, compare-and-set on `term` (the statement checks
    /// again, on the database clock, that the row is free, ours or expired). `stale`: the
    /// session tag of a holder that let its lease expire without releasing it, whose
    /// sessions are terminated once we won.
    Take { term: u64, stale: Option<String> },
    /// Someone else holds a live lease.
    Wait,
}

/// The Postgres acquisition rule for session tag `me`. A row naming us is a term of ours
/// that ended (the caller is not leading): retaken at once, nobody else held it since.
pub fn decide_row(row: Option<&Row>, me: &str) -> RowDecision {
    let Some(row) = row else {
        return RowDecision::Insert;
    };
    match row.session.as_deref() {
        None => RowDecision::Take {
            term: row.term,
            stale: None,
        },
        Some(s) if s == me => RowDecision::Take {
            term: row.term,
            stale: None,
        },
        Some(_) if row.live => RowDecision::Wait,
        Some(s) => RowDecision::Take {
            term: row.term,
            stale: Some(s.to_string()),
        },
    }
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

    fn row(session: Option<&str>, term: u64, live: bool) -> Row {
        Row {
            session: session.map(str::to_owned),
            term,
            live,
        }
    }

    #[test]
    fn a_row_is_taken_when_missing_free_ours_or_expired() {
        assert_eq!(decide_row(None, "a"), RowDecision::Insert);
        let free = row(None, 4, false);
        assert_eq!(
            decide_row(Some(&free), "a"),
            RowDecision::Take {
                term: 4,
                stale: None
            }
        );
        let ours = row(Some("a"), 4, true);
        assert_eq!(
            decide_row(Some(&ours), "a"),
            RowDecision::Take {
                term: 4,
                stale: None
            }
        );
        let live = row(Some("b"), 4, true);
        assert_eq!(decide_row(Some(&live), "a"), RowDecision::Wait);
        let expired = row(Some("b"), 4, false);
        assert_eq!(
            decide_row(Some(&expired), "a"),
            RowDecision::Take {
                term: 4,
                stale: Some("b".into())
            }
        );
    }

    /// One step of the row simulation.
    #[derive(Clone, Debug)]
    struct RowStep {
        who: usize,
        advance: u64,
        delay: u64,
        /// 0: applied and answered, 1: not applied, 2: applied but the answer is lost.
        fault: u8,
    }

    fn row_steps() -> impl Strategy<Value = Vec<RowStep>> {
        prop::collection::vec(
            (
                0usize..3,
                // Mostly short steps (where an early takeover would show), some freezes.
                prop_oneof![9 => 0u64..600, 1 => 0u64..5000],
                0u64..100,
                prop::sample::select(vec![0u8, 0, 0, 1, 2]),
            )
                .prop_map(|(who, advance, delay, fault)| RowStep {
                    who,
                    advance,
                    delay,
                    fault,
                }),
            1..300,
        )
    }

    /// The row as stored, on the database clock (real time here).
    #[derive(Clone, Debug)]
    struct Stored {
        session: Option<usize>,
        term: u64,
        renewed_at: u64,
    }

    proptest! {
        /// The Postgres protocol: three electors over one row written compare-and-set on
        /// its term, expiry judged on the database clock, each fence on the elector's own
        /// clock running up to 2% fast or slow, with arbitrary delays, lost writes, lost
        /// answers and freezes (an elector not scheduled for a while): never two open
        /// fences at once.
        #[test]
        fn never_two_open_fences(plan in row_steps(), rates in prop::collection::vec(980u64..1020, 3)) {
            const D: u64 = 1000;
            let window = T.leader_window_ms();
            let local = |i: usize, real: u64| real * rates[i] / 1000;
            let mut now: u64 = 0;
            let mut store: Option<Stored> = None;
            // Per elector: (term, fence deadline on its clock) while it thinks it leads.
            let mut fences: Vec<Option<(u64, u64)>> = vec![None; 3];
            let live = |s: &Stored, at: u64| s.session.is_some() && at < s.renewed_at + D;
            for step in plan {
                now += step.advance;
                let me = step.who;
                let sent = local(me, now);
                let leading = fences[me].filter(|&(_, d)| sent < d);
                if leading.is_none() {
                    fences[me] = None;
                }
                now += step.delay;
                let applied = step.fault != 1;
                let answered = step.fault == 0;
                if let Some((term, _)) = leading {
                    let ok = store.as_ref().is_some_and(|s| s.term == term && s.session == Some(me));
                    if ok && applied {
                        if let Some(s) = store.as_mut() { s.renewed_at = now; }
                        if answered { fences[me] = Some((term, sent + window)); }
                    } else if !ok {
                        fences[me] = None;
                    }
                } else {
                    let read = store.as_ref().map(|s| Row {
                        session: s.session.map(|i| i.to_string()),
                        term: s.term,
                        live: live(s, now - step.delay),
                    });
                    let tag = me.to_string();
                    let want = match decide_row(read.as_ref(), &tag) {
                        RowDecision::Wait => None,
                        RowDecision::Insert => Some(None),
                        RowDecision::Take { term, .. } => Some(Some(term)),
                    };
                    if let (Some(expect), true) = (want, applied) {
                        // The statement's own check, at the moment it runs.
                        let won = match (&store, expect) {
                            (None, None) => true,
                            (Some(s), Some(t)) => s.term == t
                                && (s.session.is_none() || s.session == Some(me) || !live(s, now)),
                            _ => false,
                        };
                        if won {
                            let term = store.as_ref().map_or(1, |s| s.term + 1);
                            store = Some(Stored { session: Some(me), term, renewed_at: now });
                            if answered { fences[me] = Some((term, sent + window)); }
                        }
                    }
                }
                let open: Vec<usize> = (0..3)
                    .filter(|&i| fences[i].is_some_and(|(_, d)| local(i, now) < d))
                    .collect();
                prop_assert!(open.len() <= 1, "open fences {open:?} at {now}: {fences:?} store {store:?}");
            }
        }
    }
}
