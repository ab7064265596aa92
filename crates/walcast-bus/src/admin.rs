//! Admin request/reply between the fronts and the cdc-worker.
//!
//! A ws-front has no database: to learn the projects (for verifying their keys) and to
//! enable or disable realtime on a table (its REST API), it asks the leading cdc-worker.
//! Same shape as the subscription registry ([`crate::subs`]): over NATS a JSON request on
//! [`SUBJECT_ADMIN`] answered on the reply inbox; in one process the front calls the
//! worker's [`AdminHandler`] directly.
//!
//! The NATS bus is the trusted internal bus (it already carries every row), so the
//! [`AdminRequest::Projects`] reply carries each project's JWT secret.

use serde::{Deserialize, Serialize};

use crate::subs::BoxFuture;

/// Request/reply subject the leading cdc-worker answers.
pub const SUBJECT_ADMIN: &str = "walcast.cdc.admin";

/// A project was changed through the management API (payload: its id): every front
/// refreshes its project directory at once.
pub const SUBJECT_PROJECTS_CHANGED: &str = "walcast.cdc.projects.changed";

/// What a front asks.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum AdminRequest {
    /// Every stored project (the default project is not stored).
    Projects,
    /// Enable or disable realtime on `table` of the project's schema (`public` for the
    /// default project, else `project_<hex>`).
    SetRealtime {
        project: String,
        table: String,
        enabled: bool,
    },
    /// The realtime-enabled tables of a project.
    ListTables { project: String },
    /// Whether a subscriber (its claims; `role` chooses the database role) may read
    /// (`write` false: SELECT) or write (INSERT) the private channel `topic`, under the
    /// app's policies on `realtime.messages` with `realtime.topic()` = `topic`.
    AuthorizeChannel {
        project: String,
        topic: String,
        claims: serde_json::Value,
        write: bool,
    },
    /// The broadcasts stored for a private channel `topic` since `since_ms` (Unix ms),
    /// oldest first, at most `limit` (broadcast replay).
    Replay {
        project: String,
        topic: String,
        since_ms: i64,
        limit: u32,
    },
    /// The rows of one table a subscriber may see (SSE `?snapshot=true`), read as the
    /// subscriber (its `role`, its claims: row-level security applies) in one read-only
    /// transaction, with the snapshot and the WAL position they were read at. Only a
    /// realtime-enabled table of the project's schema; `filter` and `select` as a
    /// `postgres_changes` binding's. More than `max_rows` rows or `max_bytes` bytes of
    /// them: refused (`TooLarge`), never cut short. With a `nonce` (over NATS), answered
    /// in parts on the reply inbox ([`parts`]), else in one reply.
    SnapshotRows {
        project: String,
        claims: serde_json::Value,
        schema: String,
        table: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        filter: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        select: Option<Vec<String>>,
        max_rows: u32,
        max_bytes: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<String>,
    },
    /// Management API: create a project (its secret in the reply).
    ProjectCreate {
        name: String,
        #[serde(default)]
        private_only: bool,
        /// The source its schema is created in; absent: the default source.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        source: Option<String>,
        /// Its own limits (each absent: the fronts' default), top-level fields.
        #[serde(flatten)]
        limits: ProjectLimits,
    },
    /// One stored project.
    ProjectGet { id: String },
    /// Change a stored project (`None`: unchanged).
    ProjectUpdate {
        id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        private_only: Option<bool>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        suspended: Option<bool>,
        /// Its limits, top-level fields: absent unchanged, `null` back to the fronts'
        /// default, a number set.
        #[serde(flatten)]
        limits: LimitChanges,
    },
    /// A new secret; the current one still accepted for `window_secs`.
    ProjectRotate { id: String, window_secs: u64 },
    /// Delete a project: realtime off on its tables, its row (and keys) gone.
    ProjectDelete { id: String },
    /// Queue a snapshot of a table whose change stream is on for `project` (see
    /// [`snapshots`]); `table` is `table` or `schema.table`, `filter` a `postgres_changes`
    /// filter (empty: every row).
    SnapshotStart {
        project: String,
        table: String,
        #[serde(default)]
        filter: String,
    },
    /// The project's snapshots, newest first, at most `limit`.
    SnapshotList { project: String, limit: u32 },
    /// One snapshot of the project.
    SnapshotGet { project: String, id: i64 },
    /// Cancel one queued or running snapshot of the project.
    SnapshotCancel { project: String, id: i64 },
}

impl AdminRequest {
    /// Requests that change something are answered one at a time, in arrival order (an
    /// enable is never overtaken by the disable sent after it); the others only read, and
    /// are answered side by side (see [`serve_nats`]).
    pub fn is_ordered(&self) -> bool {
        matches!(
            self,
            AdminRequest::SetRealtime { .. }
                | AdminRequest::ProjectCreate { .. }
                | AdminRequest::ProjectUpdate { .. }
                | AdminRequest::ProjectRotate { .. }
                | AdminRequest::ProjectDelete { .. }
                | AdminRequest::SnapshotStart { .. }
                | AdminRequest::SnapshotCancel { .. }
        )
    }
}

/// The largest per-project connected-users limit (`walcast.projects.max_concurrent_users`
/// is an `integer`); the same bound as every other limit's, [`MAX_LIMIT`].
pub const MAX_USERS_LIMIT: u64 = MAX_LIMIT;

mod limits;
pub use limits::{LimitChanges, LIMITS, MAX_LIMIT};

pub mod parts;
pub mod snapshots;
pub use snapshots::{SnapshotRecord, MAX_SNAPSHOT_LIST};

/// Read-only admin requests (channel checks, replays, lists) answered at once by a
/// worker; more wait for one of these to finish, so a flood of checks is bounded.
pub const CONCURRENT_READS: usize = 16;

/// A stored broadcast, replayed.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct StoredBroadcast {
    pub id: String,
    pub event: String,
    /// JSON text of the payload (with its `id`); `null` for a binary message.
    pub payload: String,
    /// The bytes of a binary message (`realtime.send_binary`), base64 in the reply.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "base64_bytes"
    )]
    pub binary: Option<Vec<u8>>,
}

/// `Option<Vec<u8>>` as a standard base64 string (absent or `null`: `None`).
mod base64_bytes {
    use base64::engine::general_purpose::STANDARD;
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
        match v {
            Some(b) => s.serialize_str(&STANDARD.encode(b)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
        let Some(text) = Option::<String>::deserialize(d)? else {
            return Ok(None);
        };
        STANDARD
            .decode(text.as_bytes())
            .map(Some)
            .map_err(serde::de::Error::custom)
    }
}

/// A stored project, as the worker tells the fronts.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct ProjectRecord {
    pub id: String,
    pub name: String,
    /// Its schema: `project_<uuid hex>`.
    pub schema: String,
    /// The source (database) its schema is in; absent: the default source.
    #[serde(default = "default_source")]
    pub source: String,
    /// HS256 secret of its keys and tokens.
    pub jwt_secret: String,
    /// Accepted too during a secret rotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_secret_previous: Option<String>,
    /// A JWKS (JSON text) for its users' public-key tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwks: Option<String>,
    /// RFC 3339, UTC.
    #[serde(default)]
    pub created_at: String,
    /// New sockets and joins refused, open ones ended.
    #[serde(default)]
    pub suspended: bool,
    /// Public channels refused.
    #[serde(default)]
    pub private_only: bool,
    /// The previous secret is accepted until then (Unix ms); absent: without end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jwt_secret_previous_until_ms: Option<i64>,
    /// Its own limits (each absent: the fronts' default), top-level fields of the record
    /// (`max_concurrent_users`, …), not a nested object.
    #[serde(flatten)]
    pub limits: ProjectLimits,
}

fn default_source() -> String {
    crate::source::DEFAULT_SOURCE.to_string()
}

/// A project's own limits (README "Running a platform"); each `None` is the fronts'
/// default (`PROJECT_MAX_USERS`, `PROJECT_MAX_JOINS_PER_SECOND`, …). Flattened into
/// [`ProjectRecord`], so each is a top-level field of the record.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProjectLimits {
    /// Connected users (sockets with a joined channel, SSE streams), across the fronts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_users: Option<u32>,
    /// Channel joins per second, across the fronts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_joins_per_second: Option<u32>,
    /// Channels one socket may have joined at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_channels_per_client: Option<u32>,
    /// Broadcast and presence messages per second, received and sent, across the fronts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_events_per_second: Option<u32>,
    /// Bytes of those messages per second, across the fronts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes_per_second: Option<u32>,
    /// Presence track and untrack events per second, across the fronts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_presence_events_per_second: Option<u32>,
    /// The largest broadcast or presence payload, in KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_payload_size_in_kb: Option<u32>,
}

/// Rows a subscriber may see, and where they stand in the change stream.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRows {
    /// `pg_current_snapshot()` of the read (`xmin:xmax:xip,…`).
    pub snapshot: String,
    /// `pg_current_wal_insert_lsn()` read after the snapshot was taken.
    pub lsn: walcast_core::Lsn,
    /// The columns of every record, in table order.
    pub columns: Vec<crate::ColumnInfo>,
    /// Each row as a JSON object (the form of a change's `record`).
    pub rows: Vec<String>,
}

/// A table of a project.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TableName {
    pub schema: String,
    pub table: String,
}

/// The roles API tokens usually act as, whose subscribers an enable reply warns about
/// when they may not read the table.
pub const API_ROLES: &[&str] = &["anon", "authenticated", "service_role"];

/// What to tell whoever enabled a table that `roles` may not read (`None`: all may).
pub fn unreadable_note(schema: &str, table: &str, roles: &[String]) -> Option<String> {
    if roles.is_empty() {
        return None;
    }
    let q = walcast_core::sql::qualified(schema, table);
    let quoted: Vec<String> = roles
        .iter()
        .map(|r| walcast_core::sql::quote_ident(r))
        .collect();
    Some(format!(
        "{} may not SELECT {q}, so subscribers acting as {} receive nothing from it; if \
         they should: GRANT SELECT ON {q} TO {};",
        roles.join(" and "),
        if roles.len() == 1 {
            "that role"
        } else {
            "those roles"
        },
        quoted.join(", ")
    ))
}

/// A successful answer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(tag = "reply", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)]
pub enum AdminReply {
    Projects {
        projects: Vec<ProjectRecord>,
    },
    Realtime {
        schema: String,
        table: String,
        /// Whether realtime is now enabled.
        enabled: bool,
        /// Whether this request changed anything.
        changed: bool,
        /// Enabled: the API roles (`anon`, `authenticated`, `service_role`, those that
        /// exist) that may not read the table — their subscribers would get nothing.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        unreadable_by: Vec<String>,
    },
    Tables {
        tables: Vec<TableName>,
    },
    Authorized {
        allowed: bool,
    },
    Replayed {
        messages: Vec<StoredBroadcast>,
    },
    /// See [`AdminRequest::SnapshotRows`].
    SnapshotRows(SnapshotRows),
    /// A project created, read, changed or rotated.
    Project {
        project: ProjectRecord,
    },
    /// A project deleted, and the tables it streamed.
    ProjectDeleted {
        id: String,
        tables: Vec<TableName>,
    },
    /// A project's snapshots.
    Snapshots {
        snapshots: Vec<SnapshotRecord>,
    },
    /// One snapshot (`None`: the project has no such snapshot); `cancelled`: a
    /// [`AdminRequest::SnapshotCancel`] cancelled it.
    Snapshot {
        snapshot: Option<SnapshotRecord>,
        #[serde(default)]
        cancelled: bool,
    },
}

/// Why a request failed.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AdminErrorKind {
    UnknownProject,
    UnknownTable,
    NoPrimaryKey,
    /// A management request the worker refuses (an empty or too long name).
    InvalidRequest,
    /// A partitioned table (wal2json names its partitions, never the table).
    PartitionedTable,
    /// No cdc-worker answered (none leads, or NATS is down), or it answered nonsense.
    Unavailable,
    /// The subscriber may not read what it asked (its token, its role).
    Refused,
    /// More than the request's bound (rows, bytes).
    TooLarge,
    /// A snapshot of a table whose change stream is off for the project.
    NotStreaming,
    /// A filter that does not parse, or does not fit the table's columns and types.
    InvalidFilter,
    /// The source's snapshot queue is full.
    QueueFull,
    Internal,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct AdminError {
    pub kind: AdminErrorKind,
    pub message: String,
}

impl AdminError {
    pub fn new(kind: AdminErrorKind, message: impl Into<String>) -> AdminError {
        AdminError {
            kind,
            message: message.into(),
        }
    }

    fn unavailable(message: impl Into<String>) -> AdminError {
        AdminError::new(AdminErrorKind::Unavailable, message)
    }
}

/// The wire form of an answer (built once per answer, serialised at once: a project
/// record with its limits in place costs less than boxing it).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)]
enum Response {
    Ok(AdminReply),
    Error(AdminError),
}

/// The worker side.
pub trait AdminHandler: Send + Sync + 'static {
    fn handle(&self, req: AdminRequest) -> BoxFuture<Result<AdminReply, AdminError>>;
}

mod client;
mod server;
pub(crate) use client::unexpected;
pub use client::AdminClient;
pub use server::serve_nats;

#[cfg(test)]
mod tests;
