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
        max_concurrent_users: max,
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
    assert_eq!(rec.max_concurrent_users, None);
    let rec = ProjectRecord {
        max_concurrent_users: Some(0),
        ..rec
    };
    let text = serde_json::to_string(&rec).unwrap();
    assert_eq!(serde_json::from_str::<ProjectRecord>(&text).unwrap(), rec);
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
