//! Realtime delivery, one [`Consumer`] of decoded transactions (see [`crate::driver`]):
//! realtime-tables edits applied at their WAL position, changes routed to a project, turned into
//! events, matched against subscriptions, authorized (RLS) and published on the bus; DDL
//! notices (logical messages) handled at their position.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_bus::event::Shrink;
use walcast_bus::{subject::change_subject, BusError, ChangeEvent, ChangeKind, Restriction};
use walcast_pipeline::{ConsumerError, Position, PublishError, Publisher};
use walcast_wal2json::{Change, Lsn, RowChange};

mod catalog;
pub use catalog::CatalogTracking;

use crate::authorize::rls::RlsChecker;
use crate::authorize::{authorize_batch, Audience, PendingChange, RlsMode};
use crate::catalog::change::NOTICE_PREFIX;
use crate::catalog::tables::{self, TABLES_SCHEMA, TABLES_TABLE};
use crate::catalog::tables_drift;
use crate::catalog::types::TypeCache;
use crate::config::RlsOptions;
use crate::delivery::event::build_event;
use crate::delivery::links::FrontLinks;
use crate::error::RealtimeError;
use crate::subscriptions::matcher::{Matcher, RowView};
use crate::telemetry;
use walcast_pipeline::consumer::{Consumer, Handled, Item, Refresh};
use walcast_pipeline::health::{PipelineHealth, SkippedChange};
use walcast_pipeline::TxnContext;

/// A stable shard for a project (FNV-1a), so routing survives restarts.
pub fn shard_of(project: &str, shards: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in project.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % shards.max(1) as u64) as usize
}

/// What a [`RealtimeConsumer`] is built with besides its connections.
pub struct RealtimeOptions {
    /// For the RLS checkers' connections.
    pub database_url: String,
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
}

/// Where a message goes: a front's delivery subject (through [`FrontLinks`]) or a subject.
enum To {
    Front(String),
    Subject(String),
}

/// A message to publish: where, and its payload.
type Message = (To, Vec<u8>);

/// Room left in a bus message for the subject, headers and framing.
const MESSAGE_OVERHEAD: usize = 1024;

/// Transactions decoded with no check since, at most: then their visibility is confirmed
/// without one (one query), so the list stays bounded.
const MAX_UNCONFIRMED: usize = 4096;

pub struct RealtimeConsumer {
    publisher: Publisher,
    links: Arc<FrontLinks>,
    matcher: Arc<Matcher>,
    shards: Vec<RlsChecker>,
    rls_opts: RlsOptions,
    /// Decoded changes waiting to be authorized and published, in WAL order.
    pending: Vec<PendingChange>,
    max_record_bytes: usize,
    health: Arc<PipelineHealth>,
    /// The largest message published so far (for the gauge).
    largest: std::sync::atomic::AtomicUsize,
    catalog: Client,
    types: TypeCache,
    routes: HashMap<(String, String), String>,
    txn: Option<TxnContext>,
    seq: u32,
    slot: String,
    ddl: CatalogTracking,
}

impl RealtimeConsumer {
    pub async fn new(
        matcher: Arc<Matcher>,
        catalog: Client,
        opts: RealtimeOptions,
    ) -> Result<RealtimeConsumer, RealtimeError> {
        let types = TypeCache::load(&catalog).await?;
        let rls_opts = opts.rls;
        let mut pipeline = RealtimeConsumer {
            publisher: opts.publisher,
            links: opts.links,
            matcher,
            shards: (0..rls_opts.shards.max(1))
                .map(|_| RlsChecker::new(opts.database_url.clone(), rls_opts.connections))
                .collect(),
            rls_opts,
            pending: Vec::new(),
            max_record_bytes: opts.max_record_bytes,
            health: opts.health,
            largest: std::sync::atomic::AtomicUsize::new(0),
            catalog,
            types,
            routes: HashMap::new(),
            txn: None,
            seq: 0,
            slot: opts.slot,
            ddl: opts.catalog,
        };
        pipeline.seed_carried();
        Ok(pipeline)
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
                self.decoded(txn.xid).await?;
                Ok(Handled::Continue)
            }
            Item::Change(_, change) => match change {
                Change::Insert(row) => self.row(ChangeKind::Insert, row).await,
                Change::Update(row) => self.row(ChangeKind::Update, row).await,
                Change::Delete(row) => self.row(ChangeKind::Delete, row).await,
                Change::Message(m) if m.transactional && m.prefix == NOTICE_PREFIX => {
                    self.catalog_notice(&m.content).await?;
                    Ok(Handled::Continue)
                }
                _ => Ok(Handled::Continue),
            },
            Item::Commit(_) => {
                self.txn = None;
                Ok(Handled::Continue)
            }
        }
    }

    /// A transaction is decoded, whatever tables it wrote (wal2json sends every BEGIN):
    /// the checks of later changes wait until it is visible, so a policy reading another
    /// table (a membership) never sees a state older than their commit (see
    /// [`RlsChecker::wait_visible`]). Confirmed now and then when no check comes.
    async fn decoded(&mut self, xid: Option<u32>) -> Result<(), RealtimeError> {
        for rls in &mut self.shards {
            if let Some(xid) = xid {
                rls.decoded(xid);
            }
            if rls.unconfirmed() >= MAX_UNCONFIRMED {
                rls.wait_visible(&[]).await?;
            }
        }
        Ok(())
    }

    async fn row(
        &mut self,
        kind: ChangeKind,
        row: &RowChange<'_>,
    ) -> Result<Handled, RealtimeError> {
        if row.schema == TABLES_SCHEMA && row.table == TABLES_TABLE {
            self.tables_edit(kind, row);
            return Ok(Handled::TablesChanged);
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
                self.skip(&table, Some(txn.commit_lsn), "event", &e.to_string());
                return Ok(Handled::Continue);
            }
        };
        if !self.fit_record(&mut event)? {
            return Ok(Handled::Continue);
        }
        // Filters see the old row for a DELETE; otherwise the new one, with unchanged
        // TOASTed values taken from the old row.
        let view = if kind == ChangeKind::Delete {
            RowView::new(row.identity.iter(), &self.types)
        } else {
            let extra = row
                .identity
                .iter()
                .filter(|old| !row.columns.iter().any(|c| c.name == old.name));
            RowView::new(row.columns.iter().chain(extra), &self.types)
        };
        let matched = self.matcher.matches(
            project,
            &row.schema,
            &row.table,
            kind,
            txn.commit_lsn,
            &view,
        );
        drop(view);
        let row_text = if matched.is_empty() || kind == ChangeKind::Delete {
            Vec::new()
        } else {
            crate::delivery::event::new_row_text(row)
        };
        self.seq += 1;
        self.pending.push(PendingChange {
            event,
            matched,
            row: row_text,
        });
        let limit = match self.rls_opts.mode {
            RlsMode::Naive => 1,
            RlsMode::Batched => self.rls_opts.max_batch.max(1),
        };
        if self.pending.len() >= limit {
            self.flush().await?;
        }
        Ok(Handled::Continue)
    }

    /// Authorize the held changes (each shard one round trip, shards side by side) and
    /// hand them to the bus in WAL order.
    pub async fn flush(&mut self) -> Result<(), RealtimeError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        self.verify_triggers().await?;
        let batch = std::mem::take(&mut self.pending);
        let view = self.ddl.next_view();
        self.shards.iter_mut().for_each(|s| s.set_view(view));
        let n = self.shards.len();
        let mut parts: Vec<Vec<PendingChange>> = (0..n).map(|_| Vec::new()).collect();
        let mut order: Vec<(usize, usize)> = Vec::with_capacity(batch.len());
        for change in batch {
            let s = shard_of(&change.event.project, n);
            let part = &mut parts[s];
            order.push((s, part.len()));
            part.push(change);
        }
        let started = std::time::Instant::now();
        let mode = self.rls_opts.mode;
        let timeout = self.rls_opts.timeout_ms;
        let audiences = futures_util::future::join_all(self.shards.iter_mut().zip(&parts).map(
            |(rls, part)| async move {
                if part.iter().all(|c| c.matched.is_empty()) {
                    return Ok(vec![Vec::new(); part.len()]);
                }
                authorize_batch(rls, part, mode, timeout).await
            },
        ))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, RealtimeError>>()?;
        metrics::histogram!(crate::telemetry::AUTHORIZE_SECONDS)
            .record(started.elapsed().as_secs_f64());
        tracing::debug!(
            changes = order.len(),
            ms = started.elapsed().as_millis() as u64,
            "batch authorized"
        );
        let mut parts: Vec<std::vec::IntoIter<PendingChange>> =
            parts.into_iter().map(Vec::into_iter).collect();
        for (s, j) in order {
            let Some(mut change) = parts.get_mut(s).and_then(Iterator::next) else {
                continue;
            };
            let audience = audiences
                .get(s)
                .and_then(|a| a.get(j))
                .cloned()
                .unwrap_or_default();
            self.publish(&mut change.event, &audience).await?;
        }
        Ok(())
    }

    /// The largest message the bus takes, less room for subject and headers.
    fn message_budget(&self) -> usize {
        self.publisher
            .max_payload()
            .map_or(usize::MAX, |m| m.saturating_sub(MESSAGE_OVERHEAD))
    }

    /// Bring a change's values within `MAX_RECORD_BYTES` and what one bus message can
    /// carry, the Supabase way (see [`ChangeEvent::shrink_to`]). `false`: it cannot be
    /// sent at all (skipped, reported).
    fn fit_record(&self, event: &mut ChangeEvent) -> Result<bool, RealtimeError> {
        let columns: usize = event
            .columns
            .iter()
            .map(|c| c.name.len() + c.type_name.len() + 24)
            .sum();
        let limit = self.max_record_bytes.min(
            self.message_budget()
                .saturating_sub(columns + MESSAGE_OVERHEAD),
        );
        let size = event.record_bytes();
        let outcome = event
            .shrink_to(limit)
            .map_err(crate::delivery::event::EventError::Json)?;
        let table = format!("{}.{}", event.schema, event.table);
        match outcome {
            Shrink::Fits => Ok(true),
            Shrink::SmallValues | Shrink::KeyOnly => {
                metrics::counter!(telemetry::CHANGES_OVERSIZED).increment(1);
                tracing::warn!(%table, commit_lsn = %event.commit_lsn, bytes = size, limit, "change too large: delivered without its large values (Error 413)");
                self.health.record_skip(
                    SkippedChange {
                        table,
                        commit_lsn: Some(event.commit_lsn),
                        reason: "payload_too_large".into(),
                    },
                    true,
                );
                Ok(true)
            }
            Shrink::TooLarge => {
                self.skip(
                    &table,
                    Some(event.commit_lsn),
                    "payload_too_large",
                    &format!("even its primary key is over {limit} bytes"),
                );
                Ok(false)
            }
        }
    }

    /// A change that no retry can deliver: log, count, report, move on.
    fn skip(&self, table: &str, commit_lsn: Option<Lsn>, reason: &'static str, error: &str) {
        self.health.report_skip(table, commit_lsn, reason, error);
    }

    /// Publish a change: once, without its audience, on its table's subject (for `walcast
    /// tail` and other services), and to each front with subscribers that may see it, on
    /// that front's delivery subject, naming them (in several parts when they do not fit
    /// one message). A change the server refuses as too large (its `max_payload` can
    /// shrink on a reconnect) is fitted again to the new size once; if that fails too it
    /// is skipped.
    async fn publish(
        &self,
        event: &mut ChangeEvent,
        audience: &Audience,
    ) -> Result<(), RealtimeError> {
        let table = format!("{}.{}", event.schema, event.table);
        for attempt in 0..2 {
            if attempt > 0 && !self.fit_record(event)? {
                return Ok(());
            }
            let Some(messages) = self.messages(event, audience)? else {
                self.skip(
                    &table,
                    Some(event.commit_lsn),
                    "payload_too_large",
                    "one subscriber's share does not fit a message",
                );
                return Ok(());
            };
            match self.send(event, messages).await {
                Err(RealtimeError::Publish(PublishError::Bus(BusError::PayloadTooLarge {
                    ..
                }))) => continue,
                other => return other,
            }
        }
        self.skip(
            &table,
            Some(event.commit_lsn),
            "payload_too_large",
            "the bus refused it twice",
        );
        Ok(())
    }

    /// (subject, payload) of every message of a change; `None` if one cannot fit.
    fn messages(
        &self,
        event: &ChangeEvent,
        audience: &Audience,
    ) -> Result<Option<Vec<Message>>, RealtimeError> {
        let budget = self.message_budget();
        let json = |e: serde_json::Error| {
            RealtimeError::Event(crate::delivery::event::EventError::Json(e))
        };
        let mut out = Vec::with_capacity(1 + audience.len());
        for front in audience {
            let mut e = event.clone();
            for (columns, ids) in &front.groups {
                if let Some(cols) = columns {
                    e.restricted.push(Restriction {
                        columns: cols.iter().cloned().collect(),
                        subs: ids.clone(),
                    });
                }
                e.subs.extend(ids.iter().cloned());
            }
            let Some(parts) = e.split(budget).map_err(json)? else {
                return Ok(None);
            };
            if parts.len() > 1 {
                metrics::counter!(telemetry::CHANGES_SPLIT).increment(1);
            }
            out.extend(
                parts
                    .into_iter()
                    .map(|m| (To::Front(front.front.clone()), m)),
            );
        }
        // The audience-free copy last: a consumer of both knows a change's deliveries
        // are complete when it arrives.
        let subject = change_subject(&event.project, &event.schema, &event.table);
        let Some(bare) = event.split(budget).map_err(json)? else {
            return Ok(None);
        };
        out.extend(bare.into_iter().map(|m| (To::Subject(subject.clone()), m)));
        Ok(Some(out))
    }

    async fn send(&self, event: &ChangeEvent, messages: Vec<Message>) -> Result<(), RealtimeError> {
        let at = Position::change(event.commit_lsn, event.seq);
        for (to, payload) in messages {
            metrics::counter!(telemetry::PUBLISHED_BYTES).increment(payload.len() as u64);
            metrics::counter!(telemetry::PUBLISHED_MESSAGES).increment(1);
            let size = payload.len();
            let before = self
                .largest
                .fetch_max(size, std::sync::atomic::Ordering::Relaxed);
            if size > before {
                metrics::gauge!(telemetry::LARGEST_MESSAGE).set(size as f64);
            }
            // The publisher checks the fence right before the hand-over: a leader that
            // lost its lease sends nothing.
            let payload = Bytes::from(payload);
            match to {
                To::Front(f) => {
                    self.links
                        .send(&self.publisher, &f, at, None, payload)
                        .await?
                }
                To::Subject(s) => self.publisher.publish(s, at, &[], payload).await?,
            }
        }
        metrics::counter!(crate::telemetry::CHANGES_PUBLISHED).increment(1);
        Ok(())
    }

    /// Publish what is held, then wait until everything handed to the bus has reached it.
    pub async fn barrier(&mut self) -> Result<(), RealtimeError> {
        self.flush().await?;
        Ok(self.publisher.barrier().await?)
    }

    /// See [`Consumer::refresh`]: `true` if the tables changed.
    async fn refresh_tables(&mut self, when: Refresh) -> Result<bool, RealtimeError> {
        let tables = match when {
            Refresh::Start => Some(tables::list(&self.catalog, None).await?),
            Refresh::Check { confirmed } => {
                let current = self.realtime_tables();
                tables_drift(&self.catalog, &current, confirmed).await?
            }
        };
        Ok(tables.map(|t| self.set_tables(&t)).is_some())
    }
}

impl Consumer for RealtimeConsumer {
    fn name(&self) -> &'static str {
        "realtime"
    }

    /// The enabled tables, and their own table (so its edits arrive in WAL order).
    fn tables(&self) -> Vec<(String, String)> {
        let mut v: Vec<(String, String)> = self.routes.keys().cloned().collect();
        v.push((TABLES_SCHEMA.to_string(), TABLES_TABLE.to_string()));
        v
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

    fn reset(&mut self) {
        RealtimeConsumer::reset(self)
    }
}
