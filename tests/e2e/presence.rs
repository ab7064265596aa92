//! Presence across two `ws-front` processes on one NATS (JetStream KV bucket
//! `walcast_presence`): track on one replica is seen on the other, untrack gives the leave,
//! and a replica killed with `kill -9` has its presences gone for the others within about
//! `PRESENCE_TTL_SECS`.

use crate::support;

use std::time::{Duration, Instant};

use crate::support::ws::anon;
use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};
use walcast_testkit::Nats;

const TTL_SECS: u64 = 4;
const TOPIC: &str = "realtime:lobby";

fn presence_config(key: &str) -> Value {
    json!({
        "broadcast": {"ack": false, "self": false},
        "presence": {"key": key, "enabled": true},
        "postgres_changes": [],
        "private": false
    })
}

/// Join `TOPIC` with presence on; returns the presence_state payload.
async fn join_presence(ws: &mut PhoenixClient, key: &str) -> Value {
    let (jr, reply) = ws.join(TOPIC, presence_config(key), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let state = ws
        .wait_frame("presence_state", Duration::from_secs(10), |_| true)
        .await;
    assert_eq!(
        state[0],
        json!(jr),
        "presence_state carries the join_ref: {state}"
    );
    state[4].clone()
}

async fn push(ws: &mut PhoenixClient, jr: &str, payload: Value) {
    let r = ws.next_ref();
    ws.send(Some(jr), Some(&r), TOPIC, "presence", payload)
        .await;
    let reply = ws.reply_to(&r).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
}

fn metas<'a>(map: &'a Value, key: &str) -> &'a [Value] {
    map[key]["metas"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn presence_across_replicas_and_replica_death() {
    let _machine = crate::support::shared().await;
    let nats = Nats::start().expect("start nats-server");
    let ttl = TTL_SECS.to_string();
    let front = || support::Worker::front(&nats.url(), &[("PRESENCE_TTL_SECS", ttl.as_str())]);
    let (mut a, mut b) = (front(), front());
    a.wait_http(Duration::from_secs(20));
    b.wait_http(Duration::from_secs(20));

    // A watcher on B, then a tracker on A.
    let mut watcher = PhoenixClient::connect(&b.ws_url(&anon())).await;
    let state = join_presence(&mut watcher, "watcher").await;
    assert_eq!(state, json!({}), "nothing tracked yet");

    let mut ann = PhoenixClient::connect(&a.ws_url(&anon())).await;
    join_presence(&mut ann, "ann").await;
    let jr_ann = "1"; // the first join of this socket
    push(
        &mut ann,
        jr_ann,
        json!({"type": "presence", "event": "track", "payload": {"user": "ann"}}),
    )
    .await;

    let diff = watcher
        .wait_frame("presence_diff", Duration::from_secs(10), |p| {
            !metas(&p["joins"], "ann").is_empty()
        })
        .await;
    let meta = &metas(&diff[4]["joins"], "ann")[0];
    assert_eq!(meta["user"], "ann", "{diff}");
    let phx_ref = meta["phx_ref"].as_str().expect("phx_ref").to_string();

    // A later join on B lists A's presence in presence_state.
    let mut late = PhoenixClient::connect(&b.ws_url(&anon())).await;
    let state = join_presence(&mut late, "late").await;
    assert_eq!(metas(&state, "ann").len(), 1, "{state}");
    assert_eq!(
        metas(&state, "ann")[0]["phx_ref"],
        json!(phx_ref),
        "{state}"
    );

    // Untrack on A: the leave on B.
    push(
        &mut ann,
        jr_ann,
        json!({"type": "presence", "event": "untrack"}),
    )
    .await;
    let diff = watcher
        .wait_frame("presence_diff", Duration::from_secs(10), |p| {
            !metas(&p["leaves"], "ann").is_empty()
        })
        .await;
    assert_eq!(
        metas(&diff[4]["leaves"], "ann")[0]["phx_ref"],
        json!(phx_ref),
        "{diff}"
    );

    // Track again, and survive several refreshes: no leave while A lives.
    push(
        &mut ann,
        jr_ann,
        json!({"type": "presence", "event": "track", "payload": {"user": "ann", "n": 2}}),
    )
    .await;
    let diff = watcher
        .wait_frame("presence_diff", Duration::from_secs(10), |p| {
            !metas(&p["joins"], "ann").is_empty()
        })
        .await;
    let phx_ref2 = metas(&diff[4]["joins"], "ann")[0]["phx_ref"].clone();
    let quiet = Duration::from_secs(TTL_SECS * 2);
    let deadline = Instant::now() + quiet;
    while let Some(m) = watcher
        .try_recv(deadline.saturating_duration_since(Instant::now()))
        .await
    {
        match m {
            Msg::Frame(f) if f[3] == "presence_diff" => {
                panic!("unexpected diff while the tracker lives (refresh failed?): {f}")
            }
            Msg::Frame(_) => {}
            other => panic!("watcher socket ended: {other:?}"),
        }
    }
    // Keep the watcher's socket alive across the quiet period.
    watcher.heartbeat_ok().await;

    // kill -9 A: its presence is gone for B within the TTL plus a few seconds.
    a.kill9();
    let killed = Instant::now();
    let bound = Duration::from_secs(TTL_SECS + 4);
    let diff = watcher
        .wait_frame("presence_diff", bound, |p| {
            !metas(&p["leaves"], "ann").is_empty()
        })
        .await;
    assert_eq!(
        metas(&diff[4]["leaves"], "ann")[0]["phx_ref"],
        phx_ref2,
        "{diff}"
    );
    assert!(
        killed.elapsed() <= bound,
        "leave after {:?}",
        killed.elapsed()
    );
    // And a fresh join on B no longer lists it.
    let mut after = PhoenixClient::connect(&b.ws_url(&anon())).await;
    let state = join_presence(&mut after, "after").await;
    assert!(
        metas(&state, "ann").is_empty(),
        "{state}\nB log:\n{}",
        b.log_text()
    );
}
