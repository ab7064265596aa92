//! The transactional outbox relay's options (docs/outbox.md).

use std::time::Duration;

use clap::Args;

/// The transactional outbox relay (docs/outbox.md).
#[derive(Args, Clone, Debug)]
pub struct OutboxArgs {
    /// Relay `walcast.emit` events and outbox-table rows to NATS JetStream, and maintain
    /// the outbox tables' partitions. The stream is created at the first event, so a
    /// deployment that never emits needs no JetStream.
    #[arg(long = "outbox-enabled", env = "OUTBOX_ENABLED", default_value_t = true, action = clap::ArgAction::Set)]
    pub enabled: bool,
    #[command(flatten)]
    pub stream: OutboxStreamArgs,
    /// How long to wait for one PubAck before retrying, in milliseconds.
    #[arg(long = "outbox-ack-timeout-ms", env = "OUTBOX_ACK_TIMEOUT_MS", default_value_t = walcast_outbox::config::DEFAULT_ACK_TIMEOUT.as_millis() as u64)]
    pub ack_timeout_ms: u64,
    /// Events sent and not yet acknowledged, at most (beyond, later events wait in the
    /// relay's queue, unsent, in order); at most 16384 is used.
    #[arg(long = "outbox-max-in-flight", env = "OUTBOX_MAX_IN_FLIGHT", default_value_t = walcast_outbox::config::DEFAULT_MAX_IN_FLIGHT)]
    pub max_in_flight: usize,
    /// Events handed to the relay and not yet acknowledged (sent or queued), at most:
    /// beyond, the relay takes no more transactions until JetStream caught up (realtime
    /// carries on; the slot retains the WAL from the relay's position).
    #[arg(long = "outbox-max-queued", env = "OUTBOX_MAX_QUEUED", default_value_t = walcast_outbox::config::DEFAULT_MAX_QUEUED)]
    pub max_queued: usize,
    /// The same bound in bytes (payload, subject and headers of each event).
    #[arg(long = "outbox-max-queued-bytes", env = "OUTBOX_MAX_QUEUED_BYTES", default_value_t = walcast_outbox::config::DEFAULT_MAX_QUEUED_BYTES)]
    pub max_queued_bytes: u64,
    /// Longest wait between retries of a transient failure, in milliseconds (waits
    /// double from 100 ms up to it).
    #[arg(long = "outbox-retry-max-ms", env = "OUTBOX_RETRY_MAX_MS", default_value_t = walcast_outbox::config::DEFAULT_RETRY_MAX.as_millis() as u64)]
    pub retry_max_ms: u64,
    /// The leader runs `walcast.outbox_maintain()` at the start of its term and then this
    /// often, in seconds: partitions for the next three days, and partitions older than
    /// their outbox's retention dropped (with a 5 s lock_timeout, so writers never wait
    /// long behind it).
    #[arg(long = "outbox-maintain-interval-secs", env = "OUTBOX_MAINTAIN_INTERVAL_SECS", default_value_t = walcast_outbox::config::DEFAULT_MAINTAIN_INTERVAL.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub maintain_interval_secs: u64,
}

/// The outbox's JetStream stream: the relay creates it with these settings, or updates it
/// to them; `walcast outbox redrive` creates it with them when it is missing.
#[derive(Args, Clone, Debug)]
pub struct OutboxStreamArgs {
    /// The outbox's JetStream stream (the relay creates it, or updates it to these
    /// settings; `walcast outbox redrive` creates it with them only when it is missing).
    #[arg(long = "outbox-stream", env = "OUTBOX_STREAM", default_value = walcast_outbox::config::DEFAULT_STREAM)]
    pub stream: String,
    /// The stream's replicas (1 for a single NATS server, 3 for a cluster).
    #[arg(long = "outbox-stream-replicas", env = "OUTBOX_STREAM_REPLICAS", default_value_t = walcast_outbox::config::DEFAULT_REPLICAS)]
    pub replicas: usize,
    /// How long the stream keeps events, in seconds (how far `walcast outbox replay`
    /// reaches back).
    #[arg(long = "outbox-max-age-secs", env = "OUTBOX_MAX_AGE_SECS", default_value_t = walcast_outbox::config::DEFAULT_MAX_AGE.as_secs())]
    pub max_age_secs: u64,
    /// JetStream's duplicate window, in seconds: replays after a crash or failover within
    /// it are dropped by event id. Must exceed the worst replay (docs/outbox.md).
    #[arg(long = "outbox-duplicate-window-secs", env = "OUTBOX_DUPLICATE_WINDOW_SECS", default_value_t = walcast_outbox::config::DEFAULT_DUPLICATE_WINDOW.as_secs())]
    pub duplicate_window_secs: u64,
}

impl OutboxStreamArgs {
    /// The defaults with these stream settings.
    pub fn to_config(&self, database_url: &str) -> walcast_outbox::OutboxConfig {
        let mut c = walcast_outbox::OutboxConfig::new(database_url);
        c.stream = self.stream.clone();
        c.replicas = self.replicas;
        c.max_age = Duration::from_secs(self.max_age_secs);
        c.duplicate_window = Duration::from_secs(self.duplicate_window_secs);
        c
    }
}

impl OutboxArgs {
    /// The relay's settings (`None` when disabled).
    pub fn to_config(&self, database_url: &str) -> Option<walcast_outbox::OutboxConfig> {
        if !self.enabled {
            return None;
        }
        let mut c = self.stream.to_config(database_url);
        c.ack_timeout = Duration::from_millis(self.ack_timeout_ms);
        c.max_in_flight = self.max_in_flight.max(1);
        c.max_queued = self.max_queued.max(1);
        c.max_queued_bytes = self.max_queued_bytes.max(1);
        c.retry.cap = Duration::from_millis(self.retry_max_ms);
        c.maintain_interval = Duration::from_secs(self.maintain_interval_secs.max(1));
        Some(c)
    }

    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "enabled": self.enabled,
            "stream": self.stream.stream,
            "replicas": self.stream.replicas,
            "max_age_secs": self.stream.max_age_secs,
            "duplicate_window_secs": self.stream.duplicate_window_secs,
            "ack_timeout_ms": self.ack_timeout_ms,
            "max_in_flight": self.max_in_flight,
            "max_queued": self.max_queued,
            "max_queued_bytes": self.max_queued_bytes,
            "retry_max_ms": self.retry_max_ms,
            "maintain_interval_secs": self.maintain_interval_secs,
        })
    }
}
