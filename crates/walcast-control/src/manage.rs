//! The management operations on projects (create, get, update, rotate, delete), as admin
//! requests ([`walcast_bus::admin::AdminRequest`]). One implementation: the cdc-worker
//! answers the fronts' management API with it, and `walcast project …` calls it directly
//! on its own database session.

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_bus::admin::{
    AdminError, AdminErrorKind, AdminReply, AdminRequest, LimitChanges, ProjectRecord, TableName,
};
use walcast_bus::source::DEFAULT_SOURCE;

use crate::projects::{self, Project, ProjectChanges, ProjectError};
use crate::secrets::SecretKeys;
use crate::RealtimeTablesError;

/// A part of walcast that answers some admin requests on the worker's database session
/// (walcast's own login), after the worker's admin has checked them (the project is on
/// the source): snapshots are answered by `walcast-changes` this way, without the
/// worker's admin (in `walcast-realtime`) depending on it.
pub trait AdminPart: Send + Sync {
    /// Whether `req` is one of this part's requests.
    fn answers(&self, req: &AdminRequest) -> bool;
    /// Answer `req` (one of this part's) on `client`.
    fn answer<'a>(
        &'a self,
        client: &'a mut Client,
        req: AdminRequest,
    ) -> BoxFuture<'a, Result<AdminReply, AdminError>>;
}

/// The wire form of a stored project (with its secrets: the bus is trusted).
pub fn record(p: Project) -> ProjectRecord {
    ProjectRecord {
        id: p.id,
        name: p.name,
        schema: p.schema,
        jwt_secret: p.jwt_secret,
        jwt_secret_previous: p.jwt_secret_previous,
        jwks: p.jwks,
        created_at: p.created_at,
        suspended: p.suspended,
        private_only: p.private_only,
        jwt_secret_previous_until_ms: p.jwt_secret_previous_until_ms,
        limits: p.limits,
        source: p.source,
    }
}

impl From<ProjectError> for AdminError {
    fn from(e: ProjectError) -> AdminError {
        AdminError::new(AdminErrorKind::Internal, e.to_string())
    }
}

impl From<RealtimeTablesError> for AdminError {
    fn from(e: RealtimeTablesError) -> AdminError {
        match e {
            RealtimeTablesError::UnknownTable(_) => {
                AdminError::new(AdminErrorKind::UnknownTable, e.to_string())
            }
            RealtimeTablesError::NoPrimaryKey(_) => {
                AdminError::new(AdminErrorKind::NoPrimaryKey, e.to_string())
            }
            RealtimeTablesError::Partitioned(_) => {
                AdminError::new(AdminErrorKind::PartitionedTable, e.to_string())
            }
            RealtimeTablesError::OtherProject { .. } => {
                AdminError::new(AdminErrorKind::Internal, e.to_string())
            }
            RealtimeTablesError::Db(d) => AdminError::new(
                AdminErrorKind::Internal,
                format!("database: {}", walcast_pgtls::db_message(&d)),
            ),
        }
    }
}

fn unknown(id: &str) -> AdminError {
    AdminError::new(
        AdminErrorKind::UnknownProject,
        format!("project {id:?} does not exist"),
    )
}

fn refused(e: ProjectError) -> AdminError {
    match e {
        ProjectError::EmptyName
        | ProjectError::LongName
        | ProjectError::ControlInName
        | ProjectError::LimitTooLarge { .. }
        | ProjectError::UnknownSource(_) => {
            AdminError::new(AdminErrorKind::InvalidRequest, e.to_string())
        }
        ProjectError::SourceUnreachable { .. } => {
            AdminError::new(AdminErrorKind::Unavailable, e.to_string())
        }
        other => AdminError::new(AdminErrorKind::Internal, other.to_string()),
    }
}

fn found(id: &str, p: Option<Project>) -> Result<AdminReply, AdminError> {
    let project = record(p.ok_or_else(|| unknown(id))?);
    Ok(AdminReply::Project { project })
}

/// Whether `req` is a management request ([`run`] answers it).
pub fn is_management(req: &AdminRequest) -> bool {
    matches!(
        req,
        AdminRequest::ProjectCreate { .. }
            | AdminRequest::ProjectGet { .. }
            | AdminRequest::ProjectUpdate { .. }
            | AdminRequest::ProjectRotate { .. }
            | AdminRequest::ProjectDelete { .. }
    )
}

/// Answer a management request (the default project is not stored: it is never found),
/// the projects' secrets read and written with `keys`.
pub async fn run(
    client: &mut Client,
    keys: &SecretKeys,
    req: AdminRequest,
) -> Result<AdminReply, AdminError> {
    match req {
        AdminRequest::ProjectCreate {
            name,
            private_only,
            source,
            limits,
        } => {
            if let Some(field) = limits.too_large() {
                return Err(refused(ProjectError::LimitTooLarge { field }));
            }
            let source = source.as_deref().unwrap_or(DEFAULT_SOURCE);
            let p = projects::create_on(client, keys, source, &name)
                .await
                .map_err(refused)?;
            tracing::info!(project = %p.id, source, "project created");
            let changes = ProjectChanges {
                private_only: private_only.then_some(true),
                limits: LimitChanges::set(&limits),
                ..ProjectChanges::default()
            };
            let p = match changes == ProjectChanges::default() {
                true => Some(p),
                false => projects::update(client, keys, &p.id, &changes)
                    .await
                    .map_err(refused)?,
            };
            found("(new)", p)
        }
        AdminRequest::ProjectGet { id } => found(
            &id,
            projects::get(client, keys, &id).await.map_err(refused)?,
        ),
        AdminRequest::ProjectUpdate {
            id,
            name,
            private_only,
            suspended,
            limits,
        } => {
            let changes = ProjectChanges {
                name,
                private_only,
                suspended,
                limits,
            };
            let p = projects::update(client, keys, &id, &changes)
                .await
                .map_err(refused)?;
            tracing::info!(project = %id, ?changes, found = p.is_some(), "project updated");
            found(&id, p)
        }
        AdminRequest::ProjectRotate { id, window_secs } => {
            let p = projects::rotate(client, keys, &id, window_secs)
                .await
                .map_err(refused)?;
            tracing::info!(project = %id, window_secs, found = p.is_some(), "project secret rotated");
            found(&id, p)
        }
        AdminRequest::ProjectDelete { id } => delete(client, keys, id).await,
        other => Err(AdminError::new(
            AdminErrorKind::Internal,
            format!("not a management request: {other:?}"),
        )),
    }
}

async fn delete(
    client: &mut Client,
    keys: &SecretKeys,
    id: String,
) -> Result<AdminReply, AdminError> {
    let streamed = projects::delete(client, keys, &id)
        .await
        .map_err(refused)?
        .ok_or_else(|| unknown(&id))?;
    let tables: Vec<TableName> = streamed
        .into_iter()
        .map(|t| TableName {
            schema: t.schema,
            table: t.table,
        })
        .collect();
    tracing::info!(project = %id, tables = tables.len(), "project deleted");
    Ok(AdminReply::ProjectDeleted { id, tables })
}
