//! What the front refuses of the change stream: messages of a stale leader term, and
//! changes it already delivered (a replay after a leader change or a worker restart).

use walcast_bus::ChangeEvent;

use crate::telemetry;

/// Drops messages of a leader term older than the newest one received: a leader frozen
/// past its lease may release, when it wakes, a message it had handed to its NATS
/// connection before its fence closed; by then its successor's messages (a higher term)
/// reached us, and the old leader's judgement (its subscriptions, privileges) is stale.
/// A lower term is adopted only after the newest has been silent for
/// [`STALE_TERM_WINDOW`] (the lease state was reset by hand, say), never within it.
#[derive(Default)]
pub(crate) struct TermGuard {
    newest: Option<(u64, std::time::Instant)>,
}

/// How long the newest term must have been silent before a lower one is accepted.
pub(crate) const STALE_TERM_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

impl TermGuard {
    /// True if a message of `term` (the header; absent from workers without it) may be
    /// delivered, seen at `now`.
    pub(crate) fn admit(&mut self, term: Option<&str>, now: std::time::Instant) -> bool {
        let Some(term) = term.and_then(|t| t.parse::<u64>().ok()) else {
            return true;
        };
        match self.newest {
            Some((newest, at)) if term < newest => {
                if now.saturating_duration_since(at) < STALE_TERM_WINDOW {
                    metrics::counter!(telemetry::STALE_TERM_DROPPED).increment(1);
                    tracing::warn!(term, newest, "dropped a message of an older leader term");
                    return false;
                }
                tracing::warn!(
                    term,
                    newest,
                    "the newest leader term went silent; accepting a lower one"
                );
            }
            _ => {}
        }
        self.newest = Some((term, now));
        true
    }
}

/// Drops what this front already delivered. Changes leave the leader in commit order, so
/// `(commit_lsn, seq, part)` only grows; a new leader (or a restarted one) replays from
/// the slot's last acknowledged position, and everything up to what we saw last is a
/// replay that each channel already got.
#[derive(Default)]
pub(crate) struct ReplayGuard {
    last: Option<(walcast_core::Lsn, u32, u32)>,
}

impl ReplayGuard {
    /// True if the change is new (and remember it).
    pub(crate) fn admit(&mut self, ev: &ChangeEvent) -> bool {
        let at = (ev.commit_lsn, ev.seq, ev.part);
        if self.last.is_some_and(|last| at <= last) {
            metrics::counter!(telemetry::REPLAYS_DROPPED).increment(1);
            return false;
        }
        self.last = Some(at);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_older_term_is_dropped_unless_the_newest_went_silent() {
        let t0 = std::time::Instant::now();
        let mut g = TermGuard::default();
        assert!(g.admit(None, t0), "no header: no election");
        assert!(g.admit(Some("3"), t0));
        assert!(g.admit(Some("3"), t0));
        assert!(g.admit(Some("4"), t0), "a new leader");
        assert!(
            !g.admit(Some("3"), t0 + std::time::Duration::from_secs(1)),
            "the old one woke up"
        );
        assert!(g.admit(Some("4"), t0 + std::time::Duration::from_secs(2)));
        assert!(g.admit(Some("junk"), t0), "unparsable: not judged");
        let later = t0 + std::time::Duration::from_secs(2) + STALE_TERM_WINDOW;
        assert!(
            g.admit(Some("1"), later),
            "term 4 silent for the window: lease reset by hand"
        );
        assert!(!g.admit(Some("0"), later), "and 1 is now the newest");
    }
}
