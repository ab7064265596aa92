//! The cluster as this front hears it: the last health beacon of every walcast process
//! (see [`walcast_bus::beacon`]) and, per pipeline, a short history of its slot lag and
//! changes per second for the inspector's graphs.
//!
//! Bounded: at most [`MAX_PROCESSES`] processes (the one heard from longest ago is
//! forgotten first) and [`HISTORY`] samples each; a process silent for [`FORGET_AFTER`]
//! is forgotten.
//!
//! What this front hears comes from its bus subscriptions, each read by one task until
//! the front stops (`listen`).

pub(crate) mod listen;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use walcast_bus::beacon::Beacon;
use walcast_bus::Subscription;

use listen::next_message;

/// Processes remembered at most.
pub const MAX_PROCESSES: usize = 256;
/// Samples kept per process (one a second: two minutes).
pub const HISTORY: usize = 120;
/// A process not heard from for this long is forgotten.
pub const FORGET_AFTER: Duration = Duration::from_secs(15);
/// A pipeline counts as streaming only if its last beacon (one a second) is this recent.
pub const FRESH: Duration = Duration::from_secs(5);

/// One point of a pipeline's graphs.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Sample {
    /// The beacon's own clock, Unix milliseconds.
    pub at_ms: u64,
    pub lag_bytes: i64,
    /// Changes read per second since the previous beacon.
    pub changes_per_s: f64,
}

struct Entry {
    last: Beacon,
    heard: Instant,
    history: VecDeque<Sample>,
}

/// What the inspector's health panel shows about one process.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct ProcessView {
    #[serde(flatten)]
    pub beacon: Beacon,
    /// Milliseconds since its last beacon arrived.
    pub heard_ms_ago: u64,
    /// Pipelines only.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<Sample>,
}

#[derive(Default)]
pub struct Cluster {
    entries: HashMap<String, Entry>,
}

impl Cluster {
    /// Take in a beacon heard at `now`.
    pub fn observe(&mut self, b: Beacon, now: Instant) {
        self.forget_silent(now);
        if !self.entries.contains_key(&b.process) && self.entries.len() >= MAX_PROCESSES {
            let oldest = self.entries.iter().min_by_key(|(_, e)| e.heard);
            if let Some(k) = oldest.map(|(k, _)| k.clone()) {
                self.entries.remove(&k);
            }
        }
        let entry = self
            .entries
            .entry(b.process.clone())
            .or_insert_with(|| Entry {
                last: b.clone(),
                heard: now,
                history: VecDeque::new(),
            });
        if let Some(sample) = sample(&entry.last, &b, entry.history.is_empty()) {
            if entry.history.len() >= HISTORY {
                entry.history.pop_front();
            }
            entry.history.push_back(sample);
        }
        entry.last = b;
        entry.heard = now;
    }

    fn forget_silent(&mut self, now: Instant) {
        self.entries
            .retain(|_, e| now.saturating_duration_since(e.heard) < FORGET_AFTER);
    }

    /// `project`'s connected users on the fronts other than `me` heard from within
    /// `fresh` of `now`.
    pub fn front_users(&self, project: &str, me: &str, now: Instant, fresh: Duration) -> u64 {
        self.entries
            .values()
            .filter(|e| e.last.process != me && now.saturating_duration_since(e.heard) < fresh)
            .filter_map(|e| e.last.front.as_ref()?.project_users.get(project).copied())
            .sum()
    }

    /// `project`'s rates on the other fronts, as last announced, added up.
    pub fn front_rates(
        &self,
        project: &str,
        me: &str,
        now: Instant,
        fresh: Duration,
    ) -> walcast_bus::beacon::ProjectRates {
        self.entries
            .values()
            .filter(|e| e.last.process != me && now.saturating_duration_since(e.heard) < fresh)
            .filter_map(|e| e.last.front.as_ref()?.project_rates.get(project).copied())
            .fold(Default::default(), |sum, r| sum.plus(r))
    }

    /// Whether a leader of `source` is streaming changes: a process heard from within
    /// [`FRESH`] says it leads that source's pipeline and its CDC is active.
    pub fn pipeline_active(&self, source: &str, now: Instant) -> bool {
        self.entries.values().any(|e| {
            now.saturating_duration_since(e.heard) < FRESH
                && e.last
                    .source(source)
                    .is_some_and(|w| w.leader && w.cdc_active)
        })
    }

    /// Why `source` is not streaming, as a class its projects' clients may be told
    /// ([`walcast_bus::beacon::not_streaming_reason`], from the error a worker running it
    /// reports), and whether a worker reported an error (else none is heard streaming it
    /// yet); `None` while a leader streams it.
    pub fn not_streaming(&self, source: &str, now: Instant) -> Option<(&'static str, bool)> {
        if self.pipeline_active(source, now) {
            return None;
        }
        let error = self
            .entries
            .values()
            .filter(|e| now.saturating_duration_since(e.heard) < FRESH)
            .find_map(|e| e.last.source(source)?.last_error.as_deref());
        Some((
            walcast_bus::beacon::not_streaming_reason(error),
            error.is_some(),
        ))
    }

    /// Every process heard from recently, pipelines first, then by id.
    pub fn view(&mut self, now: Instant) -> Vec<ProcessView> {
        self.forget_silent(now);
        let mut v: Vec<ProcessView> = self
            .entries
            .values()
            .map(|e| ProcessView {
                beacon: e.last.clone(),
                heard_ms_ago: u64::try_from(now.saturating_duration_since(e.heard).as_millis())
                    .unwrap_or(u64::MAX),
                history: e.history.iter().cloned().collect(),
            })
            .collect();
        v.sort_by(|a, b| {
            (a.beacon.worker.is_none(), &a.beacon.process)
                .cmp(&(b.beacon.worker.is_none(), &b.beacon.process))
        });
        v
    }
}

/// The graph point `next` adds after `prev` (the same process's previous beacon; `first`:
/// there was none, so no rate yet). `None` for a process without a pipeline, or a beacon
/// not newer than the previous one.
fn sample(prev: &Beacon, next: &Beacon, first: bool) -> Option<Sample> {
    let w = next.worker.as_ref()?;
    let changes_per_s = match (first, prev.worker.as_ref()) {
        (false, Some(p)) => {
            if next.at_ms <= prev.at_ms {
                return None;
            }
            let secs = (next.at_ms - prev.at_ms) as f64 / 1000.0;
            w.changes_total.saturating_sub(p.changes_total) as f64 / secs
        }
        _ => 0.0,
    };
    Some(Sample {
        at_ms: next.at_ms,
        lag_bytes: w.lag_bytes,
        changes_per_s,
    })
}

/// The front's [`Cluster`], shared by the beacon listener and the inspector.
#[derive(Default)]
pub(crate) struct Heard {
    cluster: Mutex<Cluster>,
}

impl Heard {
    pub(crate) fn lock(&self) -> MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Take in every beacon on the bus until `cancel`.
pub(crate) async fn listen(heard: Arc<Heard>, mut sub: Subscription, cancel: CancellationToken) {
    while let Some(msg) = next_message(&mut sub, &cancel, "health beacons").await {
        match Beacon::decode(&msg.payload) {
            Some(b) => heard.lock().observe(b, Instant::now()),
            None => crate::telemetry::error("bad_beacon"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_bus::beacon::{FrontBeacon, WorkerBeacon};

    fn worker(process: &str, at_ms: u64, changes_total: u64, lag_bytes: i64) -> Beacon {
        Beacon {
            process: process.into(),
            at_ms,
            bus_connected: true,
            worker: Some(WorkerBeacon {
                leader: true,
                cdc_active: true,
                changes_total,
                lag_bytes,
                ..Default::default()
            }),
            front: None,
            sources: Vec::new(),
        }
    }

    fn front(process: &str) -> Beacon {
        Beacon {
            process: process.into(),
            at_ms: 1,
            bus_connected: true,
            worker: None,
            front: Some(FrontBeacon::default()),
            sources: Vec::new(),
        }
    }

    #[test]
    fn rates_come_from_consecutive_beacons_of_one_pipeline() {
        let mut c = Cluster::default();
        let t0 = Instant::now();
        c.observe(worker("w", 1_000, 100, 5), t0);
        c.observe(front("f"), t0);
        c.observe(worker("w", 2_000, 350, 7), t0 + Duration::from_secs(1));
        c.observe(worker("w", 2_000, 900, 7), t0 + Duration::from_secs(1)); // not newer
        c.observe(worker("w", 2_500, 400, 9), t0 + Duration::from_secs(2));
        let v = c.view(t0 + Duration::from_secs(2));
        assert_eq!(
            v.iter()
                .map(|p| p.beacon.process.as_str())
                .collect::<Vec<_>>(),
            ["w", "f"],
            "pipelines first"
        );
        let rates: Vec<(i64, f64)> = v[0]
            .history
            .iter()
            .map(|s| (s.lag_bytes, s.changes_per_s))
            .collect();
        // 900 at the same instant gave no point; the next rate is from 900, not 350.
        assert_eq!(rates, [(5, 0.0), (7, 250.0), (9, 0.0)]);
        assert!(v[1].history.is_empty(), "a front has no graph");
        assert_eq!(v[1].heard_ms_ago, 2000);
    }

    #[test]
    fn a_pipeline_is_active_while_a_fresh_leader_streams() {
        let mut c = Cluster::default();
        let t0 = Instant::now();
        assert!(!c.pipeline_active("default", t0), "nothing heard");
        c.observe(front("f"), t0);
        let mut standby = worker("standby", 1_000, 0, 0);
        if let Some(w) = standby.worker.as_mut() {
            w.leader = false;
        }
        c.observe(standby, t0);
        assert!(
            !c.pipeline_active("default", t0),
            "a front and a standby do not stream"
        );
        c.observe(worker("w", 1_000, 0, 0), t0);
        assert!(c.pipeline_active("default", t0 + Duration::from_secs(1)));
        assert!(
            !c.pipeline_active("default", t0 + FRESH),
            "its beacon is stale"
        );
    }

    #[test]
    fn each_source_streams_by_its_own_leader() {
        let mut c = Cluster::default();
        let t0 = Instant::now();
        // A standby of the default source that leads source s2.
        let mut b = worker("w", 1_000, 0, 0);
        if let Some(w) = b.worker.as_mut() {
            w.leader = false;
        }
        b.sources.push(WorkerBeacon {
            source: "s2".into(),
            leader: true,
            cdc_active: true,
            ..Default::default()
        });
        c.observe(b, t0);
        assert!(c.pipeline_active("s2", t0));
        assert!(
            !c.pipeline_active("default", t0),
            "not the default's leader"
        );
        assert!(!c.pipeline_active("s3", t0), "nobody runs s3");
    }

    #[test]
    fn silent_processes_are_forgotten_and_both_bounds_hold() {
        let mut c = Cluster::default();
        let t0 = Instant::now();
        for i in 0..(HISTORY as u64 + 10) {
            c.observe(worker("w", 1_000 * (i + 1), i, 0), t0);
        }
        assert_eq!(c.view(t0)[0].history.len(), HISTORY);
        for i in 0..MAX_PROCESSES + 5 {
            c.observe(
                front(&format!("f{i}")),
                t0 + Duration::from_millis(i as u64),
            );
        }
        let v = c.view(t0 + Duration::from_millis(300));
        assert_eq!(v.len(), MAX_PROCESSES);
        assert!(
            !v.iter().any(|p| p.beacon.process == "w"),
            "heard longest ago"
        );
        assert!(c
            .view(t0 + FORGET_AFTER + Duration::from_secs(1))
            .is_empty());
    }
}
