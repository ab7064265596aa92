//! Exponential backoff with a cap, pure: the wait before retry `n` (from 0) is
//! `min(cap, base · 2ⁿ)`.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub cap: Duration,
}

impl Backoff {
    /// The wait before retry `attempt` (0 = the first retry).
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.base.saturating_mul(factor).min(self.cap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(1),
        };
        let waits: Vec<u128> = (0..6).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.delay(u32::MAX), Duration::from_secs(1));
    }

    proptest! {
        #[test]
        fn never_shrinks_and_never_passes_the_cap(base in 1u64..10_000, cap in 1u64..1_000_000, n in 0u32..64) {
            let b = Backoff { base: Duration::from_millis(base), cap: Duration::from_millis(cap) };
            prop_assert!(b.delay(n) <= b.cap);
            prop_assert!(b.delay(n + 1) >= b.delay(n));
        }
    }
}
