//! The relay's settings; every default defined once, here (the binaries' flags use them).

use std::time::Duration;

use walcast_core::Backoff;

pub const DEFAULT_STREAM: &str = "WALCAST_OUTBOX";
pub const DEFAULT_SUBJECTS: &str = "walcast.outbox.>";
pub const DEFAULT_REPLICAS: usize = 1;
/// How long the stream keeps events (what `walcast outbox replay` can reach back to).
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(7 * 86_400);
/// JetStream's duplicate window: must be longer than the worst replay (see docs/outbox.md).
pub const DEFAULT_DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// How long to wait for one PubAck before the publish counts as failed (and is retried).
pub const DEFAULT_ACK_TIMEOUT: Duration = Duration::from_secs(10);
/// Events sent and not yet acknowledged, at most; beyond, sending waits for acks.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 4096;
/// Events handed to the relay and not yet acknowledged (sent or queued), at most: past
/// it the relay takes no more transactions until JetStream caught up (the slot keeps the
/// WAL from the relay's position meanwhile).
pub const DEFAULT_MAX_QUEUED: usize = 100_000;
/// The same bound in bytes (payload, subject and headers of each event).
pub const DEFAULT_MAX_QUEUED_BYTES: u64 = 256 * 1024 * 1024;
pub const DEFAULT_RETRY_BASE: Duration = Duration::from_millis(100);
pub const DEFAULT_RETRY_MAX: Duration = Duration::from_secs(30);
/// Retention of a new outbox table (as `walcast.outbox_create`'s default).
pub const DEFAULT_RETENTION_DAYS: u32 = 7;
/// How often the leading cdc-worker runs `walcast.outbox_maintain()` (and once at the
/// start of each term): partitions for the next days, expired ones dropped.
pub const DEFAULT_MAINTAIN_INTERVAL: Duration = Duration::from_secs(600);
/// `lock_timeout` of the maintenance: creating or dropping a partition needs a lock on
/// the outbox table that queues writers behind it, so it gives up rather than wait
/// long (and tries again at the next interval).
pub const MAINTAIN_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The relay's settings.
/// Which projects a relay may relay events for (README "Sources"): a source's database
/// may belong to a tenant, who must not emit events as another source's project.
pub trait ProjectGate: Send + Sync {
    /// Whether `project`'s events may pass; `Err`: the answer could not be had (the relay
    /// retries).
    fn admits<'a>(
        &'a self,
        project: &'a str,
    ) -> futures_util::future::BoxFuture<'a, Result<bool, String>>;
}

/// The projects a relay relays for: all of them, or those a [`ProjectGate`] admits.
#[derive(Clone, Default)]
pub struct Projects(pub Option<std::sync::Arc<dyn ProjectGate>>);

impl std::fmt::Debug for Projects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "gated" } else { "all" })
    }
}

#[derive(Clone, Debug)]
pub struct OutboxConfig {
    /// The projects relayed (a source's own, or all).
    pub projects: Projects,
    /// The JetStream stream, created or updated at the first publish of a session.
    pub stream: String,
    pub subjects: Vec<String>,
    pub replicas: usize,
    pub max_age: Duration,
    pub duplicate_window: Duration,
    pub ack_timeout: Duration,
    pub max_in_flight: usize,
    /// Events outstanding (sent or queued) past which the relay stops accepting.
    pub max_queued: usize,
    /// Bytes outstanding past which the relay stops accepting.
    pub max_queued_bytes: u64,
    /// Transient failures are retried after `min(max, base · 2ⁿ)`.
    pub retry: Backoff,
    /// Partition maintenance interval (see [`DEFAULT_MAINTAIN_INTERVAL`]).
    pub maintain_interval: Duration,
    /// For the outbox-table list and the quarantine (`DATABASE_URL`).
    pub database_url: String,
}

impl OutboxConfig {
    /// The defaults, with the database to use.
    pub fn new(database_url: impl Into<String>) -> OutboxConfig {
        OutboxConfig {
            projects: Projects::default(),
            stream: DEFAULT_STREAM.into(),
            subjects: vec![DEFAULT_SUBJECTS.into()],
            replicas: DEFAULT_REPLICAS,
            max_age: DEFAULT_MAX_AGE,
            duplicate_window: DEFAULT_DUPLICATE_WINDOW,
            ack_timeout: DEFAULT_ACK_TIMEOUT,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            max_queued: DEFAULT_MAX_QUEUED,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            retry: Backoff {
                base: DEFAULT_RETRY_BASE,
                cap: DEFAULT_RETRY_MAX,
            },
            maintain_interval: DEFAULT_MAINTAIN_INTERVAL,
            database_url: database_url.into(),
        }
    }
}
