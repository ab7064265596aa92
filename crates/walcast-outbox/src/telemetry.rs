//! Metric names and descriptions of the outbox relay.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

/// Counter: events JetStream acknowledged (`duplicate` = `true` for a replay it had).
pub const PUBLISHED: &str = "walcast_outbox_published_total";
/// Counter: publish attempts that failed, by `kind` (`transient`, `too_large`, `no_stream`,
/// `refused`, `invalid`: refused before sending, quarantined).
pub const PUBLISH_FAILURES: &str = "walcast_outbox_publish_failures_total";
/// Histogram: seconds from sending an event to JetStream's acknowledgement.
pub const ACK_SECONDS: &str = "walcast_outbox_ack_seconds";
/// Histogram: seconds from the event's commit to JetStream's acknowledgement.
pub const COMMIT_TO_ACK_SECONDS: &str = "walcast_outbox_commit_to_ack_seconds";
/// Gauge: age in seconds of the oldest event handed to the relay and not yet acknowledged
/// by JetStream (0 when none waits).
pub const OLDEST_UNPUBLISHED_SECONDS: &str = "walcast_outbox_oldest_unpublished_seconds";
/// Gauge: events handed to the relay and not yet acknowledged by JetStream (sent or
/// queued); past `OUTBOX_MAX_QUEUED` the relay stops accepting transactions.
pub const QUEUED_EVENTS: &str = "walcast_outbox_queued_events";
/// Gauge: their bytes; past `OUTBOX_MAX_QUEUED_BYTES` the relay stops accepting.
pub const QUEUED_BYTES: &str = "walcast_outbox_queued_bytes";
/// Counter: events quarantined (refused by JetStream for good).
pub const QUARANTINED: &str = "walcast_outbox_quarantined_total";
/// Gauge: rows in the quarantine table (read periodically).
pub const QUARANTINE_SIZE: &str = "walcast_outbox_quarantine_size";
/// Counter: events that could not be read at all (not an outbox event), skipped.
pub const MALFORMED: &str = "walcast_outbox_malformed_total";

/// Counter: outbox partitions dropped by retention (partition maintenance).
pub const PARTITIONS_DROPPED: &str = "walcast_outbox_partitions_dropped_total";
/// Counter: partition maintenance runs that failed (lock timeout, database down …);
/// the next interval tries again.
pub const MAINTENANCE_FAILURES: &str = "walcast_outbox_maintenance_failures_total";

/// Register the descriptions (once per process).
pub fn describe() {
    describe_counter!(
        PUBLISHED,
        "Outbox events JetStream acknowledged (label duplicate)"
    );
    describe_counter!(
        PUBLISH_FAILURES,
        "Outbox publish attempts that failed, by kind (transient ones are retried)"
    );
    describe_histogram!(
        ACK_SECONDS,
        Unit::Seconds,
        "Outbox event send to JetStream ack"
    );
    describe_histogram!(
        COMMIT_TO_ACK_SECONDS,
        Unit::Seconds,
        "Outbox event commit to JetStream ack"
    );
    describe_gauge!(
        OLDEST_UNPUBLISHED_SECONDS,
        Unit::Seconds,
        "Age of the oldest outbox event not yet acknowledged by JetStream"
    );
    describe_gauge!(
        QUEUED_EVENTS,
        "Outbox events handed to the relay and not yet acknowledged by JetStream"
    );
    describe_gauge!(
        QUEUED_BYTES,
        Unit::Bytes,
        "Bytes of the outbox events handed to the relay and not yet acknowledged"
    );
    describe_counter!(
        QUARANTINED,
        "Outbox events quarantined (refused by JetStream for good)"
    );
    describe_gauge!(QUARANTINE_SIZE, "Rows in walcast.outbox_quarantine");
    describe_counter!(
        MALFORMED,
        "Outbox messages or rows that are not events (skipped)"
    );
    describe_counter!(
        PARTITIONS_DROPPED,
        "Outbox partitions dropped by retention (walcast.outbox_maintain)"
    );
    describe_counter!(
        MAINTENANCE_FAILURES,
        "Outbox partition maintenance runs that failed (retried at the next interval)"
    );
}
