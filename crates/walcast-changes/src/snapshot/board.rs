//! The chunk board: where the snapshotter hands a chunk's rows to the change-stream
//! consumer, in process (never through the database), and where the consumer notes,
//! between the chunk's low and high watermarks, the keys whose rows changed.
//!
//! Pure state behind a mutex, shared by the snapshotter and every session's consumer of
//! the source. A chunk is published only when one consumer (one session) saw both its
//! watermarks: a session that started between them missed changes it should have noted,
//! so it drops the chunk and the snapshotter reads it again under new watermarks.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tokio::sync::oneshot;
use walcast_bus::ColumnInfo;

/// A chunk: its snapshot's id and a nonce unique to this attempt (a watermark replayed
/// from the WAL after a restart names a nonce no board holds).
pub type ChunkKey = (i64, u64);

/// What every row of a snapshot's chunks shares.
#[derive(Debug)]
pub struct ChunkMeta {
    pub project: String,
    pub schema: String,
    pub table: String,
    /// Primary-key column names, in key order.
    pub pk: Vec<String>,
    pub columns: Vec<ColumnInfo>,
}

/// One row read by the snapshot: its key (see [`row_key`]) and its `to_jsonb` record.
#[derive(Debug)]
pub struct ChunkRow {
    pub key: String,
    pub record: Box<RawValue>,
}

struct Window {
    session: u64,
    changed: HashSet<String>,
    truncated: bool,
}

struct Chunk {
    meta: Arc<ChunkMeta>,
    rows: Option<Vec<ChunkRow>>,
    window: Option<Window>,
    done: oneshot::Sender<u64>,
}

/// A chunk at its high watermark: the rows to publish (those whose key did not change
/// between the watermarks), how many were dropped, and where to say they are stored.
pub struct Closed {
    pub meta: Arc<ChunkMeta>,
    pub rows: Vec<ChunkRow>,
    pub dropped: usize,
    pub done: oneshot::Sender<u64>,
}

/// See the module docs.
#[derive(Default)]
pub struct Board {
    chunks: Mutex<HashMap<ChunkKey, Chunk>>,
}

impl std::fmt::Debug for Board {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Board({} chunks)", self.lock().len())
    }
}

impl Board {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<ChunkKey, Chunk>> {
        self.chunks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A chunk about to get its low watermark; the receiver gets the number of rows
    /// published once JetStream acknowledged them (dropped: read the chunk again).
    pub fn register(&self, key: ChunkKey, meta: Arc<ChunkMeta>) -> oneshot::Receiver<u64> {
        let (done, rx) = oneshot::channel();
        let chunk = Chunk {
            meta,
            rows: None,
            window: None,
            done,
        };
        self.lock().insert(key, chunk);
        rx
    }

    /// The chunk's rows, read after its low watermark and before its high one.
    pub fn fill(&self, key: ChunkKey, rows: Vec<ChunkRow>) -> bool {
        match self.lock().get_mut(&key) {
            Some(c) => {
                c.rows = Some(rows);
                true
            }
            None => false,
        }
    }

    /// Forget a chunk (its attempt failed or found no rows).
    pub fn remove(&self, key: ChunkKey) {
        self.lock().remove(&key);
    }

    /// The low watermark, read by the consumer of `session`: note changes from here.
    pub fn open(&self, key: ChunkKey, session: u64) {
        if let Some(c) = self.lock().get_mut(&key) {
            if c.window.as_ref().is_some_and(|w| w.session == session) {
                return; // read again by the same session: keep what it noted
            }
            c.window = Some(Window {
                session,
                changed: HashSet::new(),
                truncated: false,
            });
        }
    }

    /// Whether a chunk of `schema.table` is between its watermarks (cheap: the consumer
    /// reads a change's keys only then).
    pub fn watching(&self, schema: &str, table: &str) -> bool {
        self.lock()
            .values()
            .any(|c| c.window.is_some() && c.meta.schema == schema && c.meta.table == table)
    }

    /// The primary keys of a change of `schema.table` (its new and old row's): `pk` are
    /// the event's key columns, the records its `record` and `old_record`.
    pub fn note(&self, schema: &str, table: &str, records: &[&RawValue]) {
        let mut chunks = self.lock();
        for c in chunks.values_mut() {
            let Some(w) = c.window.as_mut() else { continue };
            if c.meta.schema != schema || c.meta.table != table {
                continue;
            }
            for r in records {
                match serde_json::from_str::<Map<String, Value>>(r.get())
                    .ok()
                    .and_then(|m| row_key(&m, &c.meta.pk))
                {
                    Some(k) => {
                        w.changed.insert(k);
                    }
                    // A key that cannot be read: trust no row of the chunk.
                    None => w.truncated = true,
                }
            }
        }
    }

    /// `schema.table` was truncated: no row of its open chunks may be published.
    pub fn truncate(&self, schema: &str, table: &str) {
        for c in self.lock().values_mut() {
            if c.meta.schema == schema && c.meta.table == table {
                if let Some(w) = c.window.as_mut() {
                    w.truncated = true;
                }
            }
        }
    }

    /// The high watermark, read by the consumer of `session`: the chunk leaves the board;
    /// its rows to publish when this session saw its low watermark and it has rows,
    /// `None` otherwise (its `done` dropped: the snapshotter reads it again).
    pub fn close(&self, key: ChunkKey, session: u64) -> Option<Closed> {
        let chunk = self.lock().remove(&key)?;
        let window = chunk.window.filter(|w| w.session == session)?;
        let rows = chunk.rows?;
        let total = rows.len();
        let rows: Vec<ChunkRow> = match window.truncated {
            true => Vec::new(),
            false => rows
                .into_iter()
                .filter(|r| !window.changed.contains(&r.key))
                .collect(),
        };
        Some(Closed {
            meta: chunk.meta,
            dropped: total - rows.len(),
            rows,
            done: chunk.done,
        })
    }
}

/// A row's key as text: the JSON array of its primary-key values, in key order (`None`
/// when a key column is missing). The same for a change's record and a snapshot's
/// `to_jsonb` row, since both carry values as `to_jsonb` writes them.
pub fn row_key(record: &Map<String, Value>, pk: &[String]) -> Option<String> {
    let values: Option<Vec<&Value>> = pk.iter().map(|c| record.get(c)).collect();
    serde_json::to_string(&values?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Arc<ChunkMeta> {
        Arc::new(ChunkMeta {
            project: "p".into(),
            schema: "public".into(),
            table: "items".into(),
            pk: vec!["id".into()],
            columns: Vec::new(),
        })
    }

    fn rows(ids: &[i64]) -> Vec<ChunkRow> {
        ids.iter()
            .map(|i| ChunkRow {
                key: format!("[{i}]"),
                record: RawValue::from_string(format!(r#"{{"id":{i},"v":"x"}}"#)).unwrap(),
            })
            .collect()
    }

    fn raw(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_string()).unwrap()
    }

    #[test]
    fn rows_changed_between_the_watermarks_are_dropped() {
        let b = Board::default();
        let _rx = b.register((1, 7), meta());
        b.note("public", "items", &[&raw(r#"{"id":1}"#)]); // before the low: ignored
        b.open((1, 7), 3);
        assert!(b.watching("public", "items"));
        assert!(!b.watching("public", "other"));
        b.fill((1, 7), rows(&[1, 2, 3]));
        b.note("public", "items", &[&raw(r#"{"id":2,"v":"y"}"#)]);
        b.note("public", "other", &[&raw(r#"{"id":3}"#)]);
        let c = b.close((1, 7), 3).unwrap();
        let keys: Vec<&str> = c.rows.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, ["[1]", "[3]"]);
        assert_eq!(c.dropped, 1);
        assert!(b.close((1, 7), 3).is_none(), "gone once closed");
        assert!(!b.watching("public", "items"));
    }

    #[test]
    fn another_session_or_a_truncate_or_an_unknown_chunk_publishes_nothing() {
        let b = Board::default();
        let mut rx = b.register((1, 1), meta());
        b.open((1, 1), 3);
        b.fill((1, 1), rows(&[1]));
        assert!(b.close((1, 1), 4).is_none(), "low seen by another session");
        assert!(rx.try_recv().is_err(), "done dropped: read again");
        let _rx = b.register((1, 2), meta());
        b.open((1, 2), 3);
        b.fill((1, 2), rows(&[1, 2]));
        b.truncate("public", "items");
        let c = b.close((1, 2), 3).unwrap();
        assert!(c.rows.is_empty());
        assert_eq!(c.dropped, 2);
        assert!(b.close((9, 9), 3).is_none());
        let _rx = b.register((1, 3), meta());
        b.fill((1, 3), rows(&[1]));
        assert!(b.close((1, 3), 3).is_none(), "no low watermark seen");
    }

    #[test]
    fn keys_are_json_arrays_in_key_order() {
        let m: Map<String, Value> = serde_json::from_str(r#"{"b":"x","a":1,"c":null}"#).unwrap();
        let k = row_key(&m, &["a".into(), "b".into()]).unwrap();
        assert_eq!(k, r#"[1,"x"]"#);
        assert!(row_key(&m, &["z".into()]).is_none());
    }
}
