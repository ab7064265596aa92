//! Front configuration: every limit and timeout, each with a sensible default.

use std::time::Duration;

/// Configuration of a [`crate::Front`]. A plain struct: build it with `..Default::default()`.
#[derive(Clone, Debug)]
pub struct FrontConfig {
    /// This front's instance id (prefix of its subscription ids and its `Walcast-Origin`).
    /// `None` = `front-<random hex>`. Must be unique across replicas.
    pub front_id: Option<String>,
    /// How long a join waits for the cdc-worker to confirm its subscriptions.
    pub register_timeout: Duration,
    /// Frames queued per connection before it is closed as a slow consumer.
    pub outbound_queue: usize,
    /// Largest accepted client frame (text or binary), in bytes.
    pub max_frame_bytes: usize,
    /// Channels one socket may have joined at once.
    pub max_channels_per_socket: usize,
    /// `postgres_changes` bindings per channel.
    pub max_bindings_per_channel: usize,
    /// WebSocket connections this front accepts at once.
    pub max_connections: usize,
    /// Joins one socket may send in a burst …
    pub join_burst: u32,
    /// … and per second after that (token bucket).
    pub joins_per_second: u32,
    /// A socket that sends nothing for this long is closed (clients heartbeat every 25 s).
    pub idle_timeout: Duration,
    /// Upper bound of the per-channel token re-check timer (`min(this, exp - now)`).
    pub token_check_interval: Duration,
    /// Entries kept per SSE channel for `Last-Event-ID` resumption (`HISTORY_SIZE`).
    pub history_size: usize,
    /// How long an SSE channel (its subscription and history) survives its last reader,
    /// so a reconnecting client can resume without a gap.
    pub sse_linger: Duration,
    /// Interval of SSE keep-alive comments.
    pub sse_keepalive: Duration,
    /// Subscriptions per `register` request when re-registering everything (resync).
    pub resync_batch: usize,
    /// On shutdown, the window over which the sockets are closed (see
    /// [`crate::Front::drain`]).
    pub drain_window: Duration,
}

/// Default of [`FrontConfig::drain_window`], in seconds.
pub const DEFAULT_DRAIN_SECS: u64 = 10;

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            front_id: None,
            register_timeout: Duration::from_secs(5),
            outbound_queue: 1024,
            max_frame_bytes: 1024 * 1024,
            max_channels_per_socket: 100,
            max_bindings_per_channel: 100,
            max_connections: 100_000,
            join_burst: 200,
            joins_per_second: 100,
            idle_timeout: Duration::from_secs(60),
            token_check_interval: Duration::from_secs(5 * 60),
            history_size: 1000,
            sse_linger: Duration::from_secs(60),
            sse_keepalive: Duration::from_secs(15),
            resync_batch: 500,
            drain_window: Duration::from_secs(DEFAULT_DRAIN_SECS),
        }
    }
}
