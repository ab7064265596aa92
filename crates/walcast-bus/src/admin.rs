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

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::subs::BoxFuture;
use crate::Bus;

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
    /// (`max_concurrent_users`, … as before they were grouped).
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

/// The front side: over NATS, or calling the worker in process.
///
/// Requests about a project's tables and channels go to the leader of the project's
/// source ([`AdminClient::request_to`]); the project list and management requests to the
/// default source's leader, which keeps the control database.
#[derive(Clone)]
pub struct AdminClient {
    /// The in-process worker (`walcast serve`): answers the default source.
    local: Option<Arc<dyn AdminHandler>>,
    nats: Option<async_nats::Client>,
}

impl AdminClient {
    /// Over NATS when `bus` is NATS; the default source in process when a local handler
    /// is given.
    pub fn new(bus: &Bus, local: Option<Arc<dyn AdminHandler>>) -> Result<AdminClient, AdminError> {
        let nats = match bus {
            Bus::Nats(b) => Some(b.client().clone()),
            Bus::Local(_) => None,
        };
        if nats.is_none() && local.is_none() {
            return Err(AdminError::unavailable(
                "an in-process bus needs the worker's admin handler",
            ));
        }
        Ok(AdminClient { local, nats })
    }

    /// In process only: every request to `handler` (the default source), none elsewhere.
    pub fn local(handler: Arc<dyn AdminHandler>) -> AdminClient {
        AdminClient {
            local: Some(handler),
            nats: None,
        }
    }

    /// Send one request to the default source's leader; the answer within `timeout`, or an
    /// `Unavailable` error.
    pub async fn request(
        &self,
        req: AdminRequest,
        timeout: Duration,
    ) -> Result<AdminReply, AdminError> {
        self.request_to(crate::source::DEFAULT_SOURCE, req, timeout)
            .await
    }

    /// Send one request to the leader of `source`.
    pub async fn request_to(
        &self,
        source: &str,
        req: AdminRequest,
        timeout: Duration,
    ) -> Result<AdminReply, AdminError> {
        if let (true, Some(h)) = (crate::source::is_default(source), &self.local) {
            return tokio::time::timeout(timeout, h.handle(req))
                .await
                .map_err(|_| AdminError::unavailable("the admin request timed out"))?;
        }
        let Some(c) = &self.nats else {
            return Err(AdminError::unavailable(format!(
                "source {source:?} is served over NATS only"
            )));
        };
        let body = serde_json::to_vec(&req)
            .map_err(|e| AdminError::new(AdminErrorKind::Internal, e.to_string()))?;
        let subject = crate::source::subject(source, SUBJECT_ADMIN);
        let msg = tokio::time::timeout(timeout, c.request(subject, Bytes::from(body)))
            .await
            .map_err(|_| {
                AdminError::unavailable(format!(
                    "no cdc-worker leading source {source:?} answered the admin request in time"
                ))
            })?
            .map_err(|e| {
                AdminError::unavailable(format!(
                    "no cdc-worker leading source {source:?} answered the admin request: {e}"
                ))
            })?;
        match serde_json::from_slice::<Response>(&msg.payload) {
            Ok(Response::Ok(r)) => Ok(r),
            Ok(Response::Error(e)) => Err(e),
            Err(e) => Err(AdminError::unavailable(format!("bad admin reply: {e}"))),
        }
    }

    /// Every stored project.
    pub async fn projects(&self, timeout: Duration) -> Result<Vec<ProjectRecord>, AdminError> {
        match self.request(AdminRequest::Projects, timeout).await? {
            AdminReply::Projects { projects } => Ok(projects),
            other => Err(unexpected(&other)),
        }
    }

    /// Enable or disable realtime on a table of the project's schema (at the leader of
    /// its `source`).
    pub async fn set_realtime(
        &self,
        source: &str,
        project: &str,
        table: &str,
        enabled: bool,
        timeout: Duration,
    ) -> Result<AdminReply, AdminError> {
        let req = AdminRequest::SetRealtime {
            project: project.to_string(),
            table: table.to_string(),
            enabled,
        };
        match self.request_to(source, req, timeout).await? {
            r @ AdminReply::Realtime { .. } => Ok(r),
            other => Err(unexpected(&other)),
        }
    }

    /// The realtime-enabled tables of a project (of its `source`).
    pub async fn list_tables(
        &self,
        source: &str,
        project: &str,
        timeout: Duration,
    ) -> Result<Vec<TableName>, AdminError> {
        let req = AdminRequest::ListTables {
            project: project.to_string(),
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Tables { tables } => Ok(tables),
            other => Err(unexpected(&other)),
        }
    }
}

impl AdminClient {
    /// See [`AdminRequest::AuthorizeChannel`] (at the leader of the project's `source`).
    pub async fn authorize_channel(
        &self,
        source: &str,
        project: &str,
        topic: &str,
        claims: &serde_json::Value,
        write: bool,
        timeout: Duration,
    ) -> Result<bool, AdminError> {
        let req = AdminRequest::AuthorizeChannel {
            project: project.to_string(),
            topic: topic.to_string(),
            claims: claims.clone(),
            write,
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Authorized { allowed } => Ok(allowed),
            other => Err(unexpected(&other)),
        }
    }
}

impl AdminClient {
    /// See [`AdminRequest::Replay`] (at the leader of the project's `source`).
    pub async fn replay(
        &self,
        source: &str,
        project: &str,
        topic: &str,
        since_ms: i64,
        limit: u32,
        timeout: Duration,
    ) -> Result<Vec<StoredBroadcast>, AdminError> {
        let req = AdminRequest::Replay {
            project: project.to_string(),
            topic: topic.to_string(),
            since_ms,
            limit,
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Replayed { messages } => Ok(messages),
            other => Err(unexpected(&other)),
        }
    }
}

impl AdminClient {
    /// See [`AdminRequest::SnapshotRows`] (`req`), at the leader of the project's `source`:
    /// over NATS in parts ([`parts`]), each admitted by `admit` before it is kept; all of
    /// them within `timeout`.
    pub async fn snapshot_rows(
        &self,
        source: &str,
        req: AdminRequest,
        timeout: Duration,
        admit: &mut parts::Admit<'_>,
    ) -> Result<SnapshotRows, AdminError> {
        let in_process = crate::source::is_default(source) && self.local.is_some();
        match (&self.nats, in_process) {
            (Some(c), false) => {
                let c = c.clone();
                let source = source.to_string();
                tokio::time::timeout(timeout, snapshot_parts(&c, &source, req, admit))
                    .await
                    .map_err(|_| {
                        AdminError::unavailable(format!(
                            "the snapshot's rows did not all come in time from source {source:?}"
                        ))
                    })?
            }
            _ => match self.request_to(source, req, timeout).await? {
                AdminReply::SnapshotRows(rows) => {
                    let bytes = rows.rows.iter().map(String::len).sum();
                    admit(rows.rows.len(), bytes)?;
                    Ok(rows)
                }
                other => Err(unexpected(&other)),
            },
        }
    }
}

/// Ask for `req` in parts on an inbox of its own, and take them (see [`parts`]).
async fn snapshot_parts(
    c: &async_nats::Client,
    source: &str,
    mut req: AdminRequest,
    admit: &mut parts::Admit<'_>,
) -> Result<SnapshotRows, AdminError> {
    use futures_util::StreamExt;
    let nonce = parts::nonce();
    let AdminRequest::SnapshotRows {
        max_rows,
        max_bytes,
        nonce: asked,
        ..
    } = &mut req
    else {
        return Err(AdminError::new(
            AdminErrorKind::Internal,
            "not a snapshot request",
        ));
    };
    *asked = Some(nonce.clone());
    let mut reassembly = parts::Reassembly::new(&nonce, *max_rows, *max_bytes);
    let no_worker = |e: &dyn std::fmt::Display| {
        AdminError::unavailable(format!(
            "no cdc-worker leading source {source:?} answered the snapshot request: {e}"
        ))
    };
    let body = serde_json::to_vec(&req)
        .map_err(|e| AdminError::new(AdminErrorKind::Internal, e.to_string()))?;
    let inbox = c.new_inbox();
    let mut sub = c
        .subscribe(inbox.clone())
        .await
        .map_err(|e| no_worker(&e))?;
    let subject = crate::source::subject(source, SUBJECT_ADMIN);
    c.publish_with_reply(subject, inbox, Bytes::from(body))
        .await
        .map_err(|e| no_worker(&e))?;
    loop {
        let Some(msg) = sub.next().await else {
            return Err(no_worker(&"the inbox closed"));
        };
        if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(no_worker(&"no responders"));
        }
        if let parts::Step::Done(rows) = reassembly.take(&msg.payload, admit)? {
            return Ok(rows);
        }
    }
}

impl AdminClient {
    /// A management request answered with a project (create, get, update, rotate).
    pub async fn project(
        &self,
        req: AdminRequest,
        timeout: Duration,
    ) -> Result<ProjectRecord, AdminError> {
        match self.request(req, timeout).await? {
            AdminReply::Project { project } => Ok(project),
            other => Err(unexpected(&other)),
        }
    }

    /// See [`AdminRequest::ProjectDelete`]: the tables it streamed.
    pub async fn delete_project(
        &self,
        id: &str,
        timeout: Duration,
    ) -> Result<Vec<TableName>, AdminError> {
        let req = AdminRequest::ProjectDelete { id: id.to_string() };
        match self.request(req, timeout).await? {
            AdminReply::ProjectDeleted { tables, .. } => Ok(tables),
            other => Err(unexpected(&other)),
        }
    }
}

pub(crate) fn unexpected(reply: &AdminReply) -> AdminError {
    AdminError::unavailable(format!("unexpected admin reply {reply:?}"))
}

/// Worker side over NATS: answer admin requests until `shutdown` completes. Requests
/// that change something are answered one at a time in arrival order (an enable is never
/// overtaken by the disable sent after it); read-only ones (private-channel checks,
/// replays, lists) side by side, at most [`CONCURRENT_READS`] at once, so one slow check
/// or a burst of them does not hold every other front's request.
pub async fn serve_nats(
    bus: &Bus,
    source: &str,
    handler: Arc<dyn AdminHandler>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), crate::BusError> {
    use futures_util::StreamExt;
    let Bus::Nats(nats) = bus else {
        return Ok(());
    };
    let client = nats.client().clone();
    let mut requests = client
        .subscribe(crate::source::subject(source, SUBJECT_ADMIN))
        .await
        .map_err(crate::BusError::Subscribe)?;
    let reads = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_READS));
    tokio::pin!(shutdown);
    loop {
        let msg = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            m = requests.next() => match m {
                Some(m) => m,
                None => return Err(crate::BusError::Closed("admin subscription")),
            },
        };
        let Some(reply_to) = msg.reply else { continue };
        let req = match serde_json::from_slice::<AdminRequest>(&msg.payload) {
            Ok(req) => req,
            Err(e) => {
                tracing::warn!(error = %e, "malformed admin request");
                let refusal = Response::Error(AdminError::new(
                    AdminErrorKind::Internal,
                    format!("malformed admin request: {e}"),
                ));
                answer(&client, reply_to, refusal).await;
                continue;
            }
        };
        if req.is_ordered() {
            let response = respond(handler.as_ref(), req).await;
            answer(&client, reply_to, response).await;
            continue;
        }
        let Ok(permit) = reads.clone().acquire_owned().await else {
            continue;
        };
        let (client, handler) = (client.clone(), handler.clone());
        walcast_core::source_scope::spawn(async move {
            match parts_nonce(&req) {
                Some(nonce) => {
                    let rows = match handler.handle(req).await {
                        Ok(AdminReply::SnapshotRows(rows)) => Ok(rows),
                        Ok(other) => Err(unexpected(&other)),
                        Err(e) => Err(e),
                    };
                    send_parts(&client, reply_to, &nonce, rows).await;
                }
                None => {
                    let response = respond(handler.as_ref(), req).await;
                    answer(&client, reply_to, response).await;
                }
            }
            drop(permit);
        });
    }
}

async fn respond(handler: &dyn AdminHandler, req: AdminRequest) -> Response {
    match handler.handle(req).await {
        Ok(r) => Response::Ok(r),
        Err(e) => Response::Error(e),
    }
}

/// The nonce of a snapshot request answered in parts (one that may be echoed; another is
/// answered in one reply, as from a front that predates parts).
fn parts_nonce(req: &AdminRequest) -> Option<String> {
    match req {
        AdminRequest::SnapshotRows { nonce: Some(n), .. } if parts::nonce_ok(n) => Some(n.clone()),
        _ => None,
    }
}

fn max_payload(client: &async_nats::Client) -> usize {
    match client.server_info().max_payload {
        0 => 1024 * 1024,
        n => n,
    }
}

/// Publish the parts of a snapshot answer (see [`parts`]) to the requester's inbox. A
/// part NATS refuses ends them: the front, missing the rest, refuses the snapshot.
async fn send_parts(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    nonce: &str,
    rows: Result<SnapshotRows, AdminError>,
) {
    let max = max_payload(client);
    for part in parts::Parts::new(nonce, rows, max) {
        if let Err(e) = client.publish(reply_to.clone(), part).await {
            tracing::warn!(error = %e, "cannot send a snapshot part");
            return;
        }
    }
    if let Err(e) = client.flush().await {
        tracing::warn!(error = %e, "cannot flush snapshot parts");
    }
}

async fn answer(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    mut response: Response,
) {
    let max = max_payload(client);
    let room = max.saturating_sub(REPLY_OVERHEAD);
    fit_rows(&mut response, room);
    let left_out = fit_replay(&mut response, room);
    if left_out > 0 {
        tracing::warn!(
            left_out,
            max_payload = max,
            "a broadcast replay did not fit one NATS message: its newest messages were left out"
        );
    }
    crate::nats::reply_json(client, reply_to, &response, "admin").await
}

/// Room left in a reply for its subject and headers.
const REPLY_OVERHEAD: usize = 1024;

/// Rows asked for in one reply (by a front that predates parts) that do not fit one NATS
/// message are refused as too large (never cut short: the reader would take a part for
/// the whole).
fn fit_rows(response: &mut Response, max: usize) {
    let Response::Ok(AdminReply::SnapshotRows(rows)) = response else {
        return;
    };
    let size: usize = 256
        + rows.snapshot.len()
        + serde_json::to_vec(&rows.columns).map_or(usize::MAX / 2, |v| v.len())
        + rows
            .rows
            .iter()
            .map(|r| serde_json::to_vec(r).map_or(usize::MAX / 2, |v| v.len()) + 1)
            .sum::<usize>();
    if size > max {
        let n = rows.rows.len();
        tracing::warn!(
            rows = n,
            size,
            max_payload = max,
            "snapshot rows do not fit one NATS message"
        );
        *response = Response::Error(AdminError::new(
            AdminErrorKind::TooLarge,
            format!("{n} rows of {size} bytes do not fit one NATS message ({max} bytes)"),
        ));
    }
}

/// Bring a replay's reply within `max` bytes of JSON: its oldest messages that fit, in
/// order, the newer ones left out (a reply NATS refuses would leave the join waiting for
/// nothing until its timeout). How many were left out.
fn fit_replay(response: &mut Response, max: usize) -> usize {
    let Response::Ok(AdminReply::Replayed { messages }) = response else {
        return 0;
    };
    // `{"ok":{"reply":"replayed","messages":[…]}}` and a comma per message.
    let mut total = 64;
    let keep = messages
        .iter()
        .take_while(|m| {
            total += serde_json::to_vec(m).map_or(usize::MAX / 2, |v| v.len()) + 1;
            total <= max
        })
        .count();
    let left_out = messages.len() - keep;
    messages.truncate(keep);
    left_out
}

#[cfg(test)]
mod tests;
