//! A consumer for tests: [`Recorder`] keeps what it is handed (shared through a
//! [`Recording`]), so a test can check what the pipeline delivered without building a
//! consumer of its own.

use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use walcast_wal2json::{Change, Lsn};

use crate::consumer::{Consumer, Handled, Item};
use crate::error::ConsumerError;

/// One row change as recorded: `(schema.table, action, commit position)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Recorded {
    pub table: String,
    /// `I`, `U`, `D`, `T` (truncate) or `M` (a logical message; `table` is its prefix).
    pub action: char,
    pub commit_lsn: Lsn,
}

/// What recorders made from one [`Recorder::factory`] saw, committed transactions only
/// (a session that fails mid-transaction replays it; its partial items are dropped).
#[derive(Clone, Default)]
pub struct Recording(Arc<Mutex<Vec<Recorded>>>);

impl Recording {
    pub fn items(&self) -> Vec<Recorded> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// Records every change of its tables (see [`Recording`]).
pub struct Recorder {
    tables: Vec<(String, String)>,
    pending: Vec<Recorded>,
    recording: Recording,
}

impl Recorder {
    pub fn new(tables: Vec<(String, String)>, recording: Recording) -> Recorder {
        Recorder {
            tables,
            pending: Vec::new(),
            recording,
        }
    }

    /// A factory making a recorder of `tables` per session, all into `recording`.
    pub fn factory(
        tables: Vec<(String, String)>,
        recording: Recording,
    ) -> Arc<dyn crate::ConsumerFactory> {
        crate::factory(move |_| Box::new(Recorder::new(tables.clone(), recording.clone())))
    }

    fn wants(&self, schema: &str, table: &str) -> bool {
        self.tables.iter().any(|(s, t)| s == schema && t == table)
    }
}

impl Consumer for Recorder {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn tables(&self) -> Vec<(String, String)> {
        self.tables.clone()
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        match item {
            Item::Begin(_) => self.pending.clear(),
            Item::Change(txn, change) => {
                let (table, action) = match change {
                    Change::Insert(r) => (Some((r.schema.as_ref(), r.table.as_ref())), 'I'),
                    Change::Update(r) => (Some((r.schema.as_ref(), r.table.as_ref())), 'U'),
                    Change::Delete(r) => (Some((r.schema.as_ref(), r.table.as_ref())), 'D'),
                    Change::Truncate(t) => (Some((t.schema.as_ref(), t.table.as_ref())), 'T'),
                    _ => (None, ' '),
                };
                if let Some((s, t)) = table.filter(|(s, t)| self.wants(s, t)) {
                    self.pending.push(Recorded {
                        table: format!("{s}.{t}"),
                        action,
                        commit_lsn: txn.commit_lsn,
                    });
                }
            }
            Item::Commit(_) => {
                let done = std::mem::take(&mut self.pending);
                let mut all = self.recording.0.lock().unwrap_or_else(|p| p.into_inner());
                all.extend(done);
            }
        }
        Box::pin(async { Ok(Handled::Continue) })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async { Ok(()) })
    }

    fn reset(&mut self) {
        self.pending.clear();
    }
}
