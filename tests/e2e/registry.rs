//! The subscription registry across processes: one cdc-worker and one ws-front over real
//! NATS, a raw Phoenix WebSocket client. A new worker learns the front's subscriptions;
//! a front that dies has its subscriptions dropped within a bounded time.

mod support;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use support::{http_get, Stack};
use tokio_tungstenite::tungstenite::Message;

const SECRET: &str = "registry-test-secret-0123456789abcdef";

fn token() -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &serde_json::json!({"role": "anon", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

struct Front {
    child: Child,
    port: u16,
}

impl Drop for Front {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_front(nats: &str) -> Front {
    let port = walcast_testkit::free_port().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_ws-front"))
        .env("NATS_URL", nats)
        .env("JWT_SECRET", SECRET)
        .env("PORT", port.to_string())
        .env("HOST", "127.0.0.1")
        .env("LOG_FORMAT", "json")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn ws-front");
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_get(port, "/health").is_none() {
        assert!(Instant::now() < deadline, "ws-front not serving /health");
        std::thread::sleep(Duration::from_millis(20));
    }
    Front { child, port }
}

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
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    stack.enable("t");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let front = start_front(&stack.nats.url());

    let url = format!(
        "ws://127.0.0.1:{}/realtime/v1/websocket?apikey={}&vsn=2.0.0",
        front.port,
        token()
    );
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
