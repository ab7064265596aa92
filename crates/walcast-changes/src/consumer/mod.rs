//! Change streams (README "Change streams"): a [`Consumer`] of its own that stores the
//! changes of the tables whose change stream is on (`walcast.change_stream_tables`) in
//! the JetStream stream `WALCAST_CHANGES`, on `walcast.changes.<project>.<schema>.<table>`,
//! each with a `Nats-Msg-Id` stable across replays ([`walcast_core::ChangeId`]), and lets
//! the slot be acknowledged past a transaction only once JetStream acknowledged every
//! change of it.
//!
//! The events are realtime's ([`walcast_pipeline::change_event`]), without an audience, and a
//! `TRUNCATE` is one too ([`walcast_bus::ChangeKind::Truncate`]). `seq` counts the
//! streaming tables' changes of the transaction, so a replay numbers them the same.
//!
//! Nothing here waits on JetStream: each committed transaction's messages go to the
//! sender task ([`sender`]); [`Consumer::settle`] reports, without waiting, the commit
//! before the first transaction not all acknowledged. So a slow or unavailable JetStream
//! holds this consumer's position only (the slot keeps the WAL from there) while realtime
//! delivery goes on; past `max_queued` outstanding messages it stops accepting and the
//! driver hands it the rest again later (what it had already is skipped).

pub mod sender;
mod snapshot;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_bus::subject::changes_subject;
use walcast_bus::{ChangeEvent, ChangeKind};
use walcast_core::ChangeId;
use walcast_pipeline::consumer::{Consumer, Handled, Item, Refresh};
use walcast_pipeline::{
    ConsumerError, ConsumerFactory, PipelineHealth, PublishError, Publisher, Session, TxnContext,
};
use walcast_wal2json::{Change, Lsn, RowChange};

use crate::config::ChangeStreamConfig;
use crate::error::ChangesError;
use crate::tables::{self as change_streams, STREAMS_SCHEMA, STREAMS_TABLE};
use crate::telemetry;
use sender::{SenderHandle, Stored, StreamMessage};
use walcast_control::tables::tables_row;
use walcast_pipeline::change_event::{budget, build_event, fit, truncate_event, TypeCache};

/// The change-stream consumer's factory (the leader adds it when NATS is the bus).
pub fn factory(cfg: ChangeStreamConfig) -> Arc<dyn ConsumerFactory> {
    let source = cfg.projects.as_ref().map_or("default", |p| p.source());
    let stored = sender::stored_for(&cfg.stream, source);
    Arc::new(Factory(cfg, stored))
}

struct Factory(ChangeStreamConfig, Stored);

impl ConsumerFactory for Factory {
    fn build<'a>(
        &'a self,
        session: &'a Session<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn Consumer>, ConsumerError>> {
        Box::pin(async move {
            let catalog = walcast_pgtls::connect(&self.0.database_url)
                .await
                .map_err(ChangesError::from)?;
            let types = TypeCache::load(&catalog)
                .await
                .map_err(ChangesError::from)?;
            let publisher = session.publisher("change_stream");
            let health = session.health.clone();
            let mut c = ChangeStream::new(self.0.clone(), publisher, health, catalog, types);
            c.stored = self.1.clone();
            Ok(Box::new(c) as Box<dyn Consumer>)
        })
    }
}

/// A transaction with messages, handed to the sender.
struct PendingTxn {
    /// The consumer's handed position before it (durable once this one's are not).
    prev: Lsn,
    /// Messages handed to the sender up to and including this transaction's.
    end: u64,
    /// Snapshot chunks published in it: told their row count once it is acknowledged.
    notify: Vec<(tokio::sync::oneshot::Sender<u64>, u64)>,
}

pub struct ChangeStream {
    cfg: ChangeStreamConfig,
    publisher: Publisher,
    sender: Option<SenderHandle>,
    health: Arc<PipelineHealth>,
    catalog: Client,
    types: TypeCache,
    /// Streaming tables → their project.
    routes: HashMap<(String, String), String>,
    /// Messages of the transaction being read.
    txn: Vec<StreamMessage>,
    /// Changes of streaming tables in the transaction so far.
    seq: u32,
    /// The transaction being read was handed before: its items are skipped.
    skipping: bool,
    /// The newest commit (or caught-up position) handed over.
    seen: Lsn,
    submitted: u64,
    pending: VecDeque<PendingTxn>,
    /// The newest position stored, shared by this process's sessions and terms of the
    /// source (to count a change stored after later ones).
    stored: Stored,
    /// This consumer's number (snapshot chunks, see `snapshot.rs`).
    session: u64,
    /// Snapshot chunks published in the transaction being read.
    notify: Vec<(tokio::sync::oneshot::Sender<u64>, u64)>,
}

impl ChangeStream {
    pub fn new(
        cfg: ChangeStreamConfig,
        publisher: Publisher,
        health: Arc<PipelineHealth>,
        catalog: Client,
        types: TypeCache,
    ) -> ChangeStream {
        ChangeStream {
            cfg,
            publisher,
            sender: None,
            health,
            catalog,
            types,
            routes: HashMap::new(),
            txn: Vec::new(),
            seq: 0,
            skipping: false,
            seen: Lsn::ZERO,
            submitted: 0,
            pending: VecDeque::new(),
            stored: Stored::default(),
            session: snapshot::next_session(),
            notify: Vec::new(),
        }
    }

    /// A change-stream-tables edit, at its WAL position; `true` if the tables changed.
    fn edit(&mut self, kind: ChangeKind, row: &RowChange<'_>) -> bool {
        apply_edit(&mut self.routes, kind, row)
    }

    /// The project of a streaming table, if its project may pass on this source.
    async fn route(&self, schema: &str, table: &str) -> Result<Option<String>, ChangesError> {
        let key = (schema.to_string(), table.to_string());
        let Some(project) = self.routes.get(&key) else {
            return Ok(None);
        };
        if let Some(p) = &self.cfg.projects {
            if !p.admits(project, "change_stream").await? {
                return Ok(None);
            }
        }
        Ok(Some(project.clone()))
    }

    async fn row(
        &mut self,
        txn: &TxnContext,
        kind: ChangeKind,
        row: &RowChange<'_>,
    ) -> Result<Handled, ChangesError> {
        if row.schema == STREAMS_SCHEMA && row.table == STREAMS_TABLE {
            return Ok(match self.edit(kind, row) {
                true => Handled::TablesChanged,
                false => Handled::Continue,
            });
        }
        let Some(project) = self.route(&row.schema, &row.table).await? else {
            return Ok(Handled::Continue);
        };
        let seq = self.seq;
        self.seq += 1;
        let unknown = row
            .columns
            .iter()
            .chain(row.identity.iter())
            .any(|c| c.type_oid.is_some_and(|oid| !self.types.contains(oid)));
        if unknown {
            // A type created after start (an enum, a domain …).
            self.types.reload(&self.catalog).await?;
        }
        match build_event(&project, kind, row, txn, seq, &self.types) {
            Ok(event) => {
                self.note(Some(&event), &row.schema, &row.table);
                self.add(event)?
            }
            Err(e) => {
                self.note(None, &row.schema, &row.table);
                let table = format!("{}.{}", row.schema, row.table);
                self.health
                    .report_skip(&table, Some(txn.commit_lsn), "event", &e.to_string());
            }
        }
        Ok(Handled::Continue)
    }

    async fn truncate(
        &mut self,
        txn: &TxnContext,
        schema: &str,
        table: &str,
    ) -> Result<(), ChangesError> {
        let Some(project) = self.route(schema, table).await? else {
            return Ok(());
        };
        if let Some(board) = &self.cfg.board {
            board.truncate(schema, table);
        }
        let seq = self.seq;
        self.seq += 1;
        self.add(truncate_event(&project, schema, table, txn, seq))
    }

    /// Fit the event to a message and keep it for the transaction's commit.
    fn add(&mut self, mut event: ChangeEvent) -> Result<(), ChangesError> {
        metrics::counter!(telemetry::CHANGE_STREAM_CHANGES, "kind" => event.kind.as_str())
            .increment(1);
        let budget = budget(self.publisher.max_payload());
        if !fit(&mut event, self.cfg.max_record_bytes, budget, &self.health)? {
            return Ok(());
        }
        let payload =
            serde_json::to_vec(&event).map_err(walcast_pipeline::change_event::EventError::Json)?;
        self.txn.push(StreamMessage {
            subject: changes_subject(&event.project, &event.schema, &event.table),
            id: ChangeId {
                project: event.project,
                commit_lsn: event.commit_lsn,
                seq: event.seq,
                part: event.part,
            },
            payload: Bytes::from(payload),
            table: format!("{}.{}", event.schema, event.table),
        });
        Ok(())
    }

    /// The committed transaction's messages to the sender (never waits).
    fn commit(&mut self, txn: &TxnContext) -> Result<(), PublishError> {
        let messages = std::mem::take(&mut self.txn);
        let notify = std::mem::take(&mut self.notify);
        let prev = self.seen;
        self.seen = self.seen.max(txn.commit_lsn);
        if messages.is_empty() {
            // A chunk whose every row changed: stored once what precedes it is.
            if !notify.is_empty() {
                self.pending.push_back(PendingTxn {
                    prev,
                    end: self.submitted,
                    notify,
                });
            }
            return Ok(());
        }
        if self.sender.is_none() {
            // The context manages the stream; messages go out with their answers to
            // the sender's own subscription (its window bounds them).
            let js = self
                .publisher
                .jetstream(|b| b.timeout(self.cfg.ack_timeout))?;
            let (health, stored) = (self.health.clone(), self.stored.clone());
            let s = sender::spawn(self.cfg.clone(), js, health, stored);
            self.sender = Some(s);
        }
        let Some(sender) = self.sender.as_ref() else {
            return Ok(());
        };
        let n = messages.len() as u64;
        if !sender.send(messages) {
            return Err(self.sender_failure());
        }
        self.submitted += n;
        self.pending.push_back(PendingTxn {
            prev,
            end: self.submitted,
            notify,
        });
        Ok(())
    }

    fn sender_failure(&self) -> PublishError {
        self.sender
            .as_ref()
            .and_then(SenderHandle::take_failure)
            .unwrap_or(PublishError::Bus(walcast_bus::BusError::Closed(
                "the change-stream sender stopped",
            )))
    }

    fn outstanding(&self) -> u64 {
        self.sender
            .as_ref()
            .map_or(0, |s| self.submitted.saturating_sub(s.done()))
    }

    /// Forget the transactions whose every message is done.
    fn collect(&mut self) -> Result<(), PublishError> {
        let Some(sender) = &self.sender else {
            // Nothing was ever sent: every pending transaction is done.
            for t in self.pending.drain(..) {
                for (tx, n) in t.notify {
                    let _ = tx.send(n);
                }
            }
            return Ok(());
        };
        if let Some(failure) = sender.take_failure() {
            return Err(failure);
        }
        let done = sender.done();
        while self.pending.front().is_some_and(|t| t.end <= done) {
            if let Some(t) = self.pending.pop_front() {
                for (tx, n) in t.notify {
                    let _ = tx.send(n);
                }
            }
        }
        metrics::gauge!(telemetry::CHANGE_STREAM_QUEUED).set(self.outstanding() as f64);
        Ok(())
    }

    async fn on_item(&mut self, item: Item<'_>) -> Result<Handled, ChangesError> {
        match item {
            Item::Begin(txn) => {
                self.txn.clear();
                self.notify.clear();
                self.seq = 0;
                self.skipping = txn.commit_lsn <= self.seen;
            }
            Item::Change(..) if self.skipping => {}
            Item::Change(txn, change) => match change {
                Change::Insert(row) => return self.row(txn, ChangeKind::Insert, row).await,
                Change::Update(row) => return self.row(txn, ChangeKind::Update, row).await,
                Change::Delete(row) => return self.row(txn, ChangeKind::Delete, row).await,
                Change::Truncate(t) => self.truncate(txn, &t.schema, &t.table).await?,
                Change::Message(m) => self.watermark(txn, m)?,
                _ => {}
            },
            Item::Commit(_) if self.skipping => self.skipping = false,
            Item::Commit(txn) => self.commit(txn)?,
        }
        Ok(Handled::Continue)
    }
}

/// Apply an edit of `walcast.change_stream_tables` (its old row removed, its new row
/// added) to `routes`; `true` if they changed.
fn apply_edit(
    routes: &mut HashMap<(String, String), String>,
    kind: ChangeKind,
    row: &RowChange<'_>,
) -> bool {
    let before = routes.clone();
    if kind != ChangeKind::Insert {
        if let Some(t) = tables_row(&row.identity) {
            routes.remove(&(t.schema, t.table));
        }
    }
    if kind != ChangeKind::Delete {
        if let Some(t) = tables_row(&row.columns) {
            routes.insert((t.schema, t.table), t.project);
        }
    }
    *routes != before
}

impl Consumer for ChangeStream {
    fn name(&self) -> &'static str {
        "change_stream"
    }

    fn tables(&self) -> Vec<(String, String)> {
        let mut t: Vec<(String, String)> = self.routes.keys().cloned().collect();
        t.push((STREAMS_SCHEMA.to_string(), STREAMS_TABLE.to_string()));
        t.sort();
        t
    }

    /// The snapshot watermarks, when snapshots run in this process.
    fn message_prefixes(&self) -> Vec<String> {
        match self.cfg.board {
            Some(_) => vec![crate::snapshot::PREFIX.to_string()],
            None => Vec::new(),
        }
    }

    /// At start the streaming tables are read; later edits arrive in WAL order.
    fn refresh(&mut self, when: Refresh) -> BoxFuture<'_, Result<bool, ConsumerError>> {
        Box::pin(async move {
            if when != Refresh::Start {
                return Ok(false);
            }
            let tables = change_streams::list(&self.catalog, None)
                .await
                .map_err(ChangesError::from)?;
            self.routes = tables
                .into_iter()
                .map(|t| ((t.schema, t.table), t.project))
                .collect();
            Ok(true)
        })
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        Box::pin(async move { Ok(self.on_item(item).await?) })
    }

    fn settle(&mut self, handed: Lsn) -> BoxFuture<'_, Result<Lsn, ConsumerError>> {
        Box::pin(async move {
            self.collect()?;
            self.seen = self.seen.max(handed);
            Ok(self.pending.front().map_or(handed, |t| t.prev.min(handed)))
        })
    }

    fn accepting(&self) -> bool {
        self.outstanding() < self.cfg.max_queued.max(1) as u64
    }

    /// Waits until every message handed over is acknowledged (the driver bounds it).
    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async move {
            let n = self.submitted;
            if let Some(sender) = &mut self.sender {
                if !sender.wait_done(n).await {
                    return Err(self.sender_failure().into());
                }
            }
            self.collect()?;
            Ok(())
        })
    }

    fn reset(&mut self) {
        self.txn.clear();
        self.notify.clear();
        self.seq = 0;
        self.skipping = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(line: &str) -> walcast_wal2json::Change<'_> {
        walcast_wal2json::decode(line).unwrap()
    }

    const COLS: &str = r#"[{"name":"project_id","type":"text","value":"shop"},{"name":"schema_name","type":"text","value":"public"},{"name":"table_name","type":"text","value":"orders"}]"#;

    #[test]
    fn edits_of_the_list_change_the_routes_at_their_position() {
        let mut routes = HashMap::new();
        let insert = format!(
            r#"{{"action":"I","xid":1,"schema":"walcast","table":"change_stream_tables","columns":{COLS}}}"#
        );
        let change = row(&insert);
        assert!(apply_edit(
            &mut routes,
            ChangeKind::Insert,
            change.row().unwrap()
        ));
        let key = ("public".to_string(), "orders".to_string());
        assert_eq!(routes.get(&key).map(String::as_str), Some("shop"));
        // The same row again changes nothing.
        assert!(!apply_edit(
            &mut routes,
            ChangeKind::Insert,
            change.row().unwrap()
        ));
        let delete = format!(
            r#"{{"action":"D","xid":2,"schema":"walcast","table":"change_stream_tables","identity":{COLS}}}"#
        );
        let change = row(&delete);
        assert!(apply_edit(
            &mut routes,
            ChangeKind::Delete,
            change.row().unwrap()
        ));
        assert!(routes.is_empty());
    }
}
