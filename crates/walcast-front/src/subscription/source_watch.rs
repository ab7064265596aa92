//! Subscribed clients told when their project's database stops streaming, and when it
//! streams again (docs/architecture.md "Several databases: a leader per source"): no
//! silent stall.
//!
//! Once a second the front looks, for every source with a subscription here, at what the
//! health beacons say ([`Cluster::not_streaming`](crate::cluster::Cluster::not_streaming)).
//! A source that a worker reports failing for [`FAILING_GRACE`], or that no worker is heard
//! streaming for [`NO_LEADER_GRACE`] (longer than a takeover), gets each of its sinks a
//! `system` error naming its project, its source and the class of the reason — nothing of
//! the error itself. When it streams again they get a `system` message with status `ok`.
//! Their subscriptions go on throughout. The decision is pure ([`Watch`]); the loop is IO.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::cluster::Heard;
use crate::subscription::registry::Registry;
use crate::telemetry;

/// How long a reported failure lasts before clients are told (a blip is not worth it).
pub const FAILING_GRACE: Duration = Duration::from_secs(3);
/// How long no worker may be heard streaming a source, with none reporting an error,
/// before clients are told: longer than a takeover after a worker dies.
pub const NO_LEADER_GRACE: Duration = Duration::from_secs(30);
/// How often the sources are looked at.
const TICK: Duration = Duration::from_secs(1);

/// What a source's clients are to be told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// It stopped streaming: the class of the reason.
    Failing(&'static str),
    /// It streams again, after a [`Notice::Failing`].
    Streaming,
}

/// A source not streaming since `since`, a worker reporting an error about it since
/// `reported` (if one does now); `told`: its clients were told.
#[derive(Debug, Clone, Copy)]
struct Down {
    since: Instant,
    reported: Option<Instant>,
    told: bool,
}

/// Per source, whether its clients were told it is down: the pure part.
#[derive(Debug, Default)]
pub struct Watch {
    down: HashMap<String, Down>,
}

impl Watch {
    /// What `source`'s clients are to be told now, given what the beacons say: `None`
    /// while it streams, else the class of the reason and whether a worker reported an
    /// error.
    pub fn observe(
        &mut self,
        source: &str,
        status: Option<(&'static str, bool)>,
        now: Instant,
    ) -> Option<Notice> {
        let Some((reason, reported)) = status else {
            let was = self.down.remove(source)?;
            return was.told.then_some(Notice::Streaming);
        };
        let down = self.down.entry(source.to_string()).or_insert(Down {
            since: now,
            reported: None,
            told: false,
        });
        // An error counts from when it is first reported, not from when the stream
        // stopped: a new leader's passing error while it takes over (the old session
        // still holding the slot) is no failure unless it lasts.
        down.reported = match reported {
            true => Some(down.reported.unwrap_or(now)),
            false => None,
        };
        let failing = down
            .reported
            .is_some_and(|at| now.saturating_duration_since(at) >= FAILING_GRACE);
        let leaderless = now.saturating_duration_since(down.since) >= NO_LEADER_GRACE;
        if down.told || !(failing || leaderless) {
            return None;
        }
        down.told = true;
        Some(Notice::Failing(reason))
    }

    /// Forget the sources no longer subscribed to here.
    pub fn retain(&mut self, sources: &BTreeSet<String>) {
        self.down.retain(|s, _| sources.contains(s));
    }
}

/// Why `project` gets no changes while no leader of its source is heard streaming, for
/// its clients: its database, by the source's name, and the class of the reason (nothing
/// of the error itself, nor of other sources); and whether a worker reported an error
/// (else none is heard streaming it yet). `None` while it streams (or the project is
/// unknown).
pub(crate) fn not_streaming(
    heard: &Heard,
    projects: &crate::projects::Projects,
    project: &str,
) -> Option<(String, bool)> {
    let source = projects.source_of(project)?;
    let (reason, reported) = heard.lock().not_streaming(&source, Instant::now())?;
    let why = format!(
        "the database of project {project:?} (source {source:?}) is not streaming changes: {reason}"
    );
    Some((why, reported))
}

/// The message a sink of `project` on `source` gets for `notice`.
pub fn message(project: &str, source: &str, notice: &Notice) -> String {
    match notice {
        Notice::Failing(reason) => format!(
            "the database of project {project:?} (source {source:?}) is not streaming \
             changes: {reason}; this subscription stays, and changes flow again when it streams"
        ),
        Notice::Streaming => {
            format!("the database of project {project:?} (source {source:?}) streams changes again")
        }
    }
}

/// Look at the sources once a [`TICK`] and tell their sinks, until `cancel` fires.
pub(crate) async fn run(registry: Arc<Registry>, heard: Arc<Heard>, cancel: CancellationToken) {
    let mut watch = Watch::default();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        let sources = registry.sources();
        watch.retain(&sources);
        let now = Instant::now();
        for source in &sources {
            let status = heard.lock().not_streaming(source, now);
            if let Some(notice) = watch.observe(source, status, now) {
                tell(&registry, source, &notice);
            }
        }
    }
}

fn tell(registry: &Registry, source: &str, notice: &Notice) {
    let sinks = registry.sinks_of(source);
    let kind = match notice {
        Notice::Failing(reason) => {
            tracing::warn!(%source, reason, sinks = sinks.len(), "a source stopped streaming: its subscribers are told");
            "failing"
        }
        Notice::Streaming => {
            tracing::info!(%source, sinks = sinks.len(), "a source streams again: its subscribers are told");
            "streaming"
        }
    };
    metrics::counter!(telemetry::SOURCE_NOTICES, "notice" => kind).increment(sinks.len() as u64);
    for (sink, project) in sinks {
        let why = message(&project, source, notice);
        match notice {
            Notice::Failing(_) => sink.warn(&why),
            Notice::Streaming => sink.resumed(&why),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DB: &str = "its database cannot be reached";

    #[test]
    fn a_reported_failure_is_told_once_after_its_grace_then_the_recovery() {
        let mut w = Watch::default();
        let t0 = Instant::now();
        assert_eq!(w.observe("s", Some((DB, true)), t0), None);
        assert_eq!(
            w.observe("s", Some((DB, true)), t0 + FAILING_GRACE / 2),
            None
        );
        assert_eq!(
            w.observe("s", Some((DB, true)), t0 + FAILING_GRACE),
            Some(Notice::Failing(DB))
        );
        assert_eq!(
            w.observe("s", Some((DB, true)), t0 + FAILING_GRACE * 9),
            None
        );
        assert_eq!(
            w.observe("s", None, t0 + FAILING_GRACE * 10),
            Some(Notice::Streaming)
        );
        assert_eq!(w.observe("s", None, t0 + FAILING_GRACE * 11), None);
    }

    #[test]
    fn a_blip_or_a_takeover_is_not_told() {
        let mut w = Watch::default();
        let t0 = Instant::now();
        assert_eq!(w.observe("s", Some((DB, true)), t0), None);
        assert_eq!(w.observe("s", None, t0 + Duration::from_secs(1)), None);
        // No worker heard streaming, none reporting an error: a takeover, for a while.
        let none = Some(("no cdc-worker is reading it", false));
        let t1 = t0 + Duration::from_secs(2);
        assert_eq!(w.observe("s", none, t1), None);
        assert_eq!(w.observe("s", none, t1 + FAILING_GRACE * 2), None);
        assert_eq!(w.observe("s", None, t1 + FAILING_GRACE * 3), None);
        assert_eq!(w.observe("s", none, t1 + FAILING_GRACE * 4), None);
        assert_eq!(
            w.observe("s", none, t1 + FAILING_GRACE * 4 + NO_LEADER_GRACE),
            Some(Notice::Failing("no cdc-worker is reading it"))
        );
    }

    #[test]
    fn an_error_counts_from_its_first_report_not_from_the_stop() {
        let mut w = Watch::default();
        let t0 = Instant::now();
        let none = Some(("no cdc-worker is reading it", false));
        let slot = Some(("its replication slot cannot be used", true));
        // A takeover: no leader heard for a while, then the new one's passing error
        // (the old session still holds the slot), then it streams: nothing to tell.
        assert_eq!(w.observe("s", none, t0), None);
        let t1 = t0 + Duration::from_secs(8);
        assert_eq!(w.observe("s", none, t1), None);
        assert_eq!(w.observe("s", slot, t1 + Duration::from_secs(1)), None);
        assert_eq!(w.observe("s", slot, t1 + Duration::from_secs(2)), None);
        assert_eq!(w.observe("s", None, t1 + Duration::from_secs(3)), None);
        // The same error lasting past its grace is told, once.
        let t2 = t1 + Duration::from_secs(10);
        assert_eq!(w.observe("s", none, t2), None);
        assert_eq!(w.observe("s", slot, t2 + Duration::from_secs(1)), None);
        assert_eq!(
            w.observe("s", slot, t2 + Duration::from_secs(1) + FAILING_GRACE),
            Some(Notice::Failing("its replication slot cannot be used"))
        );
        // An error that comes and goes starts its grace again.
        let t3 = t2 + Duration::from_secs(20);
        assert_eq!(
            w.observe("s", None, t3),
            Some(Notice::Streaming),
            "streams again"
        );
        assert_eq!(w.observe("s", slot, t3), None);
        assert_eq!(w.observe("s", none, t3 + FAILING_GRACE / 2), None);
        assert_eq!(w.observe("s", slot, t3 + FAILING_GRACE), None);
        assert_eq!(w.observe("s", slot, t3 + FAILING_GRACE * 3 / 2), None);
    }

    #[test]
    fn sources_are_apart_and_forgotten_when_unsubscribed() {
        let mut w = Watch::default();
        let t0 = Instant::now();
        let later = t0 + FAILING_GRACE;
        assert_eq!(w.observe("a", Some((DB, true)), t0), None);
        assert_eq!(w.observe("b", None, t0), None);
        assert_eq!(
            w.observe("a", Some((DB, true)), later),
            Some(Notice::Failing(DB))
        );
        assert_eq!(w.observe("b", None, later), None);
        w.retain(&BTreeSet::from(["b".to_string()]));
        // Subscribed again later: a fresh start, told after its own grace.
        assert_eq!(w.observe("a", Some((DB, true)), later), None);
        assert_eq!(w.observe("a", None, later), None);
    }

    #[test]
    fn the_messages_name_project_source_and_class_only() {
        let m = message("p2", "s2", &Notice::Failing(DB));
        assert!(m.starts_with(
            "the database of project \"p2\" (source \"s2\") is not streaming changes: its database cannot be reached"
        ));
        assert_eq!(
            message("p2", "s2", &Notice::Streaming),
            "the database of project \"p2\" (source \"s2\") streams changes again"
        );
    }
}
