//! Decodes every line captured from PostgreSQL 15 + wal2json 2.5 by
//! `fixtures/capture.sh` and checks the exact content.
//!
//! xids, LSNs and timestamps change on every capture, so those are checked
//! for consistency (B/C pairing, ordering) rather than for literal values.

use std::collections::BTreeMap;

use walcast_wal2json::{add_tables_option, decode, Action, Change, Column, Lsn, RowChange};

const TYPES: &str = include_str!("../fixtures/01_types.jsonl");
const TOAST: &str = include_str!("../fixtures/02_toast.jsonl");
const QUOTING: &str = include_str!("../fixtures/03_quoting.jsonl");
const IDENTITY: &str = include_str!("../fixtures/04_identity.jsonl");
const TRANSACTIONS: &str = include_str!("../fixtures/05_transactions.jsonl");
const TRUNCATE: &str = include_str!("../fixtures/06_truncate.jsonl");
const MESSAGES: &str = include_str!("../fixtures/07_messages.jsonl");
const ADD_TABLES: &str = include_str!("../fixtures/08_add_tables.jsonl");
const ADD_TABLES_SQL: &str = include_str!("../fixtures/08_add_tables.sql");

const ALL: [(&str, &str); 8] = [
    ("01_types", TYPES),
    ("02_toast", TOAST),
    ("03_quoting", QUOTING),
    ("04_identity", IDENTITY),
    ("05_transactions", TRANSACTIONS),
    ("06_truncate", TRUNCATE),
    ("07_messages", MESSAGES),
    ("08_add_tables", ADD_TABLES),
];

fn decode_all(fixture: &str) -> Vec<Change<'_>> {
    fixture
        .lines()
        .enumerate()
        .map(|(i, line)| decode(line).unwrap_or_else(|e| panic!("line {}: {e}: {line}", i + 1)))
        .collect()
}

/// The transactions of a fixture: (begin index, commit index), checking the
/// invariants wal2json 2.5 guarantees on the way.
fn check_structure(name: &str, changes: &[Change<'_>]) -> Vec<(usize, usize)> {
    let mut txns = Vec::new();
    let mut open: Option<usize> = None;
    let mut last_commit = Lsn::ZERO;
    for (i, change) in changes.iter().enumerate() {
        let ctx = format!("{name} line {}", i + 1);
        match change {
            Change::Begin(b) => {
                assert!(open.is_none(), "{ctx}: nested B");
                assert!(b.xid.is_some() && b.timestamp.is_some(), "{ctx}");
                let (lsn, next) = (b.lsn.unwrap(), b.next_lsn.unwrap());
                assert!(lsn < next, "{ctx}: commit record start < end");
                assert!(lsn > last_commit, "{ctx}: commits in LSN order");
                last_commit = lsn;
                open = Some(i);
            }
            Change::Commit(c) => {
                let b = open.take().unwrap_or_else(|| panic!("{ctx}: C without B"));
                let Change::Begin(begin) = &changes[b] else {
                    unreachable!()
                };
                assert_eq!(begin, c, "{ctx}: B and C carry the same fields");
                txns.push((b, i));
            }
            Change::Message(m) if !m.transactional => {
                assert!(
                    open.is_none(),
                    "{ctx}: non-transactional message inside B/C"
                );
                assert_eq!((m.xid, m.timestamp.as_deref()), (None, None), "{ctx}");
                assert!(m.lsn.is_some(), "{ctx}");
            }
            other => {
                let b = open.unwrap_or_else(|| panic!("{ctx}: change outside B/C"));
                let Change::Begin(begin) = &changes[b] else {
                    unreachable!()
                };
                assert_eq!(other.xid(), begin.xid, "{ctx}");
                assert_eq!(other.timestamp(), begin.timestamp.as_deref(), "{ctx}");
                let lsn = other.lsn().unwrap();
                assert!(lsn <= begin.lsn.unwrap(), "{ctx}: change before its commit");
                if i > b + 1 {
                    assert!(changes[i - 1].lsn().unwrap() <= lsn, "{ctx}: LSN order");
                }
            }
        }
    }
    assert!(open.is_none(), "{name}: unterminated transaction");
    txns
}

#[test]
fn every_fixture_line_decodes_and_is_well_formed() {
    let mut total = 0;
    for (name, fixture) in ALL {
        let changes = decode_all(fixture);
        assert!(!changes.is_empty(), "{name} is empty");
        check_structure(name, &changes);
        total += changes.len();
    }
    assert!(total > 150, "{total}");
}

/// Compact summary: "B", "I schema.table", "M pfx" ...
fn summary(changes: &[Change<'_>]) -> Vec<String> {
    changes
        .iter()
        .map(|c| match c {
            Change::Insert(r) | Change::Update(r) | Change::Delete(r) => {
                format!("{} {}.{}", c.action().as_char(), r.schema, r.table)
            }
            Change::Truncate(t) => format!("T {}.{}", t.schema, t.table),
            Change::Message(m) => format!("M {} {}", m.transactional, m.content),
            other => other.action().as_char().to_string(),
        })
        .collect()
}

fn rows<'c, 'a>(changes: &'c [Change<'a>]) -> Vec<&'c RowChange<'a>> {
    changes.iter().filter_map(Change::row).collect()
}

fn texts(columns: &[Column<'_>]) -> BTreeMap<String, Option<String>> {
    columns
        .iter()
        .map(|c| (c.name.to_string(), c.text().map(|t| t.into_owned())))
        .collect()
}

fn names<'a>(columns: &'a [Column<'_>]) -> Vec<&'a str> {
    columns.iter().map(|c| c.name.as_ref()).collect()
}

fn text(row: &RowChange<'_>, column: &str) -> Option<String> {
    row.column(column)
        .unwrap_or_else(|| panic!("no column {column}"))
        .text()
        .map(|t| t.into_owned())
}

#[test]
fn types() {
    let changes = decode_all(TYPES);
    let rows = rows(&changes);
    assert_eq!(rows.len(), 5);
    assert!(rows
        .iter()
        .all(|r| r.schema == "public" && r.table == "types"));

    let r = rows[0];
    let expected = [
        ("id", "bigint", 20, "1", "1"),
        ("i2", "smallint", 21, "32767", "32767"),
        ("i4", "integer", 23, "-2147483648", "-2147483648"),
        (
            "i8",
            "bigint",
            20,
            "9223372036854775807",
            "9223372036854775807",
        ),
        (
            "num",
            "numeric",
            1700,
            "123456789012345678901234567890.123456789",
            "123456789012345678901234567890.123456789",
        ),
        ("f8", "double precision", 701, "1.5", "1.5"),
        ("f4", "real", 700, "-0.25", "-0.25"),
        ("bo", "boolean", 16, "true", "true"),
        (
            "tx",
            "text",
            25,
            r#""unicode é ✓ 😀 \"quoted\" back\\slash\nnew line\ttab""#,
            "unicode é ✓ 😀 \"quoted\" back\\slash\nnew line\ttab",
        ),
        (
            "vc",
            "character varying(10)",
            1043,
            r#""varchar""#,
            "varchar",
        ),
        ("ch", "character(3)", 1042, r#""ab ""#, "ab "),
        // wal2json strips bytea's "\x"; text() puts it back.
        ("by", "bytea", 17, r#""deadbeef00""#, "\\xdeadbeef00"),
        // A domain over bytea is printed by its output function, with "\x".
        ("dby", "blob", 0, r#""\\x0102""#, "\\x0102"),
        (
            "js",
            "json",
            114,
            r#""{\"a\": [1, 2.50, null], \"b\": \"x\\\"y\"}""#,
            r#"{"a": [1, 2.50, null], "b": "x\"y"}"#,
        ),
        (
            "jb",
            "jsonb",
            3802,
            r#""{\"a\": [1, 2.50, null], \"b\": \"x\\\"y\"}""#,
            r#"{"a": [1, 2.50, null], "b": "x\"y"}"#,
        ),
        ("arr", "integer[]", 1007, r#""{1,NULL,3}""#, "{1,NULL,3}"),
        (
            "arr2",
            "text[]",
            1009,
            r#""{{a,\"NULL\"},{NULL,\"d,e\"}}""#,
            r#"{{a,"NULL"},{NULL,"d,e"}}"#,
        ),
        (
            "uu",
            "uuid",
            2950,
            r#""a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11""#,
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        ),
        (
            "tstz",
            "timestamp with time zone",
            1184,
            r#""2026-01-02 01:04:05.123456+00""#,
            "2026-01-02 01:04:05.123456+00",
        ),
        (
            "ts",
            "timestamp without time zone",
            1114,
            r#""2026-01-02 03:04:05""#,
            "2026-01-02 03:04:05",
        ),
        ("d", "date", 1082, r#""2026-01-02""#, "2026-01-02"),
        (
            "iv",
            "interval",
            1186,
            r#""1 year 2 mons 3 days 04:05:06.5""#,
            "1 year 2 mons 3 days 04:05:06.5",
        ),
        ("mo", "mood", 0, r#""happy""#, "happy"),
        // A domain over integer is a JSON *string*: only the base types are numbers.
        ("dom", "posint", 0, r#""42""#, "42"),
    ];
    assert_eq!(
        names(&r.columns),
        expected.iter().map(|e| e.0).collect::<Vec<_>>()
    );
    for (col, (name, ty, oid, raw, text)) in r.columns.iter().zip(expected) {
        assert_eq!(col.name, name);
        assert_eq!(col.type_name, ty, "{name}");
        if oid == 0 {
            // User-defined types get OIDs >= 16384 that depend on the capture.
            assert!(col.type_oid.unwrap() >= 16384, "{name}");
        } else {
            assert_eq!(col.type_oid, Some(oid), "{name}");
        }
        assert_eq!(col.value.unwrap().get(), raw, "{name}");
        assert_eq!(col.text().as_deref(), Some(text), "{name}");
        assert!(!col.is_null());
    }
    assert_eq!(r.pk.len(), 1);
    assert_eq!(
        (
            r.pk[0].name.as_ref(),
            r.pk[0].type_name.as_ref(),
            r.pk[0].type_oid
        ),
        ("id", "bigint", Some(20))
    );

    // NaN and ±Infinity are sent as JSON null, like SQL NULL.
    let r = rows[1];
    for special in ["num", "f8", "f4", "i4", "tx"] {
        let c = r.column(special).unwrap();
        assert!(c.is_null(), "{special}");
        assert_eq!(c.value.unwrap().get(), "null");
    }
    assert_eq!(text(r, "bo").as_deref(), Some("false"));
    assert_eq!(text(r, "i2").as_deref(), Some("-1"));

    let r = rows[2];
    assert_eq!(
        text(r, "num").as_deref(),
        Some("-0.000000000000000000000000000001")
    );
    assert_eq!(text(r, "f4").as_deref(), Some("1e-30"));
    assert!(r.column("f8").unwrap().is_null(), "NaN");

    let r = rows[3];
    assert_eq!(r.columns.len(), 24);
    assert!(r
        .columns
        .iter()
        .skip(1)
        .all(|c| c.is_null() && c.text().is_none()));

    // Empty string, JSON 'null' (not SQL NULL) and an empty array.
    let r = rows[4];
    assert_eq!(text(r, "tx").as_deref(), Some(""));
    assert_eq!(text(r, "js").as_deref(), Some("null"));
    assert!(!r.column("js").unwrap().is_null());
    assert_eq!(text(r, "arr").as_deref(), Some("{}"));
}

#[test]
fn unchanged_toast() {
    let changes = decode_all(TOAST);
    let s = summary(&changes);
    let body: Vec<_> = s
        .iter()
        .filter(|a| *a != "B" && *a != "C")
        .map(String::as_str)
        .collect();
    assert_eq!(
        body,
        [
            "I public.toast_default",
            "I public.toast_full",
            "U public.toast_default",
            "U public.toast_full",
            "U public.toast_default",
            "U public.toast_full",
            "D public.toast_default",
            "D public.toast_full",
        ]
    );
    let rows = rows(&changes);
    let big = text(rows[0], "big").unwrap();
    assert_eq!(big.len(), 6400);
    assert!(big.starts_with("c4ca4238a0b923820dcc509a6f75849b")); // md5('1')
    assert_eq!(text(rows[1], "big").unwrap(), big);

    // DEFAULT: `big` is missing from the new tuple and cannot be detected from
    // the identity (key only).
    let u = rows[2];
    assert_eq!(names(&u.columns), ["id", "small"]);
    assert_eq!(names(&u.identity), ["id"]);
    assert!(u.omitted_unchanged_toast().is_empty());

    // FULL: the old row carries the detoasted value, so the omission is visible.
    let u = rows[3];
    assert_eq!(names(&u.columns), ["id", "small"]);
    assert_eq!(names(&u.identity), ["id", "big", "small"]);
    assert_eq!(u.omitted_unchanged_toast(), ["big"]);
    assert_eq!(u.identity_column("big").unwrap().text().unwrap(), big);
    assert_eq!(
        u.identity_column("small").unwrap().text().as_deref(),
        Some("0")
    );

    // When `big` itself changes it is sent.
    for u in [rows[4], rows[5]] {
        assert_eq!(
            texts(&u.columns),
            texts_of(&[("id", "1"), ("big", "short"), ("small", "2")])
        );
        assert!(u.omitted_unchanged_toast().is_empty());
    }
    assert_eq!(
        texts(&rows[5].identity)["big"].as_deref(),
        Some(big.as_str())
    );

    assert_eq!(texts(&rows[6].identity), texts_of(&[("id", "1")]));
    assert_eq!(
        texts(&rows[7].identity),
        texts_of(&[("id", "1"), ("big", "short"), ("small", "2")])
    );
    assert!(rows[6].columns.is_empty() && rows[7].columns.is_empty());
}

fn texts_of(pairs: &[(&str, &str)]) -> BTreeMap<String, Option<String>> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), Some(v.to_string())))
        .collect()
}

#[test]
fn quoted_names() {
    let changes = decode_all(QUOTING);
    let rows = rows(&changes);
    let got: Vec<_> = rows
        .iter()
        .map(|r| {
            (
                r.schema.as_ref(),
                r.table.as_ref(),
                names(&r.columns),
                names(&r.identity),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("Mixed Case", "Tab le", vec!["Id", "Col \"Q\""], vec![]),
            ("dot.ted", "a.b", vec!["id", "back\\slash"], vec![]),
            ("ünï ☃", "tåble", vec!["ключ", "值"], vec![]),
            ("com,ma", "x,y", vec!["id"], vec![]),
            ("Mixed Case", "Tab le", vec!["Id", "Col \"Q\""], vec!["Id"]),
            ("ünï ☃", "tåble", vec![], vec!["ключ"]),
        ]
    );
    assert_eq!(text(rows[2], "值").as_deref(), Some("три"));
    assert_eq!(text(rows[4], "Col \"Q\"").as_deref(), Some("uno"));
    assert_eq!(rows[5].pk[0].name, "ключ");
}

#[test]
fn replica_identity() {
    let changes = decode_all(IDENTITY);
    let txns = check_structure("04", &changes);
    // One statement per transaction; UPDATE/DELETE without identity leave an empty B/C.
    assert_eq!(txns.len(), 22);
    let per_txn: Vec<Vec<String>> = txns
        .iter()
        .map(|&(b, c)| summary(&changes[b + 1..c]))
        .collect();
    let empty: Vec<usize> = (0..per_txn.len())
        .filter(|&i| per_txn[i].is_empty())
        .collect();
    assert_eq!(empty, [13, 14, 16, 17]);

    let rows = rows(&changes);
    let ident = |i: usize| texts(&rows[i].identity);
    let cols = |i: usize| texts(&rows[i].columns);
    let t = |i: usize| rows[i].table.as_ref();
    let m = texts_of;
    // rid_default: identity = key, also when the key did not change.
    assert_eq!(
        (t(1), ident(1), cols(1)),
        (
            "rid_default",
            m(&[("id", "1")]),
            m(&[("id", "1"), ("v", "b")])
        )
    );
    assert_eq!(
        (t(2), ident(2), cols(2)),
        (
            "rid_default",
            m(&[("id", "1")]),
            m(&[("id", "2"), ("v", "b")])
        )
    );
    assert_eq!((t(3), ident(3)), ("rid_default", m(&[("id", "2")])));
    // rid_full: identity = whole old row.
    assert_eq!(
        (t(5), ident(5)),
        ("rid_full", m(&[("id", "1"), ("v", "a")]))
    );
    assert_eq!(
        (t(6), ident(6), cols(6)),
        (
            "rid_full",
            m(&[("id", "1"), ("v", "b")]),
            m(&[("id", "2"), ("v", "b")])
        )
    );
    assert_eq!(
        (t(7), ident(7)),
        ("rid_full", m(&[("id", "2"), ("v", "b")]))
    );
    // rid_index: identity = the index columns, pk still the primary key.
    assert_eq!((t(9), ident(9)), ("rid_index", m(&[("u", "10")])));
    assert_eq!((t(10), ident(10)), ("rid_index", m(&[("u", "10")])));
    assert_eq!((t(11), ident(11)), ("rid_index", m(&[("u", "11")])));
    assert_eq!(rows[11].pk[0].name, "id");
    // rid_nothing and rid_nopk: only the inserts.
    assert_eq!((t(12), rows[12].identity.len()), ("rid_nothing", 0));
    assert_eq!((t(13), rows[13].pk.len()), ("rid_nopk", 0));
    // rid_composite: pk and identity in column order (a, b), not key order (b, a).
    let pk: Vec<_> = rows[14]
        .pk
        .iter()
        .map(|p| (p.name.as_ref(), p.type_name.as_ref()))
        .collect();
    assert_eq!(pk, [("a", "integer"), ("b", "text")]);
    assert_eq!(names(&rows[15].identity), ["a", "b"]);
    assert_eq!(ident(16), m(&[("a", "1"), ("b", "k")]));
    assert_eq!(text(rows[16], "a").as_deref(), Some("2"));
    assert_eq!(ident(17), m(&[("a", "2"), ("b", "k")]));
    assert_eq!(rows.len(), 18);
}

#[test]
fn transactions() {
    let changes = decode_all(TRANSACTIONS);
    let txns = check_structure("05", &changes);
    let per_txn: Vec<Vec<String>> = txns
        .iter()
        .map(|&(b, c)| summary(&changes[b + 1..c]))
        .collect();
    assert_eq!(
        per_txn,
        [
            vec![
                "I public.tx",
                "I public.tx",
                "I public.tx",
                "U public.tx",
                "D public.tx"
            ],
            // CREATE TABLE: a B/C pair with nothing in it. `BEGIN; COMMIT;`,
            // `SELECT txid_current()` and the rollbacks produce nothing at all.
            vec![],
            vec!["I public.tx", "I public.tx"],
        ]
    );
    let rows = rows(&changes);
    let ids: Vec<String> = rows
        .iter()
        .map(|r| {
            r.column("id")
                .or(r.identity_column("id"))
                .unwrap()
                .text()
                .unwrap()
                .into_owned()
        })
        .collect();
    assert_eq!(ids, ["1", "2", "3", "2", "3", "20", "22"]);
    assert_eq!(text(rows[3], "v").as_deref(), Some("bb"));
    assert_eq!(text(rows[6], "v").as_deref(), Some("kept too"));
    // Within a transaction the rows are in LSN order and before the commit.
    let Change::Begin(b) = &changes[0] else {
        panic!()
    };
    assert!(rows[..5].windows(2).all(|w| w[0].lsn < w[1].lsn));
    assert!(rows[4].lsn < b.lsn);
    assert_eq!(
        rows.iter().map(|r| r.xid).collect::<Vec<_>>()[..5],
        [b.xid; 5]
    );
}

#[test]
fn truncates() {
    let changes = decode_all(TRUNCATE);
    let txns = check_structure("06", &changes);
    let per_txn: Vec<Vec<String>> = txns
        .iter()
        .map(|&(b, c)| summary(&changes[b + 1..c]))
        .collect();
    assert_eq!(
        per_txn,
        [
            vec!["T public.tr_a"],
            vec!["T public.tr_a", "T public.tr_b"],
            vec!["T public.tr_parent", "T public.tr_child"],
        ]
    );
    // One TRUNCATE statement: one line per table, all with the same LSN.
    assert_eq!(changes[4].lsn(), changes[5].lsn());
    assert_eq!(changes[4].action(), Action::Truncate);
}

#[test]
fn messages() {
    let changes = decode_all(MESSAGES);
    check_structure("07", &changes);
    assert_eq!(
        summary(&changes),
        [
            "B",
            "M true standalone transactional",
            "C",
            "M false standalone non-transactional",
            // Sent from inside the next transaction, decoded before its B.
            "M false non-transactional inside txn",
            "B",
            "I public.msg",
            "M true in txn: ünï \"q\" \\ \n end",
            "I public.msg",
            "C",
            "B",
            "M true ",
            "C",
            // '\xff41c3'::bytea: the invalid UTF-8 bytes are dropped.
            "M false A",
        ]
    );
    let prefixes: Vec<_> = changes
        .iter()
        .filter_map(|c| match c {
            Change::Message(m) => Some(m.prefix.as_ref()),
            _ => None,
        })
        .collect();
    assert_eq!(prefixes, ["pfx", "pfx", "pfx", "pfx", "", "bin"]);
    // A transactional message's LSN is the END of its record: for a standalone
    // one that is exactly where the commit record starts.
    let Change::Begin(b) = &changes[0] else {
        panic!()
    };
    assert_eq!(changes[1].lsn(), b.lsn);
    // The non-transactional message sent between the two inserts has a higher
    // LSN than the first insert, yet comes out before the transaction.
    assert!(changes[4].lsn() > changes[6].lsn());
    assert_eq!(changes[4].lsn(), changes[8].lsn());
}

#[test]
fn add_tables_selects_exactly_the_listed_tables() {
    let selected = [
        ("Mixed Case", "Tab,1"),
        ("dot.s", "a.b"),
        ("*", "*"),
        ("public", "back\\slash"),
        ("public", "ünï ☃"),
        ("public", "tab\tx"),
        ("public", "Star*"),
    ];
    let header = ADD_TABLES_SQL
        .lines()
        .find_map(|l| l.strip_prefix("-- @add-tables: "))
        .unwrap();
    assert_eq!(add_tables_option(selected), header);

    let changes = decode_all(ADD_TABLES);
    let txns = check_structure("08", &changes);
    // Filtered transactions still produce a B/C pair.
    assert_eq!(txns.len(), 15);
    let got: Vec<_> = rows(&changes)
        .iter()
        .map(|r| (r.schema.as_ref(), r.table.as_ref()))
        .collect();
    assert_eq!(got, selected);
}
