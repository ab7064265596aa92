//! A join waiting for the cdc-worker holds up nothing else on its socket. A real
//! `ws-front` and `cdc-worker` on NATS; the worker is frozen (SIGSTOP) while a socket
//! joins `postgres_changes` of a class the front does not receive yet, so the join waits
//! for the worker. Meanwhile the same socket's heartbeat, a join of another channel, a
//! broadcast and a presence track on it are answered at once; the frames of the waiting
//! topic (a leave, a second join) wait behind its join and are answered in order once it
//! is answered. What waits is bounded: joins in flight count as channels (a join beyond
//! the socket's channel limit is refused at once), and the frames waiting behind them are
//! few (one more is refused at once).

use std::time::{Duration, Instant};

use crate::support::ws::{anon, TIMEOUT};
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, PhoenixClient};

pub(crate) const STARTUP: Duration = Duration::from_secs(60);
/// How soon what does not wait for the worker must be answered.
pub(crate) const PROMPT: Duration = Duration::from_secs(1);
/// The front's channel limit per socket, for the bound on joins in flight.
const MAX_CHANNELS: usize = 3;
/// Frames a socket may have waiting behind its joins in flight (`channel::pending`).
pub(crate) const MAX_WAITING: usize = 16;

/// Read frames until one satisfies `pred`, within [`PROMPT`] of `since`; the frames
/// skipped on the way are returned too.
pub(crate) async fn prompt(
    c: &mut PhoenixClient,
    since: Instant,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> (Value, Vec<Value>) {
    let mut skipped = Vec::new();
    loop {
        let left = PROMPT.saturating_sub(since.elapsed());
        match c.try_recv(left).await {
            Some(m) if pred(m.frame()) => return (m.frame().clone(), skipped),
            Some(m) => skipped.push(m.frame().clone()),
            None => panic!(
                "{what}: not answered within {PROMPT:?} while a command waits for the worker; \
                 got meanwhile {skipped:?}"
            ),
        }
    }
}

pub(crate) fn reply_to(r: &str) -> impl Fn(&Value) -> bool + '_ {
    move |f| f[3] == "phx_reply" && f[1] == r
}

/// The next frames of `topic` (others skipped), `n` of them.
pub(crate) async fn frames_of(c: &mut PhoenixClient, topic: &str, n: usize) -> Vec<Value> {
    let mut got = Vec::new();
    while got.len() < n {
        let f = c.recv_frame().await;
        if f[2] == topic {
            got.push(f);
        }
    }
    got
}

pub(crate) fn binding(table: &str, filter: Option<&str>) -> Value {
    let mut b = json!({"event": "INSERT", "schema": "public", "table": table});
    if let Some(f) = filter {
        b["filter"] = json!(f);
    }
    json!([b])
}

pub(crate) async fn send_join(c: &mut PhoenixClient, topic: &str, config: Value) -> String {
    let r = c.next_ref();
    c.send(
        Some(&r),
        Some(&r),
        topic,
        "phx_join",
        json!({ "config": config }),
    )
    .await;
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_waiting_for_the_worker_holds_up_nothing_else_on_its_socket() {
    let _machine = crate::support::alone().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE pj (id int8 PRIMARY KEY, n int8)");
    stack.enable("pj");
    // A lease far longer than the freeze: the worker stays the leader.
    let mut worker = stack.worker(&[("LEASE_DURATION_SECS", "60")]);
    worker.wait_active(STARTUP);
    let max = MAX_CHANNELS.to_string();
    let mut front = Worker::front(
        &stack.nats.url(),
        &[("MAX_CHANNELS_PER_SOCKET", max.as_str())],
    );
    front.wait_http(STARTUP);
    let url = front.ws_url(&anon());
    let mut c = PhoenixClient::connect(&url).await;
    let mut b = PhoenixClient::connect(&url).await;
    let mut gone = PhoenixClient::connect(&url).await;

    worker.signal("STOP");
    let frozen = Instant::now();
    let slow = "realtime:slow";
    let slow_join = send_join(&mut c, slow, pg_config(binding("pj", None))).await;

    // The heartbeat, at once.
    let r = c.next_ref();
    let at = Instant::now();
    c.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
        .await;
    let (f, _) = prompt(&mut c, at, "a heartbeat", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");

    // Another channel: its join, a broadcast (acknowledged, and sent to itself) and a
    // presence track, each at once.
    let other = "realtime:other";
    let config = json!({
        "broadcast": {"ack": true, "self": true},
        "presence": {"key": "me", "enabled": true},
        "postgres_changes": [],
        "private": false
    });
    let at = Instant::now();
    let other_join = send_join(&mut c, other, config).await;
    let (f, _) = prompt(&mut c, at, "another channel's join", reply_to(&other_join)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    let r = c.next_ref();
    let at = Instant::now();
    let push = json!({"type": "broadcast", "event": "hello", "payload": {"n": 1}});
    c.send(Some(&other_join), Some(&r), other, "broadcast", push)
        .await;
    let (f, skipped) = prompt(&mut c, at, "a broadcast's ack", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    let echo = |f: &Value| f[3] == "broadcast" && f[2] == other;
    let f = match skipped.into_iter().find(echo) {
        Some(f) => f,
        None => prompt(&mut c, at, "the broadcast to itself", echo).await.0,
    };
    assert_eq!(f[4]["payload"], json!({"n": 1}), "{f}");
    let r = c.next_ref();
    let at = Instant::now();
    let track = json!({"type": "presence", "event": "track", "payload": {"at": 1}});
    c.send(Some(&other_join), Some(&r), other, "presence", track)
        .await;
    let (f, _) = prompt(&mut c, at, "a presence track", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");

    // The waiting topic's own frames wait behind its join: a leave, then a second join.
    let leave = c.next_ref();
    c.send(Some(&slow_join), Some(&leave), slow, "phx_leave", json!({}))
        .await;
    let second_join = send_join(&mut c, slow, pg_config(binding("pj", None))).await;

    // A socket that leaves with its join in flight: what the join opens is closed.
    let config = pg_config(binding("pj", Some("n=eq.99")));
    send_join(&mut gone, "realtime:gone", config).await;
    drop(gone);

    // The bounds, on another socket: joins in flight count as channels, and the frames
    // waiting behind them are few; both refusals come at once.
    let mut waiting = Vec::new();
    for i in 0..MAX_CHANNELS {
        let topic = format!("realtime:wait{i}");
        let filter = format!("n=eq.{i}");
        let mut config = pg_config(binding("pj", Some(&filter)));
        config["broadcast"]["ack"] = json!(true);
        waiting.push((topic.clone(), send_join(&mut b, &topic, config).await));
    }
    let at = Instant::now();
    let beyond = send_join(&mut b, "realtime:beyond", pg_config(json!([]))).await;
    let (f, _) = prompt(
        &mut b,
        at,
        "a join beyond the channel limit",
        reply_to(&beyond),
    )
    .await;
    assert_eq!(
        f[4]["response"]["reason"], "ChannelRateLimitReached: Too many channels",
        "{f}"
    );
    let (first, first_join) = waiting[0].clone();
    let mut pushed = Vec::new();
    for n in 0..MAX_WAITING {
        let r = b.next_ref();
        let push = json!({"type": "broadcast", "event": "early", "payload": {"n": n}});
        b.send(Some(&first_join), Some(&r), &first, "broadcast", push)
            .await;
        pushed.push(r);
    }
    let r = b.next_ref();
    let at = Instant::now();
    let push = json!({"type": "broadcast", "event": "early", "payload": {"n": "one too many"}});
    b.send(Some(&first_join), Some(&r), &first, "broadcast", push)
        .await;
    let (f, skipped) = prompt(&mut b, at, "one frame too many", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "error", "{f}");
    let reason = f[4]["response"]["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("ChannelBusy: "), "{f}");
    assert!(skipped.is_empty(), "nothing else answered yet: {skipped:?}");
    assert!(
        frozen.elapsed() < Duration::from_secs(4),
        "the worker must still be frozen: {:?}",
        frozen.elapsed()
    );

    // The worker answers: the waiting topic's frames, in order.
    worker.signal("CONT");
    let got = frames_of(&mut c, slow, 6).await;
    let shape: Vec<(String, Value)> = got
        .iter()
        .map(|f| (f[3].as_str().unwrap_or("").to_string(), f[1].clone()))
        .collect();
    let expected: Vec<(String, Value)> = [
        ("phx_reply", json!(slow_join)),
        ("system", Value::Null),
        ("phx_reply", json!(leave)),
        ("phx_close", json!(slow_join)),
        ("phx_reply", json!(second_join)),
        ("system", Value::Null),
    ]
    .into_iter()
    .map(|(e, r)| (e.to_string(), r))
    .collect();
    assert_eq!(shape, expected, "{got:?}");
    for f in [&got[0], &got[2], &got[4]] {
        assert_eq!(f[4]["status"], "ok", "{f}");
    }
    for f in [&got[1], &got[5]] {
        assert_eq!(f[4]["message"], "Subscribed to PostgreSQL", "{f}");
    }
    assert_eq!(
        got[3][0],
        json!(slow_join),
        "the first join's channel closed"
    );
    assert_eq!(got[5][0], json!(second_join), "{:?}", got[5]);

    // The other socket: its joins answered (in the order they complete), the pushes
    // that waited behind the first acknowledged after its join, in order.
    let mut expected: Vec<Value> = waiting.iter().map(|(_, jr)| json!(jr)).collect();
    expected.extend(pushed.iter().map(|r| json!(r)));
    let mut replies = Vec::new();
    while replies.len() < expected.len() {
        let f = b.recv_frame().await;
        if f[3] == "phx_reply" {
            assert_eq!(f[4]["status"], "ok", "{f}");
            replies.push(f[1].clone());
        }
    }
    let of_first: Vec<&Value> = replies
        .iter()
        .filter(|r| **r == json!(first_join) || pushed.iter().any(|p| **r == json!(p)))
        .collect();
    assert_eq!(
        of_first,
        expected[..1]
            .iter()
            .chain(&expected[MAX_CHANNELS..])
            .collect::<Vec<_>>()
    );
    replies.sort_by_key(|r| r.as_str().and_then(|r| r.parse::<u64>().ok()));
    assert_eq!(replies, expected, "every join and push answered once");

    // What the front holds: the socket that left holds nothing.
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let h = front.health().expect("front health");
        let held = (&h["front"]["channels"], &h["front"]["subscriptions"]);
        // `c`: the second join of `slow` and `other`; `b`: its three joins.
        if held == (&json!(2 + MAX_CHANNELS), &json!(1 + MAX_CHANNELS)) {
            break;
        }
        assert!(Instant::now() < deadline, "the front holds {h}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // The second join's channel receives the next row, once; the left one nothing.
    stack.sql("INSERT INTO pj VALUES (1, 1)");
    let f = c
        .wait_frame("postgres_changes", TIMEOUT, |p| {
            p["data"]["record"]["id"] == 1
        })
        .await;
    assert_eq!(f[2], slow, "{f}");
    let r = c.next_ref();
    c.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
        .await;
    loop {
        let f = c.recv_frame().await;
        if f[3] == "phx_reply" && f[1] == json!(r) {
            break;
        }
        assert_ne!(f[3], "postgres_changes", "a row twice: {f}");
    }
}
