//! Transaction framing, the pure first step of the driver: wal2json
//! lines (format-version 2 with `include-transaction`, `include-lsn`) in WAL order become
//! begin / change / commit steps, each change inside its transaction. No IO: what to do
//! with a step is the consumers' business.

use walcast_wal2json::{decode, Change, Lsn};

use crate::error::{excerpt, DecodeError, PipelineError};

/// The transaction a change belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnContext {
    pub xid: Option<u32>,
    /// End LSN of the commit record.
    pub commit_lsn: Lsn,
    /// UTC, milliseconds, `Z`.
    pub commit_timestamp: String,
}

/// What one line was.
#[derive(Debug)]
pub enum Step<'a> {
    /// A transaction started; [`TxnReader::txn`] describes it until its commit.
    Begin,
    /// A change inside the current transaction: a row change, a TRUNCATE or a
    /// transactional logical message.
    Change(Change<'a>),
    /// The current transaction ended at `commit_lsn` (the end of its commit record).
    Commit(TxnContext),
    /// A line outside any transaction (a non-transactional logical message).
    Outside(Change<'a>),
    /// A line inside a transaction that does not decode. Reading it again gives the same
    /// bytes, so it is skipped (and reported) rather than stalling the slot.
    Undecodable { line: String, error: String },
}

/// Tracks the transaction the lines belong to.
#[derive(Debug, Default)]
pub struct TxnReader {
    txn: Option<TxnContext>,
}

impl TxnReader {
    pub fn new() -> TxnReader {
        TxnReader::default()
    }

    /// The transaction between its BEGIN and COMMIT lines.
    pub fn txn(&self) -> Option<&TxnContext> {
        self.txn.as_ref()
    }

    pub fn in_transaction(&self) -> bool {
        self.txn.is_some()
    }

    /// Forget a partial transaction (the source restarts from the last acknowledged commit).
    pub fn reset(&mut self) {
        self.txn = None;
    }

    /// Read one line. Errors: a line outside a transaction that does not decode, a
    /// BEGIN or COMMIT without its LSN, a row change outside a transaction.
    pub fn read<'a>(&mut self, line: &'a str) -> Result<Step<'a>, PipelineError> {
        let change = match decode(line) {
            Ok(change) => change,
            Err(e) if self.txn.is_some() => {
                return Ok(Step::Undecodable {
                    line: excerpt(line),
                    error: e.to_string(),
                })
            }
            Err(e) => return Err(PipelineError::decode(e, line)),
        };
        let bad = |error: &'static str| PipelineError::decode(DecodeError::Framing(error), line);
        match change {
            Change::Begin(m) => {
                let commit_lsn = m
                    .next_lsn
                    .ok_or_else(|| bad("BEGIN without nextlsn (is include-lsn on?)"))?;
                let commit_timestamp = m
                    .timestamp
                    .as_deref()
                    .and_then(|t| walcast_core::timestamp::pg_to_rfc3339_millis(t).ok())
                    .unwrap_or_default();
                self.txn = Some(TxnContext {
                    xid: m.xid,
                    commit_lsn,
                    commit_timestamp,
                });
                Ok(Step::Begin)
            }
            Change::Commit(m) => {
                let txn = self.txn.take();
                let commit_lsn: Lsn = m
                    .next_lsn
                    .or(txn.as_ref().map(|t| t.commit_lsn))
                    .ok_or_else(|| bad("COMMIT without nextlsn"))?;
                let mut txn = txn.unwrap_or(TxnContext {
                    xid: m.xid,
                    commit_lsn,
                    commit_timestamp: String::new(),
                });
                txn.commit_lsn = commit_lsn;
                Ok(Step::Commit(txn))
            }
            change if self.txn.is_some() => Ok(Step::Change(change)),
            Change::Message(m) => Ok(Step::Outside(Change::Message(m))),
            _ => Err(bad(
                "row change outside a transaction (is include-transaction on?)",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEGIN: &str = r#"{"action":"B","xid":740,"timestamp":"2026-11-30 05:26:07.323193+00","lsn":"0/16B2A40","nextlsn":"0/16B2B10"}"#;
    const INSERT: &str = r#"{"action":"I","xid":740,"lsn":"0/16B2A40","schema":"public","table":"t","columns":[{"name":"i","type":"integer","typeoid":23,"value":1}],"pk":[{"name":"i","type":"integer","typeoid":23}]}"#;
    const MESSAGE: &str = r#"{"action":"M","xid":740,"lsn":"0/16B2AA0","transactional":true,"prefix":"walcast.ddl","content":"{}"}"#;
    const COMMIT: &str = r#"{"action":"C","xid":740,"timestamp":"2026-11-30 05:26:07.323193+00","lsn":"0/16B2AE0","nextlsn":"0/16B2B10"}"#;

    fn lsn(s: &str) -> Lsn {
        s.parse().unwrap()
    }

    #[test]
    fn a_transaction_is_delimited_by_its_begin_and_commit() {
        let mut f = TxnReader::new();
        assert!(matches!(f.read(BEGIN).unwrap(), Step::Begin));
        let txn = f.txn().expect("in a transaction").clone();
        assert_eq!(txn.xid, Some(740));
        assert_eq!(txn.commit_lsn, lsn("0/16B2B10"));
        assert_eq!(txn.commit_timestamp, "2026-11-30T05:26:07.323Z");
        match f.read(INSERT).unwrap() {
            Step::Change(Change::Insert(row)) => assert_eq!(row.table, "t"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            f.read(MESSAGE).unwrap(),
            Step::Change(Change::Message(_))
        ));
        match f.read(COMMIT).unwrap() {
            Step::Commit(t) => assert_eq!(t, txn),
            other => panic!("{other:?}"),
        }
        assert!(!f.in_transaction());
    }

    #[test]
    fn an_undecodable_line_inside_a_transaction_is_skipped_outside_it_fails() {
        let mut f = TxnReader::new();
        assert!(matches!(
            f.read("{oops").unwrap_err(),
            PipelineError::Decode { .. }
        ));
        f.read(BEGIN).unwrap();
        assert!(matches!(f.read("{oops").unwrap(), Step::Undecodable { .. }));
        assert!(f.in_transaction());
        assert!(matches!(f.read(COMMIT).unwrap(), Step::Commit(_)));
    }

    #[test]
    fn rows_outside_a_transaction_fail_messages_pass() {
        let mut f = TxnReader::new();
        assert!(f.read(INSERT).is_err());
        let message =
            r#"{"action":"M","lsn":"0/16B2AA0","transactional":false,"prefix":"p","content":"x"}"#;
        assert!(matches!(f.read(message).unwrap(), Step::Outside(_)));
    }

    #[test]
    fn reset_forgets_a_partial_transaction() {
        let mut f = TxnReader::new();
        f.read(BEGIN).unwrap();
        f.read(INSERT).unwrap();
        f.reset();
        assert!(!f.in_transaction());
        assert!(f.read(INSERT).is_err());
    }

    #[test]
    fn begin_without_its_lsn_fails() {
        let mut f = TxnReader::new();
        let begin = r#"{"action":"B","xid":1}"#;
        assert!(f.read(begin).is_err());
    }
}
