//! Property tests: frame round trips and decoders that never panic.

use bytes::Bytes;
use proptest::prelude::*;
use serde_json::Value;
use walcast_protocol::binary::{
    decode_client_push, decode_server_broadcast, encode_client_push, encode_server_broadcast,
};
use walcast_protocol::{
    BinaryError, BroadcastBody, ClientMessage, Frame, Payload, RawValue, UserBroadcast, Vsn,
};

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        "\\PC{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("\\PC{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn raw_json() -> impl Strategy<Value = Box<RawValue>> {
    json_value().prop_map(|v| RawValue::from_string(v.to_string()).unwrap())
}

fn raw_object() -> impl Strategy<Value = Box<RawValue>> {
    prop::collection::btree_map("\\PC{0,6}", json_value(), 0..3).prop_map(|m| {
        let v = Value::Object(m.into_iter().collect());
        RawValue::from_string(v.to_string()).unwrap()
    })
}

/// Strings that fit a one-byte length (at most 60 chars of at most 4 bytes).
fn short() -> impl Strategy<Value = String> {
    "\\PC{0,60}"
}

fn non_empty_short() -> impl Strategy<Value = Option<String>> {
    prop::option::of("\\PC{1,60}")
}

fn body() -> impl Strategy<Value = BroadcastBody> {
    prop_oneof![
        raw_json().prop_map(BroadcastBody::Json),
        prop::collection::vec(any::<u8>(), 0..64)
            .prop_map(|b| BroadcastBody::Binary(Bytes::from(b))),
    ]
}

fn user_broadcast() -> impl Strategy<Value = UserBroadcast> {
    let meta = raw_object().prop_filter("meta fits one length byte", |m| m.get().len() <= 255);
    (short(), prop::option::of(meta), body()).prop_map(|(event, meta, body)| UserBroadcast {
        event,
        meta,
        body,
    })
}

fn vsn() -> impl Strategy<Value = Vsn> {
    prop_oneof![Just(Vsn::V1), Just(Vsn::V2)]
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn text_round_trip(
        vsn in vsn(),
        join_ref in prop::option::of("\\PC{0,8}"),
        ref_ in prop::option::of("\\PC{0,8}"),
        topic in "\\PC{0,20}",
        event in "\\PC{0,12}",
        payload in raw_json(),
    ) {
        let f = Frame { join_ref, ref_, topic, event, payload: Payload::Json(payload) };
        let text = f.encode_text(vsn).unwrap();
        prop_assert_eq!(Frame::decode_text(&text, vsn).unwrap(), f);
    }

    #[test]
    fn kind3_round_trip(
        join_ref in non_empty_short(),
        ref_ in non_empty_short(),
        topic in short(),
        b in user_broadcast(),
    ) {
        let f = Frame {
            join_ref,
            ref_,
            topic,
            event: "broadcast".into(),
            payload: Payload::Broadcast(b),
        };
        let bytes = encode_client_push(&f).unwrap();
        prop_assert_eq!(decode_client_push(&bytes).unwrap(), f);
    }

    #[test]
    fn kind4_round_trip(topic in short(), b in user_broadcast()) {
        let bytes = encode_server_broadcast(&topic, &b).unwrap();
        let f = decode_server_broadcast(&bytes).unwrap();
        prop_assert_eq!(f.topic, topic);
        prop_assert_eq!(f.event, "broadcast");
        prop_assert_eq!(f.payload, Payload::Broadcast(b));
    }

    #[test]
    fn long_strings_rejected(extra in 0usize..100, b in user_broadcast()) {
        let topic = "t".repeat(256 + extra);
        prop_assert!(
            matches!(
                encode_server_broadcast(&topic, &b),
                Err(BinaryError::TooLong { field: "topic", .. })
            ),
            "topic of {} bytes accepted",
            topic.len()
        );
    }

    #[test]
    fn binary_decoders_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..96)) {
        let _ = decode_client_push(&bytes);
        let _ = decode_server_broadcast(&bytes);
        let _ = Frame::decode_client_binary(&bytes, Vsn::V2);
        if let Ok(f) = Frame::decode_client_binary(&bytes, Vsn::V2) {
            let _ = ClientMessage::parse(&f);
        }
    }

    #[test]
    fn kind3_header_fuzz(
        header in prop::collection::vec(any::<u8>(), 6),
        tail in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let mut bytes = vec![3u8];
        bytes.extend(header);
        bytes.extend(tail);
        let _ = decode_client_push(&bytes);
    }

    #[test]
    fn text_decoder_never_panics(text in "\\PC{0,64}", v in vsn()) {
        if let Ok(f) = Frame::decode_text(&text, v) {
            let _ = ClientMessage::parse(&f);
        }
    }

    #[test]
    fn message_parse_never_panics(
        event in prop_oneof![
            Just("phx_join"), Just("phx_leave"), Just("access_token"),
            Just("broadcast"), Just("presence"), Just("heartbeat"), Just("other"),
        ],
        payload in json_value(),
    ) {
        let text = format!("[\"1\",\"2\",\"realtime:x\",\"{event}\",{payload}]");
        let f = Frame::decode_text(&text, Vsn::V2).unwrap();
        let _ = ClientMessage::parse(&f);
    }

    #[test]
    fn join_config_shapes_never_panic(config in json_value(), token in json_value()) {
        let text = format!(
            "[\"1\",\"1\",\"realtime:x\",\"phx_join\",{{\"config\":{config},\"access_token\":{token}}}]"
        );
        let f = Frame::decode_text(&text, Vsn::V2).unwrap();
        let _ = ClientMessage::parse(&f);
    }
}
