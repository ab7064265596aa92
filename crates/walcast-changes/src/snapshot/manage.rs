//! Snapshots through the admin protocol ([`walcast_bus::admin::snapshots`], the
//! management API): the same [`store`] calls as `walcast snapshot`, each scoped to the
//! asking project — another project's snapshot is answered as none.

use tokio_postgres::Client;
use walcast_bus::admin::{AdminError, AdminErrorKind, AdminReply, AdminRequest, MAX_SNAPSHOT_LIST};

use super::store::{self, SnapshotError};

/// The snapshot requests, answered on the worker's admin session.
pub struct SnapshotRequests;

impl walcast_control::manage::AdminPart for SnapshotRequests {
    fn answers(&self, req: &AdminRequest) -> bool {
        is_snapshot(req)
    }

    fn answer<'a>(
        &'a self,
        client: &'a mut Client,
        req: AdminRequest,
    ) -> futures_util::future::BoxFuture<'a, Result<AdminReply, AdminError>> {
        Box::pin(run(client, req))
    }
}

/// Whether `req` is a snapshot request ([`run`] answers it).
pub fn is_snapshot(req: &AdminRequest) -> bool {
    matches!(
        req,
        AdminRequest::SnapshotStart { .. }
            | AdminRequest::SnapshotList { .. }
            | AdminRequest::SnapshotGet { .. }
            | AdminRequest::SnapshotCancel { .. }
    )
}

/// Answer a snapshot request.
pub async fn run(client: &mut Client, req: AdminRequest) -> Result<AdminReply, AdminError> {
    let one = |snapshot, cancelled| AdminReply::Snapshot {
        snapshot,
        cancelled,
    };
    match req {
        AdminRequest::SnapshotStart {
            project,
            table,
            filter,
        } => {
            let id = store::start_named(client, &project, &table, &filter).await?;
            tracing::info!(%project, %table, %filter, id, "snapshot queued through the admin bus");
            Ok(one(store::get(&*client, &project, id).await?, false))
        }
        AdminRequest::SnapshotList { project, limit } => {
            let limit = i64::from(limit.clamp(1, MAX_SNAPSHOT_LIST));
            let snapshots = store::list(&*client, Some(&project), limit).await?;
            Ok(AdminReply::Snapshots { snapshots })
        }
        AdminRequest::SnapshotGet { project, id } => {
            Ok(one(store::get(&*client, &project, id).await?, false))
        }
        AdminRequest::SnapshotCancel { project, id } => {
            let cancelled = store::cancel(&*client, &project, id).await?;
            if cancelled {
                tracing::info!(%project, id, "snapshot cancelled through the admin bus");
            }
            Ok(one(store::get(&*client, &project, id).await?, cancelled))
        }
        other => Err(AdminError::new(
            AdminErrorKind::Internal,
            format!("not a snapshot request: {other:?}"),
        )),
    }
}

impl From<SnapshotError> for AdminError {
    fn from(e: SnapshotError) -> AdminError {
        AdminError::new(kind(&e), e.to_string())
    }
}

/// How a snapshot error is told to the asker.
fn kind(e: &SnapshotError) -> AdminErrorKind {
    match e {
        SnapshotError::UnknownTable(_) => AdminErrorKind::UnknownTable,
        SnapshotError::NotStreaming { .. } => AdminErrorKind::NotStreaming,
        SnapshotError::Filter(_) | SnapshotError::Query { .. } | SnapshotError::FilterValue(_) => {
            AdminErrorKind::InvalidFilter
        }
        SnapshotError::Name(_) | SnapshotError::TooLong { .. } | SnapshotError::Control(_) => {
            AdminErrorKind::InvalidRequest
        }
        SnapshotError::QueueFull => AdminErrorKind::QueueFull,
        SnapshotError::Connect(_) => AdminErrorKind::Unavailable,
        SnapshotError::Db(_) | SnapshotError::Row { .. } => AdminErrorKind::Internal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_snapshot_is_told_as_the_asker_can_fix_it() {
        let f = walcast_protocol::filter::Filter::parse("id=zz.1").unwrap_err();
        assert_eq!(
            kind(&SnapshotError::Filter(f)),
            AdminErrorKind::InvalidFilter
        );
        assert_eq!(kind(&SnapshotError::QueueFull), AdminErrorKind::QueueFull);
        let not = SnapshotError::NotStreaming {
            table: "public.t".into(),
            project: "p".into(),
        };
        assert_eq!(kind(&not), AdminErrorKind::NotStreaming);
        let long = SnapshotError::TooLong {
            what: "filter",
            max: 1,
        };
        assert_eq!(kind(&long), AdminErrorKind::InvalidRequest);
        assert_eq!(
            kind(&SnapshotError::UnknownTable("public.t".into())),
            AdminErrorKind::UnknownTable
        );
    }
}
