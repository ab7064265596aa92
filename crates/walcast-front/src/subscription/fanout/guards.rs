//! What the front refuses of the change stream: messages of a stale leader term, and
//! changes it already delivered (a replay after a leader change or a worker restart).

use std::collections::HashMap;
use walcast_bus::ChangeEvent;

use crate::telemetry;

/// Drops messages of a leader term older than the newest one received: a leader frozen
/// past its lease may release, when it wakes, a message it had handed to its NATS
/// connection before its fence closed; by then its successor's messages (a higher term)
/// reached us, and the old leader's judgement (its subscriptions, privileges) is stale.
/// A lower term is adopted only after the newest has been silent for
/// [`STALE_TERM_WINDOW`] (the lease state was reset by hand, say), never within it.
///
/// Per source: each source has its own lease, so its own terms; a term of one source says
/// nothing about another's (term 9 of one never drops term 1 of another).
#[derive(Default)]
pub(crate) struct TermGuard {
    newest: HashMap<String, (u64, std::time::Instant)>,
}

/// How long the newest term must have been silent before a lower one is accepted.
pub(crate) const STALE_TERM_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

impl TermGuard {
    /// True if a message of `source`'s leader of `term` (the header; absent from workers
    /// without it) may be delivered, seen at `now`.
    pub(crate) fn admit(
        &mut self,
        source: &str,
        term: Option<&str>,
        now: std::time::Instant,
    ) -> bool {
        let Some(term) = term.and_then(|t| t.parse::<u64>().ok()) else {
            return true;
        };
        match self.newest.get(source) {
            Some(&(newest, at)) if term < newest => {
                if now.saturating_duration_since(at) < STALE_TERM_WINDOW {
                    metrics::counter!(telemetry::STALE_TERM_DROPPED).increment(1);
                    tracing::warn!(
                        source,
                        term,
                        newest,
                        "dropped a message of an older leader term"
                    );
                    return false;
                }
                tracing::warn!(
                    source,
                    term,
                    newest,
                    "the newest leader term went silent; accepting a lower one"
                );
            }
            _ => {}
        }
        self.newest.insert(source.to_string(), (term, now));
        true
    }
}

/// Drops what this front already delivered. A project's changes leave the leader in
/// commit order (projects are published side by side, so not across projects), so per
/// project `(commit_lsn, seq, part)` only grows; a new leader (or a restarted one)
/// replays from the slot's last acknowledged position, and everything up to what we saw
/// last of that project is a replay that each channel already got.
#[derive(Default)]
pub(crate) struct ReplayGuard {
    last: HashMap<String, (walcast_core::Lsn, u32, u32)>,
}

/// Projects remembered at most (then forgotten all at once: a replay may then pass once).
const MAX_PROJECTS: usize = 100_000;

impl ReplayGuard {
    /// True if the change is new (and remember it).
    pub(crate) fn admit(&mut self, ev: &ChangeEvent) -> bool {
        let at = (ev.commit_lsn, ev.seq, ev.part);
        if let Some(last) = self.last.get_mut(&ev.project) {
            if at <= *last {
                metrics::counter!(telemetry::REPLAYS_DROPPED).increment(1);
                return false;
            }
            *last = at;
            return true;
        }
        if self.last.len() >= MAX_PROJECTS {
            self.last.clear();
        }
        self.last.insert(ev.project.clone(), at);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(project: &str, lsn: u64, seq: u32) -> ChangeEvent {
        let mut ev: ChangeEvent = serde_json::from_value(serde_json::json!({
            "project": project, "schema": "public", "table": "t", "type": "INSERT",
            "commit_timestamp": "", "commit_lsn": "0/0", "seq": seq, "columns": [],
            "record": {}, "old_record": {}, "subs": []
        }))
        .unwrap();
        ev.commit_lsn = walcast_core::Lsn(lsn);
        ev
    }

    #[test]
    fn replays_are_dropped_per_project_not_across() {
        let mut g = ReplayGuard::default();
        assert!(g.admit(&change("a", 0x30, 1)));
        // Another project's lane is behind: its older positions are new changes.
        assert!(g.admit(&change("b", 0x10, 1)));
        assert!(g.admit(&change("b", 0x20, 1)));
        assert!(!g.admit(&change("a", 0x30, 1)), "a replay of a");
        assert!(!g.admit(&change("b", 0x10, 1)), "a replay of b");
        assert!(g.admit(&change("a", 0x30, 2)));
    }

    #[test]
    fn an_older_term_is_dropped_unless_the_newest_went_silent() {
        let t0 = std::time::Instant::now();
        let mut g = TermGuard::default();
        assert!(g.admit("default", None, t0), "no header: no election");
        assert!(g.admit("default", Some("3"), t0));
        assert!(g.admit("default", Some("3"), t0));
        assert!(g.admit("default", Some("4"), t0), "a new leader");
        assert!(
            !g.admit("default", Some("3"), t0 + std::time::Duration::from_secs(1)),
            "the old one woke up"
        );
        assert!(g.admit("default", Some("4"), t0 + std::time::Duration::from_secs(2)));
        assert!(
            g.admit("default", Some("junk"), t0),
            "unparsable: not judged"
        );
        let later = t0 + std::time::Duration::from_secs(2) + STALE_TERM_WINDOW;
        assert!(
            g.admit("default", Some("1"), later),
            "term 4 silent for the window: lease reset by hand"
        );
        assert!(
            !g.admit("default", Some("0"), later),
            "and 1 is now the newest"
        );
    }

    #[test]
    fn terms_of_different_sources_are_unrelated() {
        let t0 = std::time::Instant::now();
        let mut g = TermGuard::default();
        assert!(g.admit("a", Some("9"), t0));
        assert!(
            g.admit("b", Some("1"), t0),
            "term 9 of a does not drop term 1 of b"
        );
        assert!(g.admit("a", Some("9"), t0));
        assert!(g.admit("b", Some("1"), t0));
        assert!(g.admit("b", Some("2"), t0), "b's new leader");
        assert!(!g.admit("b", Some("1"), t0), "b's old leader woke up");
        assert!(
            g.admit("a", Some("9"), t0),
            "a is untouched by b's election"
        );
        assert!(!g.admit("a", Some("8"), t0));
    }
}
