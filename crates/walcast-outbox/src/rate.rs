//! A token bucket, pure (the caller passes the time): at most `burst + rate · t` events
//! in any span of `t` seconds. `walcast outbox replay` paces its publishes with it.

use std::time::{Duration, Instant};

/// Float rounding tolerated when counting a whole token.
const TOKEN_EPSILON: f64 = 1e-9;

#[derive(Clone, Debug)]
pub struct TokenBucket {
    /// Tokens added per second.
    rate: f64,
    /// Most tokens held (a full bucket lets this many go at once).
    burst: f64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    /// `rate` events per second, bursts of at most `burst` (both at least 1). The bucket
    /// starts full.
    pub fn new(rate: f64, burst: f64) -> TokenBucket {
        let rate = if rate.is_finite() { rate.max(1.0) } else { 1.0 };
        let burst = if burst.is_finite() {
            burst.max(1.0)
        } else {
            1.0
        };
        TokenBucket {
            rate,
            burst,
            tokens: burst,
            last: None,
        }
    }

    /// `rate` events per second in bursts of 20 ms worth (at least one event): smooth
    /// enough to read as a rate at once, coarse enough for the timer's resolution.
    pub fn per_second(rate: u32) -> TokenBucket {
        let rate = f64::from(rate.max(1));
        TokenBucket::new(rate, (rate / 50.0).floor())
    }

    fn refill(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let elapsed = now.saturating_duration_since(last).as_secs_f64();
            self.tokens = (self.tokens + elapsed * self.rate).min(self.burst);
        }
        if self.last.is_none_or(|l| now > l) {
            self.last = Some(now);
        }
    }

    /// Take one token at `now`: `Ok` if there was one, else how long until there is.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        // A token less a rounding error is a token: the wait below, rounded up, always
        // suffices even when the refill's float sum lands a hair under 1.
        if self.tokens >= 1.0 - TOKEN_EPSILON {
            self.tokens -= 1.0;
            return Ok(());
        }
        let missing = 1.0 - self.tokens;
        // Round up to the microsecond, so that waiting that long always suffices.
        let micros = (missing / self.rate * 1e6).ceil() as u64;
        Err(Duration::from_micros(micros.max(1)))
    }

    /// Wait (with tokio's clock) until a token is there, and take it.
    pub async fn acquire(&mut self) {
        while let Err(wait) = self.take(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Take as fast as allowed from `t0`: the times of the first `n` tokens.
    fn greedy(b: &mut TokenBucket, t0: Instant, n: usize) -> Vec<Duration> {
        let mut now = t0;
        let mut out = Vec::new();
        while out.len() < n {
            match b.take(now) {
                Ok(()) => out.push(now - t0),
                Err(wait) => now += wait,
            }
        }
        out
    }

    #[test]
    fn a_full_bucket_then_the_rate() {
        let mut b = TokenBucket::new(200.0, 4.0);
        let times = greedy(&mut b, Instant::now(), 100);
        assert!(times[..4].iter().all(|t| t.is_zero()), "{times:?}");
        // 96 more at 200/s: 0.48 s.
        let last = times[99].as_secs_f64();
        assert!((0.479..0.482).contains(&last), "{last}");
    }

    #[test]
    fn per_second_bursts_twenty_milliseconds_worth() {
        assert_eq!(TokenBucket::per_second(200).burst, 4.0);
        assert_eq!(TokenBucket::per_second(10).burst, 1.0);
        assert_eq!(TokenBucket::per_second(0).rate, 1.0);
        assert_eq!(TokenBucket::per_second(100_000).burst, 2000.0);
    }

    #[test]
    fn an_idle_bucket_fills_up_to_the_burst_only() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 3.0);
        greedy(&mut b, t0, 3);
        let later = t0 + Duration::from_secs(60);
        let taken = (0..10).filter(|_| b.take(later).is_ok()).count();
        assert_eq!(taken, 3);
    }

    #[test]
    fn time_going_backwards_adds_nothing() {
        let t0 = Instant::now() + Duration::from_secs(1);
        let mut b = TokenBucket::new(1.0, 1.0);
        assert!(b.take(t0).is_ok());
        assert!(b.take(t0 - Duration::from_millis(500)).is_err());
        assert!(b.take(t0).is_err());
        assert!(b.take(t0 + Duration::from_secs(1)).is_ok());
    }

    proptest! {
        /// Whatever the schedule of attempts, no span of `t` seconds holds more than
        /// `burst + rate · t` taken tokens; and waiting as told always gets one.
        #[test]
        fn never_more_than_burst_plus_rate(
            rate in 1u32..5_000,
            burst in 1u32..100,
            gaps in proptest::collection::vec(0u64..20_000, 1..300),
        ) {
            let t0 = Instant::now();
            let mut b = TokenBucket::new(f64::from(rate), f64::from(burst));
            let mut now = t0;
            let mut taken = Vec::new();
            for gap in gaps {
                now += Duration::from_micros(gap);
                match b.take(now) {
                    Ok(()) => taken.push(now),
                    Err(wait) => {
                        prop_assert!(b.take(now + wait).is_ok(), "waiting {wait:?} did not suffice");
                        now += wait;
                        taken.push(now);
                    }
                }
            }
            for (i, start) in taken.iter().enumerate() {
                for (j, end) in taken.iter().enumerate().skip(i) {
                    let span = (*end - *start).as_secs_f64();
                    let allowed = f64::from(burst) + f64::from(rate) * span + 1e-6;
                    prop_assert!((j - i + 1) as f64 <= allowed,
                        "{} tokens in {span} s (rate {rate}, burst {burst})", j - i + 1);
                }
            }
        }
    }
}
