//! Every metric name of the front, each with its description (registered by
//! [`describe`]); code records metrics only through these names.

/// Gauge: open WebSocket connections.
pub const CONNECTIONS: &str = "walcast_front_connections";
/// Gauge: joined channels (WebSocket).
pub const CHANNELS: &str = "walcast_front_channels";
/// Gauge: open SSE streams.
pub const SSE_STREAMS: &str = "walcast_front_sse_streams";
/// Counter: SSE `?snapshot=true` reads, label `outcome` (`ok`, `too_large`, `refused`,
/// `unavailable`, `error`).
pub const SSE_SNAPSHOTS: &str = "walcast_front_sse_snapshots_total";
/// Counter: rows sent by SSE snapshots.
pub const SSE_SNAPSHOT_ROWS: &str = "walcast_front_sse_snapshot_rows_total";
/// Counter: changes not sent to an SSE snapshot stream because its rows already held them.
pub const SSE_SNAPSHOT_SKIPPED: &str = "walcast_front_sse_snapshot_skipped_changes_total";
/// Counter: joins, label `result` (`ok`, `error`).
pub const JOINS: &str = "walcast_front_joins_total";
/// Counter: frames received from clients.
pub const FRAMES_IN: &str = "walcast_front_frames_in_total";
/// Counter: frames written to clients.
pub const FRAMES_OUT: &str = "walcast_front_frames_out_total";
/// Counter: errors, label `kind`.
pub const ERRORS: &str = "walcast_front_errors_total";
/// Counter: limit rejections, label `limit`.
pub const LIMITS: &str = "walcast_front_limit_rejections_total";
/// Counter: `postgres_changes` messages queued to a channel or SSE stream.
pub const DELIVERIES: &str = "walcast_front_deliveries_total";
/// Counter: connections closed because their outbound queue was full.
pub const SLOW_CONSUMERS: &str = "walcast_front_slow_consumer_disconnects_total";
/// Counter: broadcasts received, label `source` (`socket`, `rest`, `bus`).
pub const BROADCASTS: &str = "walcast_front_broadcasts_total";

/// Counter: change messages dropped because this front already delivered them (a
/// replay after a leader change or a worker restart).
pub const REPLAYS_DROPPED: &str = "walcast_front_replays_dropped_total";

/// Counter: live copies of broadcasts a join already replayed, dropped.
pub const REPLAYED_LIVE_DROPPED: &str = "walcast_front_replayed_live_dropped_total";

/// Counter: messages dropped because they came from a leader term older than one this
/// front already received (a leader that woke up after losing its lease).
pub const STALE_TERM_DROPPED: &str = "walcast_front_stale_term_dropped_total";

/// Counter: change events and database broadcasts dropped because their project is not
/// on the source whose leader sent them (a source's database must never speak for
/// another source's project).
pub const FOREIGN_SOURCE_DROPPED: &str = "walcast_front_foreign_source_dropped_total";

/// Counter: subscriptions registered, by `path`: `worker` (the join waited for the
/// worker's answer) or `ready_class` (joined at once: its class was already delivered by
/// class to this front; registered with the worker in the background).
pub const REGISTRATIONS: &str = "walcast_front_registrations_total";

/// Counter: delivery-subject messages this front missed and got again from the leader.
pub const DELIVERY_RECOVERED: &str = "walcast_front_delivery_recovered_total";
/// Counter: delivery-subject messages this front missed for good (the leader no longer
/// had them, or did not resend them in time); each affected channel got a `system` error.
pub const DELIVERY_LOST: &str = "walcast_front_delivery_lost_total";
/// Counter: subscribers told that their project's source stopped streaming (`notice`
/// `failing`) or streams again (`streaming`), one per sink told.
pub const SOURCE_NOTICES: &str = "walcast_front_source_notices_total";
/// Counter: gaps given up (each told every `postgres_changes` channel of the front).
pub const DELIVERY_GAPS: &str = "walcast_front_delivery_gaps_total";
/// Counter: times this front's NATS connection was lost.
pub const BUS_DISCONNECTS: &str = "walcast_front_bus_disconnects_total";
/// Counter: `system` notices sent to channels after a NATS disconnect (broadcast and
/// presence messages of other fronts may have been missed).
pub const BROADCAST_GAP_NOTICES: &str = "walcast_front_broadcast_gap_notices_total";

/// Counter: fetches of the JWKS URL (`JWT_JWKS_URL`), by result: `ok`, `error` (the
/// keys of the last good fetch stay) or `skipped` (an unknown `kid` within
/// `JWT_JWKS_MIN_REFRESH_SECS` of the last fetch).
pub const JWKS_FETCHES: &str = "walcast_front_jwks_fetches_total";
/// Gauge: keys in the JWKS last fetched from `JWT_JWKS_URL`.
pub const JWKS_KEYS: &str = "walcast_front_jwks_keys";
/// Counter: reloads of the project list from the worker.
pub const PROJECT_REFRESHES: &str = "walcast_front_project_refreshes_total";

/// Counter: REST admin API errors, labels `status` and `error`.
pub const API_ERRORS: &str = "walcast_front_admin_api_errors_total";

/// Counter: management API requests, labels `op` and `status`.
pub const MANAGEMENT_REQUESTS: &str = "walcast_front_management_requests_total";
/// Counter: sockets ended because their project was deleted, suspended or made
/// private-only.
pub const PROJECT_SOCKETS_ENDED: &str = "walcast_front_project_sockets_ended_total";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    describe_sockets();
    describe_delivery();
    describe_links();
    describe_failures();
}

fn describe_sockets() {
    metrics::describe_gauge!(
        CONNECTIONS,
        "Open WebSocket connections (compare with MAX_CONNECTIONS)"
    );
    metrics::describe_gauge!(CHANNELS, "Joined channels over all WebSocket connections");
    metrics::describe_gauge!(SSE_STREAMS, "Open SSE streams");
    metrics::describe_counter!(
        SSE_SNAPSHOTS,
        "SSE ?snapshot=true reads, by outcome (ok, too_large, refused, unavailable, error)"
    );
    metrics::describe_counter!(SSE_SNAPSHOT_ROWS, "Rows sent by SSE snapshots");
    metrics::describe_counter!(
        SSE_SNAPSHOT_SKIPPED,
        "Changes not sent to an SSE snapshot stream because its rows already held them"
    );
    metrics::describe_counter!(JOINS, "Channel joins, by result (ok, error)");
    metrics::describe_counter!(FRAMES_IN, "Frames received from clients");
    metrics::describe_counter!(FRAMES_OUT, "Frames written to clients");
    metrics::describe_counter!(
        REGISTRATIONS,
        "Subscriptions registered, by path: worker (the join waited for the worker's answer) or \
         ready_class (joined at once: its class is already delivered to this front)"
    );
    metrics::describe_counter!(
        PROJECT_REFRESHES,
        "Reloads of the project list from the worker"
    );
    metrics::describe_counter!(
        JWKS_FETCHES,
        "Fetches of JWT_JWKS_URL, by result (ok, error: the last good keys stay, skipped: an \
         unknown kid within JWT_JWKS_MIN_REFRESH_SECS of the last fetch)"
    );
    metrics::describe_gauge!(JWKS_KEYS, "Keys in the JWKS last fetched from JWT_JWKS_URL");
}

fn describe_delivery() {
    metrics::describe_counter!(
        DELIVERIES,
        "postgres_changes messages queued to a channel or SSE stream"
    );
    metrics::describe_counter!(
        BROADCASTS,
        "Broadcasts received, by source (socket, rest, bus)"
    );
    metrics::describe_counter!(
        REPLAYS_DROPPED,
        "Change messages dropped because this front already delivered them (a replay after a \
         leader change or a worker restart)"
    );
    metrics::describe_counter!(
        REPLAYED_LIVE_DROPPED,
        "Live copies of broadcasts dropped because the channel's join already replayed them \
         from realtime.messages"
    );
    metrics::describe_counter!(
        FOREIGN_SOURCE_DROPPED,
        "Change events and database broadcasts dropped because their project is not on the \
         source (database) whose leader sent them"
    );
    metrics::describe_counter!(
        STALE_TERM_DROPPED,
        "Change messages dropped because they came from an older leader term than one already \
         received (a leader that woke up after losing its lease)"
    );
}

fn describe_links() {
    metrics::describe_counter!(
        DELIVERY_RECOVERED,
        "Delivery-subject messages this front missed (NATS dropped them) and got again from the leader"
    );
    metrics::describe_counter!(
        DELIVERY_LOST,
        "Delivery-subject messages this front missed for good (no longer kept by the leader, or \
         not resent within GAP_RECOVERY_MS); its postgres_changes channels got a system error"
    );
    metrics::describe_counter!(
        SOURCE_NOTICES,
        "Subscribers (channels, SSE streams) told that their project's source stopped \
         streaming (notice=failing) or streams again (notice=streaming)"
    );
    metrics::describe_counter!(
        DELIVERY_GAPS,
        "Gaps in the leader's stream to this front given up; each told every postgres_changes \
         channel of the front with a system error"
    );
    metrics::describe_counter!(
        BUS_DISCONNECTS,
        "Times this front's NATS connection was lost"
    );
    metrics::describe_counter!(
        BROADCAST_GAP_NOTICES,
        "System notices sent to channels after a NATS disconnect: broadcast and presence \
         messages of other fronts may have been missed meanwhile"
    );
}

fn describe_failures() {
    metrics::describe_counter!(ERRORS, "Errors, by kind");
    metrics::describe_counter!(
        LIMITS,
        "Requests refused by a limit, by limit (connections, frame_size, join_rate, channels, \
         bindings, sse_opens, presence_events, presence_payload, rest_broadcast, \
         waiting_frames)"
    );
    metrics::describe_counter!(
        SLOW_CONSUMERS,
        "WebSocket connections closed (1013) or SSE streams ended because their outbound queue \
         (OUTBOUND_QUEUE) was full"
    );
    metrics::describe_counter!(
        MANAGEMENT_REQUESTS,
        "Management API requests, by op (create, list, get, update, delete, rotate, snapshot_start, snapshot_list, snapshot_get, snapshot_cancel) and status"
    );
    metrics::describe_counter!(
        PROJECT_SOCKETS_ENDED,
        "WebSocket connections ended (system message, then close) because their project was \
         deleted, suspended or made private-only"
    );
    metrics::describe_counter!(
        API_ERRORS,
        "Refused or failed REST API requests, by status and error"
    );
}

pub(crate) fn error(kind: &'static str) {
    metrics::counter!(ERRORS, "kind" => kind).increment(1);
}

pub(crate) fn replayed_live_dropped() {
    metrics::counter!(REPLAYED_LIVE_DROPPED).increment(1);
}

pub(crate) fn limit(limit: &'static str) {
    metrics::counter!(LIMITS, "limit" => limit).increment(1);
}
