//! Metric names of the CDC pipeline that carry a description (registered by
//! [`describe`]). Older metrics are still named where they are recorded.

/// Counter: changes not delivered at all because of a failure retrying cannot fix,
/// label `reason` (`undecodable`, `event`, `payload_too_large`).
pub const CHANGES_SKIPPED: &str = "walcast_cdc_changes_skipped_total";
/// Counter: changes delivered without their large values, with `Error 413`.
pub const CHANGES_OVERSIZED: &str = "walcast_cdc_changes_oversized_total";
/// Counter: changes whose audience was split over several messages to fit the bus.
pub const CHANGES_SPLIT: &str = "walcast_cdc_changes_split_total";

/// Counter: bytes of change messages published (payloads: table subjects and the
/// fronts' delivery subjects).
pub const PUBLISHED_BYTES: &str = "walcast_cdc_published_bytes_total";
/// Counter: change messages published.
pub const PUBLISHED_MESSAGES: &str = "walcast_cdc_published_messages_total";
/// Gauge: the largest change message published since start, in bytes.
pub const LARGEST_MESSAGE: &str = "walcast_cdc_largest_message_bytes";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        PUBLISHED_BYTES,
        "Bytes of change messages published to the bus (table and delivery subjects)"
    );
    metrics::describe_counter!(PUBLISHED_MESSAGES, "Change messages published to the bus");
    metrics::describe_gauge!(
        LARGEST_MESSAGE,
        "The largest change message published since start, in bytes"
    );
    metrics::describe_counter!(
        CHANGES_SKIPPED,
        "Changes not delivered because of a failure that retrying cannot fix (label reason)"
    );
    metrics::describe_counter!(
        CHANGES_OVERSIZED,
        "Changes delivered with Error 413: values over MAX_RECORD_BYTES or the bus's max_payload dropped"
    );
    metrics::describe_counter!(
        CHANGES_SPLIT,
        "Changes whose subscriber list was split over several bus messages"
    );
}
