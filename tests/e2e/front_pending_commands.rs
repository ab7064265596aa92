//! A token refresh or a private channel's first write check waiting for the cdc-worker
//! holds up nothing else on its socket, as a join waiting for it does not (see
//! `front_pending_joins`). A real `ws-front` and `cdc-worker` on NATS; the worker is
//! frozen (SIGSTOP) while a socket
//! * refreshes the token (`access_token`) of channels with `postgres_changes` (their
//!   subscriptions registered again with the worker) and of private channels (their
//!   read policy asked again), or
//! * sends its first broadcast or presence track on private channels (their write
//!   policy asked).
//!
//! Meanwhile the socket's heartbeat and another channel's join, broadcast and track are
//! answered at once, and nothing of the waiting channels is. Once the worker wakes
//! (SIGCONT), each waiting command completes and the frames sent behind it on its channel
//! follow, in order: the refresh takes (or, refused by the read policy, shuts its
//! channel), the broadcast is delivered or dropped and the track accepted or refused as
//! the write policy says. Frames waiting behind these commands are bounded as those
//! behind joins are.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, PhoenixClient};

use crate::front_pending_joins::{binding, prompt, reply_to, send_join, MAX_WAITING, STARTUP};
use crate::support::ws::{anon, now, token, TIMEOUT};
use crate::support::{Stack, Worker};

/// The private channels' policies: `room_w` and `room_t` may be read and written,
/// `room_r` only read, `room_x` read unless the token says `"shut": "yes"`.
const POLICIES: &str = "
    CREATE POLICY pc_read ON realtime.messages FOR SELECT TO anon
        USING (realtime.topic() IN ('room_w', 'room_r', 'room_t', 'room_x')
               AND coalesce(auth.jwt() ->> 'shut', '') <> 'yes');
    CREATE POLICY pc_write ON realtime.messages FOR INSERT TO anon
        WITH CHECK (realtime.topic() IN ('room_w', 'room_t'))";

/// The front waits this long for the worker, far longer than the test keeps it frozen:
/// every waiting command is answered by the worker, none by a timeout.
const REGISTER_TIMEOUT_MS: &str = "30000";
/// How long the worker may have been frozen when the test wakes it (well within the
/// front's wait above and its grace before it calls a silent source failed).
const FROZEN_AT_MOST: Duration = Duration::from_secs(12);
/// Supabase's refusal of a track the write policy does not allow.
const WRITE_REFUSED: &str =
    "Unauthorized: You do not have permissions to write to this Channel topic";

struct Setup {
    stack: Stack,
    worker: Worker,
    _front: Worker,
    c: PhoenixClient,
}

async fn setup() -> Setup {
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE pc (id int8 PRIMARY KEY, n int8)");
    stack.enable("pc");
    stack.sql(POLICIES);
    // A lease far longer than the freeze: the worker stays the leader.
    let mut worker = stack.worker(&[("LEASE_DURATION_SECS", "60")]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(
        &stack.nats.url(),
        &[("REGISTER_TIMEOUT_MS", REGISTER_TIMEOUT_MS)],
    );
    front.wait_http(STARTUP);
    let c = PhoenixClient::connect(&front.ws_url(&anon())).await;
    Setup {
        stack,
        worker,
        _front: front,
        c,
    }
}

/// A channel's config: `postgres_changes` bindings, private or not, broadcasts
/// acknowledged, sent to itself or not, presence off.
fn config(bindings: Value, private: bool, echo: bool) -> Value {
    let mut c = pg_config(bindings);
    c["private"] = json!(private);
    c["broadcast"] = json!({"ack": true, "self": echo});
    c
}

/// Join (before the freeze) and take its answer: the reply, and the `system` message
/// of its bindings if it has any. Returns the join_ref.
async fn join_ok(c: &mut PhoenixClient, topic: &str, config: Value) -> String {
    let bindings = config["postgres_changes"]
        .as_array()
        .is_some_and(|b| !b.is_empty());
    let (jr, reply) = c.join(topic, config, None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    if bindings {
        let sys = c.recv_frame().await;
        assert_eq!(sys[4]["message"], "Subscribed to PostgreSQL", "{sys}");
    }
    jr
}

/// Send a broadcast (event `e`, payload `{"n": n}`) on `topic`; its ref.
async fn broadcast(c: &mut PhoenixClient, jr: &str, topic: &str, n: Value) -> String {
    let r = c.next_ref();
    let push = json!({"type": "broadcast", "event": "e", "payload": {"n": n}});
    c.send(Some(jr), Some(&r), topic, "broadcast", push).await;
    r
}

/// Send a presence track on `topic`; its ref.
async fn track(c: &mut PhoenixClient, jr: &str, topic: &str) -> String {
    let r = c.next_ref();
    let track = json!({"type": "presence", "event": "track", "payload": {"at": 1}});
    c.send(Some(jr), Some(&r), topic, "presence", track).await;
    r
}

/// Send `access_token` with `token` on `topic`.
async fn refresh(c: &mut PhoenixClient, jr: &str, topic: &str, token: &str) {
    let r = c.next_ref();
    let payload = json!({ "access_token": token });
    c.send(Some(jr), Some(&r), topic, "access_token", payload)
        .await;
}

/// While commands of the `waiting` topics wait for the frozen worker: a heartbeat, then
/// another channel's join, broadcast (acknowledged and sent to itself) and presence
/// track, each answered within `PROMPT`; nothing of the waiting topics is answered
/// meanwhile.
async fn answered_meanwhile(c: &mut PhoenixClient, waiting: &[&str]) {
    let mut seen = Vec::new();
    let r = c.next_ref();
    let at = Instant::now();
    c.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
        .await;
    let (f, skipped) = prompt(c, at, "a heartbeat", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    seen.extend(skipped);

    let other = "realtime:other";
    let mut cfg = config(json!([]), false, true);
    cfg["presence"] = json!({"key": "me", "enabled": true});
    let at = Instant::now();
    let jr = send_join(c, other, cfg).await;
    let (f, skipped) = prompt(c, at, "another channel's join", reply_to(&jr)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    seen.extend(skipped);

    let at = Instant::now();
    let r = broadcast(c, &jr, other, json!("other")).await;
    let (f, skipped) = prompt(c, at, "another channel's broadcast", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    let echo = |f: &Value| f[3] == "broadcast" && f[2] == other;
    match skipped.iter().find(|f| echo(f)) {
        Some(f) => assert_eq!(f[4]["payload"]["n"], "other", "{f}"),
        None => {
            let (f, more) = prompt(c, at, "the broadcast to itself", echo).await;
            assert_eq!(f[4]["payload"]["n"], "other", "{f}");
            seen.extend(more);
        }
    }
    seen.extend(skipped);

    let at = Instant::now();
    let r = track(c, &jr, other).await;
    let (f, skipped) = prompt(c, at, "another channel's track", reply_to(&r)).await;
    assert_eq!(f[4]["status"], "ok", "{f}");
    seen.extend(skipped);

    let early: Vec<&Value> = seen
        .iter()
        .filter(|f| waiting.iter().any(|t| f[2] == *t))
        .collect();
    assert!(
        early.is_empty(),
        "answered before the worker woke: {early:?}"
    );
}

/// The frames of each topic of `want` until it has its count (frames of other topics
/// and presence events skipped).
async fn frames_by_topic(
    c: &mut PhoenixClient,
    want: &[(&str, usize)],
) -> HashMap<String, Vec<Value>> {
    let mut got: HashMap<String, Vec<Value>> = HashMap::new();
    let full = |got: &HashMap<String, Vec<Value>>| {
        want.iter()
            .all(|(t, n)| got.get(*t).map_or(0, Vec::len) >= *n)
    };
    while !full(&got) {
        let f = c.recv_frame().await;
        let event = f[3].as_str().unwrap_or_default();
        if event.starts_with("presence_") {
            continue;
        }
        let topic = f[2].as_str().unwrap_or_default();
        if let Some((t, n)) = want.iter().find(|(t, _)| *t == topic) {
            let frames = got.entry(t.to_string()).or_default();
            assert!(frames.len() < *n, "more of {t} than expected: {f}");
            frames.push(f);
        }
    }
    got
}

/// Two frames in either order: a broadcast's ack (`r`) and its copy to the sender.
fn assert_ack_and_echo(frames: &[Value], r: &str, n: &str) {
    let ack = frames.iter().find(|f| f[3] == "phx_reply" && f[1] == r);
    let echo = frames.iter().find(|f| f[3] == "broadcast");
    let (Some(ack), Some(echo)) = (ack, echo) else {
        panic!("expected the ack of {r} and the broadcast itself: {frames:?}");
    };
    assert_eq!(ack[4]["status"], "ok", "{ack}");
    assert_eq!(echo[4]["payload"]["n"], n, "{echo}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_refresh_waiting_for_the_worker_holds_up_nothing_else_on_its_socket() {
    let _machine = crate::support::alone().await;
    let Setup {
        stack,
        worker,
        _front,
        mut c,
    } = setup().await;
    let (rows_a, rows_b) = ("realtime:rows_a", "realtime:rows_b");
    let (room_t, room_x) = ("realtime:room_t", "realtime:room_x");
    let a = join_ok(
        &mut c,
        rows_a,
        config(binding("pc", Some("n=eq.0")), false, false),
    )
    .await;
    let b = join_ok(
        &mut c,
        rows_b,
        config(binding("pc", Some("n=eq.1")), false, false),
    )
    .await;
    let t = join_ok(&mut c, room_t, config(json!([]), true, true)).await;
    let x = join_ok(&mut c, room_x, config(json!([]), true, false)).await;
    let fresh = token(json!({"role": "anon", "exp": now() + 3600, "fresh": 1}));
    let shut = token(json!({"role": "anon", "exp": now() + 3600, "shut": "yes"}));

    worker.signal("STOP");
    let frozen = Instant::now();
    // Each refresh waits for the worker; what its channel sends next waits behind it.
    refresh(&mut c, &a, rows_a, &fresh).await;
    let a1 = broadcast(&mut c, &a, rows_a, json!("a1")).await;
    refresh(&mut c, &b, rows_b, &fresh).await;
    refresh(&mut c, &t, room_t, &fresh).await;
    let t1 = broadcast(&mut c, &t, room_t, json!("t1")).await;
    refresh(&mut c, &x, room_x, &shut).await;
    let x1 = broadcast(&mut c, &x, room_x, json!("x1")).await;
    let mut behind_b = Vec::new();
    for i in 0..MAX_WAITING - 3 {
        behind_b.push(broadcast(&mut c, &b, rows_b, json!(format!("b{i}"))).await);
    }

    answered_meanwhile(&mut c, &[rows_a, rows_b, room_t, room_x]).await;
    // The frames waiting behind them are bounded: one more is refused at once.
    let at = Instant::now();
    let over = broadcast(&mut c, &b, rows_b, json!("one too many")).await;
    let (f, _) = prompt(&mut c, at, "one frame too many", reply_to(&over)).await;
    let reason = f[4]["response"]["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("ChannelBusy: "), "{f}");
    assert!(
        frozen.elapsed() < FROZEN_AT_MOST,
        "the worker must still be frozen: {:?}",
        frozen.elapsed()
    );

    // The worker answers: each refresh completes, then what waited behind it, in order.
    worker.signal("CONT");
    let got = frames_by_topic(
        &mut c,
        &[
            (rows_a, 2),
            (rows_b, 1 + behind_b.len()),
            (room_t, 2),
            (room_x, 3),
        ],
    )
    .await;
    for (topic, acks) in [(rows_a, vec![a1]), (rows_b, behind_b)] {
        let frames = &got[topic];
        let sys = &frames[0];
        assert_eq!(
            (&sys[3], &sys[4]["status"], &sys[4]["message"]),
            (
                &json!("system"),
                &json!("ok"),
                &json!("Subscribed to PostgreSQL")
            ),
            "{topic}: the refresh takes first: {frames:?}"
        );
        let replies: Vec<&Value> = frames[1..].iter().map(|f| &f[1]).collect();
        let expected: Vec<Value> = acks.iter().map(|r| json!(r)).collect();
        assert_eq!(
            replies,
            expected.iter().collect::<Vec<_>>(),
            "{topic}: {frames:?}"
        );
        assert!(
            frames[1..].iter().all(|f| f[4]["status"] == "ok"),
            "{frames:?}"
        );
    }
    // Read again and allowed: its broadcast, behind the refresh, is delivered.
    assert_ack_and_echo(&got[room_t], &t1, "t1");
    // Read refused with the new token: shut, and its broadcast finds no channel.
    let frames = &got[room_x];
    let shape: Vec<&Value> = frames.iter().map(|f| &f[3]).collect();
    assert_eq!(
        shape,
        [&json!("system"), &json!("phx_close"), &json!("phx_reply")]
    );
    let message = frames[0][4]["message"].as_str().unwrap_or_default();
    assert!(
        frames[0][4]["status"] == "error" && message.contains("read from this Channel topic"),
        "{frames:?}"
    );
    assert_eq!(frames[2][1], json!(x1), "{frames:?}");
    assert_eq!(frames[2][4]["response"]["reason"], "unmatched topic");

    // The refreshed subscriptions deliver.
    stack.sql("INSERT INTO pc VALUES (1, 0), (2, 1)");
    for (topic, id) in [(rows_a, 1), (rows_b, 2)] {
        let f = c
            .wait_frame("postgres_changes", TIMEOUT, |p| {
                p["data"]["record"]["id"] == id
            })
            .await;
        assert_eq!(f[2], topic, "{f}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_private_write_check_waiting_for_the_worker_holds_up_nothing_else() {
    let _machine = crate::support::alone().await;
    let Setup {
        stack: _stack,
        worker,
        _front,
        mut c,
    } = setup().await;
    let (room_w, room_r) = ("realtime:room_w", "realtime:room_r");
    let w = join_ok(&mut c, room_w, config(json!([]), true, true)).await;
    let r = join_ok(&mut c, room_r, config(json!([]), true, false)).await;

    worker.signal("STOP");
    let frozen = Instant::now();
    // A first broadcast, then a track behind it; a first track, then a broadcast.
    let w1 = broadcast(&mut c, &w, room_w, json!("w1")).await;
    let w2 = track(&mut c, &w, room_w).await;
    let r1 = track(&mut c, &r, room_r).await;
    let r2 = broadcast(&mut c, &r, room_r, json!("r2")).await;

    answered_meanwhile(&mut c, &[room_w, room_r]).await;
    assert!(
        frozen.elapsed() < FROZEN_AT_MOST,
        "the worker must still be frozen: {:?}",
        frozen.elapsed()
    );

    // The worker answers: as the write policy says, in order.
    worker.signal("CONT");
    let got = frames_by_topic(&mut c, &[(room_w, 3), (room_r, 1)]).await;
    let frames = &got[room_w];
    assert_ack_and_echo(&frames[..2], &w1, "w1");
    assert_eq!(
        (&frames[2][1], &frames[2][4]["status"]),
        (&json!(w2), &json!("ok")),
        "the track after the broadcast: {frames:?}"
    );
    let f = &got[room_r][0];
    assert_eq!(
        (&f[1], &f[4]["status"], &f[4]["response"]["reason"]),
        (&json!(r1), &json!("error"), &json!(WRITE_REFUSED)),
        "{f}"
    );
    // Its broadcast is dropped, as Supabase drops it: no ack before the next heartbeat.
    let hb = c.next_ref();
    c.send(None, Some(&hb), "phoenix", "heartbeat", json!({}))
        .await;
    loop {
        let f = c.recv_frame().await;
        assert!(f[1] != json!(r2), "a refused broadcast acknowledged: {f}");
        if f[3] == "phx_reply" && f[1] == json!(hb) {
            break;
        }
    }
    // Asked once: the next broadcast goes at once, with the worker frozen again.
    worker.signal("STOP");
    let at = Instant::now();
    let w3 = broadcast(&mut c, &w, room_w, json!("w3")).await;
    let (f, _) = prompt(&mut c, at, "a broadcast once allowed", reply_to(&w3)).await;
    worker.signal("CONT");
    assert_eq!(f[4]["status"], "ok", "{f}");
}
