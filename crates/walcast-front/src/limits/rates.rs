//! Per-second rates of a project on this front, by a sliding window: the count of the
//! current one-second window plus the previous window's count weighted by how much of it
//! still lies within the last second. Pure: the caller gives the time (milliseconds on
//! any monotonic clock).
//!
//! Four rates are kept per project ([`Rate`]): channel joins, broadcast and presence
//! messages (received and sent), their bytes, and presence events (track, untrack).

use walcast_bus::beacon::ProjectRates;

/// What a project's rate counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    /// Channel joins.
    Joins,
    /// Broadcast and presence messages, received from and sent to its clients.
    Events,
    /// Bytes of those messages.
    Bytes,
    /// Presence track and untrack events.
    Presence,
}

impl Rate {
    const ALL: [Rate; 4] = [Rate::Joins, Rate::Events, Rate::Bytes, Rate::Presence];

    fn index(self) -> usize {
        self as usize
    }

    /// This rate's field of a beacon's [`ProjectRates`].
    pub fn of(self, r: &ProjectRates) -> u64 {
        match self {
            Rate::Joins => r.joins,
            Rate::Events => r.events,
            Rate::Bytes => r.bytes,
            Rate::Presence => r.presence,
        }
    }
}

/// One rate's two windows.
#[derive(Debug, Default, Clone, Copy)]
struct Window {
    /// Start of the current window (a multiple of 1000 ms).
    start: u64,
    current: u64,
    previous: u64,
}

impl Window {
    fn roll(&mut self, now_ms: u64) {
        let start = now_ms - now_ms % 1000;
        if start == self.start {
            return;
        }
        self.previous = if start == self.start + 1000 {
            self.current
        } else {
            0
        };
        self.current = 0;
        self.start = start;
    }

    fn rate(&mut self, now_ms: u64) -> u64 {
        self.roll(now_ms);
        let left = 1000 - (now_ms - self.start);
        self.current + self.previous * left / 1000
    }

    fn add(&mut self, now_ms: u64, n: u64) {
        self.roll(now_ms);
        self.current = self.current.saturating_add(n);
    }
}

/// A project's four rates on this front.
#[derive(Debug, Default)]
pub struct Rates {
    windows: [Window; 4],
}

impl Rates {
    /// The rate over the last second.
    pub fn rate(&mut self, rate: Rate, now_ms: u64) -> u64 {
        self.windows[rate.index()].rate(now_ms)
    }

    /// Count `n` more.
    pub fn add(&mut self, rate: Rate, now_ms: u64, n: u64) {
        self.windows[rate.index()].add(now_ms, n);
    }

    /// Every rate over the last second (a beacon announces them to the other fronts).
    pub fn all(&mut self, now_ms: u64) -> ProjectRates {
        let [joins, events, bytes, presence] = Rate::ALL.map(|r| self.rate(r, now_ms));
        ProjectRates {
            joins,
            events,
            bytes,
            presence,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_previous_second_fades_out() {
        let mut r = Rates::default();
        r.add(Rate::Events, 10_000, 100);
        assert_eq!(r.rate(Rate::Events, 10_999), 100);
        // A quarter into the next second, three quarters of the last one still count.
        assert_eq!(r.rate(Rate::Events, 11_250), 75);
        r.add(Rate::Events, 11_250, 10);
        assert_eq!(r.rate(Rate::Events, 11_500), 60);
        // Two seconds on, only the newer window is left (faded by half).
        assert_eq!(r.rate(Rate::Events, 12_500), 5);
        assert_eq!(r.rate(Rate::Events, 15_000), 0, "a gap forgets everything");
        assert_eq!(r.rate(Rate::Joins, 15_000), 0, "each rate is its own");
    }

    #[test]
    fn all_reports_every_rate() {
        let mut r = Rates::default();
        r.add(Rate::Joins, 0, 1);
        r.add(Rate::Events, 0, 2);
        r.add(Rate::Bytes, 0, 3);
        r.add(Rate::Presence, 0, 4);
        let all = r.all(500);
        assert_eq!(
            (all.joins, all.events, all.bytes, all.presence),
            (1, 2, 3, 4)
        );
        assert_eq!(Rate::Bytes.of(&all), 3);
    }

    #[test]
    fn a_steady_rate_reads_as_itself() {
        let mut r = Rates::default();
        // 50 per second, one every 20 ms, for five seconds.
        for t in (0..5000).step_by(20) {
            r.add(Rate::Events, t, 1);
        }
        let seen = r.rate(Rate::Events, 5000);
        assert!((45..=55).contains(&seen), "{seen}");
    }
}
