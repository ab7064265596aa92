//! Every metric name of change streams and snapshots, each with its description
//! (registered by [`describe`]); code records metrics only through these names.

/// Change-stream messages JetStream acknowledged (`duplicate`: a replay it already had).
pub const CHANGE_STREAM_PUBLISHED: &str = "walcast_change_stream_published_total";
/// Change-stream publishes that failed (`kind`: `transient`, resent; `too_large`, skipped).
pub const CHANGE_STREAM_FAILURES: &str = "walcast_change_stream_failures_total";
/// Change-stream messages stored after a later one (a resend after a lost publish).
pub const CHANGE_STREAM_REORDERED: &str = "walcast_change_stream_reordered_total";
/// Time from sending a change-stream message to its PubAck.
pub const CHANGE_STREAM_ACK_SECONDS: &str = "walcast_change_stream_ack_seconds";
/// Change-stream messages handed to the sender and not yet acknowledged.
pub const CHANGE_STREAM_QUEUED: &str = "walcast_change_stream_queued";
/// Changes of streaming tables read (row changes and TRUNCATEs, `kind` label).
pub const CHANGE_STREAM_CHANGES: &str = "walcast_change_stream_changes_total";

// Snapshots (snapshot/).

/// Counter: snapshot rows published as READ events and acknowledged by JetStream.
pub const SNAPSHOT_ROWS: &str = "walcast_snapshot_rows_total";
/// Counter: snapshot rows read but not published because their row changed between the
/// chunk's watermarks (the change is on the stream, and newer).
pub const SNAPSHOT_ROWS_SUPERSEDED: &str = "walcast_snapshot_rows_superseded_total";
/// Counter: snapshot chunks (`outcome`: `stored`, or `retried`: read again under new
/// watermarks after a restart or a timeout).
pub const SNAPSHOT_CHUNKS: &str = "walcast_snapshot_chunks_total";
/// Gauge: snapshots running on this process (0 or 1 per source).
pub const SNAPSHOTS_RUNNING: &str = "walcast_snapshots_running";
/// Counter: snapshots that ended (`state`: done, cancelled, failed).
pub const SNAPSHOTS_ENDED: &str = "walcast_snapshots_ended_total";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        CHANGE_STREAM_PUBLISHED,
        "Change-stream messages JetStream acknowledged (duplicate=true: a replay the stream already had)"
    );
    metrics::describe_counter!(
        CHANGE_STREAM_FAILURES,
        "Change-stream publishes that failed (kind=transient: resent after a backoff; too_large: skipped and reported)"
    );
    metrics::describe_counter!(
        CHANGE_STREAM_REORDERED,
        "Change-stream messages stored after a later change (their first publish was lost, a resend landed after what followed)"
    );
    metrics::describe_histogram!(
        CHANGE_STREAM_ACK_SECONDS,
        "Seconds from sending a change-stream message to JetStream's acknowledgement"
    );
    metrics::describe_gauge!(
        CHANGE_STREAM_QUEUED,
        "Change-stream messages handed to the sender and not yet acknowledged"
    );
    metrics::describe_counter!(
        CHANGE_STREAM_CHANGES,
        "Changes of change-stream tables read from the WAL (kind: INSERT, UPDATE, DELETE, TRUNCATE), and snapshot rows (READ)"
    );
    metrics::describe_counter!(
        SNAPSHOT_ROWS,
        "Snapshot rows published on the change stream as READ events (JetStream acknowledged)"
    );
    metrics::describe_counter!(
        SNAPSHOT_ROWS_SUPERSEDED,
        "Snapshot rows not published because the row changed between the chunk's watermarks"
    );
    metrics::describe_counter!(
        SNAPSHOT_CHUNKS,
        "Snapshot chunks (outcome=stored, or retried: read again under new watermarks)"
    );
    metrics::describe_gauge!(SNAPSHOTS_RUNNING, "Snapshots running on this process");
    metrics::describe_counter!(
        SNAPSHOTS_ENDED,
        "Snapshots that ended (state: done, cancelled, failed)"
    );
}
