//! `postgres_changes` delivery payloads: encode the change once, then build one frame per
//! channel with that channel's `ids` and topic by splicing the pre-serialised `data`.

use serde_json::value::RawValue;

use crate::events;
use crate::frame::{encode_text_parts, Frame, Payload};
use crate::json;
use crate::vsn::Vsn;

/// Type of a database change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeType {
    /// `INSERT`
    Insert,
    /// `UPDATE`
    Update,
    /// `DELETE`
    Delete,
}

impl ChangeType {
    /// Wire spelling (`INSERT`/`UPDATE`/`DELETE`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Insert => "INSERT",
            ChangeType::Update => "UPDATE",
            ChangeType::Delete => "DELETE",
        }
    }

    /// Parse case-insensitively.
    pub fn parse_ci(s: &str) -> Option<ChangeType> {
        [ChangeType::Insert, ChangeType::Update, ChangeType::Delete]
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }
}

/// A column's metadata (`{"name","type"}` in `data.columns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Column<'a> {
    /// Column name.
    pub name: &'a str,
    /// Postgres `typname` (`int4`, `_text`, …).
    pub typname: &'a str,
}

/// One column value of a record: name, typname and the JSON value, emitted verbatim.
#[derive(Debug, Clone, Copy)]
pub struct ColumnValue<'a> {
    /// Column name.
    pub name: &'a str,
    /// Postgres `typname`.
    pub typname: &'a str,
    /// The value as JSON text (native numbers/bools/json, or strings).
    pub value: &'a RawValue,
}

/// Typed inputs for a `postgres_changes` `data` object.
///
/// Key presence follows the change type: INSERT emits `record`; UPDATE `record` and
/// `old_record`; DELETE `old_record`. `columns` defaults to the columns of the emitted new
/// record (of `old_record` for DELETE) unless given explicitly.
#[derive(Debug, Clone, Copy)]
pub struct ChangeData<'a> {
    /// Schema name.
    pub schema: &'a str,
    /// Table name.
    pub table: &'a str,
    /// Already formatted (see [`crate::timestamp::pg_to_rfc3339_millis`]).
    pub commit_timestamp: &'a str,
    /// Change type (`data.type`).
    pub change_type: ChangeType,
    /// Explicit `columns`; `None` derives them from the record.
    pub columns: Option<&'a [Column<'a>]>,
    /// New values (ignored for DELETE).
    pub record: &'a [ColumnValue<'a>],
    /// Old values (ignored for INSERT).
    pub old_record: &'a [ColumnValue<'a>],
    /// `errors`: `None` → `null`, otherwise an array of strings.
    pub errors: Option<&'a [&'a str]>,
}

fn write_record(out: &mut String, values: &[ColumnValue<'_>]) {
    out.push('{');
    let mut first = true;
    for v in values {
        json::write_field(out, &mut first, v.name, v.value.get());
    }
    out.push('}');
}

fn write_columns<'a>(out: &mut String, cols: impl Iterator<Item = Column<'a>>) {
    out.push('[');
    for (i, c) in cols.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        json::write_str(out, c.name);
        out.push_str(",\"type\":");
        json::write_str(out, c.typname);
        out.push('}');
    }
    out.push(']');
}

impl ChangeData<'_> {
    /// Serialise the `data` object once.
    pub fn encode(&self) -> EncodedChange {
        let (has_new, has_old) = match self.change_type {
            ChangeType::Insert => (true, false),
            ChangeType::Update => (true, true),
            ChangeType::Delete => (false, true),
        };
        let mut out = String::with_capacity(256);
        out.push_str("{\"schema\":");
        json::write_str(&mut out, self.schema);
        out.push_str(",\"table\":");
        json::write_str(&mut out, self.table);
        out.push_str(",\"commit_timestamp\":");
        json::write_str(&mut out, self.commit_timestamp);
        out.push_str(",\"type\":\"");
        out.push_str(self.change_type.as_str());
        out.push_str("\",\"columns\":");
        match self.columns {
            Some(cols) => write_columns(&mut out, cols.iter().copied()),
            None => {
                let src = if has_new {
                    self.record
                } else {
                    self.old_record
                };
                write_columns(
                    &mut out,
                    src.iter().map(|v| Column {
                        name: v.name,
                        typname: v.typname,
                    }),
                );
            }
        }
        if has_new {
            out.push_str(",\"record\":");
            write_record(&mut out, self.record);
        }
        if has_old {
            out.push_str(",\"old_record\":");
            write_record(&mut out, self.old_record);
        }
        out.push_str(",\"errors\":");
        match self.errors {
            None => out.push_str("null"),
            Some(errs) => {
                out.push('[');
                for (i, e) in errs.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    json::write_str(&mut out, e);
                }
                out.push(']');
            }
        }
        out.push('}');
        EncodedChange { data: out }
    }
}

/// A pre-serialised `data` object, shared by every channel that receives the change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedChange {
    data: String,
}

impl EncodedChange {
    /// The `data` JSON text.
    pub fn data_json(&self) -> &str {
        &self.data
    }

    /// `{"ids":[…],"data":…}` for one channel.
    pub fn payload_json(&self, ids: &[u32]) -> String {
        let mut out = String::with_capacity(self.data.len() + 24 + ids.len() * 11);
        out.push_str("{\"ids\":[");
        for (i, id) in ids.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&id.to_string());
        }
        out.push_str("],\"data\":");
        out.push_str(&self.data);
        out.push('}');
        out
    }

    /// The complete text frame (`postgres_changes`, null refs) for one channel.
    pub fn frame_text(&self, vsn: Vsn, topic: &str, ids: &[u32]) -> String {
        encode_text_parts(
            vsn,
            None,
            None,
            topic,
            events::POSTGRES_CHANGES,
            &self.payload_json(ids),
        )
    }

    /// The same message as a [`Frame`] (slower: allocates the payload separately).
    pub fn to_frame(&self, topic: &str, ids: &[u32]) -> Frame {
        Frame {
            join_ref: None,
            ref_: None,
            topic: topic.to_owned(),
            event: events::POSTGRES_CHANGES.to_owned(),
            payload: Payload::Json(json::raw(self.payload_json(ids))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn rv(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[test]
    fn insert_shape() {
        let (a, b, c) = (rv("7"), rv("false"), rv(r#"["a","b"]"#));
        let rec = [
            ColumnValue {
                name: "id",
                typname: "int8",
                value: &a,
            },
            ColumnValue {
                name: "done",
                typname: "bool",
                value: &b,
            },
            ColumnValue {
                name: "tags",
                typname: "_text",
                value: &c,
            },
        ];
        let enc = ChangeData {
            schema: "public",
            table: "todos",
            commit_timestamp: "2025-06-01T10:00:00.123Z",
            change_type: ChangeType::Insert,
            columns: None,
            record: &rec,
            old_record: &[],
            errors: None,
        }
        .encode();
        let text = enc.frame_text(Vsn::V2, "realtime:room1", &[31485520, 8812201]);
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            v,
            json!([null, null, "realtime:room1", "postgres_changes", {
                "ids": [31485520, 8812201],
                "data": {
                    "schema": "public", "table": "todos", "type": "INSERT",
                    "commit_timestamp": "2025-06-01T10:00:00.123Z",
                    "columns": [{"name":"id","type":"int8"},{"name":"done","type":"bool"},{"name":"tags","type":"_text"}],
                    "record": {"id": 7, "done": false, "tags": ["a","b"]},
                    "errors": null
                }
            }])
        );
        let v1: Value = serde_json::from_str(&enc.frame_text(Vsn::V1, "realtime:x", &[1])).unwrap();
        assert_eq!(v1["payload"]["ids"], json!([1]));
        assert_eq!(v1["topic"], json!("realtime:x"));
        assert_eq!(
            enc.to_frame("realtime:x", &[1])
                .encode_text(Vsn::V1)
                .unwrap(),
            enc.frame_text(Vsn::V1, "realtime:x", &[1])
        );
    }

    #[test]
    fn key_presence() {
        let one = rv("1");
        let vals = [ColumnValue {
            name: "id",
            typname: "int4",
            value: &one,
        }];
        let errs = ["Error 401: Unauthorized"];
        for (t, new, old) in [
            (ChangeType::Insert, true, false),
            (ChangeType::Update, true, true),
            (ChangeType::Delete, false, true),
        ] {
            let d = ChangeData {
                schema: "s",
                table: "t",
                commit_timestamp: "x",
                change_type: t,
                columns: None,
                record: &vals,
                old_record: &vals,
                errors: Some(&errs),
            }
            .encode();
            let v: Value = serde_json::from_str(d.data_json()).unwrap();
            assert_eq!(v.get("record").is_some(), new);
            assert_eq!(v.get("old_record").is_some(), old);
            assert_eq!(v["type"], json!(t.as_str()));
            assert_eq!(v["errors"], json!(["Error 401: Unauthorized"]));
            assert_eq!(v["columns"], json!([{"name":"id","type":"int4"}]));
        }
    }
}
