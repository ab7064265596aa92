//! Broadcast (self, ack, binary kinds 3/4, v1 text, REST, across fronts) and presence.

use std::time::Duration;

use crate::support::*;
use serde_json::{json, Value};
use walcast_protocol::{BroadcastBody, Frame, Payload, RawValue, UserBroadcast, Vsn, WireMessage};

fn kind3(join_ref: &str, r: &str, topic: &str, event: &str, payload: &str) -> Vec<u8> {
    let f = Frame {
        join_ref: Some(join_ref.into()),
        ref_: Some(r.into()),
        topic: topic.into(),
        event: "broadcast".into(),
        payload: Payload::Broadcast(UserBroadcast {
            event: event.into(),
            meta: None,
            body: BroadcastBody::Json(RawValue::from_string(payload.into()).unwrap()),
        }),
    };
    match f.encode_client(Vsn::V2).unwrap() {
        WireMessage::Binary(b) => b,
        WireMessage::Text(_) => unreachable!(),
    }
}

fn decode_kind4(m: &Msg) -> (String, String, String) {
    let Msg::Binary(b) = m else {
        panic!("expected binary, got {m:?}")
    };
    let f = Frame::decode_server_binary(b).unwrap();
    let Payload::Broadcast(ub) = f.payload else {
        panic!()
    };
    let BroadcastBody::Json(body) = ub.body else {
        panic!()
    };
    (f.topic, ub.event, body.get().to_string())
}

fn bcfg(ack: bool, self_: bool) -> Value {
    json!({"broadcast": {"ack": ack, "self": self_}, "presence": {"key": "", "enabled": false}, "postgres_changes": [], "private": false})
}

#[tokio::test]
async fn broadcast_v2_binary_self_and_ack() {
    let s = start().await;
    let mut a = s.client("2.0.0").await;
    let (jra, _) = a.join("realtime:room", bcfg(true, true), None).await;
    let mut b = s.client("2.0.0").await;
    b.join("realtime:room", bcfg(false, false), None).await;
    let mut v1 = s.client("1.0.0").await;
    v1.join("realtime:room", bcfg(false, false), None).await;

    a.send_binary(kind3(&jra, "7", "realtime:room", "cursor", r#"{"x":1}"#))
        .await;
    // `a` has self and ack: the broadcast (kind 4) and an ok reply, in any order.
    let mut got_reply = false;
    let mut got_self = false;
    for _ in 0..2 {
        match a.recv().await {
            Msg::Frame(f) => {
                assert_eq!(
                    f,
                    json!([jra, "7", "realtime:room", "phx_reply", {"status":"ok","response":{}}])
                );
                got_reply = true;
            }
            m => {
                assert_eq!(
                    decode_kind4(&m),
                    ("realtime:room".into(), "cursor".into(), r#"{"x":1}"#.into())
                );
                got_self = true;
            }
        }
    }
    assert!(got_reply && got_self);
    assert_eq!(decode_kind4(&b.recv().await).1, "cursor");
    assert_eq!(
        v1.recv().await.frame(),
        &json!([null, null, "realtime:room", "broadcast", {"type":"broadcast","event":"cursor","payload":{"x":1}}])
    );

    // `b` has neither self nor ack: nothing comes back to it.
    b.send_binary(kind3("2", "8", "realtime:room", "move", "[1,2]"))
        .await;
    assert_eq!(decode_kind4(&a.recv().await).2, "[1,2]");
    b.assert_silent(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn broadcast_v1_text() {
    let s = start().await;
    let mut a = s.client("1.0.0").await;
    let (jr, _) = a.join("realtime:room", bcfg(true, true), None).await;
    let mut b = s.client("2.0.0").await;
    let (jrb, _) = b.join("realtime:room", bcfg(false, false), None).await;
    a.send(
        Some(&jr),
        Some("9"),
        "realtime:room",
        "broadcast",
        json!({"type":"broadcast","event":"hi","payload":{"n":1}}),
    )
    .await;
    let mut events = Vec::new();
    for _ in 0..2 {
        events.push(a.recv().await.frame().clone());
    }
    assert!(events
        .contains(&json!([jr, "9", "realtime:room", "phx_reply", {"status":"ok","response":{}}])));
    assert!(events.contains(&json!([null, null, "realtime:room", "broadcast", {"type":"broadcast","event":"hi","payload":{"n":1}}])));
    // A JSON push reaches a 2.0.0 socket as a text frame, as Supabase sends it.
    assert_eq!(
        b.recv().await.frame(),
        &json!([null, null, "realtime:room", "broadcast", {"type":"broadcast","event":"hi","payload":{"n":1}}])
    );
    // So does a 2.0.0 client's JSON push, locally and on another front.
    let s2 = s.replica().await;
    let mut c = s2.client("2.0.0").await;
    c.join("realtime:room", bcfg(false, false), None).await;
    b.send(
        Some(&jrb),
        Some("10"),
        "realtime:room",
        "broadcast",
        json!({"type":"broadcast","event":"json2","payload":[1]}),
    )
    .await;
    let text = json!([null, null, "realtime:room", "broadcast", {"type":"broadcast","event":"json2","payload":[1]}]);
    assert_eq!(c.recv().await.frame(), &text);
    assert_eq!(a.recv().await.frame(), &text);
}

#[tokio::test]
async fn broadcast_crosses_fronts_and_rest_api_answers_202() {
    let s = start().await;
    let s2 = s.replica().await;
    let mut a = s.client("2.0.0").await;
    let (jr, _) = a.join("realtime:room", bcfg(false, false), None).await;
    let mut b = s2.client("2.0.0").await;
    b.join("realtime:room", bcfg(false, false), None).await;
    a.send_binary(kind3(&jr, "3", "realtime:room", "ping", "{}"))
        .await;
    assert_eq!(decode_kind4(&b.recv().await).1, "ping");
    a.assert_silent(Duration::from_millis(200)).await;

    let key = anon();
    let body =
        json!({"messages":[{"topic":"room","event":"rest","payload":{"k":"v"},"private":false}]})
            .to_string();
    let (status, _) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast?apikey=x&vsn=2.0.0",
            &[
                ("apikey", &key),
                ("Authorization", &format!("Bearer {key}")),
                ("Content-Type", "application/json"),
            ],
            body.as_bytes(),
        )
        .await;
    assert_eq!(status, 202);
    // REST broadcasts reach 2.0.0 sockets as text frames (here and on the other front).
    let text = json!([null, null, "realtime:room", "broadcast", {"type":"broadcast","event":"rest","payload":{"k":"v"}}]);
    assert_eq!(a.recv().await.frame(), &text);
    assert_eq!(b.recv().await.frame(), &text);

    let (status, _) = s2
        .http(
            "POST",
            &format!("/realtime/v1/api/broadcast/room/events/single?apikey={key}"),
            &[("Content-Type", "application/json")],
            br#"{"one":1}"#,
        )
        .await;
    assert_eq!(status, 202);
    assert_eq!(a.recv().await.frame()[4]["event"], "single");
    assert_eq!(b.recv().await.frame()[4]["event"], "single");

    rest_api_refusals(&s, &key, &body).await;
    // The public channel did not get the private message.
    a.assert_silent(Duration::from_millis(200)).await;
}

/// The REST broadcast API on `s`: a private message is dropped (202) with the anon `key`
/// and sent with a service_role key (public channels must not get it), a bad apikey is 401 (for
/// `body`, a valid public request), a bad body 400.
async fn rest_api_refusals(s: &Server, key: &str, body: &str) {
    let private =
        json!({"messages":[{"topic":"room","event":"e","payload":{},"private":true}]}).to_string();
    let (status, text) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast",
            &[("apikey", key)],
            private.as_bytes(),
        )
        .await;
    // Refused by the policies (this front has no worker to ask: refused), hence dropped
    // with 202 as Supabase does; the public channel must not get it either (see below).
    assert_eq!(status, 202, "{text}");
    let service = token(json!({"role":"service_role","exp": now() + 60}));
    let (status, _) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast",
            &[("apikey", &service)],
            private.as_bytes(),
        )
        .await;
    assert_eq!(status, 202);
    let (status, text) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast",
            &[("apikey", "nope")],
            body.as_bytes(),
        )
        .await;
    assert_eq!(status, 401);
    assert!(text.contains("\"error\""));
    let (status, _) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast",
            &[("apikey", key)],
            b"{bad",
        )
        .await;
    assert_eq!(status, 400);
    // Bounded: one request may not ask 30,000 private-topic checks of the worker.
    let many = |n: usize, private: bool| {
        let messages: Vec<_> = (0..n)
            .map(|i| json!({"topic": format!("room{i}"), "event": "e", "payload": {}, "private": private}))
            .collect();
        json!({ "messages": messages }).to_string()
    };
    for (body, who) in [(many(21, true), key), (many(1001, false), service.as_str())] {
        let (status, text) = s
            .http(
                "POST",
                "/realtime/v1/api/broadcast",
                &[("apikey", who)],
                body.as_bytes(),
            )
            .await;
        assert_eq!(status, 413, "{text}");
        assert!(text.contains("too many"), "{text}");
    }
    let (status, _) = s
        .http(
            "POST",
            "/realtime/v1/api/broadcast",
            &[("apikey", &service)],
            many(21, true).as_bytes(),
        )
        .await;
    assert_eq!(status, 202, "service_role sends without checks");
}

#[tokio::test]
async fn presence_track_diff_state_and_leave() {
    let s = start().await;
    let pcfg = |key: &str| json!({"broadcast": {"ack": false, "self": false}, "presence": {"key": key, "enabled": true}, "postgres_changes": [], "private": false});
    let mut a = s.client("2.0.0").await;
    let (jra, _) = a.join("realtime:room", pcfg("ann"), None).await;
    let st = a.recv().await;
    assert_eq!(
        st.frame(),
        &json!([jra, null, "realtime:room", "presence_state", {}])
    );

    a.send(
        Some(&jra),
        Some("8"),
        "realtime:room",
        "presence",
        json!({"type":"presence","event":"track","payload":{"user":"ann"}}),
    )
    .await;
    let reply = a.recv().await;
    assert_eq!(
        reply.frame(),
        &json!([jra, "8", "realtime:room", "phx_reply", {"status":"ok","response":{}}])
    );
    let diff = a.recv().await;
    assert_eq!(diff.event(), "presence_diff");
    assert_eq!(diff.frame()[0], json!(null));
    let metas = &diff.payload()["joins"]["ann"]["metas"];
    assert_eq!(metas[0]["user"], "ann");
    assert!(metas[0]["phx_ref"].is_string());
    assert_eq!(diff.payload()["leaves"], json!({}));

    // A later joiner gets the state with its own join_ref.
    let mut b = s.client("1.0.0").await;
    let (jrb, _) = b.join("realtime:room", pcfg(""), None).await;
    let st = b.recv().await;
    assert_eq!(st.event(), "presence_state");
    assert_eq!(st.frame()[0], json!(jrb));
    assert_eq!(st.payload()["ann"]["metas"][0]["user"], "ann");

    // Bad payload.
    a.send(
        Some(&jra),
        Some("9"),
        "realtime:room",
        "presence",
        json!({"type":"presence","event":"track","payload":5}),
    )
    .await;
    assert_eq!(
        a.recv().await.payload()["response"]["reason"],
        "Presence track payload must be a map"
    );

    // Leaving untracks: b sees the leave.
    a.send(
        Some(&jra),
        Some("10"),
        "realtime:room",
        "phx_leave",
        json!({}),
    )
    .await;
    let diff = b.recv_event("presence_diff").await;
    assert_eq!(diff.payload()["leaves"]["ann"]["metas"][0]["user"], "ann");
    assert_eq!(diff.payload()["joins"], json!({}));
}

/// Presence is bounded: a payload over 8 KiB shuts the channel ("Track message
/// size exceeded"), and a socket may send 10 presence events per second after a burst of
/// 20 (each is a write every front shares), beyond which the channel is shut ("Client
/// presence rate limit exceeded"); the refused ones reach no other member.
#[tokio::test]
async fn presence_payload_size_and_event_rate_are_bounded() {
    let s = start().await;
    let pcfg = json!({"broadcast": {"ack": false, "self": false}, "presence": {"key": "", "enabled": true}, "postgres_changes": [], "private": false});
    let mut a = s.client("1.0.0").await;
    let (jra, _) = a.join("realtime:busy", pcfg.clone(), None).await;
    assert_eq!(a.recv().await.event(), "presence_state");
    let mut b = s.client("1.0.0").await;
    let (_jrb, _) = b.join("realtime:busy", pcfg.clone(), None).await;
    assert_eq!(b.recv().await.event(), "presence_state");
    let track = |n: usize, pad: usize| json!({"type":"presence","event":"track","payload":{"n": n, "pad": "x".repeat(pad)}});

    a.send(
        Some(&jra),
        Some("big"),
        "realtime:busy",
        "presence",
        track(0, 9000),
    )
    .await;
    // Over 8 KiB: the channel is shut, as Supabase shuts it.
    a.expect_shut("realtime:busy", "Track message size exceeded")
        .await;
    let (jra, _) = a.join("realtime:busy", pcfg.clone(), None).await;
    assert_eq!(a.recv().await.event(), "presence_state");

    for n in 0..40 {
        let r = format!("t{n}");
        a.send(
            Some(&jra),
            Some(&r),
            "realtime:busy",
            "presence",
            track(n, 10),
        )
        .await;
    }
    // The burst of 20 passes, then the channel is shut (Supabase's
    // ClientPresenceRateLimitReached); what follows is for a topic no longer joined.
    let ok = a
        .expect_shut("realtime:busy", "Client presence rate limit exceeded")
        .await;
    assert!(
        (15..=22).contains(&ok),
        "{ok} tracks accepted in a burst of 40 (burst 20, 10/s)"
    );
    // b saw no diff for the oversized payload and at most the accepted ones (and the
    // leave of the shut channel).
    let mut diffs = 0;
    while let Some(f) = b.try_recv(Duration::from_millis(300)).await {
        if f.event() == "presence_diff" {
            assert!(!format!("{f:?}").contains(&"x".repeat(9000)));
            diffs += 1;
        }
    }
    assert!(diffs <= ok + 1, "{diffs} diffs for {ok} accepted tracks");
}
