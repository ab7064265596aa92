//! Every metric name of the inbox consumer, each with its description (registered by
//! [`describe`]); code records metrics only through these names. Every one has the label
//! `consumer` (the durable name).

/// Counter: events whose handler ran and whose transaction committed (then acked).
pub const APPLIED: &str = "walcast_inbox_events_applied_total";
/// Counter: deliveries of events the inbox already held: committed nothing, acked.
pub const DUPLICATES: &str = "walcast_inbox_events_duplicate_total";
/// Counter: deliveries rolled back and nak'd with a delay to be tried again, label
/// `reason`: `handler` (the handler returned an error) or `database` (our own statements
/// or the commit failed).
pub const RETRIES: &str = "walcast_inbox_retries_total";
/// Counter: events whose last allowed delivery (`max_deliver`) failed: rolled back and
/// terminated, never applied.
pub const GAVE_UP: &str = "walcast_inbox_events_given_up_total";
/// Counter: messages terminated because they carry no usable event id, label `reason`
/// (`missing_id`, `bad_id`).
pub const UNIDENTIFIED: &str = "walcast_inbox_messages_unidentified_total";
/// Counter: acks, naks and terms that failed or were not confirmed (an unacked applied
/// event comes back after the ack wait and is recognised as a duplicate).
pub const SETTLE_ERRORS: &str = "walcast_inbox_settle_errors_total";
/// Counter: pull requests (fetches) that failed; retried with a backoff.
pub const FETCH_ERRORS: &str = "walcast_inbox_fetch_errors_total";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        APPLIED,
        "Outbox events applied: handler ran, transaction with the inbox row committed, then acked"
    );
    metrics::describe_counter!(
        DUPLICATES,
        "Deliveries of events already in the inbox: no side effect, acked"
    );
    metrics::describe_counter!(
        RETRIES,
        "Deliveries rolled back and nak'd with a backoff delay (label reason: handler, database)"
    );
    metrics::describe_counter!(
        GAVE_UP,
        "Events whose last allowed delivery (max_deliver) failed: rolled back and terminated"
    );
    metrics::describe_counter!(
        UNIDENTIFIED,
        "Messages terminated without handling because they have no usable event id (label reason)"
    );
    metrics::describe_counter!(
        SETTLE_ERRORS,
        "Acks, naks or terms that failed or were not confirmed by JetStream"
    );
    metrics::describe_counter!(
        FETCH_ERRORS,
        "JetStream pull requests that failed (retried with a backoff)"
    );
}
