//! Metric names (all through the `metrics` crate facade).

/// Gauge: open WebSocket connections.
pub const CONNECTIONS: &str = "walcast_front_connections";
/// Gauge: joined channels (WebSocket).
pub const CHANNELS: &str = "walcast_front_channels";
/// Gauge: open SSE streams.
pub const SSE_STREAMS: &str = "walcast_front_sse_streams";
/// Counter: joins, label `result` (`ok`, `error`).
pub const JOINS: &str = "walcast_front_joins_total";
/// Counter: frames received from clients.
pub const FRAMES_IN: &str = "walcast_front_frames_in_total";
/// Counter: frames written to clients.
pub const FRAMES_OUT: &str = "walcast_front_frames_out_total";
/// Counter: errors, label `kind`.
pub const ERRORS: &str = "walcast_front_errors_total";
/// Counter: limit rejections, label `limit`.
pub const LIMITS: &str = "walcast_front_limit_rejections_total";
/// Counter: `postgres_changes` messages queued to a channel or SSE stream.
pub const DELIVERIES: &str = "walcast_front_deliveries_total";
/// Counter: connections closed because their outbound queue was full.
pub const SLOW_CONSUMERS: &str = "walcast_front_slow_consumer_disconnects_total";
/// Counter: broadcasts received, label `source` (`socket`, `rest`, `bus`).
pub const BROADCASTS: &str = "walcast_front_broadcasts_total";

/// Counter: change messages dropped because this front already delivered them (a
/// replay after a leader change or a worker restart).
pub const REPLAYS_DROPPED: &str = "walcast_front_replays_dropped_total";

/// Counter: messages dropped because they came from a leader term older than one this
/// front already received (a leader that woke up after losing its lease).
pub const STALE_TERM_DROPPED: &str = "walcast_front_stale_term_dropped_total";

/// Counter: subscriptions registered, by `path`: `worker` (the join waited for the
/// worker's answer) or `ready_class` (joined at once: its class was already delivered by
/// class to this front; registered with the worker in the background).
pub const REGISTRATIONS: &str = "walcast_front_registrations_total";

pub(crate) fn error(kind: &'static str) {
    metrics::counter!(ERRORS, "kind" => kind).increment(1);
}

pub(crate) fn limit(limit: &'static str) {
    metrics::counter!(LIMITS, "limit" => limit).increment(1);
}
