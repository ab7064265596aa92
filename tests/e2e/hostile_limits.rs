//! Per-connection limits through the real parts: a cdc-worker and two ws-fronts on one
//! nats-server. Presence: an oversized payload and a burst of tracks are refused at the
//! socket, and the other front's members never see them. SSE: streams share
//! `MAX_CONNECTIONS` with the WebSocket connections (before, SSE had no limit at all).
//! Resync: a subscription a new leader refuses is told (before, only logged).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;

use crate::support::ws::anon;
use crate::support::{Stack, Worker};

const TOPIC: &str = "realtime:crowd";

fn presence() -> Value {
    json!({"broadcast": {"ack": false, "self": false}, "presence": {"key": "", "enabled": true}, "postgres_changes": [], "private": false})
}

/// An SSE request kept open: its status, and the connection (dropping it ends the stream).
fn open_sse(port: u16, query: &str) -> (u16, TcpStream) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let req = format!("GET /realtime/v1/sse?{query} HTTP/1.0\r\nHost: localhost\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut byte).expect("read the head"), 1, "stream ended");
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_and_sse_are_bounded_across_real_fronts() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY)");
    stack.enable("t");
    let mut worker = Worker::spawn(&stack.pg.url(), &stack.nats.url(), &[]);
    worker.wait_active(Duration::from_secs(60));
    let mut a = Worker::front(&stack.nats.url(), &[("MAX_CONNECTIONS", "3")]);
    let mut b = Worker::front(&stack.nats.url(), &[]);
    a.wait_http(Duration::from_secs(60));
    b.wait_http(Duration::from_secs(60));

    let mut watcher = PhoenixClient::connect(&b.ws_url(&anon())).await;
    let (_, reply) = watcher.join(TOPIC, presence(), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let mut ann = PhoenixClient::connect(&a.ws_url(&anon())).await;
    let (jr, reply) = ann.join(TOPIC, presence(), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");

    let big = json!({"type": "presence", "event": "track", "payload": {"pad": "x".repeat(9000)}});
    ann.send(Some(&jr), Some("big"), TOPIC, "presence", big)
        .await;
    // Over 8 KiB: the channel is shut (Supabase's "Track message size exceeded").
    ann.expect_shut(TOPIC, "Track message size exceeded").await;
    let (jr, reply) = ann.join(TOPIC, presence(), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    for n in 0..40 {
        let r = format!("t{n}");
        let track = json!({"type": "presence", "event": "track", "payload": {"n": n}});
        ann.send(Some(&jr), Some(&r), TOPIC, "presence", track)
            .await;
    }
    // The burst passes, then the channel is shut (ClientPresenceRateLimitReached).
    let accepted = ann
        .expect_shut(TOPIC, "Client presence rate limit exceeded")
        .await;
    assert!((15..=22).contains(&accepted), "{accepted} accepted");
    // The other front sees ann's accepted presence, never the oversized one: the first
    // diff may take a while to cross fronts on a loaded machine (the JetStream KV), then
    // the rest follow until the socket is quiet.
    let mut diffs = 0;
    let first_by = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let wait = match diffs {
            0 => first_by.saturating_duration_since(std::time::Instant::now()),
            _ => Duration::from_millis(1500),
        };
        let Some(m) = watcher.try_recv(wait.max(Duration::from_millis(1))).await else {
            break;
        };
        let text = format!("{m:?}");
        assert!(
            !text.contains(&"x".repeat(9000)),
            "the oversized payload crossed fronts"
        );
        diffs += usize::from(text.contains("presence_diff"));
    }
    assert!(diffs >= 1, "no presence reached the other front");

    // SSE: `ann` holds one of front A's three slots; two streams take the rest.
    let query = format!("apikey={}&table=t", anon());
    let (s1, _one) = open_sse(a.port, &query);
    let (s2, two) = open_sse(a.port, &query);
    assert_eq!((s1, s2), (200, 200));
    let (full, _) = open_sse(a.port, &query);
    assert_eq!(
        full, 429,
        "a fourth stream or socket beyond MAX_CONNECTIONS 3"
    );
    let refused = tokio_tungstenite::connect_async(a.ws_url(&anon())).await;
    assert!(refused.is_err(), "a socket beyond MAX_CONNECTIONS");
    drop(two);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _) = open_sse(a.port, &query);
        if status == 200 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closed stream's slot was never freed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A subscription the new leader refuses on resync is told: the leader is killed, the
/// table is disabled meanwhile, and the next leader's resync refuses the subscription; its
/// channel gets a `system` error instead of staying subscribed and deaf.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_the_new_leader_refuses_is_told() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE gone (id int PRIMARY KEY)");
    stack.enable("gone");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(Duration::from_secs(60));
    let mut ws = PhoenixClient::connect(&front.ws_url(&anon())).await;
    ws.join_subscribed(
        "realtime:gone",
        json!([{"event": "*", "schema": "public", "table": "gone"}]),
    )
    .await;

    worker.kill9();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["realtime", "disable", "gone"])
        .env("DATABASE_URL", stack.pg.url())
        .output()
        .expect("run walcast realtime disable");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut next = stack.worker(&[]);
    next.wait_active(Duration::from_secs(60));
    let sys = ws
        .wait_frame("system", Duration::from_secs(30), |p| {
            p["status"] == "error"
        })
        .await;
    assert_eq!(sys[2], "realtime:gone", "{sys}");
    ws.heartbeat_ok().await;
}
