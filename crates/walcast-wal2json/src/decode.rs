//! Decoding one wal2json format-version 2 line.

use std::borrow::Cow;

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use crate::change::{Action, Change, Column, Message, PkColumn, RowChange, Truncate, TxnMarker};
use crate::cow_str::CowStr;
use walcast_core::Lsn;

/// Why a line could not be decoded.
#[derive(thiserror::Error, Debug)]
pub enum DecodeError {
    /// The line is not valid JSON (syntax error or trailing data).
    #[error("invalid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// The line ends in the middle of a JSON value.
    #[error("truncated JSON: {0}")]
    Truncated(#[source] serde_json::Error),
    /// Valid JSON, but not shaped like a wal2json line (not an object, a field of
    /// the wrong type, a duplicate field, ...).
    #[error("unexpected wal2json structure: {0}")]
    Structure(#[source] serde_json::Error),
    /// The bytes are not UTF-8 (only from [`decode_bytes`]).
    #[error("line is not valid UTF-8: {0}")]
    InvalidUtf8(#[from] std::str::Utf8Error),
    /// The line has no `"action"`.
    #[error("missing field `action`")]
    MissingAction,
    /// `"action"` is not one of B, C, I, U, D, T, M.
    #[error("unknown action {0:?}")]
    UnknownAction(String),
    /// A field that this action needs is absent (or `null`).
    #[error("missing field `{field}` in {action} line")]
    MissingField {
        /// The line's action.
        action: Action,
        /// The wal2json field name.
        field: &'static str,
    },
    /// An LSN field does not hold a Postgres LSN.
    #[error("invalid LSN in field `{field}`: {value:?}")]
    BadLsn {
        /// The wal2json field name (`lsn` or `nextlsn`).
        field: &'static str,
        /// The rejected value.
        value: String,
    },
}

impl DecodeError {
    fn from_json(err: serde_json::Error) -> Self {
        use serde_json::error::Category;
        match err.classify() {
            Category::Eof => DecodeError::Truncated(err),
            Category::Syntax | Category::Io => DecodeError::InvalidJson(err),
            Category::Data => DecodeError::Structure(err),
        }
    }
}

/// `value` stays `Some` for JSON `null` (serde would turn it into `None`).
fn present_raw<'de, D: Deserializer<'de>>(d: D) -> Result<Option<&'de RawValue>, D::Error> {
    <&'de RawValue>::deserialize(d).map(Some)
}

/// Deserializes `T` from a JSON object only: serde's derived impls also accept
/// an array of the field values (`["B", 1]`), which is not a wal2json line.
struct ObjectOnly<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for ObjectOnly<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectVisitor<T>(PhantomData<T>);

        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
            type Value = T;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectVisitor(PhantomData))
            .map(ObjectOnly)
    }
}

#[derive(Deserialize)]
struct RawColumn<'a> {
    #[serde(borrow)]
    name: CowStr<'a>,
    #[serde(borrow, rename = "type", default)]
    type_name: Option<CowStr<'a>>,
    #[serde(rename = "typeoid", default)]
    type_oid: Option<u32>,
    #[serde(borrow, default, deserialize_with = "present_raw")]
    value: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct RawLine<'a> {
    #[serde(borrow, default)]
    action: Option<CowStr<'a>>,
    #[serde(default)]
    xid: Option<u32>,
    #[serde(borrow, default)]
    timestamp: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    lsn: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    nextlsn: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    schema: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    table: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    columns: Option<Vec<ObjectOnly<RawColumn<'a>>>>,
    #[serde(borrow, default)]
    identity: Option<Vec<ObjectOnly<RawColumn<'a>>>>,
    #[serde(borrow, default)]
    pk: Option<Vec<ObjectOnly<RawColumn<'a>>>>,
    #[serde(default)]
    transactional: Option<bool>,
    #[serde(borrow, default)]
    prefix: Option<CowStr<'a>>,
    #[serde(borrow, default)]
    content: Option<CowStr<'a>>,
}

fn lsn_field(field: &'static str, v: Option<CowStr<'_>>) -> Result<Option<Lsn>, DecodeError> {
    match v {
        None => Ok(None),
        Some(CowStr(s)) => s.parse().map(Some).map_err(|_| DecodeError::BadLsn {
            field,
            value: s.into_owned(),
        }),
    }
}

fn required<T>(action: Action, field: &'static str, v: Option<T>) -> Result<T, DecodeError> {
    v.ok_or(DecodeError::MissingField { action, field })
}

fn column(ObjectOnly(raw): ObjectOnly<RawColumn<'_>>) -> Column<'_> {
    Column {
        name: raw.name.0,
        type_name: raw.type_name.map_or(Cow::Borrowed(""), |t| t.0),
        type_oid: raw.type_oid,
        value: raw.value,
    }
}

fn columns(raw: Option<Vec<ObjectOnly<RawColumn<'_>>>>) -> Vec<Column<'_>> {
    raw.unwrap_or_default().into_iter().map(column).collect()
}

fn pk_column(ObjectOnly(raw): ObjectOnly<RawColumn<'_>>) -> PkColumn<'_> {
    PkColumn {
        name: raw.name.0,
        type_name: raw.type_name.map_or(Cow::Borrowed(""), |t| t.0),
        type_oid: raw.type_oid,
    }
}

/// Decodes one line of wal2json `format-version` 2 output (one row of
/// `pg_logical_slot_get_changes` / one CopyData payload of `START_REPLICATION`).
///
/// Strings are borrowed from `line` unless they contain JSON escapes; column
/// values are borrowed raw JSON. Unknown fields (e.g. `origin`) are ignored.
/// Requirements per action: `I`/`U` need `schema`, `table` and `columns`; `D`
/// needs `schema` and `table`; `T` needs `schema` and `table`; `M` needs
/// `transactional`, `prefix` and `content`. Everything else is optional.
pub fn decode(line: &str) -> Result<Change<'_>, DecodeError> {
    let ObjectOnly(raw): ObjectOnly<RawLine<'_>> =
        serde_json::from_str(line).map_err(DecodeError::from_json)?;
    let code = raw.action.ok_or(DecodeError::MissingAction)?.0;
    let mut chars = code.chars();
    let action = match (chars.next().and_then(Action::from_char), chars.next()) {
        (Some(a), None) => a,
        _ => return Err(DecodeError::UnknownAction(code.into_owned())),
    };

    let xid = raw.xid;
    let timestamp = raw.timestamp.map(|t| t.0);
    let lsn = lsn_field("lsn", raw.lsn)?;

    Ok(match action {
        Action::Begin | Action::Commit => {
            let marker = TxnMarker {
                xid,
                timestamp,
                lsn,
                next_lsn: lsn_field("nextlsn", raw.nextlsn)?,
            };
            if action == Action::Begin {
                Change::Begin(marker)
            } else {
                Change::Commit(marker)
            }
        }
        Action::Insert | Action::Update | Action::Delete => {
            let schema = required(action, "schema", raw.schema)?.0;
            let table = required(action, "table", raw.table)?.0;
            let new_tuple = if action == Action::Delete {
                raw.columns
            } else {
                Some(required(action, "columns", raw.columns)?)
            };
            let row = RowChange {
                xid,
                timestamp,
                lsn,
                schema,
                table,
                columns: columns(new_tuple),
                identity: columns(raw.identity),
                pk: raw
                    .pk
                    .unwrap_or_default()
                    .into_iter()
                    .map(pk_column)
                    .collect(),
            };
            match action {
                Action::Insert => Change::Insert(row),
                Action::Update => Change::Update(row),
                _ => Change::Delete(row),
            }
        }
        Action::Truncate => Change::Truncate(Truncate {
            xid,
            timestamp,
            lsn,
            schema: required(action, "schema", raw.schema)?.0,
            table: required(action, "table", raw.table)?.0,
        }),
        Action::Message => Change::Message(Message {
            xid,
            timestamp,
            lsn,
            transactional: required(action, "transactional", raw.transactional)?,
            prefix: required(action, "prefix", raw.prefix)?.0,
            content: required(action, "content", raw.content)?.0,
        }),
    })
}

/// [`decode`] for raw bytes (e.g. a replication CopyData payload); fails with
/// [`DecodeError::InvalidUtf8`] if they are not UTF-8.
pub fn decode_bytes(line: &[u8]) -> Result<Change<'_>, DecodeError> {
    decode(std::str::from_utf8(line)?)
}
