//! Snapshot chunks on the change stream (`crate::snapshot`): the watermarks, read in WAL
//! order like any change, open and close a chunk on the [`Board`]; between them the keys
//! of the chunk table's changes are noted; at the high watermark the chunk's rows whose
//! key did not change become `READ` events at the watermark's position (its transaction
//! holds only the message, so `seq` 0, 1, … are the chunk's alone).

use std::sync::atomic::{AtomicU64, Ordering};

use walcast_bus::{ChangeEvent, ChangeKind};
use walcast_pipeline::TxnContext;
use walcast_wal2json::Message;

use super::ChangeStream;
use crate::error::ChangesError;
use crate::snapshot::board::{ChunkMeta, ChunkRow};
use crate::snapshot::{Mark, Watermark, PREFIX};
use crate::telemetry;

/// Each consumer (one per pipeline session) its own number: a chunk is published only by
/// the session that saw both its watermarks.
pub(super) fn next_session() -> u64 {
    static SESSIONS: AtomicU64 = AtomicU64::new(1);
    SESSIONS.fetch_add(1, Ordering::Relaxed)
}

impl ChangeStream {
    /// A (verified) `walcast.snapshot` watermark.
    pub(super) fn watermark(
        &mut self,
        txn: &TxnContext,
        m: &Message<'_>,
    ) -> Result<(), ChangesError> {
        let Some(board) = self.cfg.board.clone() else {
            return Ok(());
        };
        if m.prefix != PREFIX || !m.transactional {
            return Ok(());
        }
        let Ok(w) = serde_json::from_str::<Watermark>(&m.content) else {
            tracing::warn!(content = %m.content, "snapshot watermark not understood: ignored");
            return Ok(());
        };
        match w.mark {
            Mark::Low => board.open(w.key(), self.session),
            Mark::High => {
                let Some(closed) = board.close(w.key(), self.session) else {
                    return Ok(());
                };
                metrics::counter!(telemetry::SNAPSHOT_ROWS_SUPERSEDED)
                    .increment(closed.dropped as u64);
                let n = closed.rows.len() as u64;
                for row in closed.rows {
                    let seq = self.seq;
                    self.seq += 1;
                    self.add(read_event(&closed.meta, row, txn, seq))?;
                }
                self.notify.push((closed.done, n));
            }
        }
        Ok(())
    }

    /// A change of a streaming table: note its keys if a chunk of its table is open.
    pub(super) fn note(&self, event: Option<&ChangeEvent>, schema: &str, table: &str) {
        let Some(board) = &self.cfg.board else {
            return;
        };
        if !board.watching(schema, table) {
            return;
        }
        match event {
            Some(e) => {
                let records: Vec<&serde_json::value::RawValue> = e
                    .record
                    .iter()
                    .chain(e.old_record.iter())
                    .map(|r| &**r)
                    .collect();
                board.note(schema, table, &records);
            }
            // No event (it could not be built): its key is unknown, trust no row.
            None => board.truncate(schema, table),
        }
    }
}

/// A snapshot row as an event.
fn read_event(meta: &ChunkMeta, row: ChunkRow, txn: &TxnContext, seq: u32) -> ChangeEvent {
    ChangeEvent {
        project: meta.project.clone(),
        schema: meta.schema.clone(),
        table: meta.table.clone(),
        kind: ChangeKind::Read,
        commit_timestamp: txn.commit_timestamp.clone(),
        commit_lsn: txn.commit_lsn,
        seq,
        xid: txn.xid,
        columns: meta.columns.clone(),
        record: Some(row.record),
        old_record: None,
        pk: meta.pk.clone(),
        unchanged_toast: Vec::new(),
        subs: Vec::new(),
        restricted: Vec::new(),
        errors: Vec::new(),
        part: 0,
    }
}
