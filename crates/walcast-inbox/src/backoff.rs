//! Exponential backoff with a cap.

use std::time::Duration;

/// `base · 2^(attempt-1)`, at most `cap`: the delay before the next try after the
/// `attempt`-th failed one (1 for the first). Attempts below 1 count as 1.
pub(crate) fn delay(base: Duration, cap: Duration, attempt: i64) -> Duration {
    let retry = (attempt.clamp(1, 64) - 1) as u32;
    walcast_core::Backoff { base, cap }.delay(retry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_base_up_to_the_cap() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(300));
        let delays: Vec<u64> = (0..=12).map(|n| delay(base, cap, n).as_secs()).collect();
        assert_eq!(delays, [1, 1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300]);
        assert_eq!(delay(base, cap, i64::MAX), cap);
        assert_eq!(
            delay(Duration::from_millis(50), cap, 3),
            Duration::from_millis(200)
        );
    }
}
