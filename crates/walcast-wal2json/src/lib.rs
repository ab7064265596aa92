//! Decoder for [wal2json](https://github.com/eulerto/wal2json) `format-version`
//! 2 output, as produced by PostgreSQL logical decoding.
//!
//! Each wal2json line is one JSON object; [`decode`] turns it into a typed,
//! borrowed [`Change`] without doing any IO. Names and strings borrow from the
//! line unless they contain JSON escapes, and column values stay raw JSON
//! ([`Column::value`]) until asked for ([`Column::text`]). [`Lsn`] is a
//! Postgres `pg_lsn`, and [`add_tables_option`] builds the `add-tables`
//! plugin option with wal2json's escaping rules.
//!
//! The decoder is written and tested against PostgreSQL 15 + wal2json 2.5 with
//! these options: `format-version 2`, `include-timestamp 1`,
//! `include-type-oids 1`, `include-typmod 0`, `include-transaction 1`,
//! `include-lsn 1`, `include-xids 1`, `include-pk 1` (and `add-tables`). The
//! fixtures under `fixtures/` were captured from the real server by
//! `fixtures/capture.sh`.
//!
//! wal2json 2.5 behaviour worth knowing (all visible in the fixtures):
//! * every decoded transaction gets a `B`/`C` pair, including DDL-only
//!   transactions and transactions whose changes were all filtered out by
//!   `add-tables`; transactions that wrote no WAL get none;
//! * `B` and `C` both carry the commit record's start (`lsn`) and end
//!   (`nextlsn`); row changes carry their own record's start;
//! * non-transactional messages have `"xid":null,"timestamp":null`, no B/C, and
//!   are emitted when decoded, i.e. before the `B` of a transaction that was
//!   open when they were sent. PostgreSQL 15 does not flush WAL after a
//!   non-transactional message and decoding only reads flushed WAL, so such a
//!   message can arrive late (after the next flush: a commit, the walwriter);
//! * UPDATE/DELETE on a table without replica identity (no primary key, or
//!   `REPLICA IDENTITY NOTHING`) are silently dropped (server-side WARNING);
//! * numeric/float NaN and ±Infinity come out as JSON `null`;
//! * unchanged out-of-line TOAST values are left out of an UPDATE's `columns`
//!   (see [`RowChange::omitted_unchanged_toast`]).
//!
//! ```
//! use walcast_wal2json::{decode, Change};
//!
//! let line = r#"{"action":"I","xid":729,"lsn":"0/15308E8","schema":"public","table":"t","columns":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"v","type":"text","typeoid":25,"value":"a\nb"}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
//! let Change::Insert(row) = decode(line)? else { unreachable!() };
//! assert_eq!((row.schema.as_ref(), row.table.as_ref()), ("public", "t"));
//! assert_eq!(row.lsn.map(|l| l.to_string()).as_deref(), Some("0/15308E8"));
//! assert_eq!(row.column("v").and_then(|c| c.text()).as_deref(), Some("a\nb"));
//! # Ok::<(), walcast_wal2json::DecodeError>(())
//! ```

mod add_tables;
mod bytea;
mod change;
mod cow_str;
mod decode;

#[cfg(test)]
mod decode_tests;

pub use add_tables::{add_tables_and_schemas, add_tables_option};
pub use bytea::{decode_bytea, ByteaError};
pub use change::{Action, Change, Column, Message, PkColumn, RowChange, Truncate, TxnMarker};
pub use decode::{decode, decode_bytes, DecodeError};
pub use serde_json::value::RawValue;
pub use walcast_core::{Lsn, ParseLsnError};
