//! Hostile input and slow consumers: the right error, and nobody else is disturbed.

use std::time::Duration;

use crate::support::*;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message as WsMessage;
use walcast_front::FrontConfig;

#[tokio::test]
async fn malformed_frames_get_error_replies_and_the_socket_lives() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.send_text("{not json").await;
    let m = c.recv().await;
    assert_eq!(m.frame()[2], "phoenix");
    assert_eq!(m.payload()["status"], "error");
    assert!(m.payload()["response"]["reason"]
        .as_str()
        .unwrap()
        .starts_with("MalformedMessage: "));
    // Wrong shape but refs recoverable: the reply carries them.
    c.send_text(r#"["1","2","realtime:x","phx_join"]"#).await;
    let m = c.recv().await;
    assert_eq!(m.frame()[0], "1");
    assert_eq!(m.frame()[1], "2");
    assert_eq!(m.frame()[2], "realtime:x");
    // Binary garbage (not kind 3, truncated kind 3).
    c.send_binary(vec![0xff, 0, 1, 2]).await;
    assert!(c.recv().await.payload()["response"]["reason"]
        .as_str()
        .unwrap()
        .starts_with("MalformedMessage"));
    c.send_binary(vec![3, 10, 10]).await;
    assert_eq!(c.recv().await.payload()["status"], "error");
    // A join with a malformed config.
    c.send(
        Some("5"),
        Some("5"),
        "realtime:x",
        "phx_join",
        json!({"config": {"postgres_changes": [{"schema": 1}]}}),
    )
    .await;
    let m = c.recv().await;
    assert!(m.payload()["response"]["reason"]
        .as_str()
        .unwrap()
        .starts_with("InvalidJoinPayload: "));
    // Unknown event on a joined channel.
    let (jr, _) = c.join("realtime:y", json!({}), None).await;
    c.send(
        Some(&jr),
        Some("20"),
        "realtime:y",
        "bogus_event",
        json!({}),
    )
    .await;
    assert_eq!(
        c.recv().await.payload()["response"]["reason"],
        "UnknownEvent: unknown event `bogus_event`"
    );
    c.heartbeat_ok().await;

    let mut v1 = s.client("1.0.0").await;
    v1.send_binary(vec![3, 1, 1]).await;
    assert!(v1.recv().await.payload()["response"]["reason"]
        .as_str()
        .unwrap()
        .contains("1.0.0"));
    v1.send_text("[1,2]").await;
    assert_eq!(v1.recv().await.payload()["status"], "error");
    v1.heartbeat_ok().await;
}

#[tokio::test]
async fn oversized_frames_close_with_1009_others_unaffected() {
    let s = start_with(FrontConfig {
        max_frame_bytes: 64 * 1024,
        ..FrontConfig::default()
    })
    .await;
    let mut other = joined_to_t(&s).await;
    let mut c = s.client("2.0.0").await;
    let big = "x".repeat(100 * 1024);
    c.send(None, Some("1"), "phoenix", "heartbeat", json!({"pad": big}))
        .await;
    match c.recv().await {
        Msg::Close(code, reason) => {
            assert_eq!(code, 1009);
            assert!(reason.contains("frame too large"), "{reason}");
        }
        m => panic!("expected close, got {m:?}"),
    }
    // Far beyond the hard limit too.
    let mut c2 = s.client("2.0.0").await;
    let huge = "y".repeat(1024 * 1024);
    let _ = tokio::time::timeout(TIMEOUT, async {
        use futures_util::SinkExt;
        let _ = c2
            .ws
            .send(tokio_tungstenite::tungstenite::Message::Text(huge.into()))
            .await;
    })
    .await;
    // The server may stop reading and close before our write completes: nothing may
    // come, or the stream may end without a close frame.
    if let Some(m) = c2.try_recv(Duration::from_secs(5)).await {
        if !matches!(m, Msg::Ended(_)) {
            assert!(matches!(m, Msg::Close(1009, _)), "{m:?}");
        }
    }
    s.change("t", "INSERT", json!({"id": 1}), &s.worker.ids_for("t"))
        .await;
    assert_eq!(other.recv().await.event(), "postgres_changes");
    other.heartbeat_ok().await;
}

#[tokio::test]
async fn a_thousand_joins_hit_the_limits_and_the_socket_still_works() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    for i in 0..1000 {
        let r = (i + 10).to_string();
        c.send(
            Some(&r),
            Some(&r),
            &format!("realtime:room{i}"),
            "phx_join",
            json!({"config": pg_config(json!([{"event":"*","schema":"public","table":"t"}]))}),
        )
        .await;
    }
    let mut ok = 0;
    let mut too_many_channels = 0;
    let mut too_many_joins = 0;
    let mut replies = 0;
    while replies < 1000 {
        let m = c.recv().await;
        match m.event() {
            "phx_reply" => {
                replies += 1;
                match m.payload()["status"].as_str() {
                    Some("ok") => ok += 1,
                    _ => {
                        let reason = m.payload()["response"]["reason"].as_str().unwrap();
                        if reason.starts_with("ChannelRateLimitReached") {
                            too_many_channels += 1;
                        } else if reason.starts_with("ClientJoinRateLimitReached") {
                            too_many_joins += 1;
                        } else {
                            panic!("unexpected {reason}");
                        }
                    }
                }
            }
            "system" => {}
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ok, 100);
    assert!(
        too_many_channels > 0 && too_many_joins > 0,
        "{too_many_channels} {too_many_joins}"
    );
    assert_eq!(s.worker.registered().len(), 100);
    c.heartbeat_ok().await;
    assert_eq!(s.front.health().channels, 100);
    // Another client is unaffected.
    let mut d = s.client("2.0.0").await;
    let (_, f) = d.join("realtime:room0", json!({}), None).await;
    assert_eq!(f[4]["status"], "ok");
}

#[tokio::test]
async fn too_many_bindings_and_connections() {
    let s = start_with(FrontConfig {
        max_bindings_per_channel: 2,
        max_connections: 2,
        ..FrontConfig::default()
    })
    .await;
    let mut c = s.client("2.0.0").await;
    let b = json!({"event":"*","schema":"public","table":"t"});
    let (_, f) = c
        .join("realtime:x", pg_config(json!([b, b, b])), None)
        .await;
    assert!(f[4]["response"]["reason"]
        .as_str()
        .unwrap()
        .starts_with("TooManyBindings"));
    let _c2 = s.client("2.0.0").await;
    let err = tokio_tungstenite::connect_async(s.ws_url("2.0.0", &anon()))
        .await
        .unwrap_err();
    match err {
        tokio_tungstenite::tungstenite::Error::Http(r) => assert_eq!(r.status().as_u16(), 429),
        e => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_client_that_never_reads_is_disconnected_and_others_get_everything() {
    let s = start_with(FrontConfig {
        outbound_queue: 64,
        ..FrontConfig::default()
    })
    .await;
    let cfg = pg_config(json!([{"event":"*","schema":"public","table":"t"}]));
    let mut slow = s.client("2.0.0").await;
    slow.join("realtime:r", cfg.clone(), None).await;
    let mut fast = s.client("2.0.0").await;
    fast.join("realtime:r", cfg, None).await;
    assert_eq!(fast.recv().await.event(), "system");
    let ids = s.worker.ids_for("t");
    assert_eq!(ids.len(), 2);
    const N: usize = 3000;
    let pad = "z".repeat(16 * 1024);
    // The fast client reads as it goes; the writer never gets more than half the queue
    // ahead of it, so only the client that never reads can fill its queue (on a loaded
    // machine a fixed pace let the fast one fall behind too).
    let (progress, mut read) = tokio::sync::watch::channel(0usize);
    let reader = tokio::spawn(async move {
        let mut got = 0;
        while got < N {
            let m = fast.recv().await;
            if m.event() == "postgres_changes" {
                assert_eq!(m.payload()["data"]["record"]["n"], got as u64);
                got += 1;
                progress.send_replace(got);
            }
        }
        fast
    });
    for n in 0..N {
        let ahead = tokio::time::timeout(Duration::from_secs(30), read.wait_for(|g| n < g + 32));
        assert!(
            matches!(ahead.await, Ok(Ok(_))),
            "the fast client stopped reading at {}",
            *read.borrow()
        );
        s.change("t", "INSERT", json!({"id": n, "n": n, "pad": pad}), &ids)
            .await;
    }
    let mut fast = tokio::time::timeout(Duration::from_secs(60), reader)
        .await
        .unwrap()
        .unwrap();
    s.wait_for("slow consumer closed", |s| {
        s.front.health().connections == 1
    })
    .await;
    fast.heartbeat_ok().await;
    // The slow socket ends with 1013 (or, if even the close frame could not be written, EOF).
    let mut saw_close = None;
    while let Some(m) = slow.try_recv(Duration::from_secs(3)).await {
        match m {
            Msg::Close(code, reason) => {
                saw_close = Some((code, reason));
                break;
            }
            Msg::Ended(_) => break,
            Msg::Frame(_) | Msg::Binary(_) => {}
        }
    }
    if let Some((code, reason)) = saw_close {
        assert_eq!(code, 1013);
        assert_eq!(reason, "slow consumer: outbound queue full");
    }
}

#[tokio::test]
async fn silent_sockets_are_closed() {
    let s = start_with(FrontConfig {
        idle_timeout: Duration::from_millis(400),
        ..FrontConfig::default()
    })
    .await;
    let mut c = s.client("2.0.0").await;
    c.heartbeat_ok().await;
    assert_eq!(c.recv().await, Msg::Close(1000, "heartbeat timeout".into()));
}

/// A client joined to `realtime:r` for every change of `t` (its join answered and
/// subscribed).
async fn joined_to_t(s: &Server) -> PhoenixClient {
    let mut c = s.client("2.0.0").await;
    let config = pg_config(json!([{"event":"*","schema":"public","table":"t"}]));
    let (_, reply) = c.join("realtime:r", config, None).await;
    assert_eq!(reply[4]["status"], "ok");
    assert_eq!(c.recv().await.event(), "system");
    c
}

/// The raw messages of a socket until `pongs` pongs and `texts` text frames came.
async fn raw_until(c: &mut PhoenixClient, pongs: usize, texts: usize) -> Vec<WsMessage> {
    use futures_util::StreamExt;
    let count = |got: &[WsMessage], pong: bool| {
        let is = |m: &&WsMessage| matches!(m, WsMessage::Pong(_)) == pong;
        got.iter().filter(is).count()
    };
    let mut got = Vec::new();
    while count(&got, true) < pongs || count(&got, false) < texts {
        let m = tokio::time::timeout(TIMEOUT, c.ws.next()).await;
        got.push(m.expect("a message in time").unwrap().unwrap());
    }
    got
}

#[tokio::test]
async fn pings_are_answered_whole_between_the_frames() {
    use futures_util::SinkExt;
    let s = start().await;
    let mut c = joined_to_t(&s).await;
    let ids = s.worker.ids_for("t");
    let pad = "p".repeat(70_000); // a frame with a 64-bit length
    let ping = |i: u8| WsMessage::Ping(vec![i; 125].into());
    c.ws.send(ping(1)).await.unwrap();
    s.change("t", "INSERT", json!({"id": 1, "pad": pad}), &ids)
        .await;
    c.ws.send(ping(2)).await.unwrap();
    s.change("t", "INSERT", json!({"id": 2}), &ids).await;
    c.ws.send(ping(3)).await.unwrap();
    let got = raw_until(&mut c, 3, 2).await;
    let pongs: Vec<u8> = got
        .iter()
        .filter_map(|m| match m {
            WsMessage::Pong(p) => {
                assert_eq!(p.len(), 125);
                Some(p[0])
            }
            _ => None,
        })
        .collect();
    assert_eq!(pongs, [1, 2, 3], "each ping answered once, in order");
    let ids: Vec<Value> = got
        .iter()
        .filter_map(|m| match m {
            WsMessage::Text(t) => Some(serde_json::from_str::<Value>(t).unwrap()),
            _ => None,
        })
        .map(|v| v[4]["data"]["record"]["id"].clone())
        .collect();
    assert_eq!(ids, [json!(1), json!(2)]);
    c.heartbeat_ok().await;
}

#[tokio::test]
async fn a_ping_flood_that_never_reads_its_pongs_is_closed_as_slow() {
    use futures_util::SinkExt;
    let s = start_with(FrontConfig {
        outbound_queue: 64,
        ..FrontConfig::default()
    })
    .await;
    let mut other = joined_to_t(&s).await;
    let mut flood = s.client("2.0.0").await;
    flood.heartbeat_ok().await;
    // Every ping's pong is queued like any frame: a client that does not read them
    // fills its socket, then its queue, and is closed; it cannot grow our memory.
    let started = std::time::Instant::now();
    let mut sent = 0u32;
    while s.front.health().connections == 2 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "not closed after {sent} pings"
        );
        let ping = WsMessage::Ping(vec![7; 125].into());
        let r = tokio::time::timeout(Duration::from_secs(1), flood.ws.send(ping)).await;
        match r {
            Ok(Ok(())) => sent += 1,
            // The server closed it, or stopped reading it.
            Ok(Err(_)) | Err(_) => break,
        }
    }
    s.wait_for("the flood closed", |s| s.front.health().connections == 1)
        .await;
    s.change("t", "INSERT", json!({"id": 1}), &s.worker.ids_for("t"))
        .await;
    assert_eq!(other.recv().await.event(), "postgres_changes");
    other.heartbeat_ok().await;
}

/// Every route the front does not serve answers JSON saying what it serves: `/`, the
/// other Supabase services' paths, the management API while off, a wrong method, and a
/// long hostile path (cut, escaped).
#[tokio::test(flavor = "multi_thread")]
async fn unknown_routes_and_methods_answer_json() {
    let s = start().await;
    let json = |text: &str| -> serde_json::Value {
        let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
        serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
    };
    let (status, text) = s.http("GET", "/", &[], b"").await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(json(&text)["name"], "walcast");
    let (status, text) = s.http("GET", "/rest/v1/todos?select=*", &[], b"").await;
    assert_eq!(status, 404, "{text}");
    assert!(json(&text)["error"]
        .as_str()
        .unwrap()
        .contains("serves only /realtime/v1"));
    let (status, text) = s.http("GET", "/management/v1/projects", &[], b"").await;
    assert_eq!(status, 404, "{text}");
    assert!(json(&text)["error"]
        .as_str()
        .unwrap()
        .contains("MANAGEMENT_API_KEY"));
    let (status, text) = s.http("DELETE", "/realtime/v1/sse", &[], b"").await;
    assert_eq!(status, 405, "{text}");
    assert!(json(&text)["error"].is_string());
    let hostile = format!("/%22%3Cscript%3E{}", "a".repeat(4000));
    let (status, text) = s.http("GET", &hostile, &[], b"").await;
    assert_eq!(status, 404, "{text}");
    assert_eq!(json(&text)["path"].as_str().unwrap().len(), 200);
}
