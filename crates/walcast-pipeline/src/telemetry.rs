//! Every metric name of the pipeline (slot, sources, driver), each with its description
//! (registered by [`describe`]); code records metrics only through these names. The
//! names keep their `walcast_cdc_` prefix: dashboards and alerts written against them
//! keep working.

/// Counter: changes published without their large values, with `Error 413` (see
/// `change_event/fit.rs`).
pub const CHANGES_OVERSIZED: &str = "walcast_cdc_changes_oversized_total";
/// Counter: changes no retry can deliver, skipped (label `reason`).
pub const CHANGES_SKIPPED: &str = "walcast_cdc_changes_skipped_total";
/// Gauge: 1 while this worker reads the slot.
pub const ACTIVE: &str = "walcast_cdc_active";
/// Gauge: bytes of WAL between the server's position and the slot's confirmed one.
pub const SLOT_LAG: &str = "walcast_cdc_slot_lag_bytes";
/// Gauge: bytes of WAL the server keeps for the slot (from its `restart_lsn`).
pub const SLOT_RETAINED: &str = "walcast_cdc_slot_retained_bytes";
/// Counter: heartbeats written (label `result`: `ok`, `error`).
pub const HEARTBEATS: &str = "walcast_cdc_heartbeats_total";
/// Counter: lost slots recreated.
pub const SLOT_LOST: &str = "walcast_cdc_slot_lost_total";
/// Counter: session failures retried.
pub const SOURCE_ERRORS: &str = "walcast_cdc_source_errors_total";
/// Counter: wal2json lines that could not be decoded.
pub const DECODE_ERRORS: &str = "walcast_cdc_decode_errors_total";
/// Counter: `walcast.*` logical messages whose MAC did not verify (label `prefix`).
pub const MESSAGES_FORGED: &str = "walcast_cdc_messages_forged_total";
/// Counter: items a consumer panicked on (label `consumer`).
pub const CONSUMER_PANICS: &str = "walcast_cdc_consumer_panics_total";
/// Histogram: duration of one poll of the slot.
pub const POLL_SECONDS: &str = "walcast_cdc_poll_duration_seconds";
/// Histogram: lines returned by one poll.
pub const POLL_ROWS: &str = "walcast_cdc_poll_rows";
/// Counter: publishes refused by the [`crate::Publisher`] because the term's fence had
/// closed (label `consumer`).
pub const PUBLISH_FENCED: &str = "walcast_cdc_publish_fenced_total";
/// Gauge: bytes of WAL between what was read and what a consumer made durable (label
/// `consumer`).
pub const CONSUMER_LAG: &str = "walcast_cdc_consumer_lag_bytes";
/// Gauge: 1 while a consumer is detached (its buffer full; label `consumer`).
pub const CONSUMER_DETACHED_NOW: &str = "walcast_cdc_consumer_detached";
/// Counter: times a consumer was detached (label `consumer`).
pub const CONSUMER_DETACHED: &str = "walcast_cdc_consumer_detached_total";
/// Counter: restarts of the source while running (label `reason`: `filter`, `reattach`).
pub const SOURCE_RESTARTS: &str = "walcast_cdc_source_restarts_total";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        CHANGES_OVERSIZED,
        "Changes delivered with Error 413: values over MAX_RECORD_BYTES or the bus's max_payload dropped"
    );
    metrics::describe_gauge!(
        CONSUMER_LAG,
        "Bytes of WAL between what the pipeline read and what a consumer made durable (label consumer); the slot is acknowledged at the lowest"
    );
    metrics::describe_gauge!(
        CONSUMER_DETACHED_NOW,
        "1 while a consumer is detached: its own buffer is full, it is handed nothing while the others go on (label consumer)"
    );
    metrics::describe_counter!(
        CONSUMER_DETACHED,
        "Times a consumer was detached because its own buffer was full (label consumer)"
    );
    metrics::describe_counter!(
        CHANGES_SKIPPED,
        "Changes not delivered because of a failure that retrying cannot fix (label reason)"
    );
    metrics::describe_gauge!(
        ACTIVE,
        "1 while this worker reads the slot (leader, connected), else 0"
    );
    metrics::describe_gauge!(
        SLOT_LAG,
        "Bytes of WAL between the server's current position and the slot's confirmed position"
    );
    metrics::describe_gauge!(
        SLOT_RETAINED,
        "Bytes of WAL the server keeps for the slot: between its current position and the slot's restart_lsn"
    );
    metrics::describe_counter!(
        HEARTBEATS,
        "Heartbeats (a logical message on the source database, CDC_HEARTBEAT_INTERVAL_MS) written by the leader, by result (ok, error)"
    );
    metrics::describe_counter!(
        SOURCE_RESTARTS,
        "Restarts of the source while running, by reason: filter (a consumer decodes another table or schema), reattach (a detached consumer accepts again); each re-decodes the WAL from the slot's restart_lsn"
    );
    metrics::describe_counter!(SLOT_LOST, "Replication slots found invalidated (WAL removed past max_slot_wal_keep_size), dropped and recreated");
    metrics::describe_counter!(SOURCE_ERRORS, "cdc session failures that were retried (Postgres or NATS unreachable, slot busy), in either source");
    metrics::describe_counter!(
        MESSAGES_FORGED,
        "walcast.* logical messages skipped because their MAC did not verify (forged), by prefix"
    );
    metrics::describe_counter!(
        CONSUMER_PANICS,
        "Items a consumer panicked on (caught and skipped), by consumer"
    );
    metrics::describe_counter!(DECODE_ERRORS, "wal2json lines that could not be decoded (each skipped and counted in walcast_cdc_changes_skipped_total too)");
    metrics::describe_histogram!(
        POLL_SECONDS,
        "Poll source: duration of one read of the slot, in seconds"
    );
    metrics::describe_histogram!(
        POLL_ROWS,
        "Poll source: wal2json lines returned by one read of the slot"
    );
    metrics::describe_counter!(
        PUBLISH_FENCED,
        "Publishes refused because this worker's leadership term had ended (its fence closed), by consumer"
    );
}
