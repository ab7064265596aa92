//! Rate limits: a token bucket (joins and presence events per socket), and new SSE
//! streams per project. (The connection-count limit is the `connection::open` module's.)

use tokio::time::Instant;

use crate::telemetry;

/// A token bucket: `burst` tokens, refilled at `per_second`.
pub(crate) struct TokenBucket {
    capacity: f64,
    rate: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub(crate) fn new(burst: u32, per_second: u32) -> TokenBucket {
        TokenBucket {
            capacity: f64::from(burst.max(1)),
            rate: f64::from(per_second),
            tokens: f64::from(burst.max(1)),
            last: Instant::now(),
        }
    }

    pub(crate) fn take(&mut self) -> bool {
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + dt * self.rate).min(self.capacity);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// New streams per project per second (SSE: each request is a subscription, as a join is
/// on a socket), one bucket per project seen, so no project can spend another's.
pub(crate) struct OpenRate {
    burst: u32,
    per_second: u32,
    buckets: std::sync::Mutex<std::collections::HashMap<String, TokenBucket>>,
}

impl OpenRate {
    pub(crate) fn new(burst: u32, per_second: u32) -> OpenRate {
        OpenRate {
            burst,
            per_second,
            buckets: Default::default(),
        }
    }

    /// May `project` open one more now? (Projects are those of verified keys: bounded.)
    pub(crate) fn take(&self, project: &str) -> bool {
        let mut g = self.buckets.lock().unwrap_or_else(|e| e.into_inner());
        let (burst, rate) = (self.burst, self.per_second);
        let ok = g
            .entry(project.to_string())
            .or_insert_with(|| TokenBucket::new(burst, rate))
            .take();
        if !ok {
            telemetry::limit("sse_opens");
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_limits_bursts() {
        let mut b = TokenBucket::new(3, 0);
        assert!(b.take() && b.take() && b.take());
        assert!(!b.take());
    }
}
