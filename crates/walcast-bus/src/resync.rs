//! How a new leader learns every front's subscriptions before it reads the slot.
//!
//! A worker that starts leading publishes a resync request; each front answers at once
//! ("started"), registers all its subscriptions again (each from its own position) and
//! answers "done". The leader reads the slot only when it may assume every live front is
//! done, because a change it decodes before a front re-registered is matched without that
//! front's subscriptions — and the front, which drops replays by position, never gets it.
//!
//! Waiting only a fixed grace for answers is not enough: a front that is slow to answer
//! (a loaded machine, a long pause) would be missed. So every worker, leader or standby,
//! keeps [`KnownFronts`]: the fronts it heard from recently, through their periodic sync
//! lists and through a roll call it makes when it starts (a front answers at once with its
//! id). The leader then waits for every front it knows to be alive, not only for those
//! that answered within the grace ([`ResyncWait`]).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::{Bus, BusError};

pub const SUBJECT_RESYNC: &str = "walcast.cdc.subs.resync";
/// A front's full subscription list (a `SyncMessage` of the registry protocol); every
/// worker hears them, which is how it knows which fronts are alive.
pub const SUBJECT_SYNC: &str = "walcast.cdc.subs.sync";
/// How often a front sends its full subscription list.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(5);
/// A worker asks which fronts exist; the payload is where fronts answer ([`FrontHello`]).
pub const SUBJECT_ROLL_CALL: &str = "walcast.cdc.subs.roll-call";

/// How long a new leader waits for fronts it does not know of to answer its request.
pub const RESYNC_GRACE: Duration = Duration::from_millis(500);
/// How long it waits for a front it knows to be alive to answer at all.
pub const RESYNC_KNOWN_WAIT: Duration = Duration::from_secs(10);
/// How long it waits at most for fronts that answered to finish registering.
pub const RESYNC_MAX_WAIT: Duration = Duration::from_secs(30);
/// A front heard from within this is expected to answer a resync request: two sync
/// intervals and a margin (a live front syncs every [`SYNC_INTERVAL`]).
pub const FRONT_ALIVE: Duration = Duration::from_secs(2 * SYNC_INTERVAL.as_secs() + 1);

/// A front's answer to a resync request.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ResyncProgress {
    pub front: String,
    /// `false`: started registering; `true`: everything registered again.
    pub done: bool,
}

/// A front's answer to a roll call.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FrontHello {
    pub front: String,
}

/// What a resync request gathered.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ResyncSummary {
    /// Fronts that answered.
    pub fronts: usize,
    /// Fronts still registering when the wait ended.
    pub unfinished: usize,
    /// Fronts known to be alive that never answered.
    pub silent: Vec<String>,
}

/// The fronts a worker heard from, and when.
#[derive(Clone, Default)]
pub struct KnownFronts {
    seen: Arc<Mutex<HashMap<String, Instant>>>,
}

impl KnownFronts {
    pub fn saw(&self, front: &str) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.insert(front.to_string(), Instant::now());
    }

    /// Fronts heard from within `within`.
    pub fn alive(&self, within: Duration) -> HashSet<String> {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.retain(|_, at| at.elapsed() < FRONT_ALIVE.max(within));
        seen.iter()
            .filter(|(_, at)| at.elapsed() < within)
            .map(|(f, _)| f.clone())
            .collect()
    }

    /// Listen to the fronts' sync lists and make a roll call, until `shutdown`.
    /// In process (no NATS) there is nothing to learn: the front is this process.
    pub async fn listen(
        &self,
        bus: &Bus,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), BusError> {
        let Bus::Nats(nats) = bus else {
            return Ok(());
        };
        let client = nats.client();
        let subscribe =
            |s: String| async move { client.subscribe(s).await.map_err(BusError::Subscribe) };
        let mut syncs = subscribe(SUBJECT_SYNC.to_string()).await?;
        let inbox = client.new_inbox();
        let mut hellos = subscribe(inbox.clone()).await?;
        client
            .publish(SUBJECT_ROLL_CALL, Bytes::from(inbox))
            .await
            .map_err(BusError::Publish)?;
        tokio::pin!(shutdown);
        loop {
            let payload = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                Some(m) = syncs.next() => m.payload,
                Some(m) = hellos.next() => m.payload,
                else => return Err(BusError::Closed("front subscriptions")),
            };
            // A sync list and a hello both name their front; the ids are skipped unread.
            match serde_json::from_slice::<FrontHello>(&payload) {
                Ok(h) => self.saw(&h.front),
                Err(e) => tracing::debug!(error = %e, "a front message without its name"),
            }
        }
    }
}

/// When a new leader may stop waiting for fronts (pure: the caller brings the clock).
#[derive(Debug)]
pub struct ResyncWait {
    started: Instant,
    grace: Duration,
    known_wait: Duration,
    max: Duration,
    expected: HashSet<String>,
    answered: HashMap<String, bool>,
}

impl ResyncWait {
    pub fn new(started: Instant, expected: HashSet<String>) -> ResyncWait {
        ResyncWait {
            started,
            grace: RESYNC_GRACE,
            known_wait: RESYNC_KNOWN_WAIT,
            max: RESYNC_MAX_WAIT,
            expected,
            answered: HashMap::new(),
        }
    }

    pub fn with_limits(mut self, grace: Duration, known_wait: Duration, max: Duration) -> Self {
        (self.grace, self.known_wait, self.max) = (grace, known_wait, max);
        self
    }

    pub fn answer(&mut self, p: ResyncProgress) {
        *self.answered.entry(p.front).or_insert(false) |= p.done;
    }

    /// Until when to wait for the next answer; `None`: stop waiting. Fronts that started
    /// are waited for up to `max`; known fronts that have not answered up to `known_wait`;
    /// anyone else up to `grace`.
    pub fn deadline(&self, now: Instant) -> Option<Instant> {
        let until = |d: Duration| Some(self.started + d).filter(|t| *t > now);
        if self.answered.values().any(|done| !done) {
            return until(self.max);
        }
        let silent = self.expected.iter().any(|f| !self.answered.contains_key(f));
        if silent {
            if let Some(t) = until(self.known_wait) {
                return Some(t);
            }
        }
        until(self.grace)
    }

    pub fn summary(&self) -> ResyncSummary {
        let mut silent: Vec<String> = self
            .expected
            .iter()
            .filter(|f| !self.answered.contains_key(*f))
            .cloned()
            .collect();
        silent.sort();
        ResyncSummary {
            fronts: self.answered.len(),
            unfinished: self.answered.values().filter(|done| !**done).count(),
            silent,
        }
    }
}

/// Publish a resync request whose answers come to `progress`, and wait as [`ResyncWait`]
/// says.
pub(crate) async fn request_resync(
    client: &async_nats::Client,
    subject: String,
    reply: String,
    mut progress: async_nats::Subscriber,
    mut wait: ResyncWait,
) -> ResyncSummary {
    if let Err(e) = client.publish(subject, Bytes::from(reply)).await {
        tracing::warn!(error = %e, "cannot ask fronts to register again");
        return ResyncSummary::default();
    }
    while let Some(deadline) = wait.deadline(Instant::now()) {
        match tokio::time::timeout_at(deadline, progress.next()).await {
            Ok(Some(msg)) => match serde_json::from_slice::<ResyncProgress>(&msg.payload) {
                Ok(p) => wait.answer(p),
                Err(e) => tracing::warn!(error = %e, "malformed resync progress"),
            },
            Ok(None) => break,
            Err(_) => {} // a deadline passed: the next one may be later (or none)
        }
    }
    let summary = wait.summary();
    if summary.unfinished > 0 || !summary.silent.is_empty() {
        tracing::warn!(
            ?summary,
            "fronts still registering or silent after the resync wait; reading anyway (their subscribers may miss the changes decoded before they register)"
        );
    } else {
        tracing::info!(
            fronts = summary.fronts,
            "fronts registered their subscriptions again"
        );
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(front: &str, done: bool) -> ResyncProgress {
        ResyncProgress {
            front: front.into(),
            done,
        }
    }

    fn wait(expected: &[&str]) -> (Instant, ResyncWait) {
        let t0 = Instant::now();
        let w = ResyncWait::new(t0, expected.iter().map(|s| s.to_string()).collect()).with_limits(
            Duration::from_millis(500),
            Duration::from_secs(10),
            Duration::from_secs(30),
        );
        (t0, w)
    }

    #[test]
    fn nobody_known_waits_the_grace_only() {
        let (t0, w) = wait(&[]);
        assert_eq!(w.deadline(t0), Some(t0 + Duration::from_millis(500)));
        assert_eq!(w.deadline(t0 + Duration::from_millis(500)), None);
    }

    #[test]
    fn a_started_front_is_waited_for_until_done_or_max() {
        let (t0, mut w) = wait(&[]);
        w.answer(progress("f1", false));
        let late = t0 + Duration::from_secs(5);
        assert_eq!(w.deadline(late), Some(t0 + Duration::from_secs(30)));
        assert_eq!(w.deadline(t0 + Duration::from_secs(30)), None);
        w.answer(progress("f1", true));
        assert_eq!(w.deadline(late), None, "done, and past the grace");
        // A late "started" after "done" does not reopen it.
        w.answer(progress("f1", false));
        assert_eq!(w.deadline(late), None);
    }

    #[test]
    fn a_known_front_slow_to_answer_is_waited_for_past_the_grace() {
        let (t0, mut w) = wait(&["f1", "f2"]);
        w.answer(progress("f1", true));
        let after_grace = t0 + Duration::from_secs(2);
        assert_eq!(w.deadline(after_grace), Some(t0 + Duration::from_secs(10)));
        w.answer(progress("f2", false));
        assert_eq!(w.deadline(after_grace), Some(t0 + Duration::from_secs(30)));
        w.answer(progress("f2", true));
        assert_eq!(w.deadline(after_grace), None);
        assert_eq!(w.summary().silent, Vec::<String>::new());
    }

    #[test]
    fn a_known_front_that_never_answers_costs_the_known_wait_and_is_named() {
        let (t0, mut w) = wait(&["dead"]);
        w.answer(progress("f1", true));
        assert_eq!(w.deadline(t0 + Duration::from_secs(10)), None);
        let s = w.summary();
        assert_eq!((s.fronts, s.unfinished), (1, 0));
        assert_eq!(s.silent, vec!["dead".to_string()]);
    }

    #[test]
    fn known_fronts_are_those_heard_within() {
        let k = KnownFronts::default();
        k.saw("f1");
        k.saw("f2");
        assert_eq!(k.alive(Duration::from_secs(60)).len(), 2);
        assert!(k.alive(Duration::ZERO).is_empty());
    }

    #[test]
    fn a_sync_list_reads_as_a_hello() {
        let sync = r#"{"front":"front-1","ids":["front-1:1","front-1:2"],"round":7,"last":true}"#;
        let h: FrontHello = serde_json::from_str(sync).unwrap();
        assert_eq!(h.front, "front-1");
    }
}
