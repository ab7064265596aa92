//! wal2json row change → the bus's [`ChangeEvent`] JSON, for every consumer that
//! publishes changes (realtime delivery, change streams): the event ([`build_event`],
//! [`truncate_event`]), column types as the realtime protocol names them ([`TypeCache`]),
//! and fitting a change to what one message can carry ([`fit`]).

mod fit;
mod types;

use std::collections::HashSet;

use serde_json::value::RawValue;
use walcast_bus::{ChangeEvent, ChangeKind, ColumnInfo};
use walcast_wal2json::{Column, RowChange};

use crate::TxnContext;
pub use fit::{budget, fit};
pub use types::TypeCache;

/// Default of a consumer's `max_record_bytes`: 1 MiB, as Supabase's `max_record_bytes`
/// (a change whose values are larger is published without them, `Error 413`).
pub const DEFAULT_MAX_RECORD_BYTES: usize = 1024 * 1024;

/// A row change that cannot be turned into an event.
#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("column {column:?} of {schema}.{table}: value is not valid JSON for type {type_name}: {source}")]
    Value {
        schema: String,
        table: String,
        column: String,
        type_name: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("serialising event: {0}")]
    Json(#[from] serde_json::Error),
}

const JSON_OID: u32 = 114;
const JSONB_OID: u32 = 3802;

fn type_name(types: &TypeCache, col: &Column<'_>) -> String {
    col.type_oid
        .and_then(|oid| types.get(oid))
        .map(str::to_string)
        .unwrap_or_else(|| col.type_name.to_string())
}

/// One value as JSON: wal2json's own JSON for numbers, booleans and text; json/jsonb
/// columns (which wal2json sends as strings) embedded as JSON; arrays and timestamps in
/// the form `to_jsonb` gives them (what Supabase clients receive from the reference).
fn push_value(
    out: &mut String,
    col: &Column<'_>,
    row: &RowChange<'_>,
    types: &TypeCache,
) -> Result<(), EventError> {
    let Some(raw) = col.value else {
        out.push_str("null");
        return Ok(());
    };
    let typname = col.type_oid.and_then(|o| types.get(o)).unwrap_or("");
    let reshaped = typname.starts_with('_') || typname == "timestamptz" || typname == "timestamp";
    if reshaped && raw.get().starts_with('"') {
        let text: String = serde_json::from_str(raw.get())?;
        walcast_protocol::values::append_json(typname, &text, out);
        return Ok(());
    }
    let is_json = matches!(col.type_oid, Some(JSON_OID | JSONB_OID));
    if is_json && raw.get().starts_with('"') {
        let text: String = serde_json::from_str(raw.get())?;
        let inner: &RawValue = serde_json::from_str(&text).map_err(|source| EventError::Value {
            schema: row.schema.to_string(),
            table: row.table.to_string(),
            column: col.name.to_string(),
            type_name: col.type_name.to_string(),
            source,
        })?;
        out.push_str(inner.get());
    } else {
        out.push_str(raw.get());
    }
    Ok(())
}

fn record<'c>(
    cols: impl Iterator<Item = &'c Column<'c>>,
    row: &RowChange<'_>,
    types: &TypeCache,
) -> Result<Box<RawValue>, EventError> {
    let mut out = String::from("{");
    for (i, col) in cols.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&serde_json::to_string(col.name.as_ref())?);
        out.push(':');
        push_value(&mut out, col, row, types)?;
    }
    out.push('}');
    Ok(RawValue::from_string(out)?)
}

/// The new row in table order; a column wal2json left out as unchanged TOAST is taken
/// from the old row (present with REPLICA IDENTITY FULL).
fn full_new_row<'r, 'a>(row: &'r RowChange<'a>, unchanged: &[String]) -> Vec<&'r Column<'a>> {
    if unchanged.is_empty() {
        return row.columns.iter().collect();
    }
    let missing: HashSet<&str> = unchanged.iter().map(String::as_str).collect();
    row.identity
        .iter()
        .map(|old| {
            if missing.contains(old.name.as_ref()) {
                old
            } else {
                row.columns
                    .iter()
                    .find(|c| c.name == old.name)
                    .unwrap_or(old)
            }
        })
        .collect()
}

/// Build the event for an INSERT, UPDATE or DELETE.
pub fn build_event(
    project: &str,
    kind: ChangeKind,
    row: &RowChange<'_>,
    txn: &TxnContext,
    seq: u32,
    types: &TypeCache,
) -> Result<ChangeEvent, EventError> {
    let unchanged: Vec<String> = if kind == ChangeKind::Update {
        row.omitted_unchanged_toast()
            .into_iter()
            .map(str::to_string)
            .collect()
    } else {
        Vec::new()
    };
    let (columns, record_value, old_record) = match kind {
        ChangeKind::Delete => {
            let cols = row.identity.iter().map(|c| ColumnInfo {
                name: c.name.to_string(),
                type_name: type_name(types, c),
            });
            (
                cols.collect(),
                None,
                Some(record(row.identity.iter(), row, types)?),
            )
        }
        _ => {
            let full = full_new_row(row, &unchanged);
            let cols = full.iter().map(|c| ColumnInfo {
                name: c.name.to_string(),
                type_name: type_name(types, c),
            });
            let old = if kind == ChangeKind::Update && !row.identity.is_empty() {
                Some(record(row.identity.iter(), row, types)?)
            } else {
                None
            };
            (
                cols.collect(),
                Some(record(full.into_iter(), row, types)?),
                old,
            )
        }
    };
    Ok(ChangeEvent {
        project: project.to_string(),
        schema: row.schema.to_string(),
        table: row.table.to_string(),
        kind,
        commit_timestamp: txn.commit_timestamp.clone(),
        commit_lsn: txn.commit_lsn,
        seq,
        xid: txn.xid,
        columns,
        record: record_value,
        old_record,
        pk: row.pk.iter().map(|p| p.name.to_string()).collect(),
        unchanged_toast: unchanged,
        subs: Vec::new(),
        restricted: Vec::new(),
        errors: Vec::new(),
        part: 0,
    })
}

/// The event of a `TRUNCATE` of `schema.table`: no rows, no columns (README "Change
/// streams").
pub fn truncate_event(
    project: &str,
    schema: &str,
    table: &str,
    txn: &TxnContext,
    seq: u32,
) -> ChangeEvent {
    ChangeEvent {
        project: project.to_string(),
        schema: schema.to_string(),
        table: table.to_string(),
        kind: ChangeKind::Truncate,
        commit_timestamp: txn.commit_timestamp.clone(),
        commit_lsn: txn.commit_lsn,
        seq,
        xid: txn.xid,
        columns: Vec::new(),
        record: None,
        old_record: None,
        pk: Vec::new(),
        unchanged_toast: Vec::new(),
        subs: Vec::new(),
        restricted: Vec::new(),
        errors: Vec::new(),
        part: 0,
    }
}

/// The new row's columns as Postgres text, with unchanged TOASTed values taken from the
/// old row (what RLS checks compare a row's current state with).
pub fn new_row_text(row: &RowChange<'_>) -> Vec<(String, Option<String>)> {
    let mut cols: Vec<(String, Option<String>)> = row
        .columns
        .iter()
        .map(|c| (c.name.to_string(), c.text().map(|t| t.into_owned())))
        .collect();
    for old in &row.identity {
        if !cols.iter().any(|(n, _)| n == old.name.as_ref()) {
            cols.push((old.name.to_string(), old.text().map(|t| t.into_owned())));
        }
    }
    cols
}

/// The old row's columns as Postgres text (UPDATE, DELETE: the replica identity, every
/// column with `REPLICA IDENTITY FULL`), what RLS checks judge the old version by.
pub fn old_row_text(row: &RowChange<'_>) -> Vec<(String, Option<String>)> {
    row.identity
        .iter()
        .map(|c| (c.name.to_string(), c.text().map(|t| t.into_owned())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn txn() -> TxnContext {
        TxnContext {
            xid: Some(7),
            commit_lsn: "0/10".parse().unwrap(),
            commit_timestamp: "2026-01-01T00:00:00.000Z".into(),
        }
    }

    #[test]
    fn insert_embeds_json_and_keeps_numbers_exact() {
        let line = r#"{"action":"I","xid":7,"lsn":"0/1","schema":"public","table":"t","columns":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"j","type":"jsonb","typeoid":3802,"value":"{\"x\": [1, 2]}"},{"name":"n","type":"numeric","typeoid":1700,"value":123456789012345678901234567890.5},{"name":"s","type":"text","typeoid":25,"value":null}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
        let change = walcast_wal2json::decode(line).unwrap();
        let row = change.row().unwrap();
        let ev = build_event(
            "default",
            ChangeKind::Insert,
            row,
            &txn(),
            0,
            &TypeCache::default(),
        )
        .unwrap();
        assert_eq!(
            ev.record.unwrap().get(),
            r#"{"id":1,"j":{"x": [1, 2]},"n":123456789012345678901234567890.5,"s":null}"#
        );
        assert!(ev.old_record.is_none());
        assert_eq!(ev.pk, vec!["id"]);
        // Without a loaded catalog the wal2json type name is used.
        assert_eq!(ev.columns[0].type_name, "integer");
    }

    #[test]
    fn update_fills_unchanged_toast_from_the_old_row() {
        let line = r#"{"action":"U","xid":7,"lsn":"0/1","schema":"public","table":"t","columns":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"v","type":"text","typeoid":25,"value":"new"}],"identity":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"big","type":"text","typeoid":25,"value":"xxx"},{"name":"v","type":"text","typeoid":25,"value":"old"}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
        let change = walcast_wal2json::decode(line).unwrap();
        let ev = build_event(
            "default",
            ChangeKind::Update,
            change.row().unwrap(),
            &txn(),
            1,
            &TypeCache::default(),
        )
        .unwrap();
        assert_eq!(ev.unchanged_toast, vec!["big"]);
        assert_eq!(
            ev.record.unwrap().get(),
            r#"{"id":1,"big":"xxx","v":"new"}"#
        );
        assert_eq!(
            ev.old_record.unwrap().get(),
            r#"{"id":1,"big":"xxx","v":"old"}"#
        );
        let names: Vec<_> = ev.columns.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["id", "big", "v"]);
    }

    #[test]
    fn a_truncate_has_no_rows() {
        let ev = truncate_event("p", "public", "t", &txn(), 2);
        let json = serde_json::to_value(&ev).unwrap();
        assert_eq!(json["type"], "TRUNCATE");
        assert_eq!(
            (json["seq"].as_u64(), json["table"].as_str()),
            (Some(2), Some("t"))
        );
        assert!(json.get("record").is_none() && json.get("old_record").is_none());
    }

    #[test]
    fn delete_has_only_the_old_row() {
        let line = r#"{"action":"D","xid":7,"lsn":"0/1","schema":"public","table":"t","identity":[{"name":"id","type":"integer","typeoid":23,"value":2}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
        let change = walcast_wal2json::decode(line).unwrap();
        let ev = build_event(
            "default",
            ChangeKind::Delete,
            change.row().unwrap(),
            &txn(),
            0,
            &TypeCache::default(),
        )
        .unwrap();
        assert!(ev.record.is_none());
        assert_eq!(ev.old_record.unwrap().get(), r#"{"id":2}"#);
    }
}
