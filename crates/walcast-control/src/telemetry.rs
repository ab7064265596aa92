//! Every metric name of the control plane, each with its description (registered by
//! [`describe`]); code records metrics only through these names.

/// Counter: stored secrets that could not be decrypted (altered, moved to another row or
/// column, plain text), their row left out of what was read (label `table`: projects,
/// sources).
pub const SECRETS_UNREADABLE: &str = "walcast_secrets_unreadable_total";
/// Counter: changes and broadcasts read from a source's database for a project not on
/// that source, dropped (label `what`: change, broadcast, registration, admin).
pub const FOREIGN_PROJECT_DROPPED: &str = "walcast_source_foreign_project_dropped_total";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        SECRETS_UNREADABLE,
        "Stored secrets (a project's JWT secret, a source's URL) that could not be decrypted with SECRETS_KEY: altered, moved to another row or column, or plain text; the row is left out (label table)"
    );
    metrics::describe_counter!(
        FOREIGN_PROJECT_DROPPED,
        "Things a source's database named for a project not on that source, dropped (label what: change, broadcast, registration, admin)"
    );
}
