//! Test harness: a front on 127.0.0.1:0 with an in-process bus and a recording stand-in
//! for the worker's registry; sockets are the test kit's Phoenix client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use walcast_bus::subs::{
    BoxFuture, RegisterReply, RegisterRequest, RegisterResult, SubsClient, SubsHandler,
    SubscriptionSpec, SyncMessage, UnregisterRequest,
};
use walcast_bus::Bus;
use walcast_front::{Front, FrontConfig, Projects};
// What each test binary takes of the client (not all of them use everything).
#[allow(unused_imports)]
pub use walcast_testkit::phoenix::{pg_config, Msg, PhoenixClient};

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
    /// Tables refused from now on (as `unknown` always is).
    pub refuse_tables: Mutex<Vec<String>>,
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
        let refuse = self.refuse_tables.lock().unwrap().clone();
        Box::pin(async move {
            if let Some(g) = gate {
                let _p = g.acquire().await;
            }
            let results = req
                .subs
                .iter()
                .map(|s| {
                    let bad_table = s.table.as_deref() == Some("unknown")
                        || s.table.as_ref().is_some_and(|t| refuse.contains(t));
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
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

/// Signed with the right secret but another HMAC algorithm (HS256 is the only one accepted).
pub fn token_alg(alg: Algorithm, claims: Value) -> String {
    encode(
        &Header::new(alg),
        &claims,
        &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
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

/// A socket on `url` (its vsn from the URL), each wait bounded by [`TIMEOUT`].
pub async fn connect(url: &str) -> PhoenixClient {
    PhoenixClient::connect(url).await.with_timeout(TIMEOUT)
}

impl Server {
    pub fn ws_url(&self, vsn: &str, apikey: &str) -> String {
        format!(
            "ws://{}/realtime/v1/websocket?apikey={apikey}&vsn={vsn}&log_level=info",
            self.addr
        )
    }

    /// A socket with an `anon` apikey.
    pub async fn client(&self, vsn: &str) -> PhoenixClient {
        connect(&self.ws_url(vsn, &anon())).await
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
