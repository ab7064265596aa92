//! Exponential backoff with a cap and jitter (see [`walcast_core::Backoff`]).

use std::time::Duration;

/// The delay before the next try after the `attempt`-th failed one (1 for the first;
/// attempts below 1 count as 1): between half of `base · 2^(attempt-1)` (at most `cap`)
/// and all of it.
pub(crate) fn delay(base: Duration, cap: Duration, attempt: i64) -> Duration {
    walcast_core::Backoff { base, cap }.delay(retry(attempt))
}

/// The schedule's retry number of the `attempt`-th failed try.
fn retry(attempt: i64) -> u32 {
    (attempt.clamp(1, 64) - 1) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_base_up_to_the_cap() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(300));
        let b = walcast_core::Backoff { base, cap };
        let ceilings: Vec<u64> = (0..=12).map(|n| b.ceiling(retry(n)).as_secs()).collect();
        assert_eq!(
            ceilings,
            [1, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]
        );
        let last = delay(base, cap, i64::MAX);
        assert!(last >= cap / 2 && last <= cap, "{last:?}");
        let third = delay(Duration::from_millis(50), cap, 3);
        assert!(third >= Duration::from_millis(100) && third <= Duration::from_millis(200));
    }
}
