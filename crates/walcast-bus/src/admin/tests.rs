use super::server::{fit_replay, fit_rows};
use super::*;

#[test]
fn wire_forms_are_stable() {
    let req = AdminRequest::SetRealtime {
        project: "p".into(),
        table: "t".into(),
        enabled: true,
    };
    let text = serde_json::to_string(&req).unwrap();
    assert_eq!(
        text,
        r#"{"op":"set_realtime","project":"p","table":"t","enabled":true}"#
    );
    assert_eq!(serde_json::from_str::<AdminRequest>(&text).unwrap(), req);
    assert_eq!(
        serde_json::to_string(&AdminRequest::Projects).unwrap(),
        r#"{"op":"projects"}"#
    );
    let err = Response::Error(AdminError::new(AdminErrorKind::NoPrimaryKey, "no pk"));
    let text = serde_json::to_string(&err).unwrap();
    assert_eq!(
        text,
        r#"{"error":{"kind":"no_primary_key","message":"no pk"}}"#
    );
    assert_eq!(serde_json::from_str::<Response>(&text).unwrap(), err);
    let ok = Response::Ok(AdminReply::Tables {
        tables: vec![TableName {
            schema: "s".into(),
            table: "t".into(),
        }],
    });
    let text = serde_json::to_string(&ok).unwrap();
    assert_eq!(serde_json::from_str::<Response>(&text).unwrap(), ok);
}

#[test]
fn a_limit_is_absent_null_or_a_number_on_the_wire() {
    let upd = |max| AdminRequest::ProjectUpdate {
        id: "p".into(),
        name: None,
        private_only: None,
        suspended: None,
        limits: LimitChanges {
            max_concurrent_users: max,
            ..LimitChanges::default()
        },
    };
    for (max, text) in [
        (None, r#"{"op":"project_update","id":"p"}"#),
        (
            Some(None),
            r#"{"op":"project_update","id":"p","max_concurrent_users":null}"#,
        ),
        (
            Some(Some(7)),
            r#"{"op":"project_update","id":"p","max_concurrent_users":7}"#,
        ),
    ] {
        assert_eq!(serde_json::to_string(&upd(max)).unwrap(), text);
        assert_eq!(
            serde_json::from_str::<AdminRequest>(text).unwrap(),
            upd(max)
        );
    }
    let negative = r#"{"op":"project_update","id":"p","max_concurrent_users":-1}"#;
    assert!(serde_json::from_str::<AdminRequest>(negative).is_err());
    // An older worker's record has no limit: the default.
    let old = r#"{"id":"p","name":"n","schema":"s","jwt_secret":"x"}"#;
    let rec: ProjectRecord = serde_json::from_str(old).unwrap();
    assert_eq!(rec.limits.max_concurrent_users, None);
    let rec = ProjectRecord {
        limits: ProjectLimits {
            max_concurrent_users: Some(0),
            ..ProjectLimits::default()
        },
        ..rec
    };
    let text = serde_json::to_string(&rec).unwrap();
    assert_eq!(serde_json::from_str::<ProjectRecord>(&text).unwrap(), rec);
    // The record of a worker before the other limits: the same top-level key.
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["max_concurrent_users"], 0, "{text}");
    let with_limit =
        r#"{"id":"p","name":"n","schema":"s","jwt_secret":"x","max_concurrent_users":5}"#;
    let rec: ProjectRecord = serde_json::from_str(with_limit).unwrap();
    assert_eq!(rec.limits.max_concurrent_users, Some(5));
}

/// Every limit, one at a time: each a top-level key (flattened), absent / null / a
/// number on an update, absent / a number on a create and in a record; a negative, a
/// fraction, a string or a number beyond `u32` refused.
#[test]
fn every_limit_is_a_flattened_top_level_field() {
    for (i, field) in ProjectLimits::FIELDS.into_iter().enumerate() {
        let one = |v: Option<Option<u32>>| {
            let mut a = [None; LIMITS];
            a[i] = v;
            LimitChanges::from_array(a)
        };
        let upd = |limits| AdminRequest::ProjectUpdate {
            id: "p".into(),
            name: Some("n".into()),
            private_only: None,
            suspended: Some(true),
            limits,
        };
        for (v, json) in [
            (None, None),
            (Some(None), Some("null")),
            (Some(Some(9)), Some("9")),
        ] {
            let tail = json
                .map(|j| format!(",\"{field}\":{j}"))
                .unwrap_or_default();
            let text =
                format!(r#"{{"op":"project_update","id":"p","name":"n","suspended":true{tail}}}"#);
            assert_eq!(serde_json::to_string(&upd(one(v))).unwrap(), text);
            assert_eq!(
                serde_json::from_str::<AdminRequest>(&text).unwrap(),
                upd(one(v))
            );
        }
        for bad in ["-1", "1.5", "\"3\"", "4294967296", "true", "[]"] {
            let text = format!(r#"{{"op":"project_update","id":"p","{field}":{bad}}}"#);
            assert!(
                serde_json::from_str::<AdminRequest>(&text).is_err(),
                "{text}"
            );
            let text = format!(r#"{{"op":"project_create","name":"n","{field}":{bad}}}"#);
            assert!(
                serde_json::from_str::<AdminRequest>(&text).is_err(),
                "{text}"
            );
        }
        let mut a = [None; LIMITS];
        a[i] = Some(u32::MAX);
        let limits = ProjectLimits::from_array(a);
        let create = AdminRequest::ProjectCreate {
            name: "n".into(),
            private_only: true,
            source: None,
            limits,
        };
        let text = serde_json::to_string(&create).unwrap();
        assert_eq!(
            text,
            format!(
                r#"{{"op":"project_create","name":"n","private_only":true,"{field}":4294967295}}"#
            )
        );
        assert_eq!(serde_json::from_str::<AdminRequest>(&text).unwrap(), create);
        assert_eq!(limits.too_large(), Some(field));
        assert_eq!(LimitChanges::set(&limits).too_large(), Some(field));
        let rec = ProjectRecord {
            id: "p".into(),
            limits,
            ..ProjectRecord::default()
        };
        let v = serde_json::to_value(&rec).unwrap();
        assert_eq!(v[field], u32::MAX, "{v}");
        assert_eq!(serde_json::from_value::<ProjectRecord>(v).unwrap(), rec);
    }
    // A create without limits (an older front's) has none.
    let old = r#"{"op":"project_create","name":"n"}"#;
    let AdminRequest::ProjectCreate { limits, .. } = serde_json::from_str(old).unwrap() else {
        panic!()
    };
    assert_eq!(limits, ProjectLimits::default());
}

#[test]
fn changes_apply_field_by_field_and_defaults_fill_the_gaps() {
    let current = ProjectLimits {
        max_concurrent_users: Some(5),
        max_joins_per_second: Some(6),
        ..ProjectLimits::default()
    };
    let changes = LimitChanges {
        max_concurrent_users: Some(None),
        max_events_per_second: Some(Some(7)),
        ..LimitChanges::default()
    };
    assert!(!changes.is_empty() && LimitChanges::default().is_empty());
    let now = changes.apply(&current);
    assert_eq!(
        now,
        ProjectLimits {
            max_joins_per_second: Some(6),
            max_events_per_second: Some(7),
            ..ProjectLimits::default()
        }
    );
    let defaults = ProjectLimits::from_array([Some(1); LIMITS]);
    assert_eq!(
        now.or(&defaults).to_array(),
        [
            Some(1),
            Some(6),
            Some(1),
            Some(7),
            Some(1),
            Some(1),
            Some(1)
        ]
    );
    let all: [Option<u32>; LIMITS] = std::array::from_fn(|i| Some(i as u32));
    assert_eq!(ProjectLimits::from_array(all).to_array(), all);
    let ch: [Option<Option<u32>>; LIMITS] = std::array::from_fn(|i| Some(Some(i as u32)));
    assert_eq!(LimitChanges::from_array(ch).to_array(), ch);
    assert_eq!(
        ProjectLimits::from_array([Some(i32::MAX as u32); LIMITS]).too_large(),
        None
    );
}

#[test]
fn a_replay_is_cut_to_fit_one_message() {
    let msg = |n: usize| StoredBroadcast {
        id: n.to_string(),
        event: "e".into(),
        payload: "null".into(),
        binary: Some(vec![n as u8; 3000]),
    };
    let replay = |n| {
        Response::Ok(AdminReply::Replayed {
            messages: (0..n).map(msg).collect(),
        })
    };
    let mut r = replay(25);
    assert_eq!(fit_replay(&mut r, 10_000), 23, "two of ~4 KB each fit");
    let text = serde_json::to_vec(&r).unwrap();
    assert!(text.len() <= 10_000, "{}", text.len());
    let Response::Ok(AdminReply::Replayed { messages }) = &r else {
        panic!("{r:?}")
    };
    assert_eq!(
        messages.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(),
        ["0", "1"]
    );
    let mut all = replay(25);
    assert_eq!(fit_replay(&mut all, 1 << 20), 0);
    assert_eq!(all, replay(25));
    let mut other = Response::Ok(AdminReply::Authorized { allowed: true });
    assert_eq!(fit_replay(&mut other, 0), 0);
}

#[test]
fn replayed_bytes_cross_as_base64_exactly() {
    let all: Vec<u8> = (0..=255).collect();
    let msg = |binary| StoredBroadcast {
        id: "i".into(),
        event: "e".into(),
        payload: "null".into(),
        binary,
    };
    for bytes in [Some(all), Some(Vec::new()), None] {
        let m = msg(bytes);
        let text = serde_json::to_string(&m).unwrap();
        assert_eq!(serde_json::from_str::<StoredBroadcast>(&text).unwrap(), m);
    }
    let text = serde_json::to_string(&msg(Some(vec![0xde, 0xad, 0, 0xff]))).unwrap();
    assert_eq!(
        text,
        r#"{"id":"i","event":"e","payload":"null","binary":"3q0A/w=="}"#
    );
    // A JSON message of an older worker: no `binary`.
    let old = r#"{"id":"i","event":"e","payload":"{}"}"#;
    assert_eq!(
        serde_json::from_str::<StoredBroadcast>(old).unwrap().binary,
        None
    );
    let bad = r#"{"id":"i","event":"e","payload":"null","binary":"%%"}"#;
    assert!(serde_json::from_str::<StoredBroadcast>(bad).is_err());
}

#[test]
fn snapshot_rows_over_one_message_are_refused_never_cut() {
    let rows = |n: usize| {
        Response::Ok(AdminReply::SnapshotRows(SnapshotRows {
            snapshot: "10:20:15".into(),
            lsn: walcast_core::Lsn(0x1530AD8),
            columns: vec![crate::ColumnInfo {
                name: "id".into(),
                type_name: "int4".into(),
            }],
            rows: (0..n).map(|i| format!("{{\"id\":{i}}}")).collect(),
        }))
    };
    let mut small = rows(10);
    fit_rows(&mut small, 10_000);
    assert_eq!(small, rows(10), "fits: unchanged");
    let text = serde_json::to_string(&small).unwrap();
    let back: Response = serde_json::from_str(&text).unwrap();
    assert_eq!(back, rows(10), "round trip: {text}");
    let mut big = rows(2000);
    fit_rows(&mut big, 10_000);
    let Response::Error(e) = &big else {
        panic!("not refused")
    };
    assert_eq!(e.kind, AdminErrorKind::TooLarge);
    assert!(e.message.contains("2000 rows"), "{}", e.message);
}

#[test]
fn the_unreadable_note_names_the_roles_and_the_grant_quoted() {
    assert_eq!(unreadable_note("public", "todos", &[]), None);
    let note = unreadable_note(
        "public",
        "to\"dos",
        &["anon".into(), "authenticated".into()],
    )
    .unwrap();
    assert!(
        note.starts_with("anon and authenticated may not SELECT \"public\".\"to\"\"dos\""),
        "{note}"
    );
    assert!(
        note.ends_with("GRANT SELECT ON \"public\".\"to\"\"dos\" TO \"anon\", \"authenticated\";"),
        "{note}"
    );
}
