//! What change streams are configured with, each default defined once here (the
//! binaries' options use these constants).

use walcast_pipeline::change_event::DEFAULT_MAX_RECORD_BYTES;

/// The change streams' JetStream stream (README "Change streams"), unless configured
/// otherwise.
pub const DEFAULT_CHANGES_STREAM: &str = "WALCAST_CHANGES";
/// Default of [`ChangeStreamConfig::replicas`].
pub const DEFAULT_CHANGES_REPLICAS: usize = 1;
/// Default of [`ChangeStreamConfig::max_age`]: 7 days.
pub const DEFAULT_CHANGES_MAX_AGE_SECS: u64 = 7 * 86_400;
/// Default of [`ChangeStreamConfig::max_bytes`]: no limit (-1).
pub const DEFAULT_CHANGES_MAX_BYTES: i64 = -1;
/// Default of [`ChangeStreamConfig::duplicate_window`]: 2 minutes, longer than a
/// takeover's replay (a lease of 15 s, the slot read again from its position).
pub const DEFAULT_CHANGES_DUPLICATE_WINDOW_SECS: u64 = 120;
/// Default of [`ChangeStreamConfig::max_in_flight`]: PubAcks outstanding at most.
pub const DEFAULT_CHANGES_MAX_IN_FLIGHT: usize = 4096;
/// Default of [`ChangeStreamConfig::max_queued`]: changes handed over and not yet
/// acknowledged past which the consumer stops accepting (the slot keeps the WAL).
pub const DEFAULT_CHANGES_MAX_QUEUED: usize = 100_000;
/// Default of [`ChangeStreamConfig::ack_timeout`]: 10 s.
pub const DEFAULT_CHANGES_ACK_TIMEOUT_MS: u64 = 10_000;

/// The change-stream consumer's settings (README "Change streams").
#[derive(Clone, Debug)]
pub struct ChangeStreamConfig {
    /// For the change-stream tables and the types: `DATABASE_URL`.
    pub database_url: String,
    /// The JetStream stream, created or updated to these settings at the first change
    /// of a term.
    pub stream: String,
    pub replicas: usize,
    pub max_age: std::time::Duration,
    /// `-1`: no limit.
    pub max_bytes: i64,
    /// JetStream de-duplicates by `Nats-Msg-Id` within this window.
    pub duplicate_window: std::time::Duration,
    /// How long to wait for one PubAck before resending.
    pub ack_timeout: std::time::Duration,
    pub max_in_flight: usize,
    pub max_queued: usize,
    /// A change whose values are larger is stored without them (`Error 413`).
    pub max_record_bytes: usize,
    /// The projects of this source (`None`: all).
    pub projects: Option<std::sync::Arc<walcast_control::source_projects::SourceProjects>>,
    /// Where this process's snapshotter hands chunks to the consumer (`None`: snapshots
    /// do not run here, the watermarks are not read).
    pub board: Option<std::sync::Arc<crate::snapshot::Board>>,
}

impl ChangeStreamConfig {
    /// The defaults, with the database to use.
    pub fn new(database_url: impl Into<String>) -> ChangeStreamConfig {
        ChangeStreamConfig {
            database_url: database_url.into(),
            stream: DEFAULT_CHANGES_STREAM.into(),
            replicas: DEFAULT_CHANGES_REPLICAS,
            max_age: std::time::Duration::from_secs(DEFAULT_CHANGES_MAX_AGE_SECS),
            max_bytes: DEFAULT_CHANGES_MAX_BYTES,
            duplicate_window: std::time::Duration::from_secs(DEFAULT_CHANGES_DUPLICATE_WINDOW_SECS),
            ack_timeout: std::time::Duration::from_millis(DEFAULT_CHANGES_ACK_TIMEOUT_MS),
            max_in_flight: DEFAULT_CHANGES_MAX_IN_FLIGHT,
            max_queued: DEFAULT_CHANGES_MAX_QUEUED,
            max_record_bytes: DEFAULT_MAX_RECORD_BYTES,
            projects: None,
            board: None,
        }
    }
}
