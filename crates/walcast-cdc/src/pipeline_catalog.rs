//! The pipeline's side of catalog changes (see [`crate::catalog_change`]): which view of
//! the catalog each batch is judged at, and what a DDL notice does at its position.

use std::collections::BTreeMap;

use bytes::Bytes;
use walcast_bus::subject::delivery_subject;
use walcast_bus::subs::{SubsEnded, NOTICE_SUBS_ENDED};
use walcast_bus::{HEADER_LSN, HEADER_NOTICE, HEADER_ORIGIN};
use walcast_lease::Action;

use super::Pipeline;
use crate::catalog_change::{self, Notice, NoticeTable, Tracking, View};
use crate::{telemetry, CdcError};

/// How catalog changes reach the pipeline, and where it stands.
#[derive(Clone, Debug)]
pub struct CatalogTracking {
    pub tracking: Tracking,
    /// With the triggers: the epoch at the position decoded so far (`None`: unknown).
    pub seen: Option<i64>,
    /// Without: batches judged so far (each its own view).
    batches: u64,
}

impl CatalogTracking {
    pub fn new(tracking: Tracking, seen: Option<i64>) -> CatalogTracking {
        CatalogTracking {
            tracking,
            seen,
            batches: 0,
        }
    }

    /// The view the next batch is judged at: the epoch decoded so far, or (without the
    /// triggers) a view of its own, so nothing read for an earlier batch is used.
    pub(super) fn next_view(&mut self) -> View {
        match self.tracking {
            Tracking::EventTrigger => View::Epoch(self.seen),
            Tracking::PerBatch(_) => {
                self.batches += 1;
                View::Batch(self.batches)
            }
        }
    }
}

impl Pipeline {
    /// A DDL notice at its position: what came before is authorized and published with
    /// the state before it; the facts it may have changed are dropped (read again, as of
    /// this position, for what follows); subscriptions to a dropped table end.
    pub(super) async fn catalog_notice(&mut self, content: &str) -> Result<(), CdcError> {
        let notice = Notice::parse(content).unwrap_or_else(|e| {
            tracing::warn!(error = %e, content, "unreadable DDL notice: taken as a change of every table");
            Notice::everything("unreadable")
        });
        self.flush().await?;
        let tag = notice.tag.clone();
        metrics::counter!(telemetry::DDL_NOTICES, "tag" => tag).increment(1);
        let commit_lsn = self.txn.as_ref().map(|t| t.commit_lsn);
        tracing::info!(tag = %notice.tag, epoch = ?notice.epoch, tables = ?notice.tables, ?commit_lsn, "DDL notice: catalog facts dropped at this position");
        if let (Tracking::EventTrigger, Some(e)) = (&self.ddl.tracking, notice.epoch) {
            self.ddl.seen = Some(e);
            if let Some(at) = commit_lsn {
                // Before this position can be acknowledged: a restart resumes at this epoch.
                catalog_change::record_epoch(&self.catalog, &self.slot, at, e).await?;
            }
        }
        let to = match self.ddl.tracking {
            Tracking::EventTrigger => View::Epoch(self.ddl.seen),
            Tracking::PerBatch(_) => View::Batch(self.ddl.batches),
        };
        for shard in &mut self.shards {
            shard.on_notice(&notice, to);
        }
        for table in notice.dropped() {
            self.end_dropped(table).await?;
        }
        Ok(())
    }

    /// A table was dropped: its subscriptions end, each front told in order with the
    /// changes before (the registry row goes in the same transaction).
    async fn end_dropped(&mut self, t: &NoticeTable) -> Result<(), CdcError> {
        // Not looked up in the routes: the registry row may be deleted before or after
        // the notice in its transaction.
        let specs = self.matcher.take_table(&t.schema, &t.table);
        if specs.is_empty() {
            return Ok(());
        }
        metrics::counter!(telemetry::TABLES_DROPPED).increment(1);
        tracing::warn!(schema = %t.schema, table = %t.table, subscriptions = specs.len(), "realtime table dropped: its subscriptions end");
        let mut by_front: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (front, id) in specs {
            by_front.entry(front).or_default().push(id);
        }
        let message = format!(
            "Table {}.{} was dropped: this subscription has ended",
            t.schema, t.table
        );
        let lsn = self
            .txn
            .as_ref()
            .map(|x| x.commit_lsn.to_string())
            .unwrap_or_default();
        for (front, ids) in by_front {
            metrics::counter!(telemetry::SUBS_ENDED).increment(ids.len() as u64);
            let payload = serde_json::to_vec(&SubsEnded {
                ids,
                message: message.clone(),
            })
            .map_err(|e| CdcError::Event(crate::event::EventError::Json(e)))?;
            self.fence.check(Action::Publish)?;
            self.bus
                .publish(
                    delivery_subject(&front),
                    &[
                        (HEADER_ORIGIN, &self.origin),
                        (HEADER_LSN, &lsn),
                        (HEADER_NOTICE, NOTICE_SUBS_ENDED),
                    ],
                    Bytes::from(payload),
                )
                .await?;
        }
        Ok(())
    }
}
