//! How the sources are spread over the cdc-workers: each takes at most its fair share
//! (sources / live workers, rounded up) and gives sources up when more workers appear.
//!
//! Pure rules ([`fair_share`], [`may_take`], [`to_give_up`]) and the live-worker count
//! ([`Workers`]), which comes from the health beacons every walcast process publishes
//! once a second (see [`walcast_bus::beacon`]): a worker that dies or freezes stops
//! beaconing and no longer counts, so the others' shares grow and they take its sources
//! once its leases expire.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use walcast_bus::beacon::{Beacon, BEACON_ALL};
use walcast_bus::Bus;

/// A worker heard from within this is alive (three beacons).
pub const WORKER_ALIVE: Duration = Duration::from_secs(3);

/// How long a worker waits after its start before it takes more than one source (so
/// it has heard the others' beacons), and how stable the count must be before it gives
/// one up.
pub const SETTLE: Duration = Duration::from_millis(2500);

/// The most sources one of `live` workers should lead: `ceil(sources / live)`, at least 1.
pub fn fair_share(sources: usize, live: usize) -> usize {
    sources.div_ceil(live.max(1)).max(1)
}

/// Whether a worker that leads `held` sources may try to take one more.
pub fn may_take(held: usize, share: usize) -> bool {
    held < share
}

/// The source to give up, if a worker leads more than its share: the one it took last
/// (the default source only if it leads nothing else). `held`: name and when taken.
pub fn to_give_up(held: &[(String, Instant)], share: usize) -> Option<String> {
    if held.len() <= share {
        return None;
    }
    held.iter()
        .max_by_key(|(name, at)| (!walcast_bus::source::is_default(name), *at))
        .map(|(name, _)| name.clone())
}

/// The cdc-workers heard from (their beacons), this one included.
pub struct Workers {
    me: String,
    heard: Mutex<HashMap<String, Instant>>,
    started: Instant,
}

impl Workers {
    pub fn new(me: String) -> Workers {
        Workers {
            me,
            heard: Mutex::new(HashMap::new()),
            started: Instant::now(),
        }
    }

    /// A beacon of `process`, a worker, at `now`.
    pub fn saw(&self, process: &str, now: Instant) {
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        heard.insert(process.to_string(), now);
        heard.retain(|_, at| now.saturating_duration_since(*at) < 10 * WORKER_ALIVE);
    }

    /// Workers heard within [`WORKER_ALIVE`] of `now`, this one always.
    pub fn live(&self, now: Instant) -> usize {
        let heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        let others = heard
            .iter()
            .filter(|(p, at)| **p != self.me && now.saturating_duration_since(**at) < WORKER_ALIVE)
            .count();
        others + 1
    }

    /// Whether this worker has been up long enough to have heard the others.
    pub fn settled(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.started) >= SETTLE
    }

    /// Follow the beacons until `shutdown` (in process, no NATS: this worker alone).
    pub async fn listen(&self, bus: &Bus, shutdown: impl std::future::Future<Output = ()>) {
        let mut sub = match bus.subscribe(BEACON_ALL).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot follow the workers' beacons: this worker counts itself alone when sharing sources");
                return;
            }
        };
        tokio::pin!(shutdown);
        loop {
            let m = tokio::select! {
                _ = &mut shutdown => return,
                m = sub.next() => match m { Some(m) => m, None => return },
            };
            if let Some(b) = Beacon::decode(&m.payload) {
                if b.worker.is_some() || !b.sources.is_empty() {
                    self.saw(&b.process, Instant::now());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_round_up() {
        assert_eq!(fair_share(3, 2), 2);
        assert_eq!(fair_share(3, 3), 1);
        assert_eq!(fair_share(20, 3), 7);
        assert_eq!(fair_share(1, 5), 1);
        assert_eq!(fair_share(0, 0), 1);
        assert_eq!(fair_share(4, 0), 4, "no worker heard: this one alone");
    }

    #[test]
    fn a_worker_takes_up_to_its_share() {
        assert!(may_take(0, 1));
        assert!(may_take(1, 2));
        assert!(!may_take(2, 2));
    }

    #[test]
    fn the_last_taken_is_given_up_the_default_last() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let held = vec![
            ("default".to_string(), t0 + 5 * s),
            ("a".to_string(), t0),
            ("b".to_string(), t0 + s),
        ];
        assert_eq!(to_give_up(&held, 3), None);
        assert_eq!(to_give_up(&held, 2).as_deref(), Some("b"));
        let only_default = vec![("default".to_string(), t0)];
        assert_eq!(to_give_up(&only_default, 0).as_deref(), Some("default"));
    }

    #[test]
    fn live_workers_are_those_heard_lately_and_this_one() {
        let w = Workers::new("me".into());
        let t0 = Instant::now();
        assert_eq!(w.live(t0), 1);
        w.saw("me", t0);
        w.saw("b", t0);
        w.saw("c", t0);
        assert_eq!(w.live(t0 + Duration::from_secs(1)), 3);
        w.saw("b", t0 + Duration::from_secs(2));
        assert_eq!(w.live(t0 + Duration::from_secs(4)), 2, "c went silent");
    }
}
