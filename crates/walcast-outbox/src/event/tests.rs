use std::borrow::Cow;

use proptest::prelude::*;
use serde_json::value::RawValue;
use walcast_wal2json::{Column, Lsn};

use super::*;

fn raw(json: &str) -> Box<RawValue> {
    RawValue::from_string(json.to_string()).unwrap()
}

fn column<'a>(name: &'a str, value: &'a RawValue) -> Column<'a> {
    Column {
        name: Cow::Borrowed(name),
        type_name: Cow::Borrowed(""),
        type_oid: None,
        value: Some(value),
    }
}

const AT: &str = "2026-12-01T00:00:00.000Z";

#[test]
fn an_emit_message_becomes_an_event() {
    let content = r#"{"id":"6b1c","project":"default","topic":"orders.created","key":"o-1",
        "payload":{"total": 12.50, "items":[1,2]},"headers":{"trace":"abc","n":1,"gone":null}}"#;
    let ev = OutboxEvent::from_message(content, Lsn(0x10), AT).unwrap();
    assert_eq!(ev.subject(), "walcast.outbox.default.orders.created");
    assert_eq!(
        ev.payload, r#"{"total": 12.50, "items":[1,2]}"#,
        "payload bytes kept"
    );
    assert_eq!(
        ev.message_headers(),
        vec![
            ("Nats-Msg-Id", "6b1c".to_string()),
            ("Walcast-Event-Id", "6b1c".to_string()),
            ("Walcast-Commit-Lsn", "0/10".to_string()),
            ("Walcast-Project", "default".to_string()),
            ("Walcast-Topic", "orders.created".to_string()),
            ("Walcast-Key", "o-1".to_string()),
            ("n", "1".to_string()),
            ("trace", "abc".to_string()),
        ]
    );
}

#[test]
fn headers_visited_are_the_message_headers_and_the_subject_length_its_length() {
    for (key, headers) in [("\"o-1\"", r#"{"trace":"abc","n":1}"#), ("null", "null")] {
        let content = format!(
            r#"{{"id":"6b1c","project":"default","topic":"orders.created","key":{key},"payload":1,"headers":{headers}}}"#
        );
        let ev = OutboxEvent::from_message(&content, Lsn(0x10), AT).unwrap();
        let mut visited = Vec::new();
        ev.for_each_header(|n, v| {
            visited.push((n.as_str().to_string(), v.to_string()));
            Ok::<(), ()>(())
        })
        .unwrap();
        let listed: Vec<(String, String)> = ev
            .message_headers()
            .into_iter()
            .map(|(n, v)| (n.to_string(), v))
            .collect();
        assert_eq!(visited, listed);
        assert_eq!(ev.subject_len(), ev.subject().len());
    }
}

#[test]
fn bad_messages_are_refused_with_their_reason() {
    let msg = |topic: &str, headers: &str| {
        format!(
            r#"{{"id":"1","project":"p","topic":{topic},"key":null,"payload":1,"headers":{headers}}}"#
        )
    };
    let err = |m: String| OutboxEvent::from_message(&m, Lsn(1), AT).unwrap_err();
    assert!(matches!(err("nope".into()), EventError::Malformed(_)));
    assert_eq!(
        err(msg(r#""a..b""#, "null")),
        EventError::Topic("a..b".into())
    );
    assert_eq!(
        err(msg(r#""a b""#, "null")),
        EventError::Topic("a b".into())
    );
    assert!(matches!(
        err(msg(r#""t""#, r#"{"Nats-Msg-Id":"x"}"#)),
        EventError::Header { .. }
    ));
    assert!(matches!(
        err(msg(r#""t""#, r#"{"walcast-key":"x"}"#)),
        EventError::Header { .. }
    ));
    assert!(matches!(
        err(msg(r#""t""#, r#"{"a b":"x"}"#)),
        EventError::Header { .. }
    ));
    assert!(matches!(
        err(msg(r#""t""#, r#"{"a":"x\ny"}"#)),
        EventError::Header { .. }
    ));
}

#[test]
fn an_outbox_row_becomes_an_event() {
    let (id, ty, agg, et, sv, payload, headers, at) = (
        raw(r#""0f0e""#),
        raw(r#""orders""#),
        raw(r#""o-7""#),
        raw(r#""created""#),
        raw("2"),
        raw(&json_text(r#"{"a": 1}"#)),
        raw(&json_text(r#"{"trace": "t1"}"#)),
        raw(r#""2026-12-01 10:00:00+00""#),
    );
    let cols = vec![
        column("id", &id),
        column("aggregate_type", &ty),
        column("aggregate_id", &agg),
        column("event_type", &et),
        column("schema_version", &sv),
        column("payload", &payload),
        column("headers", &headers),
        column("occurred_at", &at),
    ];
    let ev = OutboxEvent::from_row("p1", &cols, Lsn(7), AT).unwrap();
    assert_eq!(ev.subject(), "walcast.outbox.p1.orders");
    assert_eq!(ev.key.as_deref(), Some("o-7"));
    assert_eq!(ev.payload, r#"{"a": 1}"#);
    assert_eq!(
        ev.headers,
        vec![
            ("trace".to_string(), "t1".to_string()),
            ("Walcast-Event-Type".to_string(), "created".to_string()),
            ("Walcast-Schema-Version".to_string(), "2".to_string()),
            (
                "Walcast-Occurred-At".to_string(),
                "2026-12-01 10:00:00+00".to_string()
            ),
        ]
    );
    let null = raw("null");
    let without_payload = vec![
        column("id", &id),
        column("aggregate_type", &ty),
        column("payload", &null),
    ];
    assert!(matches!(
        OutboxEvent::from_row("p1", &without_payload, Lsn(7), AT),
        Err(EventError::Malformed(_))
    ));
}

/// `text` as a JSON string (a `text` column's value as wal2json writes it).
fn json_text(text: &str) -> String {
    serde_json::Value::from(text).to_string()
}

/// An outbox row with these event type, key and id (JSON), other columns plain.
fn row_event(event_type: &str, key: &str, id: &str) -> Result<OutboxEvent, EventError> {
    let (id, ty, agg, et, payload) = (
        raw(id),
        raw(r#""orders""#),
        raw(key),
        raw(event_type),
        raw(r#""{}""#),
    );
    let cols = vec![
        column("id", &id),
        column("aggregate_type", &ty),
        column("aggregate_id", &agg),
        column("event_type", &et),
        column("payload", &payload),
    ];
    OutboxEvent::from_row("p1", &cols, Lsn(7), AT)
}

#[test]
fn every_header_is_checked_before_it_meets_nats() {
    assert!(row_event(r#""created""#, r#""k""#, r#""1""#).is_ok());
    for (et, key, id) in [
        (r#""created\nX-Injected: 1""#, r#""k""#, r#""1""#),
        (r#""created\r""#, r#""k""#, r#""1""#),
        (r#""a\u0000b""#, r#""k""#, r#""1""#),
        (r#""tab\there""#, r#""k""#, r#""1""#),
        (r#""del\u007f""#, r#""k""#, r#""1""#),
        (r#""created""#, r#""k\nz""#, r#""1""#),
        (r#""created""#, r#""k""#, r#""1\n2""#),
    ] {
        let e = row_event(et, key, id).unwrap_err();
        assert!(
            matches!(e, EventError::Header { .. }),
            "{et} {key} {id}: {e:?}"
        );
    }
    let long = format!("\"{}\"", "x".repeat(MAX_HEADER_VALUE + 1));
    assert!(matches!(
        row_event(&long, r#""k""#, r#""1""#),
        Err(EventError::Header { .. })
    ));
    // Non-ASCII text is fine in a value (UTF-8 on the wire).
    assert!(row_event(r#""créé""#, r#""k""#, r#""1""#).is_ok());
    let mut ev = row_event(r#""created""#, r#""k""#, r#""1""#).unwrap();
    ev.topic = "t".repeat(MAX_TOPIC + 1);
    assert!(matches!(ev.validate(), Err(EventError::Topic(_))));
    ev.topic = "t".into();
    ev.project = "p".repeat(MAX_PROJECT + 1);
    assert!(matches!(ev.validate(), Err(EventError::Project(_))));
}

proptest! {
    /// Whatever event passes validation, async-nats takes its headers without panicking.
    #[test]
    fn a_valid_event_never_panics_async_nats(value in "\\PC{0,40}|[\\x00-\\x7f]{0,40}") {
        let json = serde_json::to_string(&value).unwrap();
        if let Ok(ev) = row_event(&json, &json, r#""1""#) {
            let mut headers = async_nats::HeaderMap::new();
            for (name, value) in ev.message_headers() {
                headers.insert(name, value.as_str());
            }
        }
    }
}

#[test]
fn partitions_name_their_outbox() {
    assert_eq!(partition_outbox("o17_20261201"), Some(17));
    assert_eq!(partition_outbox("o1_2026120"), None);
    assert_eq!(partition_outbox("x1_20261201"), None);
    assert_eq!(partition_outbox("o_20261201"), None);
}

proptest! {
    #[test]
    fn topics_are_valid_exactly_when_their_subject_has_plain_tokens(topic in "[a-z._ -]{0,12}") {
        let ok = valid_topic(&topic);
        let expect = !topic.is_empty()
            && topic.split('.').all(|t| !t.is_empty() && !t.contains(' '));
        prop_assert_eq!(ok, expect);
    }
}
