//! Heartbeat, join, delivery, leave, re-join, unmatched topic, shutdown.

use std::sync::Arc;
use std::time::Duration;

use crate::support::*;
use serde_json::json;
use tokio::sync::Semaphore;
use walcast_front::FrontConfig;

#[tokio::test]
async fn heartbeat_v2_and_v1() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.heartbeat_ok().await;
    let mut c1 = s.client("1.0.0").await;
    c1.heartbeat_ok().await;
}

#[tokio::test]
async fn join_registers_before_reply_and_echoes_ids_in_order() {
    let s = start().await;
    let gate = Arc::new(Semaphore::new(0));
    *s.worker.gate.lock().unwrap() = Some(gate.clone());
    let mut c = s.client("2.0.0").await;
    let bindings = json!([
        {"event":"INSERT","schema":"public","table":"todos","filter":"user_id=eq.42"},
        {"event":"*","schema":"public","table":"todos"}
    ]);
    c.send(
        Some("3"),
        Some("3"),
        "realtime:room1",
        "phx_join",
        json!({"config": pg_config(bindings), "access_token": user("u1")}),
    )
    .await;
    // The worker got the registration; no reply while it has not answered.
    s.wait_for("register", |s| s.worker.registered().len() == 2)
        .await;
    c.assert_silent(Duration::from_millis(300)).await;
    let specs = s.worker.registered();
    assert_eq!(specs[0].event, "INSERT");
    assert_eq!(specs[0].filter.as_deref(), Some("user_id=eq.42"));
    assert_eq!(specs[1].event, "*");
    assert_eq!(specs[0].claims["sub"], "u1");
    assert_eq!(specs[0].project, "default");
    assert!(specs[0].id.starts_with(&format!("{}:", s.front.id())));
    gate.add_permits(10);

    let reply = c.recv().await;
    let f = reply.frame();
    assert_eq!(f[0], "3");
    assert_eq!(f[1], "3");
    assert_eq!(f[3], "phx_reply");
    assert_eq!(f[4]["status"], "ok");
    let pc = f[4]["response"]["postgres_changes"].as_array().unwrap();
    assert_eq!(pc.len(), 2);
    assert_eq!(pc[0]["event"], "INSERT");
    assert_eq!(pc[0]["filter"], "user_id=eq.42");
    assert_eq!(pc[1]["event"], "*");
    assert!(pc[0]["id"].is_u64() && pc[1]["id"].is_u64());
    assert_ne!(pc[0]["id"], pc[1]["id"]);

    let sys = c.recv().await;
    assert_eq!(
        sys.frame(),
        &json!(["3", null, "realtime:room1", "system", {"extension":"postgres_changes","status":"ok","message":"Subscribed to PostgreSQL","channel":"room1"}])
    );
}

#[tokio::test]
async fn join_without_bindings_replies_empty_array_and_no_system() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let (_, f) = c.join("realtime:plain", json!({}), None).await;
    assert_eq!(
        f[4],
        json!({"status":"ok","response":{"postgres_changes":[]}})
    );
    c.assert_silent(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn refused_bindings_get_a_system_error_and_the_channel_stays() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let (_, f) = c
        .join(
            "realtime:bad",
            pg_config(json!([{"event":"*","schema":"public","table":"unknown"}, {"event":"*","schema":"public","table":"t","filter":"a=bogus.1"}])),
            None,
        )
        .await;
    assert_eq!(f[4]["status"], "ok");
    let sys = c.recv().await;
    assert_eq!(sys.event(), "system");
    assert_eq!(sys.payload()["status"], "error");
    let msg = sys.payload()["message"].as_str().unwrap();
    assert!(
        msg.contains("Unable to subscribe") && msg.contains("bogus"),
        "{msg}"
    );
    c.heartbeat_ok().await;
    // Still joined: a push on it is not an unmatched topic.
    let r = c.next_ref();
    c.send(
        Some(f[0].as_str().unwrap()),
        Some(&r),
        "realtime:bad",
        "presence",
        json!({"type":"presence","event":"untrack"}),
    )
    .await;
    assert_eq!(c.recv().await.payload()["status"], "ok");
}

async fn delivery(vsn: &str) {
    let s = start().await;
    let mut c = s.client(vsn).await;
    let (_, f) = c
        .join(
            "realtime:room1",
            pg_config(json!([
                {"event":"INSERT","schema":"public","table":"todos"},
                {"event":"*","schema":"public","table":"todos"},
                {"event":"DELETE","schema":"public","table":"todos"}
            ])),
            None,
        )
        .await;
    let ids: Vec<u64> = f[4]["response"]["postgres_changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_u64().unwrap())
        .collect();
    assert_eq!(c.recv().await.event(), "system");
    let subs = s.worker.ids_for("todos");
    // The worker matched the INSERT binding and the `*` binding.
    s.change(
        "todos",
        "INSERT",
        json!({"id": 7, "done": false, "tags": ["a","b"]}),
        &subs[..2],
    )
    .await;
    let m = c.recv_event("postgres_changes").await;
    let f = m.frame();
    assert_eq!(f[0], json!(null));
    assert_eq!(f[1], json!(null));
    assert_eq!(f[2], "realtime:room1");
    assert_eq!(f[4]["ids"], json!([ids[0], ids[1]]));
    let data = &f[4]["data"];
    assert_eq!(data["type"], "INSERT");
    assert_eq!(data["schema"], "public");
    assert_eq!(data["table"], "todos");
    assert_eq!(data["commit_timestamp"], "2026-01-01T00:00:00.123Z");
    assert_eq!(
        data["record"],
        json!({"id": 7, "done": false, "tags": ["a","b"]})
    );
    assert!(data.get("old_record").is_none());
    assert_eq!(data["errors"], json!(null));
    assert_eq!(data["columns"][0], json!({"name":"done","type":"bool"}));

    // A DELETE matched by the `*` and DELETE bindings (and a repeated id is not repeated).
    s.change(
        "todos",
        "DELETE",
        json!({"id": 7}),
        &[subs[1].clone(), subs[2].clone(), subs[1].clone()],
    )
    .await;
    let m = c.recv_event("postgres_changes").await;
    assert_eq!(m.payload()["ids"], json!([ids[1], ids[2]]));
    assert_eq!(m.payload()["data"]["old_record"], json!({"id": 7}));
    assert!(m.payload()["data"].get("record").is_none());

    // Ids of other fronts and unknown ids deliver nothing.
    s.change(
        "todos",
        "INSERT",
        json!({"id": 8}),
        &["other-front:1".into(), format!("{}:999999", s.front.id())],
    )
    .await;
    c.assert_silent(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn postgres_changes_v2() {
    delivery("2.0.0").await;
}

#[tokio::test]
async fn postgres_changes_v1() {
    delivery("1.0.0").await;
}

#[tokio::test]
async fn two_channels_on_one_socket_each_get_only_their_own() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.join(
        "realtime:a",
        pg_config(json!([{"event":"*","schema":"public","table":"ta"}])),
        None,
    )
    .await;
    assert_eq!(c.recv().await.event(), "system");
    c.join(
        "realtime:b",
        pg_config(json!([{"event":"*","schema":"public","table":"tb"}])),
        None,
    )
    .await;
    assert_eq!(c.recv().await.event(), "system");
    let (ta, tb) = (s.worker.ids_for("ta"), s.worker.ids_for("tb"));
    s.change("ta", "INSERT", json!({"id": 1}), &ta).await;
    s.change("tb", "INSERT", json!({"id": 2}), &tb).await;
    let m1 = c.recv_event("postgres_changes").await;
    let m2 = c.recv_event("postgres_changes").await;
    assert_eq!(m1.frame()[2], "realtime:a");
    assert_eq!(m1.payload()["data"]["record"]["id"], 1);
    assert_eq!(m2.frame()[2], "realtime:b");
    assert_eq!(m2.payload()["data"]["record"]["id"], 2);
    c.assert_silent(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn leave_replies_ok_then_closes_and_unregisters() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let (jr, _) = c
        .join(
            "realtime:room",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            None,
        )
        .await;
    assert_eq!(c.recv().await.event(), "system");
    let ids = s.worker.ids_for("t");
    c.send(
        Some(&jr),
        Some("12"),
        "realtime:room",
        "phx_leave",
        json!({}),
    )
    .await;
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr, "12", "realtime:room", "phx_reply", {"status":"ok","response":{}}])
    );
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr, jr, "realtime:room", "phx_close", {}])
    );
    assert_eq!(s.worker.unregistered(), ids);
    // No more delivery; a leave for a topic not joined still gets ok.
    s.change("t", "INSERT", json!({"id": 1}), &ids).await;
    c.send(None, Some("13"), "realtime:never", "phx_leave", json!({}))
        .await;
    assert_eq!(c.recv().await.payload()["status"], "ok");
    c.assert_silent(Duration::from_millis(200)).await;
}

#[tokio::test]
async fn socket_close_unregisters() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.join(
        "realtime:room",
        pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
        None,
    )
    .await;
    let ids = s.worker.ids_for("t");
    drop(c);
    s.wait_for("unregister", |s| s.worker.unregistered() == ids)
        .await;
    s.wait_for("connection gone", |s| s.front.health().connections == 0)
        .await;
    assert_eq!(s.front.health().channels, 0);
}

#[tokio::test]
async fn rejoin_replaces_the_channel() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    let (jr1, _) = c
        .join(
            "realtime:room",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            None,
        )
        .await;
    assert_eq!(c.recv().await.event(), "system");
    let first = s.worker.ids_for("t");
    let r = c.next_ref();
    c.send(
        Some(&r),
        Some(&r),
        "realtime:room",
        "phx_join",
        json!({"config": pg_config(json!([{"event":"*","schema":"public","table":"t"}]))}),
    )
    .await;
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr1, jr1, "realtime:room", "phx_close", {}])
    );
    let reply = c.recv().await;
    assert_eq!(reply.frame()[1], json!(r));
    assert_eq!(reply.payload()["status"], "ok");
    assert_eq!(s.worker.unregistered(), first);
    assert_eq!(s.front.health().channels, 1);
}

#[tokio::test]
async fn unmatched_topic() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.send(
        Some("1"),
        Some("5"),
        "realtime:nope",
        "access_token",
        json!({"access_token": "x"}),
    )
    .await;
    assert_eq!(
        c.recv().await.frame(),
        &json!(["1", "5", "realtime:nope", "phx_reply", {"status":"error","response":{"reason":"unmatched topic"}}])
    );
    c.send(None, Some("6"), "elsewhere", "phx_join", json!({}))
        .await;
    assert_eq!(
        c.recv().await.payload()["response"]["reason"],
        "unmatched topic"
    );
    c.send(None, Some("7"), "realtime:", "phx_join", json!({}))
        .await;
    assert_eq!(
        c.recv().await.payload()["response"]["reason"],
        "TopicNameRequired: You must provide a topic name"
    );
}

#[tokio::test]
async fn shutdown_closes_sockets_with_1001() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.heartbeat_ok().await;
    s.cancel.cancel();
    assert_eq!(
        c.recv().await,
        Msg::Close(1001, "server shutting down".into())
    );
    tokio::time::timeout(TIMEOUT, s.front.closed())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_client_close_is_answered_with_its_code() {
    use futures_util::SinkExt;
    use tokio_tungstenite::tungstenite::protocol::{frame::coding::CloseCode, CloseFrame};
    use tokio_tungstenite::tungstenite::Message;
    let s = start().await;
    for (code, vsn) in [(1000u16, "2.0.0"), (4001, "1.0.0")] {
        let mut c = s.client(vsn).await;
        c.join("realtime:room", pg_config(json!([])), None).await;
        let frame = CloseFrame {
            code: CloseCode::from(code),
            reason: "bye".into(),
        };
        c.ws.send(Message::Close(Some(frame))).await.unwrap();
        // Our own Close was sent: the next message must be the server's, not an EOF.
        assert_eq!(c.recv().await, Msg::Close(code, "bye".into()), "vsn {vsn}");
    }
    s.wait_for("connections gone", |s| s.front.health().connections == 0)
        .await;
}

/// A health beacon of a pipeline process, as a cdc-worker publishes it once a second.
async fn pipeline_beacon(s: &Server, leader: bool) {
    use walcast_bus::beacon::{Beacon, WorkerBeacon};
    let b = Beacon {
        process: format!("worker-{leader}"),
        at_ms: 1,
        bus_connected: true,
        worker: Some(WorkerBeacon {
            leader,
            cdc_active: leader,
            ..Default::default()
        }),
        front: None,
        sources: Vec::new(),
    };
    s.bus.publish(b.subject(), &[], b.encode()).await.unwrap();
}

#[tokio::test]
async fn replication_ready_waits_for_a_streaming_leader() {
    let s = start().await;
    let mut config = pg_config(json!([]));
    config["broadcast"]["replication_ready"] = json!(true);
    let ready = |jr: &str, name: &str| json!([jr, null, format!("realtime:{name}"), "system", {"extension":"system","status":"ok","message":"Replication connection established","channel":name}]);
    let mut c = s.client("2.0.0").await;
    let (jr, reply) = c.join("realtime:room", config.clone(), None).await;
    assert_eq!(reply[4]["status"], "ok");
    // No pipeline heard yet, then only a standby: no message.
    c.assert_silent(Duration::from_millis(700)).await;
    pipeline_beacon(&s, false).await;
    c.assert_silent(Duration::from_millis(700)).await;
    // A leader streams: the message comes (once), with the channel's join_ref.
    pipeline_beacon(&s, true).await;
    assert_eq!(c.recv().await.frame(), &ready(&jr, "room"));
    c.assert_silent(Duration::from_millis(700)).await;
    // A later join gets it at once, right after its reply; a join without the flag not.
    let (jr2, _) = c.join("realtime:other", config, None).await;
    assert_eq!(c.recv().await.frame(), &ready(&jr2, "other"));
    c.join("realtime:plain", pg_config(json!([])), None).await;
    c.assert_silent(Duration::from_millis(300)).await;
}

#[tokio::test]
async fn replication_ready_not_in_time_closes_the_channel() {
    let s = start_with(FrontConfig {
        replication_ready_timeout: Duration::from_secs(1),
        ..FrontConfig::default()
    })
    .await;
    let mut config = pg_config(json!([]));
    config["broadcast"]["replication_ready"] = json!(true);
    let mut c = s.client("1.0.0").await;
    let (jr, _) = c.join("realtime:room", config, None).await;
    // Supabase's words, then why: no worker heard streaming the project's source.
    let error = c.recv().await.frame().clone();
    let message = error[4]["message"].as_str().unwrap_or_default().to_string();
    assert_eq!(
        error,
        json!([jr, null, "realtime:room", "system", {"extension":"system","status":"error","message":message,"channel":"room"}])
    );
    assert!(
        message.starts_with(
            "Replication connection was not established in time: the database of project "
        ) && message.ends_with(
            "(source \"default\") is not streaming changes: no cdc-worker is reading it"
        ),
        "{message}"
    );
    assert_eq!(
        c.recv().await.frame(),
        &json!([jr, jr, "realtime:room", "phx_close", {}])
    );
    s.wait_for("channel closed", |s| s.front.health().channels == 0)
        .await;
    // The socket goes on.
    c.heartbeat_ok().await;
}

#[tokio::test]
async fn resync_reregisters_everything_and_sync_lists_ids() {
    let s = start().await;
    let mut c = s.client("2.0.0").await;
    c.join("realtime:a", pg_config(json!([{"event":"*","schema":"public","table":"t1"},{"event":"*","schema":"public","table":"t2"}])), None).await;
    let ids: Vec<String> = s.worker.registered().into_iter().map(|s| s.id).collect();
    s.bus
        .publish(
            walcast_bus::subs::SUBJECT_RESYNC.to_string(),
            &[],
            bytes::Bytes::new(),
        )
        .await
        .unwrap();
    s.wait_for("re-registration", |s| s.worker.register_calls().len() == 2)
        .await;
    let mut again: Vec<String> = s.worker.register_calls()[1]
        .iter()
        .map(|s| s.id.clone())
        .collect();
    again.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(again, want);
    // The periodic sync (every 5 s) lists this front's ids.
    s.wait_for("sync with ids", |s| {
        s.worker.calls.lock().unwrap().iter().any(|c| match c {
            Call::Sync(m) => m.front == s.front.id() && m.ids.len() == 2,
            _ => false,
        })
    })
    .await;
}

/// A subscription a new leader refuses on resync, or that cannot be registered with it
/// at all, ends with a `system` error to its channel rather than leaving the client
/// subscribed and deaf.
#[tokio::test]
async fn a_resync_that_refuses_or_fails_tells_the_channel() {
    let s = start_with(walcast_front::FrontConfig {
        register_timeout: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let mut c = s.client("2.0.0").await;
    let both = json!([{"event":"*","schema":"public","table":"t1"},{"event":"*","schema":"public","table":"t2"}]);
    c.join("realtime:a", pg_config(both), None).await;
    let resync = || async {
        let subject = walcast_bus::subs::SUBJECT_RESYNC.to_string();
        s.bus
            .publish(subject, &[], bytes::Bytes::new())
            .await
            .unwrap();
    };
    s.worker.refuse_tables.lock().unwrap().push("t2".into());
    resync().await;
    let sys = c
        .wait_frame("system", TIMEOUT, |p| p["status"] == "error")
        .await;
    let message = sys[4]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("table unknown"), "{sys}");
    s.wait_for("t2 unregistered", |s| {
        s.worker.unregistered() == s.worker.ids_for("t2")
    })
    .await;
    assert_eq!(s.front.health().subscriptions, 1);

    // The new leader never answers: after three tries the channel is told.
    *s.worker.gate.lock().unwrap() = Some(Arc::new(Semaphore::new(0)));
    resync().await;
    let sys = c
        .wait_frame("system", Duration::from_secs(10), |p| {
            p["status"] == "error"
        })
        .await;
    let message = sys[4]["message"].as_str().unwrap_or_default().to_string();
    assert!(message.contains("after a failover"), "{sys}");
    s.wait_for("no subscription left", |s| {
        s.front.health().subscriptions == 0
    })
    .await;
}

#[tokio::test]
async fn a_worker_that_does_not_answer_fails_the_join() {
    let s = start_with(walcast_front::FrontConfig {
        register_timeout: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    *s.worker.gate.lock().unwrap() = Some(Arc::new(Semaphore::new(0)));
    let mut c = s.client("2.0.0").await;
    let (_, f) = c
        .join(
            "realtime:room",
            pg_config(json!([{"event":"*","schema":"public","table":"t"}])),
            None,
        )
        .await;
    assert_eq!(f[4]["status"], "error");
    let reason = f[4]["response"]["reason"].as_str().unwrap();
    assert!(reason.starts_with("UnableToSubscribe: "), "{reason}");
    assert_eq!(s.worker.unregistered(), s.worker.ids_for("t"));
    assert_eq!(s.front.health().subscriptions, 0);
    assert_eq!(s.front.health().channels, 0);
    c.heartbeat_ok().await;
}
