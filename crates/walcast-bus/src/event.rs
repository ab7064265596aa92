//! The change event: one JSON message per row change, as published by the cdc-worker.
//!
//! ```json
//! {"project":"default","schema":"public","table":"todos","type":"UPDATE",
//!  "commit_timestamp":"2026-11-30T05:26:07.323Z","commit_lsn":"0/1530AD8","seq":0,"xid":730,
//!  "columns":[{"name":"id","type":"int4"},{"name":"title","type":"text"}],
//!  "record":{"id":1,"title":"new"},"old_record":{"id":1,"title":"old"},"pk":["id"]}
//! ```
//!
//! `(commit_lsn, seq)` identifies a change uniquely and orders changes in commit order: a
//! consumer that sees a pair not greater than the last one it kept drops it as a replay.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use walcast_wal2json::Lsn;

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "UPPERCASE")]
pub enum ChangeKind {
    Insert,
    Update,
    Delete,
    Truncate,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Insert => "INSERT",
            ChangeKind::Update => "UPDATE",
            ChangeKind::Delete => "DELETE",
            ChangeKind::Truncate => "TRUNCATE",
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ColumnInfo {
    pub name: String,
    /// The Postgres `typname` (`int4`, `text`, `_int4`, `timestamptz`, an enum's name …).
    #[serde(rename = "type")]
    pub type_name: String,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct ChangeEvent {
    pub project: String,
    pub schema: String,
    pub table: String,
    #[serde(rename = "type")]
    pub kind: ChangeKind,
    /// Commit time, UTC, millisecond precision, `Z` suffix.
    pub commit_timestamp: String,
    /// End LSN of the commit record: the slot position that acknowledges this transaction.
    pub commit_lsn: Lsn,
    /// Position of this change inside its transaction, from 0.
    pub seq: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u32>,
    /// Columns of `record` (or of `old_record` for a DELETE), in table order.
    pub columns: Vec<ColumnInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_record: Option<Box<RawValue>>,
    /// Primary-key column names.
    #[serde(default)]
    pub pk: Vec<String>,
    /// UPDATE only: columns whose unchanged TOASTed value wal2json left out of the new row.
    /// They were filled from `old_record` when the table has `REPLICA IDENTITY FULL`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unchanged_toast: Vec<String>,
    /// Ids of the registered subscriptions (see [`crate::subs`]) this change matched
    /// (event, filter, and later row-level security). A front delivers the change to
    /// exactly these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subs: Vec<String>,
    /// Subscribers of `subs` that may see only some columns (column privileges, or only
    /// the key of a deleted row under row-level security).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restricted: Vec<Restriction>,
}

/// These subscribers get only these columns.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Restriction {
    pub columns: Vec<String>,
    pub subs: Vec<String>,
}

impl ChangeEvent {
    /// The position used to drop replays: commit order, then order inside the transaction.
    pub fn position(&self) -> (Lsn, u32) {
        (self.commit_lsn, self.seq)
    }

    /// What each subscriber may receive: the full event for the unrestricted ones, and a
    /// reduced copy per [`Restriction`], each with exactly its subscribers in `subs`.
    pub fn variants(&self) -> Result<Vec<ChangeEvent>, serde_json::Error> {
        if self.restricted.is_empty() {
            return Ok(vec![self.clone()]);
        }
        let limited: std::collections::HashSet<&str> = self
            .restricted
            .iter()
            .flat_map(|r| r.subs.iter().map(String::as_str))
            .collect();
        let mut full = self.clone();
        full.restricted.clear();
        full.subs.retain(|s| !limited.contains(s.as_str()));
        let mut out = vec![full];
        for r in &self.restricted {
            let mut e = self.restrict(&r.columns)?;
            e.subs = r.subs.clone();
            out.push(e);
        }
        Ok(out)
    }

    /// A copy with only `keep` columns, in the event's column order.
    pub fn restrict(&self, keep: &[String]) -> Result<ChangeEvent, serde_json::Error> {
        let keep: std::collections::HashSet<&str> = keep.iter().map(String::as_str).collect();
        let mut e = self.clone();
        e.restricted.clear();
        e.columns.retain(|c| keep.contains(c.name.as_str()));
        e.record = restrict_record(self.record.as_deref(), &e.columns)?;
        e.old_record = restrict_record(self.old_record.as_deref(), &e.columns)?;
        e.pk.retain(|k| keep.contains(k.as_str()));
        e.unchanged_toast.retain(|k| keep.contains(k.as_str()));
        Ok(e)
    }
}

fn restrict_record(
    rec: Option<&RawValue>,
    columns: &[ColumnInfo],
) -> Result<Option<Box<RawValue>>, serde_json::Error> {
    let Some(rec) = rec else { return Ok(None) };
    let map: std::collections::HashMap<String, Box<RawValue>> = serde_json::from_str(rec.get())?;
    let mut out = String::from("{");
    for c in columns {
        if let Some(v) = map.get(&c.name) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(&c.name)?);
            out.push(':');
            out.push_str(v.get());
        }
    }
    out.push('}');
    Ok(Some(RawValue::from_string(out)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"INSERT","commit_timestamp":"2026-11-30T05:26:07.323Z","commit_lsn":"0/1530AD8","seq":2,"columns":[{"name":"id","type":"int4"}],"record":{"id":1},"pk":["id"]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        assert_eq!(ev.kind, ChangeKind::Insert);
        assert_eq!(ev.commit_lsn.to_string(), "0/1530AD8");
        assert_eq!(ev.record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert!(ev.old_record.is_none());
        assert_eq!(serde_json::to_string(&ev).unwrap(), text);
    }

    #[test]
    fn restricted_subscribers_get_reduced_copies() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"UPDATE","commit_timestamp":"x","commit_lsn":"0/1","seq":0,"columns":[{"name":"id","type":"int4"},{"name":"secret","type":"text"}],"record":{"id":1,"secret":"s"},"old_record":{"id":1,"secret":"o"},"pk":["id"],"subs":["a","b"],"restricted":[{"columns":["id"],"subs":["b"]}]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        let v = ev.variants().unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].subs, ["a"]);
        assert_eq!(
            v[0].record.as_ref().unwrap().get(),
            r#"{"id":1,"secret":"s"}"#
        );
        assert_eq!(v[1].subs, ["b"]);
        assert_eq!(v[1].record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert_eq!(v[1].old_record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert_eq!(v[1].columns.len(), 1);
    }
}
