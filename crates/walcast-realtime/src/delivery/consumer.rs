//! Realtime delivery, one [`Consumer`] of decoded transactions (see `walcast_pipeline`'s driver):
//! realtime-tables edits applied at their WAL position, changes routed to a project, turned into
//! events, matched against subscriptions, authorized (RLS) and published on the bus; DDL
//! notices (logical messages) handled at their position.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_bus::ChangeKind;
use walcast_pipeline::{ConsumerError, Publisher};
use walcast_wal2json::{Change, Lsn, RowChange};

mod catalog;
pub use catalog::CatalogTracking;

use crate::authorize::check::Version;
use crate::authorize::{PendingChange, RlsMode};
use crate::catalog::change::NOTICE_PREFIX;
use crate::catalog::tables_drift;
use crate::config::LaneLimits;
use crate::config::RlsOptions;
use crate::delivery::lanes::Lanes;
use crate::delivery::links::FrontLinks;
use crate::delivery::outlet::Outlet;
use crate::delivery::privilege_watch::PrivilegeWatch;
use crate::error::RealtimeError;
use crate::subscriptions::matcher::Matcher;
use crate::subscriptions::row_view::OwnedRow;
use walcast_control::tables::{self, TABLES_SCHEMA, TABLES_TABLE};
use walcast_pipeline::change_event::build_event;
use walcast_pipeline::change_event::TypeCache;
use walcast_pipeline::consumer::{Consumer, Handled, Item, Refresh};
use walcast_pipeline::health::PipelineHealth;
use walcast_pipeline::TxnContext;

/// What a [`RealtimeConsumer`] is built with besides its connections.
pub struct RealtimeOptions {
    /// For the RLS checkers' catalog connections (walcast's own login).
    pub database_url: String,
    /// For the RLS checks themselves (the check login, see [`walcast_control::check_login`]).
    pub check_url: String,
    pub rls: RlsOptions,
    /// Values larger than this are dropped from a change (`Error 413`).
    pub max_record_bytes: usize,
    /// Where skipped and reduced changes are reported.
    pub health: Arc<PipelineHealth>,
    /// The session's way to the bus: fenced, stamped with origin, term and position.
    pub publisher: Publisher,
    /// Every message to a front goes through it (numbered, kept for resending).
    pub links: Arc<FrontLinks>,
    /// The slot read (its DDL epochs are recorded under its name).
    pub slot: String,
    /// How catalog changes reach the pipeline, and the epoch at the start position.
    pub catalog: CatalogTracking,
    /// How far a project's delivery may fall behind.
    pub limits: LaneLimits,
    /// The projects of this source (`None`: all).
    pub projects: Option<Arc<walcast_control::source_projects::SourceProjects>>,
}

/// While stopping, how often the lanes are looked at.
const IDLE_POLL: Duration = Duration::from_millis(5);

pub struct RealtimeConsumer {
    publisher: Publisher,
    outlet: Arc<Outlet>,
    matcher: Arc<Matcher>,
    lanes: Lanes,
    rls_opts: RlsOptions,
    /// Decoded changes waiting to be handed to their lanes, in WAL order.
    pending: Vec<PendingChange>,
    /// The last commit decoded.
    last_commit: Lsn,
    /// The same, for the filter watch's notices.
    position: Arc<AtomicU64>,
    /// Tells subscriptions whose filter reads a column their role may not read.
    watch: PrivilegeWatch,
    health: Arc<PipelineHealth>,
    catalog: Client,
    types: TypeCache,
    routes: HashMap<(String, String), String>,
    /// Routes removed in the current transaction (a dropped table's notice may come
    /// after its realtime-tables row is deleted).
    removed_routes: HashMap<(String, String), String>,
    /// The schemas decoded whole (see [`RealtimeConsumer::decode_schemas`]).
    decoded: BTreeSet<String>,
    txn: Option<TxnContext>,
    seq: u32,
    slot: String,
    ddl: CatalogTracking,
    projects: Option<Arc<walcast_control::source_projects::SourceProjects>>,
}

impl RealtimeConsumer {
    pub async fn new(
        matcher: Arc<Matcher>,
        catalog: Client,
        opts: RealtimeOptions,
    ) -> Result<RealtimeConsumer, RealtimeError> {
        let types = TypeCache::load(&catalog).await?;
        let rls_opts = opts.rls;
        let outlet = Arc::new(Outlet::new(
            opts.publisher.clone(),
            opts.max_record_bytes,
            opts.health.clone(),
            opts.links,
        ));
        let lanes = Lanes::new(
            opts.database_url.clone(),
            opts.check_url.clone(),
            rls_opts.clone(),
            opts.limits,
            outlet.clone(),
        );
        let position = Arc::new(AtomicU64::new(0));
        let watch = PrivilegeWatch::spawn(
            matcher.clone(),
            opts.database_url.clone(),
            outlet.clone(),
            position.clone(),
        );
        Ok(RealtimeConsumer {
            publisher: opts.publisher,
            outlet,
            matcher,
            lanes,
            rls_opts,
            pending: Vec::new(),
            last_commit: Lsn(0),
            position,
            watch,
            health: opts.health,
            catalog,
            types,
            routes: HashMap::new(),
            removed_routes: HashMap::new(),
            decoded: BTreeSet::new(),
            txn: None,
            seq: 0,
            slot: opts.slot,
            ddl: opts.catalog,
            projects: opts.projects,
        })
    }

    /// The catalog connection (`DATABASE_URL`): the sources read the realtime tables
    /// through it, never through the replication connection (whose role may only
    /// replicate).
    pub fn catalog(&self) -> &Client {
        &self.catalog
    }

    /// Forget a partial transaction (the source restarts from the last acknowledged commit).
    pub fn reset(&mut self) {
        // Only changes of a transaction cut short can be left here (a commit is always
        // followed by a barrier, which publishes): they are read again.
        self.pending.clear();
        self.txn = None;
        self.seq = 0;
    }

    /// One step of a decoded transaction (see [`Consumer::handle`]).
    async fn on_item(&mut self, item: Item<'_>) -> Result<Handled, RealtimeError> {
        match item {
            Item::Begin(txn) => {
                self.txn = Some(txn.clone());
                self.seq = 0;
                self.removed_routes.clear();
                if let Some(xid) = txn.xid {
                    self.lanes.decoded(xid);
                }
                Ok(Handled::Continue)
            }
            Item::Change(_, change) => match change {
                Change::Insert(row) => self.row(ChangeKind::Insert, row).await,
                Change::Update(row) => self.row(ChangeKind::Update, row).await,
                Change::Delete(row) => self.row(ChangeKind::Delete, row).await,
                Change::Truncate(t) => self.truncate(&t.schema, &t.table).await,
                Change::Message(m) if m.transactional && m.prefix == NOTICE_PREFIX => {
                    self.catalog_notice(&m.content).await?;
                    Ok(Handled::Continue)
                }
                _ => Ok(Handled::Continue),
            },
            Item::Commit(txn) => {
                self.txn = None;
                self.last_commit = self.last_commit.max(txn.commit_lsn);
                self.position.store(self.last_commit.0, Ordering::Release);
                Ok(Handled::Continue)
            }
        }
    }

    /// A realtime-tables edit. Whole schemas are decoded: enabling or disabling a table
    /// of a schema already decoded changes nothing in the filter (no restart; the edit
    /// applies right here).
    fn registry_edit(&mut self, kind: ChangeKind, row: &RowChange<'_>) -> Handled {
        self.tables_edit(kind, row);
        // A table enabled under a wildcard binding may have a column its filter reads.
        self.watch.poke();
        match self.decode_schemas() {
            false => Handled::Continue,
            true => Handled::TablesChanged,
        }
    }

    async fn row(
        &mut self,
        kind: ChangeKind,
        row: &RowChange<'_>,
    ) -> Result<Handled, RealtimeError> {
        if row.schema == TABLES_SCHEMA && row.table == TABLES_TABLE {
            return Ok(self.registry_edit(kind, row));
        }
        let Some(txn) = self.txn.as_ref() else {
            let table = format!("{}.{}", row.schema, row.table);
            return Err(RealtimeError::OutsideTransaction(table));
        };
        let key = (row.schema.to_string(), row.table.to_string());
        let Some(project) = self.routes.get(&key) else {
            // Another consumer's table, or decoded because it was enabled when this batch
            // started, since disabled.
            return Ok(Handled::Continue);
        };
        if let Some(p) = &self.projects {
            if !p.admits(project, "change").await? {
                return Ok(Handled::Continue);
            }
        }
        metrics::counter!(crate::telemetry::CHANGES_DECODED).increment(1);
        let unknown_type = row
            .columns
            .iter()
            .chain(row.identity.iter())
            .any(|c| c.type_oid.is_some_and(|oid| !self.types.contains(oid)));
        if unknown_type {
            // A type created after start (an enum, a domain …).
            self.types.reload(&self.catalog).await?;
        }
        let mut event = match build_event(project, kind, row, txn, self.seq, &self.types) {
            Ok(event) => event,
            Err(e) => {
                let table = format!("{}.{}", row.schema, row.table);
                self.outlet
                    .skip(&table, Some(txn.commit_lsn), "event", &e.to_string());
                return Ok(Handled::Continue);
            }
        };
        if !self.outlet.fit_record(&mut event)? {
            return Ok(Handled::Continue);
        }
        // The classes of the table: their filters are evaluated on the project's lane.
        let at = txn.commit_lsn;
        let candidates = self
            .matcher
            .candidates(project, &row.schema, &row.table, at);
        let (filter_row, row_text, old_text) = match candidates.is_empty() {
            true => (OwnedRow::default(), Vec::new(), Vec::new()),
            false => {
                let (new, old) = versions_text(kind, row);
                (filter_row(kind, row, &self.types), new, old)
            }
        };
        self.seq += 1;
        self.hold(PendingChange {
            event,
            candidates,
            filter_row,
            matched: Vec::new(),
            row: row_text,
            old: old_text,
        })
        .await?;
        Ok(Handled::Continue)
    }

    /// A `TRUNCATE` of a realtime table: published, audience-free, on the table subject
    /// (services mirroring the table see it emptied), in order with the table's other
    /// changes; no client gets it (the matcher matches none, as Supabase delivers none).
    async fn truncate(&mut self, schema: &str, table: &str) -> Result<Handled, RealtimeError> {
        let Some(txn) = self.txn.as_ref() else {
            let table = format!("{schema}.{table}");
            return Err(RealtimeError::OutsideTransaction(table));
        };
        let key = (schema.to_string(), table.to_string());
        let Some(project) = self.routes.get(&key) else {
            return Ok(Handled::Continue);
        };
        if let Some(p) = &self.projects {
            if !p.admits(project, "change").await? {
                return Ok(Handled::Continue);
            }
        }
        metrics::counter!(crate::telemetry::CHANGES_DECODED).increment(1);
        let event =
            walcast_pipeline::change_event::truncate_event(project, schema, table, txn, self.seq);
        self.seq += 1;
        self.hold(PendingChange {
            event,
            candidates: Vec::new(),
            filter_row: OwnedRow::default(),
            matched: Vec::new(),
            row: Vec::new(),
            old: Vec::new(),
        })
        .await?;
        Ok(Handled::Continue)
    }

    /// Hold a change for its lane; hand the batch over once it is full.
    async fn hold(&mut self, change: PendingChange) -> Result<(), RealtimeError> {
        self.pending.push(change);
        let limit = match self.rls_opts.mode {
            RlsMode::Naive => 1,
            RlsMode::Batched => self.rls_opts.max_batch.max(1),
        };
        if self.pending.len() >= limit {
            self.flush().await?;
        }
        Ok(())
    }

    /// Hand the held changes to their projects' lanes, in WAL order (see
    /// [`crate::delivery::lanes`]).
    pub async fn flush(&mut self) -> Result<(), RealtimeError> {
        self.lanes.failure()?;
        if self.pending.is_empty() {
            return Ok(());
        }
        self.verify_triggers().await?;
        let batch = std::mem::take(&mut self.pending);
        let view = self.ddl.next_view();
        let mut parts: Vec<(usize, Vec<PendingChange>)> = Vec::new();
        for change in batch {
            let ddl = &self.ddl;
            let lane = self
                .lanes
                .lane_for(&change.event.project, |rls| ddl.seed(rls));
            match parts.iter_mut().find(|(l, _)| *l == lane) {
                Some((_, part)) => part.push(change),
                None => parts.push((lane, vec![change])),
            }
        }
        for (lane, changes) in parts {
            self.lanes.batch(lane, changes, view, self.last_commit);
        }
        Ok(())
    }

    /// How far everything handed over is published: the lanes' lowest position, once
    /// what they published has reached the bus. Never waits for a slow lane.
    pub async fn settle(&mut self, handed: Lsn) -> Result<Lsn, RealtimeError> {
        self.flush().await?;
        self.record_epochs().await?;
        let position = self.lanes.position(handed);
        self.lanes.report();
        self.publisher.barrier().await?;
        Ok(position)
    }

    /// Publish what is held, wait until every lane published what it was handed, then
    /// until everything handed to the bus has reached it (at a graceful stop).
    pub async fn barrier(&mut self) -> Result<(), RealtimeError> {
        self.flush().await?;
        self.record_epochs().await?;
        while !self.lanes.idle() {
            self.lanes.failure()?;
            tokio::time::sleep(IDLE_POLL).await;
        }
        self.lanes.report();
        Ok(self.publisher.barrier().await?)
    }

    /// Decode the schemas of the enabled tables too: `true` if one is new (the source
    /// restarts with it in the filter, once). A schema stays decoded while this pipeline
    /// runs, even when its last table is disabled: every change of the filter restarts
    /// the stream for every project (the slot re-decodes from its `restart_lsn`), so a
    /// tenant disabling and enabling its only table again and again must not be able to
    /// do that. The price: such a schema's writes are decoded and skipped until the next
    /// start of the pipeline, which drops it.
    fn decode_schemas(&mut self) -> bool {
        let mut added = false;
        // A name is copied only when new: an edit checks every route, and a burst of
        // 2,000 enables would otherwise copy ~2,000 names per enable.
        for (schema, _) in self.routes.keys() {
            if !self.decoded.contains(schema) {
                self.decoded.insert(schema.clone());
                added = true;
            }
        }
        added
    }

    /// See [`Consumer::refresh`]: `true` if a schema is decoded that was not.
    async fn refresh_tables(&mut self, when: Refresh) -> Result<bool, RealtimeError> {
        let tables = match when {
            Refresh::Start => Some(tables::list(&self.catalog, None).await?),
            Refresh::Check { confirmed } => {
                let current = self.realtime_tables();
                tables_drift(&self.catalog, &current, confirmed).await?
            }
        };
        let Some(tables) = tables else {
            return Ok(false);
        };
        if when == Refresh::Start {
            self.decoded.clear();
        }
        self.set_tables(&tables);
        Ok(self.decode_schemas() || when == Refresh::Start)
    }
}

/// The row filters see: the old row for a DELETE; otherwise the new one, with unchanged
/// TOASTed values taken from the old row.
fn filter_row(kind: ChangeKind, row: &RowChange<'_>, types: &TypeCache) -> OwnedRow {
    if kind == ChangeKind::Delete {
        return OwnedRow::new(row.identity.iter(), types);
    }
    let extra = row
        .identity
        .iter()
        .filter(|old| !row.columns.iter().any(|c| c.name == old.name));
    OwnedRow::new(row.columns.iter().chain(extra), types)
}

/// The versions of a matched change row checks may judge, as Postgres text: the new row
/// (INSERT, UPDATE) and the old one (a DELETE's row, an UPDATE's `old_record`).
fn versions_text(kind: ChangeKind, row: &RowChange<'_>) -> (Version, Version) {
    let new = match kind {
        ChangeKind::Delete => Vec::new(),
        _ => walcast_pipeline::change_event::new_row_text(row),
    };
    let old = match kind {
        ChangeKind::Insert => Vec::new(),
        _ => walcast_pipeline::change_event::old_row_text(row),
    };
    (new, old)
}

impl Consumer for RealtimeConsumer {
    fn name(&self) -> &'static str {
        "realtime"
    }

    /// The realtime tables' own table (so its edits arrive in WAL order); the enabled
    /// tables come with their schemas (see [`Consumer::schemas`]).
    fn tables(&self) -> Vec<(String, String)> {
        vec![(TABLES_SCHEMA.to_string(), TABLES_TABLE.to_string())]
    }

    /// Every schema that had an enabled table since the pipeline started, whole:
    /// enabling or disabling another table of one of them needs no restart of the source
    /// (a burst of enables costs the other tables nothing), at the price of decoding the
    /// schemas' other tables too (skipped here).
    fn schemas(&self) -> Vec<String> {
        self.decoded.iter().cloned().collect()
    }

    /// The DDL notices (see [`crate::catalog::change`]).
    fn message_prefixes(&self) -> Vec<String> {
        vec![NOTICE_PREFIX.to_string()]
    }

    /// At start the realtime tables are loaded; later edits arrive in WAL order and are applied
    /// exactly where they happened. The periodic re-read is a safety net (see
    /// [`tables_drift`]).
    fn refresh(&mut self, when: Refresh) -> BoxFuture<'_, Result<bool, ConsumerError>> {
        Box::pin(async move { Ok(self.refresh_tables(when).await?) })
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        Box::pin(async move { Ok(self.on_item(item).await?) })
    }

    /// Changes are waiting to be authorized and published.
    fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn flush(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move { Ok(RealtimeConsumer::flush(self).await?) })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move { Ok(RealtimeConsumer::barrier(self).await?) })
    }

    fn settle(&mut self, handed: Lsn) -> BoxFuture<'_, Result<Lsn, ConsumerError>> {
        Box::pin(async move { Ok(RealtimeConsumer::settle(self, handed).await?) })
    }

    fn reset(&mut self) {
        RealtimeConsumer::reset(self)
    }
}
