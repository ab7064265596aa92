//! Typed, borrowed representation of wal2json format-version 2 lines.

use std::borrow::Cow;
use std::fmt;

use serde_json::value::RawValue;

use crate::cow_str::CowStr;
use walcast_core::Lsn;

/// Postgres' type OID of `bytea`.
const BYTEA_OID: u32 = 17;

/// The `"action"` of a wal2json format-version 2 line.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub enum Action {
    /// `"B"`: transaction begin (needs `include-transaction`).
    Begin,
    /// `"C"`: transaction commit (needs `include-transaction`).
    Commit,
    /// `"I"`: row inserted.
    Insert,
    /// `"U"`: row updated.
    Update,
    /// `"D"`: row deleted.
    Delete,
    /// `"T"`: table truncated (one line per truncated table).
    Truncate,
    /// `"M"`: `pg_logical_emit_message()`.
    Message,
}

impl Action {
    /// The one-letter code wal2json uses for this action.
    pub fn as_char(self) -> char {
        match self {
            Action::Begin => 'B',
            Action::Commit => 'C',
            Action::Insert => 'I',
            Action::Update => 'U',
            Action::Delete => 'D',
            Action::Truncate => 'T',
            Action::Message => 'M',
        }
    }

    /// The action for a wal2json one-letter code.
    pub fn from_char(c: char) -> Option<Action> {
        Some(match c {
            'B' => Action::Begin,
            'C' => Action::Commit,
            'I' => Action::Insert,
            'U' => Action::Update,
            'D' => Action::Delete,
            'T' => Action::Truncate,
            'M' => Action::Message,
            _ => return None,
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Action::Begin => "begin",
            Action::Commit => "commit",
            Action::Insert => "insert",
            Action::Update => "update",
            Action::Delete => "delete",
            Action::Truncate => "truncate",
            Action::Message => "message",
        };
        write!(f, "{} ({name})", self.as_char())
    }
}

/// One column of a tuple (`"columns"` or `"identity"`).
#[derive(Clone, Debug)]
pub struct Column<'a> {
    /// Column name, unquoted (`Col "Q"` for `"Col ""Q"""`).
    pub name: Cow<'a, str>,
    /// wal2json `"type"`: the type name as `format_type` prints it (`integer`,
    /// `character varying`, `text[]`, a domain or enum name, ...). Empty if the
    /// line had no `"type"` (`include-types` = 0).
    pub type_name: Cow<'a, str>,
    /// wal2json `"typeoid"` (with `include-type-oids`). For a domain this is the
    /// domain's OID, not its base type's.
    pub type_oid: Option<u32>,
    /// The raw JSON value: `None` when the key is absent, `Some("null")` for SQL NULL.
    ///
    /// wal2json 2.5 writes `smallint`, `integer`, `bigint`, `oid`, `real`,
    /// `double precision` and `numeric` as bare JSON numbers (the Postgres text,
    /// verbatim, so `numeric` keeps every digit) **except NaN and ±Infinity,
    /// which become `null`** and are indistinguishable from SQL NULL. `boolean`
    /// is `true`/`false`. `bytea` is its hex text **without** the `\x` prefix.
    /// Everything else, including domains over those types, arrays, json and
    /// jsonb, is a JSON string holding the Postgres text form.
    pub value: Option<&'a RawValue>,
}

impl Column<'_> {
    /// True when the value is absent or JSON `null` (SQL NULL, or NaN/±Infinity of
    /// a numeric/float column, which wal2json 2.5 cannot represent).
    pub fn is_null(&self) -> bool {
        self.value.is_none_or(|v| v.get() == "null")
    }

    /// The value in Postgres text form (what `SELECT col::text` would print, and
    /// valid input for the column type), or `None` for NULL.
    ///
    /// * JSON strings are unescaped (borrowed when they have no escapes);
    /// * numbers are returned verbatim (`123456789012345678901234567890.5`);
    /// * booleans are returned as `true`/`false` (Postgres prints `t`/`f`; both
    ///   are valid boolean input);
    /// * `bytea` (OID 17, or type name `bytea` when OIDs are not included) gets
    ///   back the `\x` prefix that wal2json strips, so `deadbeef` becomes
    ///   `\xdeadbeef`. Domains over bytea already carry it.
    pub fn text(&self) -> Option<Cow<'_, str>> {
        let raw = self.value?.get();
        match raw.as_bytes().first() {
            Some(b'"') => {
                // A RawValue starting with '"' is a complete JSON string.
                let s = serde_json::from_str::<CowStr<'_>>(raw).ok()?.0;
                if self.is_bytea() {
                    Some(Cow::Owned(format!("\\x{s}")))
                } else {
                    Some(s)
                }
            }
            _ if raw == "null" => None,
            _ => Some(Cow::Borrowed(raw)),
        }
    }

    fn is_bytea(&self) -> bool {
        match self.type_oid {
            Some(oid) => oid == BYTEA_OID,
            None => self.type_name == "bytea",
        }
    }
}

/// One entry of `"pk"` (the primary key's columns, in table column order, not
/// key order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PkColumn<'a> {
    /// Column name.
    pub name: Cow<'a, str>,
    /// wal2json `"type"` (empty if absent).
    pub type_name: Cow<'a, str>,
    /// wal2json `"typeoid"`.
    pub type_oid: Option<u32>,
}

/// A `B` (begin) or `C` (commit) line.
///
/// On both, `lsn` is the start of the transaction's commit record and `next_lsn`
/// its end (the position to confirm once the transaction is applied). Both
/// lines carry the same values, and `lsn` is greater than the `lsn` of every row
/// change in the transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TxnMarker<'a> {
    /// Transaction id (`include-xids`).
    pub xid: Option<u32>,
    /// Commit timestamp, as wal2json prints it (`2026-11-30 05:26:07.323193+00`).
    pub timestamp: Option<Cow<'a, str>>,
    /// Start of the commit record.
    pub lsn: Option<Lsn>,
    /// End of the commit record.
    pub next_lsn: Option<Lsn>,
}

/// An `I`, `U` or `D` line.
#[derive(Clone, Debug)]
pub struct RowChange<'a> {
    /// Transaction id (`include-xids`).
    pub xid: Option<u32>,
    /// Commit timestamp of the transaction (`include-timestamp`).
    pub timestamp: Option<Cow<'a, str>>,
    /// Start of this change's WAL record (`include-lsn`).
    pub lsn: Option<Lsn>,
    /// Schema name, unquoted.
    pub schema: Cow<'a, str>,
    /// Table name, unquoted.
    pub table: Cow<'a, str>,
    /// New tuple (insert, update); empty for delete. For an update, unchanged
    /// out-of-line TOASTed columns are missing (see
    /// [`RowChange::omitted_unchanged_toast`]).
    pub columns: Vec<Column<'a>>,
    /// Old tuple's replica identity: the key columns (REPLICA IDENTITY DEFAULT or
    /// USING INDEX) or the whole old row (FULL). wal2json 2.5 always sends it for
    /// updates (for DEFAULT it takes the key from the new tuple when the key did
    /// not change) and deletes; tables without a replica identity get no update
    /// or delete lines at all. Empty for inserts.
    pub identity: Vec<Column<'a>>,
    /// The table's primary key columns (`include-pk`), in table column order;
    /// empty if the table has none.
    pub pk: Vec<PkColumn<'a>>,
}

impl RowChange<'_> {
    /// For an UPDATE, wal2json omits unchanged out-of-line TOASTed columns from
    /// `columns`. This returns the names that appear in `identity` but not in
    /// `columns`.
    ///
    /// Limitation: this is only complete under REPLICA IDENTITY FULL, where
    /// `identity` is the whole old row (and carries the old, detoasted value).
    /// Under DEFAULT / USING INDEX, `identity` holds only key columns, so an
    /// omitted non-key column is not detectable here; compare `columns` with the
    /// table's column list instead. Returns an empty list when `columns` is empty
    /// (DELETE).
    pub fn omitted_unchanged_toast(&self) -> Vec<&str> {
        if self.columns.is_empty() {
            return Vec::new();
        }
        self.identity
            .iter()
            .filter(|old| !self.columns.iter().any(|new| new.name == old.name))
            .map(|old| old.name.as_ref())
            .collect()
    }
}

impl<'a> RowChange<'a> {
    /// The new-tuple column with this name.
    pub fn column(&self, name: &str) -> Option<&Column<'a>> {
        self.columns.iter().find(|c| c.name == name)
    }

    /// The identity (old key / old row) column with this name.
    pub fn identity_column(&self, name: &str) -> Option<&Column<'a>> {
        self.identity.iter().find(|c| c.name == name)
    }
}

/// A `T` line: one truncated table (a `TRUNCATE a, b` gives one line per table,
/// all with the same `lsn`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Truncate<'a> {
    /// Transaction id.
    pub xid: Option<u32>,
    /// Commit timestamp of the transaction.
    pub timestamp: Option<Cow<'a, str>>,
    /// Start of the TRUNCATE record.
    pub lsn: Option<Lsn>,
    /// Schema name.
    pub schema: Cow<'a, str>,
    /// Table name.
    pub table: Cow<'a, str>,
}

/// An `M` line (`pg_logical_emit_message`).
///
/// Non-transactional messages are sent with `"xid":null,"timestamp":null`
/// outside any B/C pair, as soon as they are decoded: one emitted from inside an
/// open transaction shows up *before* that transaction's `B`. Here `lsn` is the
/// *end* of the message record (for row changes it is the start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message<'a> {
    /// Transaction id (`None` for non-transactional messages).
    pub xid: Option<u32>,
    /// Commit timestamp (`None` for non-transactional messages).
    pub timestamp: Option<Cow<'a, str>>,
    /// End of the message's WAL record.
    pub lsn: Option<Lsn>,
    /// Whether the message was emitted as transactional.
    pub transactional: bool,
    /// The message prefix.
    pub prefix: Cow<'a, str>,
    /// The content. wal2json 2.5 cuts it at the first NUL byte and drops bytes
    /// that are not valid UTF-8, so binary payloads do not survive.
    pub content: Cow<'a, str>,
}

/// One decoded wal2json format-version 2 line.
#[derive(Clone, Debug)]
pub enum Change<'a> {
    /// `B`
    Begin(TxnMarker<'a>),
    /// `C`
    Commit(TxnMarker<'a>),
    /// `I`
    Insert(RowChange<'a>),
    /// `U`
    Update(RowChange<'a>),
    /// `D`
    Delete(RowChange<'a>),
    /// `T`
    Truncate(Truncate<'a>),
    /// `M`
    Message(Message<'a>),
}

impl<'a> Change<'a> {
    /// The line's action.
    pub fn action(&self) -> Action {
        match self {
            Change::Begin(_) => Action::Begin,
            Change::Commit(_) => Action::Commit,
            Change::Insert(_) => Action::Insert,
            Change::Update(_) => Action::Update,
            Change::Delete(_) => Action::Delete,
            Change::Truncate(_) => Action::Truncate,
            Change::Message(_) => Action::Message,
        }
    }

    /// The transaction id, if the line has one.
    pub fn xid(&self) -> Option<u32> {
        match self {
            Change::Begin(m) | Change::Commit(m) => m.xid,
            Change::Insert(r) | Change::Update(r) | Change::Delete(r) => r.xid,
            Change::Truncate(t) => t.xid,
            Change::Message(m) => m.xid,
        }
    }

    /// The line's `"lsn"`, if present (see each variant for what it points at).
    pub fn lsn(&self) -> Option<Lsn> {
        match self {
            Change::Begin(m) | Change::Commit(m) => m.lsn,
            Change::Insert(r) | Change::Update(r) | Change::Delete(r) => r.lsn,
            Change::Truncate(t) => t.lsn,
            Change::Message(m) => m.lsn,
        }
    }

    /// The line's `"timestamp"` (commit time of the transaction), if present.
    pub fn timestamp(&self) -> Option<&str> {
        let ts = match self {
            Change::Begin(m) | Change::Commit(m) => &m.timestamp,
            Change::Insert(r) | Change::Update(r) | Change::Delete(r) => &r.timestamp,
            Change::Truncate(t) => &t.timestamp,
            Change::Message(m) => &m.timestamp,
        };
        ts.as_deref()
    }

    /// The row change, for `I`, `U` and `D`.
    pub fn row(&self) -> Option<&RowChange<'a>> {
        match self {
            Change::Insert(r) | Change::Update(r) | Change::Delete(r) => Some(r),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col<'a>(name: &'a str, ty: &'a str, oid: Option<u32>, raw: Option<&'a str>) -> Column<'a> {
        Column {
            name: Cow::Borrowed(name),
            type_name: Cow::Borrowed(ty),
            type_oid: oid,
            value: raw.map(|r| serde_json::from_str::<&RawValue>(r).unwrap()),
        }
    }

    #[test]
    fn action_chars_round_trip() {
        for a in [
            Action::Begin,
            Action::Commit,
            Action::Insert,
            Action::Update,
            Action::Delete,
            Action::Truncate,
            Action::Message,
        ] {
            assert_eq!(Action::from_char(a.as_char()), Some(a));
        }
        assert_eq!(Action::from_char('X'), None);
        assert_eq!(Action::Update.to_string(), "U (update)");
    }

    #[test]
    fn text_forms() {
        let s = col("v", "text", Some(25), Some(r#""a\"\\b\nc""#));
        assert_eq!(s.text().as_deref(), Some("a\"\\b\nc"));
        let plain = col("v", "text", Some(25), Some(r#""abc""#));
        assert!(matches!(plain.text(), Some(Cow::Borrowed("abc"))));
        let n = col(
            "n",
            "numeric",
            Some(1700),
            Some("123456789012345678901234567890.5"),
        );
        assert_eq!(
            n.text().as_deref(),
            Some("123456789012345678901234567890.5")
        );
        let b = col("b", "boolean", Some(16), Some("true"));
        assert_eq!(b.text().as_deref(), Some("true"));
        let null = col("x", "text", Some(25), Some("null"));
        assert!(null.is_null());
        assert_eq!(null.text(), None);
        let absent = col("x", "text", Some(25), None);
        assert!(absent.is_null());
        assert_eq!(absent.text(), None);
        let json_null = col("j", "json", Some(114), Some(r#""null""#));
        assert!(!json_null.is_null());
        assert_eq!(json_null.text().as_deref(), Some("null"));
    }

    #[test]
    fn bytea_gets_its_prefix_back() {
        let by = col("b", "bytea", Some(17), Some(r#""deadbeef""#));
        assert_eq!(by.text().as_deref(), Some("\\xdeadbeef"));
        let by_no_oid = col("b", "bytea", None, Some(r#""00""#));
        assert_eq!(by_no_oid.text().as_deref(), Some("\\x00"));
        let domain = col("d", "blob", Some(16397), Some(r#""\\x0102""#));
        assert_eq!(domain.text().as_deref(), Some("\\x0102"));
        let arr = col("a", "bytea[]", Some(1001), Some(r#""{\"\\\\x01\"}""#));
        assert_eq!(arr.text().as_deref(), Some(r#"{"\\x01"}"#));
    }

    fn row<'a>(columns: Vec<Column<'a>>, identity: Vec<Column<'a>>) -> RowChange<'a> {
        RowChange {
            xid: None,
            timestamp: None,
            lsn: None,
            schema: "public".into(),
            table: "t".into(),
            columns,
            identity,
            pk: Vec::new(),
        }
    }

    #[test]
    fn omitted_toast() {
        let full = row(
            vec![
                col("id", "integer", None, Some("1")),
                col("small", "integer", None, Some("2")),
            ],
            vec![
                col("id", "integer", None, Some("1")),
                col("big", "text", None, Some(r#""x""#)),
                col("small", "integer", None, Some("1")),
            ],
        );
        assert_eq!(full.omitted_unchanged_toast(), vec!["big"]);
        assert_eq!(full.column("small").unwrap().text().as_deref(), Some("2"));
        assert_eq!(
            full.identity_column("small").unwrap().text().as_deref(),
            Some("1")
        );
        assert!(full.column("big").is_none());
        let delete = row(vec![], vec![col("id", "integer", None, Some("1"))]);
        assert!(delete.omitted_unchanged_toast().is_empty());
    }
}
