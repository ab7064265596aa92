//! Snapshots through the admin protocol (the management API's
//! `/management/v1/projects/{id}/snapshots`): started, listed, read and cancelled at the
//! leader of the project's source, which keeps `walcast.snapshots`. Every request names
//! its project, and the worker only ever reads or cancels that project's snapshots.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{unexpected, AdminClient, AdminError, AdminReply, AdminRequest};

/// A row of `walcast.snapshots`: a snapshot and its progress (the CLI's `walcast snapshot
/// status --json` line, the management API's answer without `last_key`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SnapshotRecord {
    pub id: i64,
    pub project: String,
    pub schema: String,
    pub table: String,
    pub filter: String,
    /// `queued`, `running`, `done`, `cancelled` or `failed`.
    pub state: String,
    /// The key of the last row stored, a JSON array's text.
    pub last_key: Option<String>,
    pub rows_done: i64,
    pub chunks_done: i64,
    pub rows_estimate: i64,
    pub error: Option<String>,
}

/// The largest `limit` of a [`AdminRequest::SnapshotList`].
pub const MAX_SNAPSHOT_LIST: u32 = 1_000;

impl AdminClient {
    /// Queue a snapshot of `table` (`table` or `schema.table`) for `project` under a
    /// `postgres_changes` `filter` (empty: every row), at the leader of `source`.
    pub async fn snapshot_start(
        &self,
        source: &str,
        project: &str,
        (table, filter): (&str, &str),
        timeout: Duration,
    ) -> Result<SnapshotRecord, AdminError> {
        let req = AdminRequest::SnapshotStart {
            project: project.to_string(),
            table: table.to_string(),
            filter: filter.to_string(),
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Snapshot {
                snapshot: Some(s), ..
            } => Ok(s),
            other => Err(unexpected(&other)),
        }
    }

    /// The project's snapshots, newest first, at most `limit`.
    pub async fn snapshot_list(
        &self,
        source: &str,
        project: &str,
        limit: u32,
        timeout: Duration,
    ) -> Result<Vec<SnapshotRecord>, AdminError> {
        let req = AdminRequest::SnapshotList {
            project: project.to_string(),
            limit,
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Snapshots { snapshots } => Ok(snapshots),
            other => Err(unexpected(&other)),
        }
    }

    /// The project's snapshot `id` (`None`: no such snapshot of this project); with
    /// `cancel`, cancelled first if it is queued or running. `(snapshot, cancelled now)`.
    pub async fn snapshot_get(
        &self,
        source: &str,
        project: &str,
        (id, cancel): (i64, bool),
        timeout: Duration,
    ) -> Result<(Option<SnapshotRecord>, bool), AdminError> {
        let project = project.to_string();
        let req = match cancel {
            true => AdminRequest::SnapshotCancel { project, id },
            false => AdminRequest::SnapshotGet { project, id },
        };
        match self.request_to(source, req, timeout).await? {
            AdminReply::Snapshot {
                snapshot,
                cancelled,
            } => Ok((snapshot, cancelled)),
            other => Err(unexpected(&other)),
        }
    }
}
