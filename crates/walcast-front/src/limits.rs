//! Per-socket rate limits and the connection-count limit (WebSocket connections and SSE
//! streams share `max_connections`).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use tokio::time::Instant;

use crate::state::Shared;
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

/// One of the `max_connections` slots, released on drop.
pub(crate) struct ConnSlot {
    shared: Arc<Shared>,
}

impl ConnSlot {
    pub(crate) fn acquire(shared: &Arc<Shared>) -> Option<ConnSlot> {
        let prev = shared.connections.fetch_add(1, Ordering::AcqRel);
        if prev + shared.sse_streams.load(Ordering::Acquire) >= shared.cfg.max_connections {
            shared.connections.fetch_sub(1, Ordering::AcqRel);
            telemetry::limit("connections");
            return None;
        }
        metrics::gauge!(telemetry::CONNECTIONS).increment(1.0);
        Some(ConnSlot {
            shared: shared.clone(),
        })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        self.shared.connections.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(telemetry::CONNECTIONS).decrement(1.0);
    }
}

/// One of the `max_connections` slots taken by an SSE stream (counted in `sse_streams`),
/// released on drop. Taken before the stream subscribes, so requests in flight count too.
pub(crate) struct SseSlot {
    shared: Arc<Shared>,
}

impl SseSlot {
    pub(crate) fn acquire(shared: &Arc<Shared>) -> Option<SseSlot> {
        let prev = shared.sse_streams.fetch_add(1, Ordering::AcqRel);
        if prev + shared.connections.load(Ordering::Acquire) >= shared.cfg.max_connections {
            shared.sse_streams.fetch_sub(1, Ordering::AcqRel);
            telemetry::limit("connections");
            return None;
        }
        metrics::gauge!(telemetry::SSE_STREAMS).increment(1.0);
        Some(SseSlot {
            shared: shared.clone(),
        })
    }
}

impl Drop for SseSlot {
    fn drop(&mut self) {
        self.shared.sse_streams.fetch_sub(1, Ordering::AcqRel);
        metrics::gauge!(telemetry::SSE_STREAMS).decrement(1.0);
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
