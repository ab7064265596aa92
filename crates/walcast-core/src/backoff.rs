//! Exponential backoff with a cap and jitter: the schedule's wait before retry `n` (from
//! 0) is `min(cap, base · 2ⁿ)` ([`Backoff::ceiling`], pure); the wait taken is a random
//! point in its upper half ([`Backoff::delay`]), so that the many tasks one outage fails
//! together (a NATS restart, a Postgres failover) do not all retry in the same instant.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// The schedule's wait before retry `attempt` (0 = the first retry), without jitter.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }

    /// The wait before retry `attempt`: between half of [`Backoff::ceiling`] and all of it,
    /// at random ("equal jitter": never less than half the schedule, never more).
    pub fn delay(&self, attempt: u32) -> Duration {
        jittered(self.ceiling(attempt), rand::random::<f64>())
    }
}

/// `ceiling` moved into its upper half by `unit` (in `[0, 1)`).
fn jittered(ceiling: Duration, unit: f64) -> Duration {
    let half = ceiling / 2;
    half + half.mul_f64(unit.clamp(0.0, 1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_schedule_doubles_up_to_the_cap() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        let waits: Vec<u128> = (0..6).map(|n| b.ceiling(n).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn waits_are_spread_over_the_upper_half() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(10),
        };
        let waits: std::collections::BTreeSet<Duration> = (0..50).map(|_| b.delay(3)).collect();
        assert!(waits.len() > 10, "jittered: {waits:?}");
        assert!(waits.iter().all(|w| *w >= Duration::from_millis(400)));
        assert!(waits.iter().all(|w| *w <= Duration::from_millis(800)));
    }

    proptest! {
        #[test]
        fn the_schedule_never_shrinks_and_never_passes_the_cap(base in 1u64..10_000, cap in 1u64..1_000_000, n in 0u32..64) {
            let b = Backoff { base: Duration::from_millis(base), cap: Duration::from_millis(cap) };
            prop_assert!(b.ceiling(n) <= b.cap);
            prop_assert!(b.ceiling(n + 1) >= b.ceiling(n));
        }

        #[test]
        fn a_wait_is_within_half_and_all_of_the_schedule(ms in 0u64..100_000_000, unit in 0.0f64..1.0) {
            let ceiling = Duration::from_millis(ms);
            let w = jittered(ceiling, unit);
            prop_assert!(w <= ceiling);
            prop_assert!(w >= ceiling / 2);
        }
    }
}
