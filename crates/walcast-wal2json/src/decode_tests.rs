//! Unit tests for [`crate::decode`]: one per action, then error cases and fuzzing.

use std::borrow::Cow;

use proptest::prelude::*;

use crate::{decode, decode_bytes, Action, Change, DecodeError, Lsn};

fn lsn(s: &str) -> Option<Lsn> {
    Some(s.parse().unwrap())
}

#[test]
fn begin_and_commit() {
    let line = r#"{"action":"B","xid":729,"timestamp":"2026-11-30 05:26:07.323193+00","lsn":"0/1530AA8","nextlsn":"0/1530AD8"}"#;
    let Change::Begin(b) = decode(line).unwrap() else {
        panic!("not a begin")
    };
    assert_eq!(b.xid, Some(729));
    assert_eq!(
        b.timestamp.as_deref(),
        Some("2026-11-30 05:26:07.323193+00")
    );
    assert!(matches!(b.timestamp, Some(Cow::Borrowed(_))));
    assert_eq!(b.lsn, lsn("0/1530AA8"));
    assert_eq!(b.next_lsn, lsn("0/1530AD8"));

    let commit_line = line.replace(r#""B""#, r#""C""#);
    let c = decode(&commit_line).unwrap();
    assert_eq!(c.action(), Action::Commit);
    assert_eq!(c.xid(), Some(729));
    assert_eq!(c.lsn(), lsn("0/1530AA8"));
    assert_eq!(c.timestamp(), Some("2026-11-30 05:26:07.323193+00"));

    // Every field but the action is optional.
    let Change::Commit(bare) = decode(r#"{"action":"C"}"#).unwrap() else {
        panic!()
    };
    assert_eq!(
        (bare.xid, bare.lsn, bare.next_lsn, bare.timestamp),
        (None, None, None, None)
    );
}

#[test]
fn insert() {
    let line = r#"{"action":"I","xid":729,"timestamp":"2026-11-30 05:26:07.323193+00","lsn":"0/15308E8","schema":"public","table":"t","columns":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"v","type":"text","typeoid":25,"value":"a\"\\\\b\nc"},{"name":"j","type":"jsonb","typeoid":3802,"value":"{\"x\": 1}"},{"name":"n","type":"numeric","typeoid":1700,"value":123456789012345678901234567890.5},{"name":"b","type":"boolean","typeoid":16,"value":true},{"name":"a","type":"integer[]","typeoid":1007,"value":"{1,NULL}"},{"name":"z","type":"text","typeoid":25,"value":null}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
    let change = decode(line).unwrap();
    assert_eq!(change.action(), Action::Insert);
    let Change::Insert(row) = change else {
        panic!()
    };
    assert_eq!(row.xid, Some(729));
    assert_eq!(row.lsn, lsn("0/15308E8"));
    assert!(matches!(row.schema, Cow::Borrowed("public")));
    assert_eq!(row.table, "t");
    assert!(row.identity.is_empty());
    let texts: Vec<_> = row.columns.iter().map(|c| c.text()).collect();
    assert_eq!(
        texts,
        vec![
            Some("1".into()),
            Some("a\"\\\\b\nc".into()),
            Some("{\"x\": 1}".into()),
            Some("123456789012345678901234567890.5".into()),
            Some("true".into()),
            Some("{1,NULL}".into()),
            None,
        ]
    );
    let n = &row.columns[3];
    assert_eq!(
        (n.name.as_ref(), n.type_name.as_ref(), n.type_oid),
        ("n", "numeric", Some(1700))
    );
    assert_eq!(n.value.unwrap().get(), "123456789012345678901234567890.5");
    let z = &row.columns[6];
    assert!(z.is_null());
    assert_eq!(z.value.unwrap().get(), "null");
    assert_eq!(row.pk.len(), 1);
    assert_eq!(row.pk[0].name, "id");
    assert_eq!(row.pk[0].type_oid, Some(23));
    assert!(row.omitted_unchanged_toast().is_empty());
}

#[test]
fn update_and_delete() {
    let u = r#"{"action":"U","xid":5,"lsn":"0/10","schema":"s","table":"t","columns":[{"name":"id","type":"integer","typeoid":23,"value":2},{"name":"small","type":"integer","typeoid":23,"value":1}],"identity":[{"name":"id","type":"integer","typeoid":23,"value":1},{"name":"big","type":"text","typeoid":25,"value":"xx"},{"name":"small","type":"integer","typeoid":23,"value":0}],"pk":[{"name":"id","type":"integer","typeoid":23}]}"#;
    let Change::Update(row) = decode(u).unwrap() else {
        panic!()
    };
    assert_eq!(row.columns.len(), 2);
    assert_eq!(row.identity.len(), 3);
    assert_eq!(row.identity[0].text().as_deref(), Some("1"));
    assert_eq!(row.omitted_unchanged_toast(), vec!["big"]);

    let d = r#"{"action":"D","xid":5,"lsn":"0/10","schema":"s","table":"t","identity":[{"name":"id","type":"integer","typeoid":23,"value":2}],"pk":[]}"#;
    let Change::Delete(row) = decode(d).unwrap() else {
        panic!()
    };
    assert!(row.columns.is_empty());
    assert!(row.pk.is_empty());
    assert_eq!(row.identity[0].text().as_deref(), Some("2"));
    assert!(row.omitted_unchanged_toast().is_empty());
    assert_eq!(decode(d).unwrap().row().unwrap().table, "t");
}

#[test]
fn truncate() {
    let line = r#"{"action":"T","xid":734,"timestamp":"2026-11-30 05:29:04.63516+00","lsn":"0/1532378","schema":"public","table":"t"}"#;
    let Change::Truncate(t) = decode(line).unwrap() else {
        panic!()
    };
    assert_eq!(t.xid, Some(734));
    assert_eq!(t.lsn, lsn("0/1532378"));
    assert_eq!((t.schema.as_ref(), t.table.as_ref()), ("public", "t"));
    assert!(decode(line).unwrap().row().is_none());
}

#[test]
fn messages() {
    let tx = r#"{"action":"M","xid":727,"timestamp":"2026-11-30 05:29:05+00","lsn":"0/15283D8","transactional":true,"prefix":"pfx","content":"hello \u00e9"}"#;
    let Change::Message(m) = decode(tx).unwrap() else {
        panic!()
    };
    assert_eq!(m.xid, Some(727));
    assert!(m.transactional);
    assert_eq!(m.prefix, "pfx");
    assert_eq!(m.content, "hello é");
    assert!(matches!(m.content, Cow::Owned(_)));

    let non_tx = r#"{"action":"M","xid":null,"timestamp":null,"lsn":"0/32387B0","transactional":false,"prefix":"","content":""}"#;
    let change = decode(non_tx).unwrap();
    assert_eq!(change.xid(), None);
    assert_eq!(change.timestamp(), None);
    let Change::Message(m) = change else { panic!() };
    assert!(!m.transactional);
    assert_eq!((m.prefix.as_ref(), m.content.as_ref()), ("", ""));
}

#[test]
fn escaped_names_are_unescaped() {
    let line = r#"{"action":"I","schema":"Mixed Case","table":"a\"b\\c","columns":[{"name":"Col \"Q\"","type":"text","value":"x"}]}"#;
    let Change::Insert(row) = decode(line).unwrap() else {
        panic!()
    };
    assert_eq!(row.table, "a\"b\\c");
    assert_eq!(row.columns[0].name, "Col \"Q\"");
    assert_eq!(row.columns[0].type_oid, None);
}

#[test]
fn unknown_fields_are_ignored() {
    let line = r#"{"action":"B","xid":1,"origin":7,"future":{"x":[1,2]}}"#;
    assert_eq!(decode(line).unwrap().xid(), Some(1));
}

#[test]
fn optional_type_and_value() {
    let line = r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","value":1}],"pk":[{"name":"a"}]}"#;
    let Change::Insert(row) = decode(line).unwrap() else {
        panic!()
    };
    assert_eq!(row.columns[0].type_name, "");
    assert_eq!(row.pk[0].type_name, "");
    // A pk-like entry without value decodes as an absent value.
    let line =
        r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","type":"integer"}]}"#;
    let Change::Insert(row) = decode(line).unwrap() else {
        panic!()
    };
    assert!(row.columns[0].value.is_none());
    assert!(row.columns[0].is_null());
}

#[test]
fn decode_bytes_checks_utf8() {
    assert_eq!(
        decode_bytes(br#"{"action":"C"}"#).unwrap().action(),
        Action::Commit
    );
    let err = decode_bytes(b"{\"action\":\"C\",\"timestamp\":\"\xff\"}").unwrap_err();
    assert!(matches!(err, DecodeError::InvalidUtf8(_)), "{err}");
}

fn err(line: &str) -> DecodeError {
    match decode(line) {
        Ok(c) => panic!("{line:?} decoded to {c:?}"),
        Err(e) => e,
    }
}

#[test]
fn truncated_json() {
    let full = r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","type":"text","value":"xyz"}]}"#;
    for cut in 1..full.len() {
        let e = err(&full[..cut]);
        assert!(matches!(e, DecodeError::Truncated(_)), "cut at {cut}: {e}");
        assert!(e.to_string().starts_with("truncated JSON"));
    }
    assert!(matches!(err(""), DecodeError::Truncated(_)));
}

#[test]
fn invalid_json() {
    for line in [
        "nope",
        "{action:\"B\"}",
        r#"{"action":"B"} trailing"#,
        r#"{"action":"B",}"#,
        r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","value":01}]}"#,
    ] {
        assert!(matches!(err(line), DecodeError::InvalidJson(_)), "{line}");
    }
}

#[test]
fn wrong_types() {
    for line in [
        "[]",
        "42",
        "\"B\"",
        r#"{"action":66}"#,
        r#"{"action":"B","xid":"1"}"#,
        r#"{"action":"B","xid":-1}"#,
        r#"{"action":"B","xid":4294967296}"#,
        r#"{"action":"B","lsn":1}"#,
        r#"{"action":"I","schema":"s","table":"t","columns":{}}"#,
        r#"{"action":"I","schema":"s","table":"t","columns":[{"value":1}]}"#,
        r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","typeoid":"23"}]}"#,
        r#"{"action":"I","schema":1,"table":"t","columns":[]}"#,
        r#"{"action":"M","transactional":"yes","prefix":"","content":""}"#,
        r#"{"action":"B","action":"C"}"#,
        r#"["B"]"#,
        r#"{"action":"I","schema":"s","table":"t","columns":[["a","text",25,1]]}"#,
        r#"{"action":"I","schema":"s","table":"t","columns":[{"name":"a","value":1,"value":2}]}"#,
    ] {
        let e = err(line);
        assert!(matches!(e, DecodeError::Structure(_)), "{line}: {e:?}");
        assert!(e.to_string().starts_with("unexpected wal2json structure"));
    }
}

#[test]
fn unknown_or_missing_action() {
    for (line, code) in [
        (r#"{"action":"X"}"#, "X"),
        (r#"{"action":""}"#, ""),
        (r#"{"action":"BC"}"#, "BC"),
        (r#"{"action":"b"}"#, "b"),
    ] {
        match err(line) {
            DecodeError::UnknownAction(a) => assert_eq!(a, code),
            e => panic!("{line}: {e:?}"),
        }
    }
    assert_eq!(
        err(r#"{"action":"X"}"#).to_string(),
        r#"unknown action "X""#
    );
    assert!(matches!(err("{}"), DecodeError::MissingAction));
    assert!(matches!(
        err(r#"{"action":null}"#),
        DecodeError::MissingAction
    ));
}

#[test]
fn missing_fields() {
    for (line, action, field) in [
        (
            r#"{"action":"I","table":"t","columns":[]}"#,
            Action::Insert,
            "schema",
        ),
        (
            r#"{"action":"I","schema":"s","columns":[]}"#,
            Action::Insert,
            "table",
        ),
        (
            r#"{"action":"I","schema":"s","table":"t"}"#,
            Action::Insert,
            "columns",
        ),
        (
            r#"{"action":"U","schema":"s","table":"t","identity":[]}"#,
            Action::Update,
            "columns",
        ),
        (r#"{"action":"D","schema":"s"}"#, Action::Delete, "table"),
        (r#"{"action":"T","table":"t"}"#, Action::Truncate, "schema"),
        (
            r#"{"action":"M","prefix":"p","content":"c"}"#,
            Action::Message,
            "transactional",
        ),
        (
            r#"{"action":"M","transactional":true,"content":"c"}"#,
            Action::Message,
            "prefix",
        ),
        (
            r#"{"action":"M","transactional":true,"prefix":"p","content":null}"#,
            Action::Message,
            "content",
        ),
    ] {
        match err(line) {
            DecodeError::MissingField {
                action: a,
                field: f,
            } => {
                assert_eq!((a, f), (action, field), "{line}")
            }
            e => panic!("{line}: {e:?}"),
        }
    }
    assert_eq!(
        err(r#"{"action":"T","table":"t"}"#).to_string(),
        "missing field `schema` in T (truncate) line"
    );
    // D without identity (never sent by wal2json) is accepted with an empty one.
    let Change::Delete(row) = decode(r#"{"action":"D","schema":"s","table":"t"}"#).unwrap() else {
        panic!()
    };
    assert!(row.identity.is_empty());
}

#[test]
fn bad_lsn() {
    for (line, field, value) in [
        (r#"{"action":"B","lsn":"0/ZZ"}"#, "lsn", "0/ZZ"),
        (
            r#"{"action":"B","lsn":"0/0","nextlsn":"1234"}"#,
            "nextlsn",
            "1234",
        ),
        (
            r#"{"action":"T","lsn":"","schema":"s","table":"t"}"#,
            "lsn",
            "",
        ),
        (
            r#"{"action":"M","lsn":"1/2/3","transactional":true,"prefix":"","content":""}"#,
            "lsn",
            "1/2/3",
        ),
    ] {
        match err(line) {
            DecodeError::BadLsn { field: f, value: v } => {
                assert_eq!((f, v.as_str()), (field, value))
            }
            e => panic!("{line}: {e:?}"),
        }
    }
    assert_eq!(
        err(r#"{"action":"B","lsn":"x"}"#).to_string(),
        r#"invalid LSN in field `lsn`: "x""#
    );
}

fn jsonish() -> impl Strategy<Value = String> {
    let token = prop::sample::select(vec![
        "{",
        "}",
        "[",
        "]",
        ":",
        ",",
        "\"",
        "\\",
        "\"action\"",
        "\"B\"",
        "\"C\"",
        "\"I\"",
        "\"U\"",
        "\"D\"",
        "\"T\"",
        "\"M\"",
        "\"xid\"",
        "\"lsn\"",
        "\"nextlsn\"",
        "\"0/1A\"",
        "\"schema\"",
        "\"table\"",
        "\"columns\"",
        "\"identity\"",
        "\"pk\"",
        "\"name\"",
        "\"type\"",
        "\"typeoid\"",
        "\"value\"",
        "\"transactional\"",
        "\"prefix\"",
        "\"content\"",
        "\"timestamp\"",
        "null",
        "true",
        "false",
        "0",
        "-1",
        "1e400",
        "4294967296",
        "\"\\u00e9\"",
        "\"\\ud800\"",
        "é",
        " ",
    ]);
    prop::collection::vec(token, 0..40).prop_map(|v| v.concat())
}

fn structured() -> impl Strategy<Value = String> {
    let action = prop::sample::select(vec!["B", "C", "I", "U", "D", "T", "M", "?"]);
    let val = prop::sample::select(vec![
        "null",
        "1",
        "\"s\"",
        "true",
        "[]",
        "{}",
        "\"0/1\"",
        "\"1/\"",
        "-5",
        "[{\"name\":\"a\"}]",
        "[{\"name\":\"a\",\"value\":null}]",
        "[{\"name\":1}]",
    ]);
    let key = prop::sample::select(vec![
        "xid",
        "lsn",
        "nextlsn",
        "schema",
        "table",
        "columns",
        "identity",
        "pk",
        "transactional",
        "prefix",
        "content",
        "timestamp",
    ]);
    (action, prop::collection::vec((key, val), 0..10)).prop_map(|(a, kv)| {
        let mut s = format!("{{\"action\":\"{a}\"");
        for (k, v) in kv {
            s.push_str(&format!(",\"{k}\":{v}"));
        }
        s.push('}');
        s
    })
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let line = String::from_utf8_lossy(&bytes);
        let _ = decode(&line);
        let _ = decode_bytes(&bytes);
    }

    #[test]
    fn jsonish_strings_never_panic(line in jsonish()) {
        if let Ok(change) = decode(&line) {
            let _ = (change.action(), change.xid(), change.lsn());
        }
    }

    #[test]
    fn structured_lines_never_panic(line in structured()) {
        if let Ok(change) = decode(&line) {
            if let Some(row) = change.row() {
                for c in row.columns.iter().chain(&row.identity) {
                    let _ = (c.text(), c.is_null());
                }
                let _ = row.omitted_unchanged_toast();
            }
        }
    }
}
