//! Per-project rates and sizes across real fronts, through raw sockets: a cdc-worker
//! and two ws-fronts on one nats-server, two projects (a noisy one, a quiet one). Each
//! limit answers with Supabase's error and code; each is shared between the fronts (every
//! rate case is set up so that neither front alone is over the limit); the quiet project
//! on the same fronts, at the same moment, is unaffected.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::management::{create, op, path, Created, APPLIED, OPERATOR, STARTUP};
use crate::project_limits::inspected;
use crate::support::{Stack, Worker};

const ROOM: &str = "realtime:room";
/// The fronts' defaults in this file.
const EVENTS_PER_SECOND: &str = "150";
const JOINS_PER_SECOND: &str = "20";
const PRESENCE_PER_SECOND: &str = "6";
const PAYLOAD_KB: &str = "1";
const BYTES_PER_SECOND: &str = "40000";
/// How long a project's rates take to leave the other fronts' sums: a beacon a second,
/// each counting the last second.
const FADE: Duration = Duration::from_millis(3500);

/// A worker and two fronts with small per-project defaults (the management API on the
/// first), and the noisy and quiet projects.
fn start(stack: &Stack) -> (Worker, Worker, Worker, Created, Created) {
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let limits = [
        ("PROJECT_MAX_EVENTS_PER_SECOND", EVENTS_PER_SECOND),
        ("PROJECT_MAX_JOINS_PER_SECOND", JOINS_PER_SECOND),
        (
            "PROJECT_MAX_PRESENCE_EVENTS_PER_SECOND",
            PRESENCE_PER_SECOND,
        ),
        ("PROJECT_MAX_PAYLOAD_KB", PAYLOAD_KB),
        ("PROJECT_MAX_BYTES_PER_SECOND", BYTES_PER_SECOND),
    ];
    let mut env = limits.to_vec();
    env.push(("MANAGEMENT_API_KEY", OPERATOR));
    let mut a = Worker::front(&stack.nats.url(), &env);
    let mut b = Worker::front(&stack.nats.url(), &limits);
    a.wait_http(STARTUP);
    b.wait_http(STARTUP);
    let noisy = create(&a, "noisy");
    let quiet = create(&a, "quiet");
    (worker, a, b, noisy, quiet)
}

fn broadcast_config() -> Value {
    json!({"broadcast": {"ack": false, "self": false}, "presence": {"enabled": false}, "postgres_changes": [], "private": false})
}

fn presence_config() -> Value {
    json!({"broadcast": {"ack": false, "self": false}, "presence": {"key": "", "enabled": true}, "postgres_changes": [], "private": false})
}

/// A socket of `p` on `w` joined to `topic`; (socket, join_ref).
async fn joined(w: &Worker, p: &Created, topic: &str, config: Value) -> (PhoenixClient, String) {
    let mut s = PhoenixClient::connect(&w.ws_url(&p.anon)).await;
    let (jr, reply) = s.join(topic, config, None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    (s, jr)
}

fn message(n: usize) -> Value {
    json!({"type": "broadcast", "event": "tick", "payload": {"n": n}})
}

/// Broadcast frames received within `d`, by their `n`; panics on a `system` error.
async fn received(s: &mut PhoenixClient, d: Duration) -> Vec<u64> {
    let deadline = Instant::now() + d;
    let mut got = Vec::new();
    while let Some(m) = s
        .try_recv(deadline.saturating_duration_since(Instant::now()))
        .await
    {
        let Msg::Frame(f) = m else {
            panic!("a listener's socket ended: {m:?}")
        };
        assert_ne!(f[3], "system", "a listener was told something: {f}");
        if f[3] == "broadcast" {
            got.extend(f[4]["payload"]["n"].as_u64());
        }
    }
    got
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rates_are_a_project_s_across_the_fronts_and_not_the_others() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_worker, a, b, noisy, quiet) = start(&stack);
    messages_shut_the_sender(&a, &b, &noisy, &quiet).await;
    tokio::time::sleep(FADE).await;
    joins_are_refused(&a, &b, &noisy, &quiet).await;
    tokio::time::sleep(FADE).await;
    presence_shuts_the_tracker(&a, &b, &noisy, &quiet).await;
    tokio::time::sleep(FADE).await;
    bytes_shut_the_sender(&a, &b, &noisy).await;
}

/// Bytes, not messages: 900-byte messages at 20/s from front A (18 KB/s, under the
/// 40 KB/s alone; 20 messages/s, far under the 150) to four listeners on front B: the
/// bytes B sends them put the project over its bytes/s (while its messages/s, 100, stay
/// under 150), and the sender's channel is shut.
async fn bytes_shut_the_sender(a: &Worker, b: &Worker, noisy: &Created) {
    let mut listeners = Vec::new();
    for _ in 0..4 {
        listeners.push(joined(b, noisy, ROOM, broadcast_config()).await.0);
    }
    let (mut sender, jr) = joined(a, noisy, ROOM, broadcast_config()).await;
    let pad = "y".repeat(900);
    let started = Instant::now();
    let mut sent: u32 = 0;
    let shut = loop {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{sent} messages of 900 bytes at 20/s to 4 listeners, and no shut"
        );
        let m = json!({"type": "broadcast", "event": "big", "payload": {"pad": pad}});
        sender.send(Some(&jr), None, ROOM, "broadcast", m).await;
        sent += 1;
        let due = started + Duration::from_millis(50) * sent;
        let left = due.saturating_duration_since(Instant::now());
        if let Some(m) = sender.try_recv(left).await {
            break m;
        }
        for l in &mut listeners {
            let _ = received(l, Duration::from_millis(1)).await;
        }
    };
    let Msg::Frame(f) = shut else {
        panic!("{shut:?}")
    };
    assert_eq!(f[4]["message"], "Too many messages per second", "{f}");
    println!("bytes: the sender shut after {sent} messages of 900 bytes");
    let seen = inspected(b, noisy, &noisy.anon);
    println!("front B's rates then: {}", seen["here"]["rates"]);
    let events = seen["here"]["rates"]["events"].as_u64().unwrap_or(0);
    assert!(events < 130, "messages, not bytes, were over: {seen}");
}

/// A sender on front A at up to 100 messages/s is under the 150 alone; with eight
/// listeners on front B, the messages B sends them (eight per message: over the limit even
/// if a loaded machine slows the sender to 20/s) put the project over its rate and the
/// sender's channel is shut. The listeners keep their channel; the quiet project's
/// messages pass.
async fn messages_shut_the_sender(a: &Worker, b: &Worker, noisy: &Created, quiet: &Created) {
    let (mut sender, jr) = joined(a, noisy, ROOM, broadcast_config()).await;
    // Alone, the sender is under the limit: two seconds at up to 100/s, not shut.
    let alone = Instant::now();
    let mut n = 0;
    while alone.elapsed() < Duration::from_secs(2) {
        sender
            .send(Some(&jr), None, ROOM, "broadcast", message(n))
            .await;
        n += 1;
        if let Some(m) = sender.try_recv(Duration::from_millis(10)).await {
            panic!("the sender alone, after {n} messages: {m:?}");
        }
    }
    let mut listeners = Vec::new();
    for _ in 0..8 {
        listeners.push(joined(b, noisy, ROOM, broadcast_config()).await.0);
    }
    let (mut q_listener, _) = joined(b, quiet, ROOM, broadcast_config()).await;
    let (mut q_sender, qjr) = joined(a, quiet, ROOM, broadcast_config()).await;
    let started = Instant::now();
    let mut sent = 0;
    let shut = loop {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{sent} messages sent at 100/s and the sender was never shut"
        );
        sender
            .send(Some(&jr), None, ROOM, "broadcast", message(sent))
            .await;
        sent += 1;
        if let Some(m) = sender.try_recv(Duration::from_millis(10)).await {
            break m;
        }
        if sent % 50 == 0 {
            // Keep the listeners' queues short.
            for l in &mut listeners {
                let _ = received(l, Duration::from_millis(1)).await;
            }
        }
    };
    let Msg::Frame(f) = shut else {
        panic!("{shut:?}")
    };
    assert_eq!(f[3], "system", "{f}");
    assert_eq!(f[4]["status"], "error", "{f}");
    assert_eq!(f[4]["message"], "Too many messages per second", "{f}");
    assert_eq!(sender.recv_frame().await[3], "phx_close");
    println!(
        "sender shut after {sent} messages in {:?}",
        started.elapsed()
    );
    // The quiet project, at the same moment, on the same fronts: every message arrives.
    for n in 0..30 {
        q_sender
            .send(Some(&qjr), None, ROOM, "broadcast", message(n))
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let got = received(&mut q_listener, Duration::from_secs(2)).await;
    assert_eq!(
        got,
        (0..30).collect::<Vec<u64>>(),
        "the quiet project's messages"
    );
    // The noisy listeners were never told anything and still hold their channel.
    for l in &mut listeners {
        let _ = received(l, Duration::from_millis(300)).await;
        l.heartbeat_ok().await;
    }
}

/// Joins on both fronts, each at about 14/s (under the 20 alone): some are refused with
/// `ClientJoinRateLimitReached`; the quiet project's joins on the same fronts all pass.
async fn joins_are_refused(a: &Worker, b: &Worker, noisy: &Created, quiet: &Created) {
    let mut on_a = PhoenixClient::connect(&a.ws_url(&noisy.anon)).await;
    let mut on_b = PhoenixClient::connect(&b.ws_url(&noisy.anon)).await;
    let mut q = PhoenixClient::connect(&b.ws_url(&quiet.anon)).await;
    let (mut ok, mut refused) = (0, 0);
    let started = Instant::now();
    let mut i: u32 = 0;
    while started.elapsed() < Duration::from_secs(4) {
        let s = if i.is_multiple_of(2) {
            &mut on_a
        } else {
            &mut on_b
        };
        match join_once(s, &format!("realtime:j{i}")).await {
            Ok(()) => ok += 1,
            Err(why) => {
                assert_eq!(why, "ClientJoinRateLimitReached: Too many joins per second");
                refused += 1;
            }
        }
        if i.is_multiple_of(7) {
            let r = join_once(&mut q, &format!("realtime:q{i}")).await;
            assert_eq!(r, Ok(()), "a quiet project's join");
        }
        i += 1;
        // On a schedule, so a slow round trip is made up for.
        tokio::time::sleep_until((started + Duration::from_millis(35) * i).into()).await;
    }
    println!("noisy joins: {ok} ok, {refused} refused in 4 s");
    assert!(
        refused > 0,
        "{ok} joins at 28/s across two fronts, none refused"
    );
    assert!(ok >= 20, "only {ok} joins passed at 20/s over 4 s");
}

/// One join of `topic` (a socket keeps at most about 60 of them here, under its 100);
/// the refusal's reason.
async fn join_once(s: &mut PhoenixClient, topic: &str) -> Result<(), String> {
    let r = s.next_ref();
    let payload = json!({"config": broadcast_config()});
    s.send(Some(&r), Some(&r), topic, "phx_join", payload).await;
    let reply = s.reply_to(&r).await;
    match reply[4]["status"].as_str() {
        Some("ok") => Ok(()),
        _ => Err(reply[4]["response"]["reason"].as_str().unwrap_or("").into()),
    }
}

/// Two trackers, one per front, each at 5 events/s (under the 6 alone): one is shut with
/// "Too many presence messages per second"; the quiet project's tracker is not.
async fn presence_shuts_the_tracker(a: &Worker, b: &Worker, noisy: &Created, quiet: &Created) {
    let (mut ta, jra) = joined(a, noisy, ROOM, presence_config()).await;
    let (mut tb, jrb) = joined(b, noisy, ROOM, presence_config()).await;
    let (mut tq, jrq) = joined(b, quiet, ROOM, presence_config()).await;
    let started = Instant::now();
    let mut n: u32 = 0;
    let why = loop {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "{n} tracks at 10/s across two fronts, none refused"
        );
        let (s, jr) = if n.is_multiple_of(2) {
            (&mut ta, &jra)
        } else {
            (&mut tb, &jrb)
        };
        if let Err(why) = track(s, jr, n).await {
            break why;
        }
        if n.is_multiple_of(4) {
            assert_eq!(track(&mut tq, &jrq, n).await, Ok(()), "the quiet tracker");
        }
        n += 1;
        // On a schedule, so a slow round trip is made up for.
        let due = started + Duration::from_millis(100) * n;
        tokio::time::sleep_until(due.into()).await;
    };
    assert_eq!(why, "Too many presence messages per second");
    println!("a tracker shut after {n} tracks");
    assert!(n >= 4, "shut after {n}");
}

/// Track on `jr`'s topic; `Err` with the `system` message if the channel was shut.
async fn track(s: &mut PhoenixClient, jr: &str, n: u32) -> Result<(), String> {
    let r = s.next_ref();
    let payload = json!({"type": "presence", "event": "track", "payload": {"n": n}});
    s.send(Some(jr), Some(&r), ROOM, "presence", payload).await;
    loop {
        let f = s.recv_frame().await;
        match f[3].as_str() {
            Some("phx_reply") if f[1] == r.as_str() => {
                assert_eq!(f[4]["status"], "ok", "{f}");
                return Ok(());
            }
            Some("system") if f[4]["status"] == "error" => {
                assert_eq!(s.recv_frame().await[3], "phx_close");
                return Err(f[4]["message"].as_str().unwrap_or("").into());
            }
            _ => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sizes_channels_and_rest_broadcasts_are_a_project_s() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_worker, a, b, noisy, quiet) = start(&stack);
    payloads_over_the_size_are_refused(&a, &b, &noisy, &quiet).await;
    tokio::time::sleep(FADE).await;
    rest_broadcasts_are_limited(&a, &noisy, &quiet);
    channels_per_client_is_the_project_s_own(&a, &b, &noisy, &quiet).await;
    tokio::time::sleep(FADE).await;
    private_only_refuses_public_rest_broadcasts(&a, &b, &noisy, &quiet).await;
}

/// `p`'s limits in force as `w`'s inspector shows them to `p`'s key.
fn limits_seen(w: &Worker, p: &Created) -> Value {
    inspected(w, p, &p.anon)["limits"].clone()
}

/// `PATCH` the project `id` through the management API on `w`; the answer, 200.
fn patch(w: &Worker, id: &str, body: &str) -> Value {
    let (status, v) = op(w, "PATCH", &path(id), Some(body));
    assert_eq!(status, 200, "{v}");
    v
}

/// The noisy project's own `max_channels_per_client` (2, set through the management API
/// on front A) holds on front B: a third channel is refused with
/// `ChannelRateLimitReached: Too many channels`; the quiet project keeps the default.
async fn channels_per_client_is_the_project_s_own(
    a: &Worker,
    b: &Worker,
    noisy: &Created,
    quiet: &Created,
) {
    let v = patch(a, &noisy.id, r#"{"max_channels_per_client": 2}"#);
    assert_eq!(v["effective_max_channels_per_client"], 2, "{v}");
    let deadline = Instant::now() + APPLIED;
    while limits_seen(b, noisy)["channels_per_client"] != 2 {
        assert!(Instant::now() < deadline, "{}", limits_seen(b, noisy));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(limits_seen(b, quiet)["channels_per_client"], 100);
    let mut s = PhoenixClient::connect(&b.ws_url(&noisy.anon)).await;
    let mut q = PhoenixClient::connect(&b.ws_url(&quiet.anon)).await;
    for i in 0..3 {
        let topic = format!("realtime:c{i}");
        let (_, reply) = s.join(&topic, broadcast_config(), None).await;
        let (_, quiet_reply) = q.join(&topic, broadcast_config(), None).await;
        assert_eq!(quiet_reply[4]["status"], "ok", "{quiet_reply}");
        if i < 2 {
            assert_eq!(reply[4]["status"], "ok", "{reply}");
        } else {
            assert_eq!(reply[4]["status"], "error", "{reply}");
            assert_eq!(
                reply[4]["response"]["reason"],
                "ChannelRateLimitReached: Too many channels"
            );
        }
    }
}

/// Over the project's 1 KiB: a broadcast gets an error reply and reaches nobody; a track
/// shuts its channel; a REST message gets 413. Under it, the same pass.
async fn payloads_over_the_size_are_refused(
    a: &Worker,
    b: &Worker,
    noisy: &Created,
    quiet: &Created,
) {
    let (mut listener, _) = joined(b, noisy, ROOM, broadcast_config()).await;
    let (mut sender, jr) = joined(a, noisy, ROOM, broadcast_config()).await;
    let pad = "x".repeat(1100);
    let big = json!({"type": "broadcast", "event": "big", "payload": {"pad": pad}});
    sender
        .send(Some(&jr), Some("big"), ROOM, "broadcast", big)
        .await;
    let reply = sender.reply_to("big").await;
    assert_eq!(reply[4]["status"], "error", "{reply}");
    let why = reply[4]["response"]["reason"].as_str().unwrap_or("");
    assert!(
        why.starts_with("PayloadSizeExceeded: Payload size exceeded: "),
        "{reply}"
    );
    sender
        .send(Some(&jr), None, ROOM, "broadcast", message(7))
        .await;
    assert_eq!(
        received(&mut listener, Duration::from_secs(2)).await,
        [7],
        "only the small one"
    );

    let (mut tracker, tjr) = joined(a, noisy, ROOM, presence_config()).await;
    let payload = json!({"type": "presence", "event": "track", "payload": {"pad": pad}});
    tracker
        .send(Some(&tjr), Some("t"), ROOM, "presence", payload)
        .await;
    tracker
        .expect_shut(ROOM, "Track message size exceeded")
        .await;

    let body = json!({"messages": [{"topic": "room", "event": "e", "payload": {"pad": pad}}]});
    let (status, text) = rest(a, &noisy.anon, &body);
    assert_eq!(status, 413, "{text}");
    let small = json!({"messages": [{"topic": "room", "event": "e", "payload": {"n": 1}}]});
    let (status, text) = rest(a, &quiet.anon, &small);
    assert_eq!(status, 202, "{text}");
}

/// `POST /realtime/v1/api/broadcast` with `key`: (status, body).
fn rest(w: &Worker, key: &str, body: &Value) -> (u16, String) {
    w.request(
        "POST",
        "/realtime/v1/api/broadcast",
        &[("apikey", key)],
        Some(&body.to_string()),
    )
}

/// REST messages count against the project's rate: a burst over it is answered 429
/// (`Too many messages per second`); the quiet project's request at the same moment is
/// accepted.
fn rest_broadcasts_are_limited(a: &Worker, noisy: &Created, quiet: &Created) {
    let batch = |n: usize| {
        let messages: Vec<Value> = (0..n)
            .map(|i| json!({"topic": "room", "event": "e", "payload": {"i": i}}))
            .collect();
        json!({ "messages": messages })
    };
    let mut answers = Vec::new();
    for _ in 0..4 {
        answers.push(rest(a, &noisy.anon, &batch(60)));
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(statuses[0], 202, "{answers:?}");
    let over = answers
        .iter()
        .find(|a| a.0 == 429)
        .unwrap_or_else(|| panic!("240 messages in a burst, limit 150/s: {answers:?}"));
    assert!(over.1.contains("Too many messages per second"), "{over:?}");
    let (status, text) = rest(a, &quiet.anon, &batch(60));
    assert_eq!(status, 202, "{text}");
}

/// A private-only project refuses a REST broadcast to a public topic (403 `PrivateOnly`),
/// on the other front too; the quiet project's is accepted.
async fn private_only_refuses_public_rest_broadcasts(
    a: &Worker,
    b: &Worker,
    noisy: &Created,
    quiet: &Created,
) {
    patch(a, &noisy.id, r#"{"private_only": true}"#);
    let body = json!({"messages": [{"topic": "room", "event": "e", "payload": {}}]});
    let deadline = Instant::now() + APPLIED;
    loop {
        let (status, text) = rest(b, &noisy.anon, &body);
        if status == 403 {
            assert!(text.contains("PrivateOnly"), "{text}");
            break;
        }
        assert!(Instant::now() < deadline, "{status} {text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, text) = rest(b, &quiet.anon, &body);
    assert_eq!(status, 202, "{text}");
}
