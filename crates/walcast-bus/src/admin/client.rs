//! The front's side of the admin requests: over NATS to the leader of a project's
//! source, or calling the in-process worker.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{
    parts, AdminError, AdminErrorKind, AdminHandler, AdminReply, AdminRequest, ProjectRecord,
    Response, SnapshotRows, StoredBroadcast, TableName, SUBJECT_ADMIN,
};
use crate::Bus;

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
