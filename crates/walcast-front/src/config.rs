//! Front configuration: every limit and timeout, each with a sensible default.

use std::time::Duration;

/// Configuration of a [`crate::Front`]. A plain struct: build it with `..Default::default()`.
#[derive(Clone, Debug)]
pub struct FrontConfig {
    /// This front's instance id (prefix of its subscription ids and its `Walcast-Origin`).
    /// `None` = `front-<random hex>`. Must be unique across replicas.
    pub front_id: Option<String>,
    /// How long a join, a token refresh or a private channel's check waits for the
    /// cdc-worker.
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
    /// Connected users per project across the fronts (see [`crate::limits::usage`]).
    pub project_max_users: u64,
    /// A project's default rate limits across the fronts (see [`crate::limits::usage`]); each
    /// project may have its own (the management API).
    pub project_rates: ProjectRateDefaults,
    /// Joins one socket may send in a burst …
    pub join_burst: u32,
    /// … and per second after that (token bucket).
    pub joins_per_second: u32,
    /// A socket that sends nothing for this long is closed (clients heartbeat every 25 s).
    pub idle_timeout: Duration,
    /// Upper bound of the per-channel token re-check timer (`min(this, exp - now)`).
    pub token_check_interval: Duration,
    /// How long a channel that asked for `replication_ready` waits for the change stream
    /// before it is closed (Supabase's `replication_ready_timeout`: a minute).
    pub replication_ready_timeout: Duration,
    /// Entries kept per SSE channel for `Last-Event-ID` resumption (`HISTORY_SIZE`).
    pub history_size: usize,
    /// How long an SSE channel (its subscription and history) survives its last reader,
    /// so a reconnecting client can resume without a gap.
    pub sse_linger: Duration,
    /// Interval of SSE keep-alive comments.
    pub sse_keepalive: Duration,
    /// Most rows one SSE `?snapshot=true` may send (more: the stream is refused, 413).
    pub sse_snapshot_max_rows: u32,
    /// Most bytes of records one SSE snapshot may send (more: 413). The front holds a
    /// snapshot's rows until it has sent them, and at most [`SSE_SNAPSHOTS_HELD`] such
    /// snapshots' worth at once.
    pub sse_snapshot_max_bytes: u32,
    /// How long an SSE snapshot waits for all of the worker's rows (every part).
    pub sse_snapshot_timeout: Duration,
    /// Subscriptions per `register` request when re-registering everything (resync).
    pub resync_batch: usize,
    /// On shutdown, the window over which the sockets are closed (see
    /// [`crate::Front::drain`]).
    pub drain_window: Duration,
    /// Serve the inspector page and its health API (see [`crate::Front::router`]).
    pub inspector: bool,
    /// How long a gap in the leader's stream to this front is waited for (resend asked
    /// for) before its channels are told with a `system` error.
    pub gap_recovery: Duration,
    /// Messages held behind such a gap, at most.
    pub gap_max_held: usize,
    /// The operator key of the management API (`None`: the API is not served).
    pub management_api_key: Option<String>,
    /// The figures key: reads `/metrics/projects`, never manages (`None`: none).
    pub metrics_api_key: Option<String>,
    /// How long a rotated secret's predecessor stays valid, unless a rotation says.
    pub rotation_window: Duration,
    /// Cross-origin requests on the browser routes (SSE, REST broadcast, the realtime
    /// tables API): any origin by default.
    pub cors: crate::cors::CorsConfig,
}

/// The default per-project limits besides connected users and channels per socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProjectRateDefaults {
    /// Channel joins per second.
    pub joins_per_second: u32,
    /// Broadcast and presence messages per second, received and sent.
    pub events_per_second: u32,
    /// Bytes of those messages per second.
    pub bytes_per_second: u32,
    /// Presence track and untrack events per second.
    pub presence_events_per_second: u32,
    /// The largest broadcast or presence payload, in KiB.
    pub max_payload_kb: u32,
}

/// Default of [`ProjectRateDefaults::joins_per_second`].
pub const DEFAULT_PROJECT_JOINS_PER_SECOND: u32 = 1000;
/// Default of [`ProjectRateDefaults::events_per_second`].
pub const DEFAULT_PROJECT_EVENTS_PER_SECOND: u32 = 50_000;
/// Default of [`ProjectRateDefaults::bytes_per_second`] (50 MB).
pub const DEFAULT_PROJECT_BYTES_PER_SECOND: u32 = 50_000_000;
/// Default of [`ProjectRateDefaults::presence_events_per_second`].
pub const DEFAULT_PROJECT_PRESENCE_EVENTS_PER_SECOND: u32 = 1000;
/// Default of [`ProjectRateDefaults::max_payload_kb`] (the default frame limit).
pub const DEFAULT_PROJECT_MAX_PAYLOAD_KB: u32 = 1024;

impl Default for ProjectRateDefaults {
    fn default() -> Self {
        ProjectRateDefaults {
            joins_per_second: DEFAULT_PROJECT_JOINS_PER_SECOND,
            events_per_second: DEFAULT_PROJECT_EVENTS_PER_SECOND,
            bytes_per_second: DEFAULT_PROJECT_BYTES_PER_SECOND,
            presence_events_per_second: DEFAULT_PROJECT_PRESENCE_EVENTS_PER_SECOND,
            max_payload_kb: DEFAULT_PROJECT_MAX_PAYLOAD_KB,
        }
    }
}

impl FrontConfig {
    /// Every per-project limit's default, as a project's own limits are stored.
    pub fn project_defaults(&self) -> walcast_bus::admin::ProjectLimits {
        let r = &self.project_rates;
        walcast_bus::admin::ProjectLimits {
            max_concurrent_users: Some(self.project_max_users.min(u64::from(u32::MAX)) as u32),
            max_joins_per_second: Some(r.joins_per_second),
            max_channels_per_client: Some(
                self.max_channels_per_socket.min(u32::MAX as usize) as u32
            ),
            max_events_per_second: Some(r.events_per_second),
            max_bytes_per_second: Some(r.bytes_per_second),
            max_presence_events_per_second: Some(r.presence_events_per_second),
            max_payload_size_in_kb: Some(r.max_payload_kb),
        }
    }
}

/// Default of [`FrontConfig::rotation_window`], in seconds (a day).
pub const DEFAULT_ROTATION_WINDOW_SECS: u64 = 86_400;
/// Shortest operator key accepted.
pub const MIN_MANAGEMENT_KEY_BYTES: usize = 32;

/// Default of [`FrontConfig::gap_recovery`], in milliseconds.
pub const DEFAULT_GAP_RECOVERY_MS: u64 = 5000;
/// Default of [`FrontConfig::gap_max_held`].
pub const DEFAULT_GAP_MAX_HELD: usize = 10_000;
/// Default of [`FrontConfig::inspector`].
pub const DEFAULT_INSPECTOR: bool = true;
/// Default of [`FrontConfig::drain_window`], in seconds.
pub const DEFAULT_DRAIN_SECS: u64 = 10;
/// Default of [`FrontConfig::register_timeout`], in milliseconds.
pub const DEFAULT_REGISTER_TIMEOUT_MS: u64 = 5000;
/// Default of [`FrontConfig::outbound_queue`].
pub const DEFAULT_OUTBOUND_QUEUE: usize = 1024;
/// Default of [`FrontConfig::max_frame_bytes`].
pub const DEFAULT_MAX_FRAME_BYTES: usize = 1 << 20;
/// Default of [`FrontConfig::max_channels_per_socket`].
pub const DEFAULT_MAX_CHANNELS_PER_SOCKET: usize = 100;
/// Default of [`FrontConfig::max_bindings_per_channel`].
pub const DEFAULT_MAX_BINDINGS_PER_CHANNEL: usize = 100;
/// Default of [`FrontConfig::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 100_000;
/// Default of [`FrontConfig::project_max_users`].
pub const DEFAULT_PROJECT_MAX_USERS: u64 = 10_000;
/// Default of [`FrontConfig::joins_per_second`] (the burst is twice it).
pub const DEFAULT_JOINS_PER_SECOND: u32 = 100;
/// Default of [`FrontConfig::sse_snapshot_max_rows`]: the most the worker reads for any
/// request.
pub const DEFAULT_SSE_SNAPSHOT_MAX_ROWS: u32 = 100_000;
/// Default of [`FrontConfig::sse_snapshot_max_bytes`] (16 MiB: a front holds up to
/// [`SSE_SNAPSHOTS_HELD`] of them, about 90 MiB with the rows' overhead, at the default
/// limits; the worker's own cap is 64 MiB).
pub const DEFAULT_SSE_SNAPSHOT_MAX_BYTES: u32 = 16 << 20;
/// How many snapshots of the largest size (`SSE_SNAPSHOT_MAX_ROWS` rows of
/// `SSE_SNAPSHOT_MAX_BYTES` bytes) a front holds at once, received and not yet sent; a
/// snapshot beyond that is refused (503) until others are sent.
pub const SSE_SNAPSHOTS_HELD: usize = 4;
/// What a front counts per held row besides its bytes (its allocation).
pub const SSE_SNAPSHOT_ROW_OVERHEAD: usize = 64;
/// Default of [`FrontConfig::sse_snapshot_timeout`], in milliseconds.
pub const DEFAULT_SSE_SNAPSHOT_TIMEOUT_MS: u64 = 10_000;
/// Default of [`FrontConfig::history_size`].
pub const DEFAULT_HISTORY_SIZE: usize = 1000;

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            front_id: None,
            register_timeout: Duration::from_millis(DEFAULT_REGISTER_TIMEOUT_MS),
            outbound_queue: DEFAULT_OUTBOUND_QUEUE,
            max_frame_bytes: DEFAULT_MAX_FRAME_BYTES,
            max_channels_per_socket: DEFAULT_MAX_CHANNELS_PER_SOCKET,
            max_bindings_per_channel: DEFAULT_MAX_BINDINGS_PER_CHANNEL,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            project_max_users: DEFAULT_PROJECT_MAX_USERS,
            project_rates: ProjectRateDefaults::default(),
            join_burst: DEFAULT_JOINS_PER_SECOND * 2,
            joins_per_second: DEFAULT_JOINS_PER_SECOND,
            idle_timeout: Duration::from_secs(60),
            token_check_interval: Duration::from_secs(5 * 60),
            replication_ready_timeout: Duration::from_secs(60),
            history_size: DEFAULT_HISTORY_SIZE,
            sse_linger: Duration::from_secs(60),
            sse_keepalive: Duration::from_secs(15),
            sse_snapshot_max_rows: DEFAULT_SSE_SNAPSHOT_MAX_ROWS,
            sse_snapshot_max_bytes: DEFAULT_SSE_SNAPSHOT_MAX_BYTES,
            sse_snapshot_timeout: Duration::from_millis(DEFAULT_SSE_SNAPSHOT_TIMEOUT_MS),
            resync_batch: 500,
            drain_window: Duration::from_secs(DEFAULT_DRAIN_SECS),
            inspector: DEFAULT_INSPECTOR,
            gap_recovery: Duration::from_millis(DEFAULT_GAP_RECOVERY_MS),
            gap_max_held: DEFAULT_GAP_MAX_HELD,
            management_api_key: None,
            metrics_api_key: None,
            rotation_window: Duration::from_secs(DEFAULT_ROTATION_WINDOW_SECS),
            cors: crate::cors::CorsConfig::default(),
        }
    }
}
