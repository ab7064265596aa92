//! The pipeline's view of the catalog at its WAL position: which tables stream (realtime-tables
//! edits, decoded in WAL order), which view of privileges and columns each batch is
//! judged at, and what a DDL notice does at its position (see [`crate::catalog::change`]).

use std::collections::BTreeMap;

use std::time::{Duration, Instant};

use walcast_bus::subs::NOTICE_SUBS_ENDED;
use walcast_pipeline::Position;

use super::RealtimeConsumer;
use crate::authorize::rls::RlsChecker;
use crate::catalog::change::{self, Notice, NoticeTable, Resume, TableState, Tracking, View};
use crate::error::RealtimeError;
use crate::telemetry;
use walcast_bus::ChangeKind;
use walcast_control::tables::TableRef;
use walcast_wal2json::{Lsn, RowChange};

/// How catalog changes reach the pipeline, and where it stands.
#[derive(Clone, Debug)]
pub struct CatalogTracking {
    pub tracking: Tracking,
    /// With the triggers: the epoch at the position decoded so far (`None`: unknown).
    pub seen: Option<i64>,
    /// Without: batches judged so far (each its own view).
    batches: u64,
    /// When the triggers were last seen in place.
    checked: Instant,
    /// The latest state each notice so far carried, per table (recorded with the epoch).
    carried: BTreeMap<(String, String), TableState>,
    /// Epochs decoded and not yet recorded: (position, epoch, carried states).
    unrecorded: Vec<(Lsn, i64, Vec<TableState>)>,
}

/// How often a pipeline relying on the triggers checks they are still there.
const TRIGGER_CHECK: Duration = Duration::from_secs(1);

impl CatalogTracking {
    pub fn new(tracking: Tracking, resume: Resume) -> CatalogTracking {
        CatalogTracking {
            tracking,
            seen: resume.seen,
            batches: 0,
            checked: Instant::now(),
            carried: resume
                .carried
                .into_iter()
                .map(|s| ((s.schema.clone(), s.table.clone()), s))
                .collect(),
            unrecorded: Vec::new(),
        }
    }

    /// Follow a notice (as the checkers' caches do): what it may have changed is no
    /// longer known, unless it carries it; after a gap in the epochs, nothing is.
    fn carry(&mut self, notice: &Notice) {
        let follows = match (self.seen, notice.epoch) {
            (_, None) => true,
            (Some(a), Some(b)) => b == a + 1 || b == a,
            (None, Some(_)) => false,
        };
        if !follows || notice.tables.is_none() {
            self.carried.clear();
        } else {
            self.carried.retain(|(s, t), _| !notice.touches(s, t));
        }
        for state in &notice.states {
            let key = (state.schema.clone(), state.table.clone());
            self.carried.insert(key, state.clone());
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

impl CatalogTracking {
    /// Prepare a new lane's checker: it knows the states carried so far.
    pub(super) fn seed(&self, rls: &mut RlsChecker) {
        if let Tracking::EventTrigger = self.tracking {
            let states: Vec<TableState> = self.carried.values().cloned().collect();
            rls.seed(View::Epoch(self.seen), &states);
        }
    }
}

impl RealtimeConsumer {
    /// Record the epochs of the notices decoded since the last call (see
    /// [`change::record_epoch`]), side by side on the catalog connection.
    pub(super) async fn record_epochs(&mut self) -> Result<(), RealtimeError> {
        let unrecorded = std::mem::take(&mut self.ddl.unrecorded);
        let (catalog, slot) = (&self.catalog, self.slot.as_str());
        let writes = unrecorded
            .iter()
            .map(|(at, e, carried)| change::record_epoch(catalog, slot, *at, *e, carried));
        futures_util::future::try_join_all(writes).await?;
        Ok(())
    }

    /// Relying on the event triggers: are they still there (checked every
    /// [`TRIGGER_CHECK`])? If someone dropped or disabled them, every batch re-reads the
    /// catalog from now on, as when they never existed.
    pub(super) async fn verify_triggers(&mut self) -> Result<(), RealtimeError> {
        if self.ddl.tracking != Tracking::EventTrigger || self.ddl.checked.elapsed() < TRIGGER_CHECK
        {
            return Ok(());
        }
        self.ddl.checked = Instant::now();
        if change::triggers_present(&self.catalog).await? {
            return Ok(());
        }
        let why = "the event triggers were dropped or disabled while running".to_string();
        tracing::warn!(reason = %why, "DDL and GRANT/REVOKE are no longer tracked at their WAL position: every batch re-reads privileges and columns instead");
        self.health.set_ddl_tracking("per_batch");
        metrics::gauge!(telemetry::DDL_EVENT_TRIGGER).set(0.0);
        self.ddl.tracking = Tracking::PerBatch(why);
        Ok(())
    }

    /// The streamed tables as the pipeline knows them at its current WAL position.
    pub fn realtime_tables(&self) -> Vec<TableRef> {
        let mut v: Vec<TableRef> = self
            .routes
            .iter()
            .map(|((schema, table), project)| TableRef {
                project: project.clone(),
                schema: schema.clone(),
                table: table.clone(),
            })
            .collect();
        v.sort();
        v
    }

    /// Which project each streamed table belongs to.
    pub fn set_tables(&mut self, tables: &[TableRef]) {
        self.routes = tables
            .iter()
            .map(|t| ((t.schema.clone(), t.table.clone()), t.project.clone()))
            .collect();
    }

    /// Apply a realtime-tables edit as of its WAL position: the filter for what follows
    /// is then exact, whatever the table holds by the time we read it.
    pub(super) fn tables_edit(&mut self, kind: ChangeKind, row: &RowChange<'_>) {
        if kind != ChangeKind::Insert {
            if let Some(t) = walcast_control::tables::tables_row(&row.identity) {
                let key = (t.schema, t.table);
                if let Some(project) = self.routes.remove(&key) {
                    self.removed_routes.insert(key, project);
                }
            }
        }
        if kind != ChangeKind::Delete {
            if let Some(t) = walcast_control::tables::tables_row(&row.columns) {
                self.routes.insert((t.schema, t.table), t.project);
            }
        }
    }

    /// A DDL notice at its position: what came before is authorized and published with
    /// the state before it; the facts it may have changed are dropped (read again, as of
    /// this position, for what follows); subscriptions to a dropped table end.
    pub(super) async fn catalog_notice(&mut self, content: &str) -> Result<(), RealtimeError> {
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
            self.ddl.carry(&notice);
            self.ddl.seen = Some(e);
            if let Some(at) = commit_lsn {
                // Recorded before this position can be acknowledged (at the next settle,
                // several in one round trip): a restart resumes with these.
                let carried: Vec<TableState> = self.ddl.carried.values().cloned().collect();
                self.ddl.unrecorded.push((at, e, carried));
            }
        }
        let to = match self.ddl.tracking {
            Tracking::EventTrigger => View::Epoch(self.ddl.seen),
            Tracking::PerBatch(_) => View::Batch(self.ddl.batches),
        };
        let dropped: Vec<NoticeTable> = notice.dropped().cloned().collect();
        self.lanes.notice(notice, to);
        // A REVOKE may leave a filter reading a column its role may not read.
        self.watch.poke();
        for table in &dropped {
            self.end_dropped(table).await?;
        }
        Ok(())
    }

    /// A table was dropped: its subscriptions end, each front told in order with the
    /// changes before (the realtime-tables row goes in the same transaction).
    async fn end_dropped(&mut self, t: &NoticeTable) -> Result<(), RealtimeError> {
        // Not looked up in the routes: the realtime-tables row may be deleted before or after
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
        let message = crate::subscriptions::validate::dropped_message(&t.schema, &t.table);
        let at = Position::commit(self.txn.as_ref().map(|x| x.commit_lsn).unwrap_or_default());
        let key = (t.schema.clone(), t.table.clone());
        let project = self
            .routes
            .get(&key)
            .or(self.removed_routes.get(&key))
            .cloned();
        for (front, ids) in by_front {
            metrics::counter!(telemetry::SUBS_ENDED).increment(ids.len() as u64);
            // A front may hold more of the table's subscriptions than one message names.
            for payload in crate::delivery::notice::bodies(ids, &message)? {
                // After the table's changes its project's lane still holds.
                if let Some(p) = &project {
                    if self.lanes.publish_after(
                        p,
                        front.clone(),
                        at,
                        NOTICE_SUBS_ENDED,
                        payload.clone(),
                    ) {
                        continue;
                    }
                }
                let publisher = &self.publisher;
                self.outlet
                    .links
                    .send(publisher, &front, at, Some(NOTICE_SUBS_ENDED), payload)
                    .await?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(table: &str) -> TableState {
        TableState {
            schema: "public".into(),
            table: table.into(),
            rls: false,
            pk: Vec::new(),
            columns: Vec::new(),
            roles: Default::default(),
        }
    }

    fn notice(epoch: i64, tables: Option<&[&str]>, states: &[&str]) -> Notice {
        let tables = tables.map(|ts| {
            ts.iter()
                .map(|t| NoticeTable {
                    schema: "public".into(),
                    table: t.to_string(),
                    dropped: false,
                })
                .collect()
        });
        Notice {
            epoch: Some(epoch),
            tag: "X".into(),
            tables,
            states: states.iter().map(|t| state(t)).collect(),
        }
    }

    fn carried(t: &CatalogTracking) -> Vec<&str> {
        t.carried.keys().map(|(_, t)| t.as_str()).collect()
    }

    #[test]
    fn the_recorded_states_follow_the_notices() {
        let resume = Resume {
            seen: Some(1),
            carried: vec![state("a")],
        };
        let mut t = CatalogTracking::new(Tracking::EventTrigger, resume);
        // ALTER TABLE b (b not streamed: no state): a's state still holds.
        t.carry(&notice(2, Some(&["b"]), &[]));
        t.seen = Some(2);
        assert_eq!(carried(&t), ["a"]);
        // GRANT: every streamed table's state, replacing the rest.
        t.carry(&notice(3, None, &["c"]));
        t.seen = Some(3);
        assert_eq!(carried(&t), ["c"]);
        // A gap (epoch 4 never decoded): nothing known but what this notice carries.
        t.carry(&notice(5, Some(&["d"]), &["d"]));
        assert_eq!(carried(&t), ["d"]);
    }
}
