//! Test harness: a front on 127.0.0.1:0 with an in-process bus, a recording stand-in for
//! the worker's registry, and a raw Phoenix WebSocket client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use tokio_util::sync::CancellationToken;
use walcast_bus::subs::{
    BoxFuture, RegisterReply, RegisterRequest, RegisterResult, SubsClient, SubsHandler,
    SubscriptionSpec, SyncMessage, UnregisterRequest,
};
use walcast_bus::Bus;
use walcast_front::{Front, FrontConfig, Projects};

pub const SECRET: &str = "test-secret-with-enough-bytes-0123456789";
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// What the stand-in worker saw, in order.
#[derive(Debug, Clone)]
pub enum Call {
    Register(Vec<SubscriptionSpec>),
    Unregister(Vec<String>),
    Sync(SyncMessage),
}

/// Accepts every spec except tables named `unknown` and filters containing `bogus`.
#[derive(Default)]
pub struct TestWorker {
    pub calls: Mutex<Vec<Call>>,
    /// When set, `register` waits for a permit.
    pub gate: Mutex<Option<Arc<Semaphore>>>,
}

impl TestWorker {
    pub fn registered(&self) -> Vec<SubscriptionSpec> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match c {
                Call::Register(s) => Some(s.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    pub fn register_calls(&self) -> Vec<Vec<SubscriptionSpec>> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match c {
                Call::Register(s) => Some(s.clone()),
                _ => None,
            })
            .collect()
    }

    pub fn unregistered(&self) -> Vec<String> {
        self.calls
            .lock()
            .unwrap()
            .iter()
            .filter_map(|c| match c {
                Call::Unregister(s) => Some(s.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    /// Ids of registered subscriptions on `table` (latest registration first wins nothing:
    /// all of them, deduplicated, in order).
    pub fn ids_for(&self, table: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for s in self.registered() {
            if s.table.as_deref() == Some(table) && !out.contains(&s.id) {
                out.push(s.id);
            }
        }
        out
    }
}

impl SubsHandler for TestWorker {
    fn register(&self, req: RegisterRequest) -> BoxFuture<RegisterReply> {
        self.calls
            .lock()
            .unwrap()
            .push(Call::Register(req.subs.clone()));
        let gate = self.gate.lock().unwrap().clone();
        Box::pin(async move {
            if let Some(g) = gate {
                let _p = g.acquire().await;
            }
            let results = req
                .subs
                .iter()
                .map(|s| {
                    let bad_table = s.table.as_deref() == Some("unknown");
                    let bad_filter = s.filter.as_deref().is_some_and(|f| f.contains("bogus"));
                    RegisterResult {
                        id: s.id.clone(),
                        ok: !bad_table && !bad_filter,
                        error: if bad_table {
                            Some("Unable to subscribe to changes with given parameters: table unknown".into())
                        } else if bad_filter {
                            Some("Error parsing `filter` params: bogus".into())
                        } else {
                            None
                        },
                        by_class: false,
                    }
                })
                .collect();
            RegisterReply {
                results,
                effective_from: None,
            }
        })
    }

    fn unregister(&self, req: UnregisterRequest) {
        self.calls.lock().unwrap().push(Call::Unregister(req.ids));
    }

    fn sync(&self, msg: SyncMessage) {
        self.calls.lock().unwrap().push(Call::Sync(msg));
    }
}

pub struct Server {
    pub addr: SocketAddr,
    pub bus: Bus,
    pub worker: Arc<TestWorker>,
    pub front: Front,
    pub cancel: CancellationToken,
}

pub async fn start() -> Server {
    start_with(FrontConfig::default()).await
}

pub async fn start_with(cfg: FrontConfig) -> Server {
    let bus = Bus::local(100_000);
    let worker = Arc::new(TestWorker::default());
    let subs = SubsClient::new(&bus, Some(worker.clone() as Arc<dyn SubsHandler>)).unwrap();
    let cancel = CancellationToken::new();
    let front = Front::start(
        cfg,
        bus.clone(),
        subs,
        Projects::new(SECRET),
        cancel.clone(),
    )
    .await
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = front.router();
    let c = cancel.clone();
    tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move { c.cancelled().await })
            .await
            .unwrap();
    });
    Server {
        addr,
        bus,
        worker,
        front,
        cancel,
    }
}

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

pub fn token_with(secret: &str, claims: Value) -> String {
    encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

/// Signed with the right secret but another HMAC algorithm (HS256 is the only one accepted).
pub fn token_alg(alg: Algorithm, claims: Value) -> String {
    encode(
        &Header::new(alg),
        &claims,
        &EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

pub fn token(claims: Value) -> String {
    token_with(SECRET, claims)
}

/// An `authenticated` user token valid for an hour.
pub fn user(sub: &str) -> String {
    token(json!({"role":"authenticated","sub":sub,"exp":now() + 3600}))
}

pub fn anon() -> String {
    token(json!({"role":"anon","exp":now() + 3600}))
}

impl Server {
    pub fn ws_url(&self, vsn: &str, apikey: &str) -> String {
        format!(
            "ws://{}/realtime/v1/websocket?apikey={apikey}&vsn={vsn}&log_level=info",
            self.addr
        )
    }

    pub async fn client(&self, vsn: &str) -> Client {
        Client::connect(&self.ws_url(vsn, &anon()), vsn).await
    }

    /// Publish a change the way the worker does, matched to `subs`, at a position after
    /// every earlier `change` (fronts drop what is not after the last they saw).
    pub async fn change(&self, table: &str, kind: &str, record: Value, subs: &[String]) {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let seq = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.change_at(table, kind, record, subs, 0x10_0000, seq)
            .await
    }

    pub async fn change_at(
        &self,
        table: &str,
        kind: &str,
        record: Value,
        subs: &[String],
        lsn: u64,
        seq: u32,
    ) {
        let cols: Vec<Value> = record
            .as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| {
                        let t = match v {
                            Value::Number(_) => "int8",
                            Value::Bool(_) => "bool",
                            Value::String(_) => "text",
                            _ => "jsonb",
                        };
                        json!({"name": k, "type": t})
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut ev = json!({
            "project": "default", "schema": "public", "table": table, "type": kind,
            "commit_timestamp": "2026-01-01T00:00:00.123Z",
            "commit_lsn": format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff), "seq": seq,
            "columns": cols, "pk": ["id"], "subs": subs,
        });
        match kind {
            "DELETE" => ev["old_record"] = record,
            "UPDATE" => {
                ev["old_record"] = json!({"id": record["id"]});
                ev["record"] = record;
            }
            _ => ev["record"] = record,
        }
        // To the front that owns the subscriptions, as the worker does.
        let Some(front) = subs
            .first()
            .and_then(|id| id.split_once(':'))
            .map(|(f, _)| f)
        else {
            return;
        };
        self.bus
            .publish(
                walcast_bus::subject::delivery_subject(front),
                &[],
                Bytes::from(serde_json::to_vec(&ev).unwrap()),
            )
            .await
            .unwrap();
    }

    /// Poll until `f` holds (or panic after the timeout).
    pub async fn wait_for(&self, what: &str, f: impl Fn(&Server) -> bool) {
        let deadline = tokio::time::Instant::now() + TIMEOUT;
        while !f(self) {
            if tokio::time::Instant::now() > deadline {
                panic!("timed out waiting for {what}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A decoded server message.
#[derive(Debug, Clone, PartialEq)]
pub enum Msg {
    /// Normalised to `[join_ref, ref, topic, event, payload]` whatever the vsn.
    Frame(Value),
    Binary(Vec<u8>),
    Close(u16, String),
}

impl Msg {
    pub fn frame(&self) -> &Value {
        match self {
            Msg::Frame(v) => v,
            other => panic!("expected a text frame, got {other:?}"),
        }
    }
    pub fn event(&self) -> &str {
        self.frame()[3].as_str().unwrap()
    }
    pub fn payload(&self) -> &Value {
        &self.frame()[4]
    }
}

pub struct Client {
    pub ws: WebSocketStream<MaybeTlsStream<TcpStream>>,
    pub vsn: String,
    next_ref: u64,
}

impl Client {
    pub async fn connect(url: &str, vsn: &str) -> Client {
        let (ws, _) = tokio_tungstenite::connect_async(url).await.unwrap();
        Client {
            ws,
            vsn: vsn.to_string(),
            next_ref: 1,
        }
    }

    pub fn next_ref(&mut self) -> String {
        self.next_ref += 1;
        self.next_ref.to_string()
    }

    /// Send `[join_ref, ref, topic, event, payload]` in this client's vsn.
    pub async fn send(
        &mut self,
        join_ref: Option<&str>,
        r: Option<&str>,
        topic: &str,
        event: &str,
        payload: Value,
    ) {
        let text = if self.vsn == "1.0.0" {
            json!({"topic": topic, "event": event, "payload": payload, "ref": r, "join_ref": join_ref}).to_string()
        } else {
            json!([join_ref, r, topic, event, payload]).to_string()
        };
        self.send_text(&text).await;
    }

    pub async fn send_text(&mut self, text: &str) {
        self.ws.send(Message::Text(text.into())).await.unwrap();
    }

    pub async fn send_binary(&mut self, b: Vec<u8>) {
        self.ws.send(Message::Binary(b.into())).await.unwrap();
    }

    /// Next message (skipping pings), or panic after the timeout.
    pub async fn recv(&mut self) -> Msg {
        match tokio::time::timeout(TIMEOUT, self.recv_inner()).await {
            Ok(Some(m)) => m,
            Ok(None) => panic!("socket ended"),
            Err(_) => panic!("timed out waiting for a message"),
        }
    }

    /// Next message within `d`, if any.
    pub async fn try_recv(&mut self, d: Duration) -> Option<Msg> {
        tokio::time::timeout(d, self.recv_inner())
            .await
            .ok()
            .flatten()
    }

    async fn recv_inner(&mut self) -> Option<Msg> {
        loop {
            let m = self.ws.next().await?;
            let m = match m {
                Ok(m) => m,
                Err(_) => return None,
            };
            return Some(match m {
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(&t).unwrap();
                    Msg::Frame(if self.vsn == "1.0.0" {
                        json!([
                            v["join_ref"],
                            v["ref"],
                            v["topic"],
                            v["event"],
                            v["payload"]
                        ])
                    } else {
                        v
                    })
                }
                Message::Binary(b) => Msg::Binary(b.to_vec()),
                Message::Close(Some(c)) => Msg::Close(c.code.into(), c.reason.to_string()),
                Message::Close(None) => Msg::Close(1005, String::new()),
                _ => continue,
            });
        }
    }

    /// Next message that is not a `system`/`presence_*` notice … unless asked for.
    pub async fn recv_event(&mut self, event: &str) -> Msg {
        loop {
            let m = self.recv().await;
            if let Msg::Frame(v) = &m {
                if v[3] == event {
                    return m;
                }
            }
            if let Msg::Close(..) = m {
                panic!("closed while waiting for {event}: {m:?}");
            }
        }
    }

    /// Join `topic` with `config` (and optional access token); returns the reply frame.
    pub async fn join(
        &mut self,
        topic: &str,
        config: Value,
        token: Option<&str>,
    ) -> (String, Value) {
        let r = self.next_ref();
        let mut payload = json!({"config": config});
        if let Some(t) = token {
            payload["access_token"] = json!(t);
        }
        self.send(Some(&r), Some(&r), topic, "phx_join", payload)
            .await;
        let reply = self.recv().await;
        let f = reply.frame().clone();
        assert_eq!(f[3], "phx_reply", "{f}");
        assert_eq!(f[1], json!(r), "{f}");
        (r, f)
    }

    pub async fn heartbeat_ok(&mut self) {
        let r = self.next_ref();
        self.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
            .await;
        let m = self.recv().await;
        assert_eq!(
            m.frame(),
            &json!([null, r, "phoenix", "phx_reply", {"status":"ok","response":{}}])
        );
    }
}

pub fn pg_config(bindings: Value) -> Value {
    json!({
        "broadcast": {"ack": false, "self": false},
        "presence": {"key": "", "enabled": false},
        "postgres_changes": bindings,
        "private": false
    })
}

impl Server {
    /// A second front on the same bus and worker (another replica).
    pub async fn replica(&self) -> Server {
        let subs =
            SubsClient::new(&self.bus, Some(self.worker.clone() as Arc<dyn SubsHandler>)).unwrap();
        let cancel = CancellationToken::new();
        let front = Front::start(
            FrontConfig::default(),
            self.bus.clone(),
            subs,
            Projects::new(SECRET),
            cancel.clone(),
        )
        .await
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = front.router();
        let c = cancel.clone();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move { c.cancelled().await })
                .await
                .unwrap();
        });
        Server {
            addr,
            bus: self.bus.clone(),
            worker: self.worker.clone(),
            front,
            cancel,
        }
    }

    /// A raw HTTP/1.0 request; returns (status, headers+body text).
    pub async fn http(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = TcpStream::connect(self.addr).await.unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.0\r\nHost: test\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        s.write_all(body).await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(TIMEOUT, s.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        let text = String::from_utf8_lossy(&out).to_string();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (status, text)
    }
}
