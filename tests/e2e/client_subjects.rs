//! Client strings on NATS subjects: presence keys (JetStream KV keys) and channel topics
//! (broadcast subjects, from sockets, the REST API and `realtime.send`) of any length and
//! any bytes. A subject over nats-server's control line limit (4 KB) makes the server cut
//! the connection every part of the process shares; a bad token would be refused or
//! misrouted; two inputs sharing one token would cross. Every variant must reach its own
//! listeners on another front, exactly as sent, and the shared link must hold: another
//! project's socket on the same front sees no link error and keeps receiving its rows.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::management::STARTUP;
use crate::support::projects::{create_project, Project};
use crate::support::ws::anon;
use crate::support::{Stack, Worker};

/// The presence TTL of the fronts: each re-puts its entries every TTL / 3 (1 s).
const TTL_SECS: &str = "3";
/// Bound of one delivery between the fronts.
const WITHIN: Duration = Duration::from_secs(15);

/// Presence keys and topic names no token may be built from as they are.
fn hostile_names() -> Vec<String> {
    let long = "k".repeat(1500);
    vec![
        long.clone(),
        format!("{long}1"),
        format!("{long}2"),
        "é".repeat(1500),
        "🙂".repeat(700),
        ".".into(),
        "*".into(),
        ">".into(),
        "a b".into(),
        "a.b".into(),
        "a~2Eb".into(),
        "a_2Eb".into(),
        "\t\r\n\u{1}".into(),
        "ü*>.🙂 ~".into(),
    ]
}

/// A worker, two fronts (A attacked, B watching) and the default project's table `items`
/// streamed to a victim socket on A.
struct Setup {
    stack: Stack,
    _worker: Worker,
    a: Worker,
    b: Worker,
    victim: PhoenixClient,
    attacker: Project,
}

async fn setup() -> Setup {
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let env = [("PRESENCE_TTL_SECS", TTL_SECS)];
    let (mut a, mut b) = (
        Worker::front(&stack.nats.url(), &env),
        Worker::front(&stack.nats.url(), &env),
    );
    a.wait_http(STARTUP);
    b.wait_http(STARTUP);
    stack.sql("CREATE TABLE items (id int PRIMARY KEY, v text)");
    stack.enable("items");
    let attacker = create_project(&stack, "attacker");
    let mut victim = PhoenixClient::connect(&a.ws_url(&anon())).await;
    victim
        .join_subscribed(
            "realtime:victim",
            json!([{"event": "INSERT", "schema": "public", "table": "items"}]),
        )
        .await;
    Setup {
        stack,
        _worker: worker,
        a,
        b,
        victim,
        attacker,
    }
}

impl Setup {
    /// The victim got nothing but its rows since it joined (no `system` error: no link
    /// loss), then gets row `id`; neither front lost its NATS link.
    async fn victim_unharmed(&mut self, id: i32) {
        self.stack
            .sql(&format!("INSERT INTO items VALUES ({id}, 'after')"));
        let deadline = Instant::now() + WITHIN;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.victim.try_recv(left).await {
                Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                    if f[4]["data"]["record"]["id"] == id {
                        break;
                    }
                }
                Some(Msg::Frame(f)) if f[3] == "phx_reply" => {}
                Some(Msg::Frame(f)) => panic!("the victim got {}", short(&f)),
                Some(other) => panic!("the victim's socket: {other:?}"),
                None => panic!("the victim's row {id} did not come"),
            }
        }
        for (name, front) in [("A", &self.a), ("B", &self.b)] {
            let h = front.health().expect("health");
            assert_eq!(
                h["front"]["bus_disconnects"],
                0,
                "front {name} lost its NATS link: {h}\n{}",
                front.log_text()
            );
        }
    }
}

/// Every byte of `name` but letters and digits percent-encoded, for a URL path.
fn percent(name: &str) -> String {
    name.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A frame for a failure message, cut short (the names are kilobytes long).
fn short(f: &Value) -> String {
    f.to_string().chars().take(400).collect()
}

fn presence_config(key: &str) -> Value {
    json!({
        "broadcast": {"ack": false, "self": false},
        "presence": {"key": key, "enabled": true},
        "postgres_changes": [],
        "private": false
    })
}

/// The keys of a `presence_diff`'s `joins` (or `leaves`).
fn diff_keys(payload: &Value, side: &str) -> Vec<String> {
    payload[side]
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_keys_of_any_length_or_bytes_keep_the_shared_link() {
    let _machine = crate::support::shared().await;
    let mut s = setup().await;
    let topic = "realtime:room";
    let mut watcher = PhoenixClient::connect(&s.b.ws_url(&s.attacker.anon)).await;
    let (_, reply) = watcher.join(topic, presence_config("watcher"), None).await;
    assert_eq!(reply[4]["status"], "ok", "{}", short(&reply));
    watcher.wait_frame("presence_state", WITHIN, |_| true).await;

    // One socket per key on A, each tracking on the same topic.
    let keys = hostile_names();
    let mut trackers = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        let mut t = PhoenixClient::connect(&s.a.ws_url(&s.attacker.anon)).await;
        let (jr, reply) = t.join(topic, presence_config(key), None).await;
        assert_eq!(reply[4]["status"], "ok", "{}", short(&reply));
        let r = t.next_ref();
        let track = json!({"type": "presence", "event": "track", "payload": {"i": i}});
        t.send(Some(&jr), Some(&r), topic, "presence", track).await;
        let reply = t.reply_to(&r).await;
        assert_eq!(reply[4]["status"], "ok", "key {i}: {}", short(&reply));
        trackers.push(t);
    }

    // B sees every key exactly as sent, each with its own meta (no two keys merged).
    let want: BTreeSet<String> = keys.iter().cloned().collect();
    let mut seen = BTreeSet::new();
    let deadline = Instant::now() + WITHIN;
    while seen != want {
        let left = deadline.saturating_duration_since(Instant::now());
        let f = match watcher.try_recv(left).await {
            Some(Msg::Frame(f)) => f,
            Some(other) => panic!("the watcher's socket ended: {other:?}"),
            None => panic!(
                "presence keys missing on B: {:?}",
                want.difference(&seen)
                    .map(|k| k.chars().take(20).collect::<String>())
                    .collect::<Vec<_>>()
            ),
        };
        if f[3] != "presence_diff" {
            continue;
        }
        assert!(
            diff_keys(&f[4], "leaves").is_empty(),
            "a leave: {}",
            short(&f)
        );
        for k in diff_keys(&f[4], "joins") {
            let i = keys.iter().position(|x| *x == k).expect("a key never sent");
            let metas = f[4]["joins"][&k]["metas"].as_array().expect("metas");
            assert_eq!(metas.len(), 1, "{}", short(&f));
            assert_eq!(metas[0]["i"], i, "key {i} carries another's: {}", short(&f));
            seen.insert(k);
        }
    }

    // A key too large for a presence entry: the track is refused (Supabase's text), the
    // channel shut; nothing reaches the bus.
    let mut big = PhoenixClient::connect(&s.a.ws_url(&s.attacker.anon)).await;
    let (jr, reply) = big
        .join(topic, presence_config(&"k".repeat(21_000)), None)
        .await;
    assert_eq!(reply[4]["status"], "ok", "{}", short(&reply));
    let r = big.next_ref();
    let track = json!({"type": "presence", "event": "track", "payload": {"big": true}});
    big.send(Some(&jr), Some(&r), topic, "presence", track)
        .await;
    big.expect_shut(topic, "Track message size exceeded").await;

    // Several refreshes (every second) later: no leave on B, nothing cut on A.
    let quiet = Instant::now() + Duration::from_secs(4);
    while let Some(m) = watcher
        .try_recv(quiet.saturating_duration_since(Instant::now()))
        .await
    {
        match m {
            Msg::Frame(f) if f[3] == "presence_diff" => panic!("a diff: {}", short(&f)),
            Msg::Frame(f) if f[3] == "system" => panic!("the watcher was told: {}", short(&f)),
            Msg::Frame(_) => {}
            other => panic!("the watcher's socket ended: {other:?}"),
        }
    }
    watcher.heartbeat_ok().await;
    for t in &mut trackers {
        t.heartbeat_ok_skipping_changes().await;
    }
    s.victim_unharmed(1).await;

    // A later join on B lists every key; a tracker leaving is one leave, of its own key.
    let mut late = PhoenixClient::connect(&s.b.ws_url(&s.attacker.anon)).await;
    let (_, reply) = late.join(topic, presence_config("late"), None).await;
    assert_eq!(reply[4]["status"], "ok", "{}", short(&reply));
    let state = late.wait_frame("presence_state", WITHIN, |_| true).await;
    let listed: BTreeSet<String> = state[4].as_object().unwrap().keys().cloned().collect();
    assert!(listed.is_superset(&want), "presence_state lacks keys");
    drop(trackers.remove(1));
    let f = watcher
        .wait_frame("presence_diff", WITHIN, |p| {
            !diff_keys(p, "leaves").is_empty()
        })
        .await;
    assert!(
        diff_keys(&f[4], "leaves") == [keys[1].clone()],
        "{}",
        short(&f)
    );
    s.victim_unharmed(2).await;
}

/// A public channel `topic` on `front` with broadcast, for `key`'s project.
async fn broadcast_channel(front: &Worker, key: &str, topic: &str) -> (PhoenixClient, String) {
    let mut c = PhoenixClient::connect(&front.ws_url(key)).await;
    let config = json!({"broadcast": {"ack": true, "self": false}, "private": false});
    let (jr, reply) = c.join(topic, config, None).await;
    assert_eq!(reply[4]["status"], "ok", "{}", short(&reply));
    (c, jr)
}

/// The next broadcast of `listener` (skipping other frames); `None` within `d`.
async fn next_broadcast(listener: &mut PhoenixClient, d: Duration) -> Option<Value> {
    let deadline = Instant::now() + d;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match listener.try_recv(left).await? {
            Msg::Frame(f) if f[3] == "broadcast" => return Some(f),
            Msg::Frame(f) if f[3] == "system" => panic!("the listener was told: {}", short(&f)),
            Msg::Frame(_) => {}
            other => panic!("the listener's socket ended: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topics_of_any_length_or_bytes_reach_their_own_listeners_on_every_front() {
    let _machine = crate::support::shared().await;
    let mut s = setup().await;
    let key = s.attacker.anon.clone();
    let names = hostile_names();
    let mut listeners = Vec::new();
    for name in &names {
        let topic = format!("realtime:{name}");
        listeners.push(broadcast_channel(&s.b, &key, &topic).await.0);
    }

    // From a socket on A: each listener gets its own message, its topic as sent.
    for (i, name) in names.iter().enumerate() {
        let topic = format!("realtime:{name}");
        let (mut sender, jr) = broadcast_channel(&s.a, &key, &topic).await;
        let r = sender.next_ref();
        let msg = json!({"type": "broadcast", "event": "m", "payload": {"i": i}});
        sender
            .send(Some(&jr), Some(&r), &topic, "broadcast", msg)
            .await;
        let reply = sender.reply_to(&r).await;
        assert_eq!(reply[4]["status"], "ok", "topic {i}: {}", short(&reply));
    }
    for (i, l) in listeners.iter_mut().enumerate() {
        let f = next_broadcast(l, WITHIN)
            .await
            .unwrap_or_else(|| panic!("topic {i}: nothing"));
        assert!(
            f[2] == format!("realtime:{}", names[i]),
            "topic {i}: {}",
            short(&f)
        );
        assert_eq!(
            f[4]["payload"]["i"],
            i,
            "topic {i} got another's: {}",
            short(&f)
        );
    }
    s.victim_unharmed(1).await;

    // The REST API, through A.
    let messages: Vec<Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| json!({"topic": n, "event": "rest", "payload": {"i": i}, "private": false}))
        .collect();
    let body = json!({ "messages": messages }).to_string();
    let (status, text) = s.a.request(
        "POST",
        "/realtime/v1/api/broadcast",
        &[("apikey", key.as_str())],
        Some(&body),
    );
    assert_eq!(status, 202, "{text}");
    for (i, l) in listeners.iter_mut().enumerate() {
        let f = next_broadcast(l, WITHIN)
            .await
            .unwrap_or_else(|| panic!("REST {i}: nothing"));
        assert_eq!(
            (f[4]["event"].clone(), f[4]["payload"]["i"].clone()),
            (json!("rest"), json!(i)),
            "{}",
            short(&f)
        );
    }
    // The single-message route: the topic in the path.
    for (i, name) in names.iter().enumerate() {
        let path = format!("/realtime/v1/api/broadcast/{}/events/one", percent(name));
        let body = json!({ "i": i }).to_string();
        let (status, text) =
            s.a.request("POST", &path, &[("apikey", key.as_str())], Some(&body));
        assert_eq!(status, 202, "topic {i}: {text}");
    }
    for (i, l) in listeners.iter_mut().enumerate() {
        let f = next_broadcast(l, WITHIN)
            .await
            .unwrap_or_else(|| panic!("REST path {i}: nothing"));
        let got = (f[4]["event"].clone(), f[4]["payload"]["i"].clone());
        assert_eq!(got, (json!("one"), json!(i)), "{}", short(&f));
    }
    s.victim_unharmed(2).await;

    // `realtime.send` from the database (the worker's link): the attacker's login.
    s.stack.sql(&format!(
        "CREATE POLICY open_write ON realtime.messages FOR INSERT TO PUBLIC WITH CHECK (true);
         CREATE ROLE mallory LOGIN;
         GRANT USAGE ON SCHEMA realtime TO mallory;
         GRANT SELECT, INSERT ON realtime.messages TO mallory;
         INSERT INTO walcast.project_roles VALUES ('{}', 'mallory');",
        s.attacker.id
    ));
    for (i, name) in names.iter().enumerate() {
        let quoted = name.replace('\'', "''");
        let out = s.stack.sql(&format!(
            "SET SESSION AUTHORIZATION mallory; SET walcast.project = '{}';
             SELECT realtime.send('{{\"i\": {i}}}'::jsonb, 'db', E'{}', false);",
            s.attacker.id,
            quoted.replace('\\', "\\\\")
        ));
        assert!(!out.contains("WARNING"), "{out}");
    }
    for (i, l) in listeners.iter_mut().enumerate() {
        let f = next_broadcast(l, WITHIN)
            .await
            .unwrap_or_else(|| panic!("db {i}: nothing"));
        assert_eq!(
            (f[4]["event"].clone(), f[4]["payload"]["i"].clone()),
            (json!("db"), json!(i)),
            "{}",
            short(&f)
        );
    }
    s.victim_unharmed(3).await;
    for (i, l) in listeners.iter_mut().enumerate() {
        assert!(
            next_broadcast(l, Duration::from_millis(300))
                .await
                .is_none(),
            "topic {i}: twice"
        );
    }
}
