//! SSE: ready after registration, delivery, resume with Last-Event-ID, errors.

use std::time::Duration;

use crate::support::*;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use walcast_front::FrontConfig;

/// An SSE reader over a raw HTTP/1.0 connection.
struct SseClient {
    stream: TcpStream,
    buf: String,
    status: u16,
}

#[derive(Debug, Default, Clone)]
struct SseEvent {
    id: Option<String>,
    event: String,
    data: String,
}

impl SseClient {
    async fn open(s: &Server, query: &str, last_event_id: Option<&str>) -> SseClient {
        let mut stream = TcpStream::connect(s.addr).await.unwrap();
        let mut req = format!(
            "GET /realtime/v1/sse?{query} HTTP/1.0\r\nHost: test\r\nAccept: text/event-stream\r\n"
        );
        if let Some(id) = last_event_id {
            req.push_str(&format!("Last-Event-ID: {id}\r\n"));
        }
        req.push_str("\r\n");
        stream.write_all(req.as_bytes()).await.unwrap();
        let mut c = SseClient {
            stream,
            buf: String::new(),
            status: 0,
        };
        while !c.buf.contains("\r\n\r\n") {
            c.fill().await;
        }
        let end = c.buf.find("\r\n\r\n").unwrap();
        let head = c.buf[..end].to_string();
        c.buf = c.buf[end + 4..].to_string();
        c.status = head.split(' ').nth(1).unwrap().parse().unwrap();
        c
    }

    async fn fill(&mut self) -> bool {
        let mut chunk = vec![0u8; 65536];
        let n = tokio::time::timeout(TIMEOUT, self.stream.read(&mut chunk))
            .await
            .unwrap()
            .unwrap();
        self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
        n > 0
    }

    async fn body(mut self) -> String {
        while self.fill().await {}
        self.buf
    }

    /// Next event (comments skipped).
    async fn next(&mut self) -> SseEvent {
        loop {
            if let Some(end) = self.buf.find("\n\n") {
                let block = self.buf[..end].to_string();
                self.buf = self.buf[end + 2..].to_string();
                let mut ev = SseEvent::default();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id: ") {
                        ev.id = Some(v.to_string());
                    } else if let Some(v) = line.strip_prefix("event: ") {
                        ev.event = v.to_string();
                    } else if let Some(v) = line.strip_prefix("data: ") {
                        ev.data.push_str(v);
                    }
                }
                if ev.event.is_empty() && ev.data.is_empty() {
                    continue;
                }
                return ev;
            }
            assert!(self.fill().await, "stream ended");
        }
    }
}

#[tokio::test]
async fn sse_delivers_and_resumes_from_last_event_id() {
    let s = start_with(FrontConfig {
        history_size: 3,
        ..FrontConfig::default()
    })
    .await;
    let key = anon();
    let q = format!(
        "apikey={key}&channel=todos-feed&schema=public&table=todos&event=INSERT&filter=id%3Dgt.0"
    );
    let mut c = SseClient::open(&s, &q, None).await;
    assert_eq!(c.status, 200);
    let ready = c.next().await;
    assert_eq!(ready.event, "ready");
    let rv: Value = serde_json::from_str(&ready.data).unwrap();
    assert_eq!(rv["channel"], "todos-feed");
    let bid = rv["postgres_changes"][0]["id"].as_u64().unwrap();
    let spec = &s.worker.registered()[0];
    assert_eq!(spec.table.as_deref(), Some("todos"));
    assert_eq!(spec.event, "INSERT");
    assert_eq!(spec.filter.as_deref(), Some("id=gt.0"));

    let ids = s.worker.ids_for("todos");
    for n in 1..=2u32 {
        s.change_at("todos", "INSERT", json!({"id": n}), &ids, 0x100, n)
            .await;
    }
    let e1 = c.next().await;
    assert_eq!(e1.event, "postgres_changes");
    assert_eq!(e1.id.as_deref(), Some("0/100:1"));
    let v: Value = serde_json::from_str(&e1.data).unwrap();
    assert_eq!(v["ids"], json!([bid]));
    assert_eq!(v["data"]["record"]["id"], 1);
    assert_eq!(v["data"]["type"], "INSERT");
    let e2 = c.next().await;
    assert_eq!(e2.id.as_deref(), Some("0/100:2"));
    drop(c);

    // While disconnected the stream (and its subscription) lingers and records.
    s.wait_for("reader gone", |s| s.front.health().sse_streams == 0)
        .await;
    s.change_at("todos", "INSERT", json!({"id": 3}), &ids, 0x200, 0)
        .await;
    tokio::time::sleep(Duration::from_millis(100)).await;

    let mut c = SseClient::open(&s, &q, Some("0/100:1")).await;
    assert_eq!(c.next().await.event, "ready");
    assert_eq!(c.next().await.id.as_deref(), Some("0/100:2"));
    assert_eq!(c.next().await.id.as_deref(), Some("0/200:0"));
    s.change_at("todos", "INSERT", json!({"id": 4}), &ids, 0x300, 0)
        .await;
    assert_eq!(c.next().await.id.as_deref(), Some("0/300:0"));
    // A replay of an older position is dropped.
    s.change_at("todos", "INSERT", json!({"id": 4}), &ids, 0x300, 0)
        .await;
    s.change_at("todos", "INSERT", json!({"id": 5}), &ids, 0x400, 0)
        .await;
    assert_eq!(c.next().await.id.as_deref(), Some("0/400:0"));
    // Only one registration for the shared stream.
    assert_eq!(s.worker.register_calls().len(), 1);

    // Too far back: history holds 3 entries, so a gap is announced first.
    let mut old = SseClient::open(&s, &q, Some("0/100:1")).await;
    assert_eq!(old.next().await.event, "ready");
    let gap = old.next().await;
    assert_eq!(gap.event, "gap");
    assert_eq!(old.next().await.id.as_deref(), Some("0/200:0"));
}

#[tokio::test]
async fn sse_errors_are_http_errors() {
    let s = start().await;
    let c = SseClient::open(&s, "apikey=bad&table=t", None).await;
    assert_eq!(c.status, 401);
    assert!(c.body().await.contains("\"error\""));
    let key = anon();
    let c = SseClient::open(&s, &format!("apikey={key}&table=unknown"), None).await;
    assert_eq!(c.status, 400);
    assert!(c.body().await.contains("Unable to subscribe"));
    let c = SseClient::open(&s, &format!("apikey={key}&table=t&event=TRUNCATE"), None).await;
    assert_eq!(c.status, 400);
    let c = SseClient::open(&s, &format!("apikey={key}&table=t"), Some("nonsense")).await;
    assert_eq!(c.status, 400);
    // The refused stream's subscription is gone.
    s.wait_for("unregister", |s| s.worker.unregistered().len() == 1)
        .await;
}

#[tokio::test]
async fn sse_stream_ends_when_the_token_expires() {
    let s = start().await;
    let key = anon();
    let short = token(json!({"role":"anon","exp": now() + 1}));
    let mut c = SseClient::open(
        &s,
        &format!("apikey={key}&access_token={short}&table=t"),
        None,
    )
    .await;
    assert_eq!(c.next().await.event, "ready");
    let sys = c.next().await;
    assert_eq!(sys.event, "system");
    assert!(sys.data.contains("Token has expired"));
}

/// SSE streams are under the WebSocket's limits: they share MAX_CONNECTIONS with the
/// sockets, and each project may open JOINS_PER_SECOND new streams per second (burst
/// twice that); before, SSE had neither.
#[tokio::test]
async fn sse_streams_share_the_connection_limit_and_are_rate_limited() {
    let s = start_with(FrontConfig {
        max_connections: 2,
        ..FrontConfig::default()
    })
    .await;
    let key = anon();
    let query = format!("apikey={key}&table=t");
    let _ws = s.client("1.0.0").await;
    let mut first = SseClient::open(&s, &query, None).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.next().await.event, "ready");
    let full = SseClient::open(&s, &query, None).await;
    assert_eq!(
        full.status, 429,
        "a third stream/socket beyond MAX_CONNECTIONS 2"
    );
    assert!(full.body().await.contains("too many connections"));
    let refused = tokio_tungstenite::connect_async(s.ws_url("1.0.0", &key)).await;
    assert!(refused.is_err(), "a socket beyond MAX_CONNECTIONS");
    drop(first);
    s.wait_for("the stream's slot to be freed", |s| {
        s.front.health().sse_streams == 0
    })
    .await;
    let again = SseClient::open(&s, &query, None).await;
    assert_eq!(again.status, 200);

    let s = start_with(FrontConfig {
        joins_per_second: 1,
        join_burst: 2,
        ..FrontConfig::default()
    })
    .await;
    let mut open = Vec::new();
    for _ in 0..2 {
        let c = SseClient::open(&s, &query, None).await;
        assert_eq!(c.status, 200);
        open.push(c);
    }
    let over = SseClient::open(&s, &query, None).await;
    assert_eq!(over.status, 429, "a third stream within the burst of 2");
    assert!(over.body().await.contains("too many new streams"));
}
