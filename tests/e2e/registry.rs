//! The subscription registry across processes: one cdc-worker and one ws-front over real
//! NATS, a raw Phoenix WebSocket client. A new worker learns the front's subscriptions;
//! a front that dies has its subscriptions dropped within a bounded time.

use crate::support;

use std::time::{Duration, Instant};

use crate::support::Stack;
use futures_util::{SinkExt, StreamExt};
use tokio_tungstenite::tungstenite::Message;

fn subscriptions(worker: &support::Worker) -> f64 {
    worker.metric("walcast_cdc_subscriptions").unwrap_or(0.0)
}

fn wait_subscriptions(worker: &support::Worker, n: f64, within: Duration) {
    let deadline = Instant::now() + within;
    while subscriptions(worker) != n {
        assert!(
            Instant::now() < deadline,
            "worker holds {} subscriptions, expected {n} within {within:?}",
            subscriptions(worker)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_worker_learns_subscriptions_and_a_dead_front_loses_them() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    stack.enable("t");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = support::Worker::front(&stack.nats.url(), &[]);
    front.wait_http(Duration::from_secs(30));

    let url = front.ws_url(&support::ws::anon());
    let (mut ws, _) = tokio_tungstenite::connect_async(url)
        .await
        .expect("connect");
    let join = r#"["1","1","realtime:room","phx_join",{"config":{"postgres_changes":[{"event":"*","schema":"public","table":"t"}]}}]"#;
    ws.send(Message::text(join)).await.unwrap();
    let reply = next_text(&mut ws, "join reply").await;
    assert!(
        reply.contains("\"phx_reply\"") && reply.contains("\"ok\""),
        "{reply}"
    );
    assert_eq!(subscriptions(&worker), 1.0);

    // The worker dies; a new one asks the fronts to register again at start.
    worker.kill9();
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    wait_subscriptions(&worker, 1.0, Duration::from_secs(30));
    stack.sql("INSERT INTO t VALUES (1, 'after failover')");
    loop {
        let m = next_text(&mut ws, "the change after failover").await;
        let frame: serde_json::Value = serde_json::from_str(&m).unwrap();
        if frame[3] == "postgres_changes" {
            assert!(m.contains("after failover"), "{m}");
            break;
        }
    }

    // The front dies without unregistering: its subscription expires.
    drop(ws);
    drop(front);
    let bound = walcast_bus::subs::FRONT_EXPIRY + walcast_bus::subs::SYNC_INTERVAL * 2;
    wait_subscriptions(&worker, 0.0, bound);
}

async fn next_text<S>(ws: &mut S, what: &str) -> String
where
    S: StreamExt<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let deadline = Duration::from_secs(30);
    loop {
        let msg = tokio::time::timeout(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
            .unwrap_or_else(|| panic!("socket closed waiting for {what}"))
            .unwrap_or_else(|e| panic!("socket error waiting for {what}: {e}"));
        if let Message::Text(t) = msg {
            return t.to_string();
        }
    }
}
