//! The source-independent half of the CDC path: wal2json lines in WAL order → decoded,
//! routed to a project, turned into events and published, with transaction boundaries
//! tracked so the source knows which commit LSN is safe to acknowledge.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use tokio_postgres::Client;
use walcast_bus::{
    subject::change_subject, Bus, ChangeKind, Restriction, HEADER_LSN, HEADER_ORIGIN, HEADER_SEQ,
};
use walcast_wal2json::{decode, Change, Lsn, RowChange};

use crate::authorize::authorize;
use crate::event::{build_event, TxnContext};
use crate::matcher::{Matcher, RowView};
use crate::registry::{TableRef, REGISTRY_SCHEMA, REGISTRY_TABLE};
use crate::rls::RlsChecker;
use crate::types::TypeCache;
use crate::CdcError;

/// What a line meant for the source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineOutcome {
    /// Inside a transaction, or a line outside any.
    Continue,
    /// A transaction ended; everything of it has been handed to the bus.
    Committed {
        commit_lsn: Lsn,
        /// It changed the realtime registry: the table filter must be refreshed before
        /// decoding anything after it.
        registry_changed: bool,
    },
}

pub struct Pipeline {
    bus: Bus,
    matcher: Arc<Matcher>,
    rls: RlsChecker,
    origin: String,
    catalog: Client,
    types: TypeCache,
    routes: HashMap<(String, String), String>,
    txn: Option<TxnContext>,
    seq: u32,
    registry_changed: bool,
}

impl Pipeline {
    pub async fn new(
        bus: Bus,
        matcher: Arc<Matcher>,
        origin: String,
        catalog: Client,
        database_url: String,
    ) -> Result<Pipeline, CdcError> {
        let types = TypeCache::load(&catalog).await?;
        Ok(Pipeline {
            bus,
            matcher,
            rls: RlsChecker::new(database_url),
            origin,
            catalog,
            types,
            routes: HashMap::new(),
            txn: None,
            seq: 0,
            registry_changed: false,
        })
    }

    /// The streamed tables as the pipeline knows them at its current WAL position.
    pub fn tables(&self) -> Vec<TableRef> {
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

    /// True between a transaction's BEGIN and COMMIT lines.
    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// Forget a partial transaction (the source restarts from the last acknowledged commit).
    pub fn reset(&mut self) {
        self.txn = None;
        self.seq = 0;
        self.registry_changed = false;
    }

    pub async fn on_line(&mut self, data: &str) -> Result<LineOutcome, CdcError> {
        let change = decode(data).map_err(|e| {
            metrics::counter!("walcast_cdc_decode_errors_total").increment(1);
            CdcError::Decode {
                error: e.to_string(),
                line: data.chars().take(300).collect(),
            }
        })?;
        match change {
            Change::Begin(m) => {
                let commit_lsn = m.next_lsn.ok_or_else(|| CdcError::Decode {
                    error: "BEGIN without nextlsn (is include-lsn on?)".into(),
                    line: data.chars().take(300).collect(),
                })?;
                let commit_timestamp = m
                    .timestamp
                    .as_deref()
                    .and_then(|t| walcast_protocol::timestamp::pg_to_rfc3339_millis(t).ok())
                    .unwrap_or_default();
                self.txn = Some(TxnContext {
                    xid: m.xid,
                    commit_lsn,
                    commit_timestamp,
                });
                self.seq = 0;
                self.registry_changed = false;
                Ok(LineOutcome::Continue)
            }
            Change::Insert(row) => self.row(ChangeKind::Insert, &row).await,
            Change::Update(row) => self.row(ChangeKind::Update, &row).await,
            Change::Delete(row) => self.row(ChangeKind::Delete, &row).await,
            Change::Truncate(_) | Change::Message(_) => Ok(LineOutcome::Continue),
            Change::Commit(m) => {
                let txn = self.txn.take();
                let commit_lsn =
                    m.next_lsn
                        .or(txn.map(|t| t.commit_lsn))
                        .ok_or_else(|| CdcError::Decode {
                            error: "COMMIT without nextlsn".into(),
                            line: data.chars().take(300).collect(),
                        })?;
                Ok(LineOutcome::Committed {
                    commit_lsn,
                    registry_changed: std::mem::take(&mut self.registry_changed),
                })
            }
        }
    }

    async fn row(
        &mut self,
        kind: ChangeKind,
        row: &RowChange<'_>,
    ) -> Result<LineOutcome, CdcError> {
        if row.schema == REGISTRY_SCHEMA && row.table == REGISTRY_TABLE {
            // Apply the registry edit as of this WAL position: the filter for what follows
            // is then exact, whatever the registry holds by the time we read it.
            if kind != ChangeKind::Insert {
                if let Some(t) = registry_row(&row.identity) {
                    self.routes.remove(&(t.schema, t.table));
                }
            }
            if kind != ChangeKind::Delete {
                if let Some(t) = registry_row(&row.columns) {
                    self.routes.insert((t.schema, t.table), t.project);
                }
            }
            self.registry_changed = true;
            return Ok(LineOutcome::Continue);
        }
        metrics::counter!("walcast_cdc_changes_decoded_total").increment(1);
        let Some(txn) = self.txn.as_ref() else {
            return Err(CdcError::Decode {
                error: "row change outside a transaction (is include-transaction on?)".into(),
                line: format!("{}.{}", row.schema, row.table),
            });
        };
        let key = (row.schema.to_string(), row.table.to_string());
        let Some(project) = self.routes.get(&key) else {
            // Decoded because it was enabled when this batch started, since disabled.
            return Ok(LineOutcome::Continue);
        };
        let unknown_type = row
            .columns
            .iter()
            .chain(row.identity.iter())
            .any(|c| c.type_oid.is_some_and(|oid| !self.types.contains(oid)));
        if unknown_type {
            // A type created after start (an enum, a domain …).
            self.types.reload(&self.catalog).await?;
        }
        let mut event = build_event(project, kind, row, txn, self.seq, &self.types)?;
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
        if !matched.is_empty() {
            let audience = authorize(&mut self.rls, kind, row, &event, matched).await?;
            for (columns, ids) in audience {
                if let Some(cols) = columns {
                    event.restricted.push(Restriction {
                        columns: cols.into_iter().collect(),
                        subs: ids.clone(),
                    });
                }
                event.subs.extend(ids);
            }
        }
        self.seq += 1;
        let subject = change_subject(project, &event.schema, &event.table);
        let payload =
            Bytes::from(serde_json::to_vec(&event).map_err(crate::event::EventError::Json)?);
        let lsn = event.commit_lsn.to_string();
        let seq = event.seq.to_string();
        self.bus
            .publish(
                subject,
                &[
                    (HEADER_ORIGIN, &self.origin),
                    (HEADER_LSN, &lsn),
                    (HEADER_SEQ, &seq),
                ],
                payload,
            )
            .await?;
        metrics::counter!("walcast_cdc_changes_published_total").increment(1);
        Ok(LineOutcome::Continue)
    }

    /// Wait until everything handed to the bus has reached it.
    pub async fn barrier(&self) -> Result<(), CdcError> {
        Ok(self.bus.barrier().await?)
    }
}

/// A registry row (`project_id`, `schema_name`, `table_name`) from decoded columns.
fn registry_row(cols: &[walcast_wal2json::Column<'_>]) -> Option<TableRef> {
    let get = |name: &str| {
        cols.iter()
            .find(|c| c.name == name)
            .and_then(|c| c.text())
            .map(|t| t.into_owned())
    };
    Some(TableRef {
        project: get("project_id")?,
        schema: get("schema_name")?,
        table: get("table_name")?,
    })
}
