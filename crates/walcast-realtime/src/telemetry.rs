//! Every metric name of realtime delivery, each with its description (registered by
//! [`describe`]); code records metrics only through these names.

/// Counter: broadcasts from the database published to the fronts (label `payload`:
/// `json` for `realtime.send`, `binary` for `realtime.send_binary`).
pub const DB_BROADCASTS: &str = "walcast_cdc_db_broadcasts_total";
/// Counter: changes whose audience was split over several messages to fit the bus.
pub const CHANGES_SPLIT: &str = "walcast_cdc_changes_split_total";
/// Counter: catalog reads kept although their snapshot was ahead of the position judged,
/// because no DDL in between touched the tables read.
pub const CATALOG_AHEAD_KEPT: &str = "walcast_realtime_catalog_ahead_kept_total";
/// Gauge: how long the oldest change waiting in a delivery lane has waited, in seconds
/// (label `lane`: the project, or `shared-…`).
pub const LANE_LAG: &str = "walcast_realtime_lane_lag_seconds";
/// Counter: changes not checked nor delivered to their subscribers because their project
/// lagged past its bound (label `reason`: `lag` or `bytes`).
pub const CHANGES_LAGGED: &str = "walcast_realtime_changes_lagged_total";
/// Counter: subscriptions told (`system` error) that changes were skipped for lag.
pub const LAG_NOTICES: &str = "walcast_realtime_lag_notices_total";
/// Counter: (change, subscription) pairs withheld because the subscription's checks could
/// not judge the change (labels `project`, `reason`: timeout, cancelled, failed, catalog,
/// superseded).
pub const UNJUDGED: &str = "walcast_realtime_unjudged_total";
/// Counter: subscriptions told (`system` error) that a change could not be judged for
/// them (label `project`).
pub const UNJUDGED_NOTICES: &str = "walcast_realtime_unjudged_notices_total";

/// Counter: bytes of change messages published (payloads: table subjects and the
/// fronts' delivery subjects).
pub const PUBLISHED_BYTES: &str = "walcast_cdc_published_bytes_total";
/// Counter: change messages published.
pub const PUBLISHED_MESSAGES: &str = "walcast_cdc_published_messages_total";
/// Gauge: the largest change message published since start, in bytes.
pub const LARGEST_MESSAGE: &str = "walcast_cdc_largest_message_bytes";

/// Counter: check statements sent, one per (table, role, claims) group per batch whose
/// role's policies make a condition.
pub const RLS_CHECKS: &str = "walcast_cdc_rls_checks_total";
/// Counter: (change, subscriber) pairs not delivered by the authorizer.
pub const RLS_DENIED: &str = "walcast_cdc_rls_denied_total";
/// Counter: failed checks (each denies its own subscribers only).
pub const RLS_ERRORS: &str = "walcast_cdc_rls_errors_total";
/// Counter: INSERT/UPDATE versions judged by their row's current state instead of their
/// own values, because they lack a value the policies read.
pub const RLS_CURRENT_ROW: &str = "walcast_cdc_rls_current_row_total";
/// Counter: deliveries withheld because a version judged by its row's current state was
/// no longer that state when checked.
pub const RLS_SUPERSEDED: &str = "walcast_cdc_rls_superseded_total";
/// Counter: checks run although a transaction decoded before them was still not visible
/// after waiting 2 s.
pub const RLS_INVISIBLE: &str = "walcast_cdc_rls_invisible_total";
/// Counter: (change, subscriber) pairs whose old version (a DELETE's row, an UPDATE's
/// `old_record`) lacks a value the policies read: it cannot be judged, so nothing of it
/// is sent.
pub const RLS_OLD_UNJUDGED: &str = "walcast_cdc_rls_old_unjudged_total";

// Each front's numbered stream (delivery/links.rs).

/// Counter: delivery-subject messages sent again at a front's request.
pub const FRONT_RESENT: &str = "walcast_cdc_front_resent_total";
/// Counter: delivery-subject messages a front asked for that were no longer kept.
pub const FRONT_RESEND_LOST: &str = "walcast_cdc_front_resend_lost_total";
/// Gauge: bytes kept for resending, all fronts together.
pub const FRONT_KEPT_BYTES: &str = "walcast_cdc_front_kept_bytes";

// Subscriptions and matching.

/// Counter: Row changes decoded from the slot for enabled tables.
pub const CHANGES_DECODED: &str = "walcast_cdc_changes_decoded_total";
/// Counter: Row changes published to the bus.
pub const CHANGES_PUBLISHED: &str = "walcast_cdc_changes_published_total";
/// Histogram: Time to authorize one batch of changes (RLS and column privileges), in seconds.
pub const AUTHORIZE_SECONDS: &str = "walcast_cdc_authorize_seconds";
/// Gauge: Subscriptions the leader matches changes against.
pub const SUBSCRIPTIONS: &str = "walcast_cdc_subscriptions";
/// Counter: Subscriptions registered (or registered again) by fronts.
pub const SUBSCRIPTIONS_REGISTERED: &str = "walcast_cdc_subscriptions_registered_total";
/// Histogram: Subscriptions handled together in one registration batch.
pub const REGISTRATION_BATCH: &str = "walcast_cdc_registration_batch_subscriptions";
/// Counter: subscriptions refused because their class key names a class with other
/// fields (a hash collision or a forged key; never merged).
pub const CLASS_COLLISIONS: &str = "walcast_cdc_class_collisions_total";
/// Counter: subscriptions refused because their class would be one too many, label
/// `limit` (`project` or `front`; see `CDC_MAX_CLASSES_PER_PROJECT` / `_PER_FRONT`).
pub const CLASSES_REFUSED: &str = "walcast_cdc_classes_refused_total";
/// Counter: Subscription filters that could not be evaluated against a change (the change is not delivered to them).
pub const FILTER_ERRORS: &str = "walcast_cdc_filter_errors_total";
/// Classes whose filter a change was not evaluated against by its lag bound.
pub const FILTERS_UNEVALUATED: &str = "walcast_cdc_filters_unevaluated_total";
/// Memory of the compiled patterns of the classes kept.
pub const FILTER_BYTES: &str = "walcast_cdc_filter_bytes";
/// Counter: (change, subscriber) pairs withheld because the subscription's filter reads a
/// column its role may not `SELECT` at that change.
pub const FILTER_UNREADABLE: &str = "walcast_cdc_filter_unreadable_total";
/// Counter: subscriptions told (once per table) that their filter reads a column their
/// role may not `SELECT`, so that table's changes are withheld from them.
pub const FILTER_UNREADABLE_NOTICES: &str = "walcast_cdc_filter_unreadable_notices_total";
/// Counter: subscriptions told (once per table) that their role may not `SELECT` their
/// table at all, so none of its changes reach them.
pub const TABLE_UNREADABLE_NOTICES: &str = "walcast_cdc_table_unreadable_notices_total";

// Catalog and DDL at their WAL position.

/// Counter: catalog reads whose snapshot did not show the state at the position being
/// judged (a later DDL already visible, or a decoded one not yet): what depended on them
/// was withheld.
pub const CATALOG_AHEAD: &str = "walcast_cdc_catalog_moved_total";
/// Counter: catalog reads whose snapshot showed a later DDL, answered with the state the
/// position's notice carried instead (exact for the table; nothing withheld).
pub const CATALOG_CARRIED: &str = "walcast_cdc_catalog_carried_total";
/// Counter: DDL notices (`walcast.ddl` logical messages) decoded, label `tag`.
pub const DDL_NOTICES: &str = "walcast_cdc_ddl_notices_total";
/// Counter: realtime tables dropped (their subscriptions ended with a system message).
pub const TABLES_DROPPED: &str = "walcast_cdc_tables_dropped_total";
/// Counter: subscriptions ended because their table was dropped.
pub const SUBS_ENDED: &str = "walcast_cdc_subscriptions_ended_total";
/// Gauge: 1 when DDL and privilege changes are tracked at their WAL position by the
/// event triggers, 0 when every batch re-reads the catalog instead.
pub const DDL_EVENT_TRIGGER: &str = "walcast_cdc_ddl_event_trigger";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    describe_catalog();
    describe_rls();
    describe_publishing();
    describe_pipeline();
}

fn describe_catalog() {
    metrics::describe_counter!(
        CATALOG_AHEAD,
        "Catalog reads whose snapshot did not show the privileges and columns at the WAL position \
         being judged (a later DDL already committed, or a decoded one not yet visible); the \
         deliveries depending on them were withheld"
    );
    metrics::describe_counter!(
        CATALOG_CARRIED,
        "Catalog reads whose snapshot already showed a later DDL, answered instead with the table \
         state carried by the notice at the position being judged"
    );
    metrics::describe_counter!(
        DDL_NOTICES,
        "DDL and privilege notices (event-trigger logical messages) decoded, by command tag"
    );
    metrics::describe_counter!(
        TABLES_DROPPED,
        "Realtime tables dropped; their subscribers got a system error"
    );
    metrics::describe_counter!(
        SUBS_ENDED,
        "Subscriptions ended by the worker because their table was dropped"
    );
    metrics::describe_gauge!(
        DDL_EVENT_TRIGGER,
        "1: DDL and GRANT/REVOKE apply at their WAL position (event triggers); 0: no event \
         trigger, each batch re-reads the catalog (see the README)"
    );
}

fn describe_rls() {
    metrics::describe_counter!(
        RLS_CHECKS,
        "Row-level-security check statements run (one per table, role and claims group per batch)"
    );
    metrics::describe_counter!(
        RLS_DENIED,
        "Change deliveries refused by the authorizer (no role, no privilege, not visible under RLS, failed check)"
    );
    metrics::describe_counter!(
        RLS_ERRORS,
        "Row-level-security checks that failed; their subscribers were denied, the others served"
    );
    metrics::describe_counter!(
        RLS_CURRENT_ROW,
        "INSERT/UPDATE versions judged by the row's current state instead of their own values, \
         because they lack a value the policies read: an unchanged TOASTed column left out of an \
         UPDATE (REPLICA IDENTITY other than FULL), a column added since, or a NULL in a numeric, \
         real or double precision column (wal2json writes NaN and Infinity as null)"
    );
    metrics::describe_counter!(
        RLS_SUPERSEDED,
        "Deliveries withheld because a version judged by its row's current state (see \
         walcast_cdc_rls_current_row_total) was no longer that state when checked: it cannot be judged"
    );
    metrics::describe_counter!(
        RLS_OLD_UNJUDGED,
        "Old versions (a DELETE's row, an UPDATE's old_record) lacking a value the policies read \
         (REPLICA IDENTITY other than FULL): they cannot be judged, so nothing of them is sent \
         (no DELETE, an empty old_record), per subscriber"
    );
    metrics::describe_counter!(
        RLS_INVISIBLE,
        "Row-level-security checks run although a transaction decoded before them was still not \
         visible to new snapshots after 2 s (a commit held by a synchronous standby): policies \
         reading other tables saw the state before it"
    );
}

fn describe_publishing() {
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
        CHANGES_SPLIT,
        "Changes whose subscriber list was split over several bus messages"
    );
    metrics::describe_counter!(
        CATALOG_AHEAD_KEPT,
        "Catalog reads kept although the snapshot was ahead of the WAL position judged, because no DDL in between touched the tables read (walcast.catalog_log)"
    );
    metrics::describe_gauge!(
        LANE_LAG,
        "Age of the oldest change waiting in a project's delivery lane, in seconds (label lane)"
    );
    metrics::describe_counter!(
        CHANGES_LAGGED,
        "Changes skipped for their subscribers because their project lagged past REALTIME_MAX_LAG_MS or REALTIME_MAX_LAG_BYTES (label reason)"
    );
    metrics::describe_counter!(
        LAG_NOTICES,
        "Subscriptions told with a system error that changes were skipped because their project lagged"
    );
    metrics::describe_counter!(
        UNJUDGED,
        "Changes withheld from a subscription because its row-level security could not be judged \
         (label project; reason: timeout, cancelled, failed, catalog, superseded); the subscription is told"
    );
    metrics::describe_counter!(
        UNJUDGED_NOTICES,
        "Subscriptions told with a system error that a change could not be judged for them (label project)"
    );
    metrics::describe_counter!(
        FRONT_RESENT,
        "Delivery-subject messages sent again because a front missed them (NATS dropped them)"
    );
    metrics::describe_counter!(
        FRONT_RESEND_LOST,
        "Delivery-subject messages a front asked for again that the leader no longer kept \
         (CDC_RESEND_MAX_MESSAGES / _BYTES / _SECS); the front told its channels"
    );
    metrics::describe_gauge!(
        FRONT_KEPT_BYTES,
        "Bytes of delivery-subject messages kept for resending, all fronts together"
    );
}

fn describe_pipeline() {
    metrics::describe_counter!(
        DB_BROADCASTS,
        "Broadcasts from the database published to the fronts (label payload: json for realtime.send and realtime.broadcast_changes, binary for realtime.send_binary)"
    );
    metrics::describe_counter!(
        CHANGES_DECODED,
        "Row changes decoded from the slot for enabled tables"
    );
    metrics::describe_counter!(CHANGES_PUBLISHED, "Row changes published to the bus");
    metrics::describe_counter!(
        CLASS_COLLISIONS,
        "Subscriptions refused because their class key names a class with other fields (never merged)"
    );
    metrics::describe_counter!(
        CLASSES_REFUSED,
        "Subscriptions refused because their class would exceed the classes allowed per project or per front (label limit)"
    );
    metrics::describe_histogram!(
        AUTHORIZE_SECONDS,
        "Time to authorize one batch of changes (RLS and column privileges), in seconds"
    );
    metrics::describe_gauge!(
        SUBSCRIPTIONS,
        "Subscriptions the leader matches changes against"
    );
    metrics::describe_counter!(
        SUBSCRIPTIONS_REGISTERED,
        "Subscriptions registered (or registered again) by fronts"
    );
    metrics::describe_histogram!(
        REGISTRATION_BATCH,
        "Subscriptions handled together in one registration batch"
    );
    metrics::describe_counter!(FILTER_ERRORS, "Subscription filters that could not be evaluated against a change (the change is not delivered to them)");
    metrics::describe_counter!(FILTERS_UNEVALUATED, "Classes whose filter a change was not evaluated against before its project's lag bound (their subscribers told the change could not be judged)");
    metrics::describe_gauge!(FILTER_BYTES, metrics::Unit::Bytes, "Memory of the compiled filter patterns of the subscription classes kept (bounded per project by CDC_MAX_FILTER_BYTES_PER_PROJECT and in all by CDC_MAX_FILTER_BYTES)");
    metrics::describe_counter!(
        FILTER_UNREADABLE,
        "Deliveries withheld because the subscription's filter reads a column its role may not \
         SELECT at that change (revoked since the join, or a table enabled after a wildcard binding)"
    );
    metrics::describe_counter!(
        TABLE_UNREADABLE_NOTICES,
        "Subscriptions told with a system error (once per table) that their role may not SELECT \
         their table at all, so none of its changes reach them"
    );
    metrics::describe_counter!(
        FILTER_UNREADABLE_NOTICES,
        "Subscriptions told with a system error (once per table) that their filter reads a column \
         their role may not SELECT, so that table's changes are withheld from them"
    );
}
