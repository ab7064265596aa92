//! NATS restarted under load: `walcast serve` on NATS keeps its WebSocket clients
//! connected, reports the outage on /health and /readyz (503), and delivers changes
//! committed after NATS is back.

use std::time::{Duration, Instant};

use crate::support::ws::anon;
use crate::support::{Stack, Worker};
use serde_json::json;
use walcast_testkit::phoenix::{Msg, PhoenixClient};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_survive_a_nats_restart_and_receive_what_follows() {
    let _machine = crate::support::shared().await;
    let mut stack = Stack::start("stream");
    stack.sql("CREATE TABLE n (id int PRIMARY KEY, phase text)");
    stack.enable("n");
    let mut server = Worker::serve(
        &stack.pg.url(),
        &[
            ("NATS_URL", &stack.nats.url()),
            ("LEASE_DURATION_SECS", "3"),
        ],
    );
    server.wait_active(Duration::from_secs(60));
    let mut ws = PhoenixClient::connect(&server.ws_url(&anon())).await;
    ws.join_subscribed(
        "realtime:n",
        json!([{"event": "INSERT", "schema": "public", "table": "n"}]),
    )
    .await;

    // Load before and during the outage.
    let writer = stack.pg.connect().await.unwrap();
    let stmt = writer
        .prepare("INSERT INTO n VALUES ($1, $2)")
        .await
        .unwrap();
    for i in 0..200 {
        writer.execute(&stmt, &[&i, &"before"]).await.unwrap();
    }
    stack.nats.stop();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.health().is_none_or(|h| h["bus_connected"] != false) {
        assert!(
            Instant::now() < deadline,
            "outage not reported: {:?}",
            server.health()
        );
        writer
            .execute(&stmt, &[&(10_000 + rand_id()), &"during"])
            .await
            .ok();
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, why) = server.status("/readyz");
    assert_eq!(status, 503, "/readyz while NATS is down: {why}");
    assert!(why.contains("NATS"), "{why}");
    assert_eq!(server.status("/livez").0, 200);
    for i in 200..400 {
        writer.execute(&stmt, &[&i, &"during"]).await.unwrap();
    }
    stack.nats.restart().expect("restart nats");
    let deadline = Instant::now() + Duration::from_secs(60);
    while server.health().is_none_or(|h| h["bus_connected"] != true) {
        assert!(
            Instant::now() < deadline,
            "NATS not reconnected: {:?}",
            server.health()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.status("/readyz").0 != 200 {
        assert!(
            Instant::now() < deadline,
            "/readyz: {:?}",
            server.status("/readyz")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The socket is still open: it answers a heartbeat.
    ws.heartbeat_ok_skipping_changes().await;

    for i in 1000..1100 {
        writer.execute(&stmt, &[&i, &"after"]).await.unwrap();
    }
    let mut after = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while after.len() < 100 {
        assert!(
            Instant::now() < deadline,
            "only {} of the 100 later changes arrived",
            after.len()
        );
        match ws.try_recv(Duration::from_secs(30)).await {
            Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                let rec = &f[4]["data"]["record"];
                if rec["phase"] == "after" {
                    after.insert(rec["id"].as_i64().unwrap());
                }
            }
            Some(Msg::Frame(_)) | Some(Msg::Binary(_)) => {}
            Some(other) => panic!("the socket ended across the NATS restart: {other:?}"),
            None => panic!("nothing received for 30 s after NATS came back"),
        }
    }
    assert_eq!(after, (1000..1100).collect());
}

fn rand_id() -> i32 {
    (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
        % 1_000_000) as i32
}
