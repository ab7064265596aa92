//! The worker side of the admin protocol ([`walcast_bus::admin`]): the project list for
//! the fronts' key verification, and enabling realtime per table for their REST API.
//!
//! Private-channel checks and SSE snapshot reads evaluate the tenants' policies: those
//! run on the check login's sessions ([`walcast_control::check_login`]), never on walcast's own.
//!
//! A table is always looked up in its project's schema (`public` for the default
//! project, `project_<hex>` for the others), so a project can never enable, disable or
//! list another project's tables.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Mutex;
use tokio_postgres::Client;
use walcast_bus::admin::{
    AdminError, AdminErrorKind, AdminHandler, AdminReply, AdminRequest, TableName,
};
use walcast_bus::subs::BoxFuture;

use crate::authorize::channel::Channel;
use crate::error::RealtimeError;
use walcast_control::check_login::CheckSessions;
use walcast_control::manage::AdminPart;
use walcast_control::projects;
use walcast_control::roles::RolePolicy;
use walcast_control::secrets::SecretKeys;
use walcast_control::source_projects::SourceProjects;
use walcast_control::tables::{self, RealtimeTablesError};

/// Every admin session: a statement waits at most 3 s for a table lock and runs at most
/// 5 s (a slow policy on `realtime.messages` fails its own check, never holds the others).
const SESSION_LIMITS: &str = "SET lock_timeout = '3s'; SET statement_timeout = '5s'";

/// Sessions for read-only requests (channel checks, replays, lists), used side by side;
/// one more is kept for the requests that change something, answered one at a time.
const READ_SESSIONS: usize = 4;

/// Answers admin requests with lazily (re)connected database sessions.
#[derive(Clone)]
pub struct Admin {
    inner: Arc<Inner>,
    /// The requests other parts answer (snapshots), see [`Admin::answering`].
    parts: Arc<Vec<Arc<dyn AdminPart>>>,
}

struct Inner {
    database_url: String,
    /// The check login's sessions: everything that runs a tenant's policies.
    checks: CheckSessions,
    /// `[0]` for ordered requests (see [`AdminRequest::is_ordered`]), the rest for reads.
    sessions: Vec<Mutex<Option<Client>>>,
    next_read: AtomicUsize,
    /// The roles a private-channel check may act as.
    roles: RolePolicy,
    /// The keys of the projects' secrets (the project list, the management requests).
    keys: Arc<SecretKeys>,
    /// Another source's admin: only its projects' tables and channels (see
    /// [`Admin::for_source`]); `None`: the default source's, with the control database.
    projects: Option<Arc<SourceProjects>>,
}

impl Admin {
    /// Answers with `database_url` (walcast's own login), and runs the tenants' policies
    /// on `check_url` (the check login); the projects' secrets are read with `keys`.
    pub fn new(
        database_url: String,
        check_url: &str,
        roles: RolePolicy,
        keys: Arc<SecretKeys>,
    ) -> Admin {
        Admin {
            inner: Arc::new(Inner {
                database_url,
                checks: CheckSessions::new(check_url, SESSION_LIMITS, READ_SESSIONS),
                sessions: (0..=READ_SESSIONS).map(|_| Mutex::new(None)).collect(),
                next_read: AtomicUsize::new(0),
                roles,
                keys,
                projects: None,
            }),
            parts: Arc::default(),
        }
    }

    /// Also answer `part`'s requests (on the same sessions, after the same checks).
    pub fn answering(mut self, part: Arc<dyn AdminPart>) -> Admin {
        Arc::make_mut(&mut self.parts).push(part);
        self
    }

    /// The admin of a source other than the default: it answers only for the projects
    /// the control database puts on the source (their schemas from there, never from the
    /// source's own database), and no project list or management request.
    pub fn for_source(
        database_url: String,
        check_url: &str,
        roles: RolePolicy,
        keys: Arc<SecretKeys>,
        projects: Arc<SourceProjects>,
    ) -> Admin {
        let mut a = Admin::new(database_url, check_url, roles, keys);
        if let Some(inner) = Arc::get_mut(&mut a.inner) {
            inner.projects = Some(projects);
        }
        a
    }

    /// Refuse a request this source's admin does not answer (see [`Admin::for_source`]).
    async fn refusal(&self, req: &AdminRequest) -> Result<(), AdminError> {
        let Some(projects) = &self.inner.projects else {
            return Ok(());
        };
        let project = match req {
            AdminRequest::SetRealtime { project, .. }
            | AdminRequest::ListTables { project }
            | AdminRequest::AuthorizeChannel { project, .. }
            | AdminRequest::Replay { project, .. }
            | AdminRequest::SnapshotRows { project, .. }
            | AdminRequest::SnapshotStart { project, .. }
            | AdminRequest::SnapshotList { project, .. }
            | AdminRequest::SnapshotGet { project, .. }
            | AdminRequest::SnapshotCancel { project, .. } => project,
            _ => {
                return Err(AdminError::new(
                    AdminErrorKind::InvalidRequest,
                    format!(
                        "source {:?} answers only its projects' table and channel requests",
                        projects.source()
                    ),
                ))
            }
        };
        match projects.schema_of(project).await.map_err(internal)? {
            Some(_) => Ok(()),
            None => {
                projects.foreign(project, "admin");
                Err(AdminError::new(
                    AdminErrorKind::UnknownProject,
                    format!(
                        "project {project:?} is not on source {:?}",
                        projects.source()
                    ),
                ))
            }
        }
    }

    /// The session for `req`: the ordered one, or a free read session (else the next in
    /// turn, waited for).
    async fn session(&self, req: &AdminRequest) -> tokio::sync::MutexGuard<'_, Option<Client>> {
        let sessions = &self.inner.sessions;
        if req.is_ordered() {
            return sessions[0].lock().await;
        }
        let reads = &sessions[1..];
        if let Some(free) = reads.iter().find_map(|m| m.try_lock().ok()) {
            return free;
        }
        let turn = self.inner.next_read.fetch_add(1, Ordering::Relaxed) % reads.len();
        reads[turn].lock().await
    }

    async fn answer(&self, req: AdminRequest) -> Result<AdminReply, AdminError> {
        self.refusal(&req).await?;
        let schema = match (&self.inner.projects, project_of(&req)) {
            (Some(p), Some(project)) => p.schema_of(project).await.map_err(internal)?,
            _ => None,
        };
        let mut guard = self.session(&req).await;
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            // A busy table must not hold every admin request (and the fronts' project
            // refreshes) behind `ALTER TABLE … REPLICA IDENTITY FULL`.
            let connected = match walcast_pgtls::connect(&self.inner.database_url)
                .await
                .map_err(RealtimeError::from)
            {
                Ok(c) => c
                    .batch_execute(SESSION_LIMITS)
                    .await
                    .map(|_| c)
                    .map_err(RealtimeError::from),
                Err(e) => Err(e),
            };
            match connected {
                Ok(c) => *guard = Some(c),
                Err(e) => {
                    let message = e.to_string();
                    tracing::error!(error = %message, "admin request: cannot connect");
                    return Err(AdminError::new(AdminErrorKind::Unavailable, message));
                }
            }
        }
        let Some(client) = guard.as_mut() else {
            return Err(AdminError::new(
                AdminErrorKind::Unavailable,
                "no database session",
            ));
        };
        let result = run(client, &self.inner, &self.parts, req, schema).await;
        if let Err(e) = &result {
            if e.kind == AdminErrorKind::Internal {
                // The session is suspect: reconnect next time.
                *guard = None;
                tracing::error!(error = %e, "admin request failed");
            }
        }
        result
    }
}

impl AdminHandler for Admin {
    /// Answered on a task of its own: a caller that stops waiting (a front's timeout) must
    /// not drop the work between `BEGIN` and `ROLLBACK`, which would leave the session in an
    /// aborted transaction and fail every later request on it.
    fn handle(&self, req: AdminRequest) -> BoxFuture<Result<AdminReply, AdminError>> {
        let this = self.clone();
        let task = walcast_core::source_scope::spawn(async move { this.answer(req).await });
        Box::pin(async move {
            task.await
                .unwrap_or_else(|e| Err(internal(format!("admin request task: {e}"))))
        })
    }
}

fn unavailable(e: impl std::fmt::Display) -> AdminError {
    AdminError::new(
        AdminErrorKind::Unavailable,
        format!("the check login's session: {e}"),
    )
}

fn internal(e: impl std::fmt::Display) -> AdminError {
    AdminError::new(AdminErrorKind::Internal, e.to_string())
}

async fn schema_of(client: &Client, project: &str) -> Result<String, AdminError> {
    projects::schema_of(client, project).await?.ok_or_else(|| {
        AdminError::new(
            AdminErrorKind::UnknownProject,
            format!("project {project:?} does not exist"),
        )
    })
}

/// Private channels: a policy check, or a replay (see [`crate::authorize::channel`]), always
/// of the asking project's channel.
async fn private_channel(
    client: &Client,
    checks: &CheckSessions,
    roles: &RolePolicy,
    req: AdminRequest,
) -> Result<AdminReply, AdminError> {
    let db =
        |e: tokio_postgres::Error| internal(format!("database: {}", walcast_pgtls::db_message(&e)));
    match req {
        AdminRequest::AuthorizeChannel {
            project,
            topic,
            claims,
            write,
        } => {
            let channel = Channel {
                project: &project,
                topic: &topic,
            };
            let mut check = checks.session().await.map_err(unavailable)?;
            let Some(on) = check.client() else {
                return Err(unavailable("no check session"));
            };
            let allowed =
                crate::authorize::channel::may(client, on, roles, channel, &claims, write).await;
            if allowed.is_err() {
                check.discard();
            }
            Ok(AdminReply::Authorized {
                allowed: allowed.map_err(db)?,
            })
        }
        AdminRequest::Replay {
            project,
            topic,
            since_ms,
            limit,
        } => {
            let channel = Channel {
                project: &project,
                topic: &topic,
            };
            let messages = crate::authorize::channel::stored(client, channel, since_ms, limit)
                .await
                .map_err(db)?;
            Ok(AdminReply::Replayed { messages })
        }
        other => Err(internal(format!(
            "not a private-channel request: {other:?}"
        ))),
    }
}

/// The project a table or channel request is about.
fn project_of(req: &AdminRequest) -> Option<&str> {
    match req {
        AdminRequest::SetRealtime { project, .. }
        | AdminRequest::ListTables { project }
        | AdminRequest::AuthorizeChannel { project, .. }
        | AdminRequest::Replay { project, .. }
        | AdminRequest::SnapshotRows { project, .. }
        | AdminRequest::SnapshotStart { project, .. }
        | AdminRequest::SnapshotList { project, .. }
        | AdminRequest::SnapshotGet { project, .. }
        | AdminRequest::SnapshotCancel { project, .. } => Some(project),
        _ => None,
    }
}

/// Answer `req`; `schema`: its project's schema when the control database told it (another
/// source's admin), else read here.
async fn run(
    client: &mut Client,
    inner: &Inner,
    parts: &[Arc<dyn AdminPart>],
    req: AdminRequest,
    schema: Option<String>,
) -> Result<AdminReply, AdminError> {
    let (checks, roles) = (&inner.checks, &inner.roles);
    if walcast_control::manage::is_management(&req) {
        return walcast_control::manage::run(client, &inner.keys, req).await;
    }
    if let Some(part) = parts.iter().find(|p| p.answers(&req)) {
        return part.answer(client, req).await;
    }
    match req {
        AdminRequest::Projects => project_list(client, &inner.keys).await,
        AdminRequest::SetRealtime {
            project,
            table,
            enabled,
        } => set_realtime(client, project, table, enabled, schema).await,
        req @ (AdminRequest::AuthorizeChannel { .. } | AdminRequest::Replay { .. }) => {
            private_channel(client, checks, roles, req).await
        }
        AdminRequest::SnapshotRows {
            project,
            claims,
            schema: asked,
            table,
            filter,
            select,
            max_rows,
            max_bytes,
            nonce: _,
        } => {
            let project_schema = match schema {
                Some(s) => s,
                None => schema_of(client, &project).await?,
            };
            let req = crate::authorize::rows::RowsRequest {
                project: &project,
                project_schema: &project_schema,
                claims: &claims,
                schema: &asked,
                table: &table,
                filter: filter.as_deref(),
                select: select.as_deref(),
                max_rows,
                max_bytes,
            };
            let mut check = checks.session().await.map_err(unavailable)?;
            let Some(on) = check.client() else {
                return Err(unavailable("no check session"));
            };
            let rows = crate::authorize::rows::read(client, on, roles, req).await;
            if rows
                .as_ref()
                .is_err_and(|e| e.kind == AdminErrorKind::Internal)
            {
                check.discard();
            }
            Ok(AdminReply::SnapshotRows(rows?))
        }
        AdminRequest::ListTables { project } => {
            if schema.is_none() {
                schema_of(client, &project).await?;
            }
            let tables = tables::list(&*client, Some(&project))
                .await?
                .into_iter()
                .map(|t| TableName {
                    schema: t.schema,
                    table: t.table,
                })
                .collect();
            Ok(AdminReply::Tables { tables })
        }
        other => Err(internal(format!("not answered here: {other:?}"))),
    }
}

/// Every stored project with its secrets, for the fronts' key checks.
async fn project_list(client: &Client, keys: &SecretKeys) -> Result<AdminReply, AdminError> {
    let projects = projects::list(client, keys)
        .await?
        .into_iter()
        .map(walcast_control::manage::record)
        .collect();
    Ok(AdminReply::Projects { projects })
}

/// Enable or disable realtime for a table of `project`'s schema.
async fn set_realtime(
    client: &Client,
    project: String,
    table: String,
    enabled: bool,
    schema: Option<String>,
) -> Result<AdminReply, AdminError> {
    let schema = match schema {
        Some(s) => s,
        None => schema_of(client, &project).await?,
    };
    if table.is_empty() || table.contains('\0') {
        // Postgres text cannot hold NUL: no such table can exist.
        return Err(
            RealtimeTablesError::UnknownTable(walcast_core::sql::qualified(&schema, &table)).into(),
        );
    }
    let mut unreadable_by = Vec::new();
    let changed = if enabled {
        let changed = tables::enable(client, &project, &schema, &table).await?;
        tracing::info!(%project, %schema, %table, changed, "realtime enabled");
        unreadable_by = tables::unreadable_by(client, &schema, &table, tables::API_ROLES)
            .await
            .map_err(RealtimeTablesError::Db)?;
        changed
    } else {
        let changed = tables::disable(client, &project, &schema, &table).await?;
        if !changed
            && tables::inspect(client, &schema, &table)
                .await
                .map_err(RealtimeTablesError::Db)?
                .is_none()
        {
            return Err(
                RealtimeTablesError::UnknownTable(walcast_core::sql::qualified(&schema, &table))
                    .into(),
            );
        }
        tracing::info!(%project, %schema, %table, changed, "realtime disabled");
        changed
    };
    Ok(AdminReply::Realtime {
        schema,
        table,
        enabled,
        changed,
        unreadable_by,
    })
}
