//! The `data` of a change as realtime-js reads it, encoded once per change from the
//! worker's [`ChangeEvent`] (record values are kept as the raw JSON the worker sent).

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use walcast_bus::{ChangeEvent, ChangeKind};
use walcast_protocol::{ChangeData, ChangeType, Column, ColumnValue, EncodedChange};

use crate::telemetry;

/// The `data` of a change, encoded once.
pub(crate) fn encode(ev: &ChangeEvent) -> Option<EncodedChange> {
    let change_type = match ev.kind {
        ChangeKind::Insert => ChangeType::Insert,
        ChangeKind::Update => ChangeType::Update,
        ChangeKind::Delete => ChangeType::Delete,
        // Not delivered to clients (README "Change streams"); never on a delivery subject.
        ChangeKind::Truncate | ChangeKind::Read => return None,
    };
    let columns: Vec<Column<'_>> = ev
        .columns
        .iter()
        .map(|c| Column {
            name: &c.name,
            typname: &c.type_name,
        })
        .collect();
    let record = fields(ev.record.as_deref())?;
    let old = fields(ev.old_record.as_deref())?;
    let typname = |name: &str| {
        ev.columns
            .iter()
            .find(|c| c.name == name)
            .map_or("", |c| c.type_name.as_str())
    };
    let rec: Vec<ColumnValue<'_>> = record
        .iter()
        .map(|(k, v)| ColumnValue {
            name: k,
            typname: typname(k),
            value: v,
        })
        .collect();
    let errors: Vec<&str> = ev.errors.iter().map(String::as_str).collect();
    let old_rec: Vec<ColumnValue<'_>> = old
        .iter()
        .map(|(k, v)| ColumnValue {
            name: k,
            typname: typname(k),
            value: v,
        })
        .collect();
    Some(
        ChangeData {
            schema: &ev.schema,
            table: &ev.table,
            commit_timestamp: &ev.commit_timestamp,
            change_type,
            columns: Some(&columns),
            record: &rec,
            old_record: &old_rec,
            errors: (!errors.is_empty()).then_some(errors.as_slice()),
        }
        .encode(),
    )
}

type Fields<'a> = Vec<(Cow<'a, str>, &'a RawValue)>;

/// The fields of a raw JSON object, in order, values kept raw.
fn fields(raw: Option<&RawValue>) -> Option<Fields<'_>> {
    let Some(raw) = raw else {
        return Some(Vec::new());
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    match (&mut de).deserialize_map(FieldsVisitor) {
        Ok(f) => Some(f),
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(error = %e, "change record is not a JSON object");
            None
        }
    }
}

struct FieldsVisitor;

#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some((k, v)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
            out.push((k.0, v));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_an_event() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"UPDATE","commit_timestamp":"2026-01-01T00:00:00.000Z","commit_lsn":"0/10","seq":0,"columns":[{"name":"id","type":"int4"},{"name":"x\"y","type":"jsonb"}],"record":{"id":1,"x\"y":{"a":[1,2]}},"old_record":{"id":1},"pk":["id"],"subs":["f:1"]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        let enc = encode(&ev).unwrap();
        let v: serde_json::Value = serde_json::from_str(enc.data_json()).unwrap();
        assert_eq!(v["record"]["x\"y"]["a"][1], 2);
        assert_eq!(v["old_record"]["id"], 1);
        assert_eq!(v["type"], "UPDATE");
        assert_eq!(v["columns"][1]["type"], "jsonb");
    }
}
