//! The two servers the `ws` benchmark runs as child processes of itself (so the server's
//! memory and CPU are measured apart from the load generator's):
//!
//! * `ws-server`: exactly what `walcast serve` runs with an in-process bus (same options,
//!   same environment variables, same defaults): the CDC pipeline, the realtime front,
//!   `/health` and `/metrics`, on 127.0.0.1 and a free port.
//! * `ws-baseline-server`: a minimal axum WebSocket fan-out server. It answers joins and
//!   heartbeats like the front, and for every line `<id> <phase>` on its stdin builds one
//!   `postgres_changes` frame of the same shape per topic (stamped with the current time)
//!   and queues it to every connection of that topic (bounded queue, writer task per
//!   connection, batched flushes). No Postgres, no decoding, no registry: the floor of
//!   what fanning frames out to N sockets costs on this machine.
//!
//! Both print `LISTENING <port>` on stdout once bound.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::ws::{Message, Utf8Bytes, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::Response;
use axum::routing::get;
use axum::{Json, Router};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use walcast_bus::Bus;
use walcast_worker::config::{CdcArgs, DbArgs, HttpArgs, LogArgs};
use walcast_worker::front::FrontArgs;

#[derive(Args, Debug)]
pub struct ServerArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    cdc: CdcArgs,
    #[command(flatten)]
    secrets: walcast_worker::config::SecretsArgs,
    /// In-process bus queue size per subscriber.
    #[arg(long, env = "BUS_CAPACITY", default_value_t = 65_536)]
    bus_capacity: usize,
    #[command(flatten)]
    front: FrontArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    log: LogArgs,
}

fn announce(port: u16) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "LISTENING {port}");
    let _ = out.flush();
}

/// `walcast serve` with the in-process bus ([`walcast_worker::serve::run`]).
pub async fn serve_walcast(cfg: ServerArgs) -> anyhow::Result<()> {
    let metrics = walcast_worker::telemetry::init_metrics()?;
    let bus = Bus::local(cfg.bus_capacity);
    let listener = cfg.http.bind().await?;
    announce(listener.local_addr()?.port());
    // Logs after the port line (the parent forwards them to its stderr).
    walcast_worker::telemetry::init_logs(&cfg.log);
    let cancel = walcast_worker::shutdown::on_signal();
    let keys = cfg.secrets.keys()?;
    let ops = walcast_worker::http::OpsHttp {
        listener,
        metrics,
        key: cfg.front.operator.key(),
    };
    let serve = walcast_worker::serve::Serve {
        db: &cfg.db,
        cdc: &cfg.cdc,
        keys,
        front: &cfg.front,
        bus,
        ops,
    };
    walcast_worker::serve::run(serve, cancel).await
}

#[derive(Args, Debug)]
pub struct BaselineArgs {
    /// Frames queued per connection before it is dropped.
    #[arg(long, default_value_t = 1024)]
    outbound_queue: usize,
    /// Bytes of the `pad` column of each generated row.
    #[arg(long, default_value_t = 100)]
    pad: usize,
}

struct Conn {
    id: u64,
    tx: mpsc::Sender<Message>,
}

#[derive(Default)]
struct Baseline {
    queue: usize,
    next: AtomicU64,
    connections: AtomicUsize,
    dropped: AtomicU64,
    topics: Mutex<HashMap<String, Vec<Conn>>>,
}

pub async fn serve_baseline(args: BaselineArgs) -> anyhow::Result<()> {
    let state = Arc::new(Baseline {
        queue: args.outbound_queue.max(1),
        ..Baseline::default()
    });
    let router = Router::new()
        .route("/realtime/v1/websocket", get(upgrade))
        .route("/health", get(health))
        .with_state(state.clone());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    announce(listener.local_addr()?.port());
    tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let pad = "x".repeat(args.pad);
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let mut it = line
            .split_whitespace()
            .filter_map(|w| w.parse::<i64>().ok());
        let (Some(id), Some(ph)) = (it.next(), it.next()) else {
            continue;
        };
        emit(&state, id, ph, &pad);
    }
    Ok(())
}

fn emit(state: &Baseline, id: i64, ph: i64, pad: &str) {
    let at = crate::ws::now_micros();
    let data = json!({
        "schema": "public", "table": "bench", "commit_timestamp": "2026-01-01T00:00:00.000Z",
        "type": "INSERT",
        "columns": [{"name":"id","type":"int8"},{"name":"ph","type":"int4"},{"name":"at","type":"int8"},{"name":"pad","type":"text"}],
        "record": {"id": id, "ph": ph, "at": at, "pad": pad},
        "errors": null
    })
    .to_string();
    let mut topics = state.topics.lock().unwrap_or_else(|p| p.into_inner());
    for (topic, conns) in topics.iter_mut() {
        // One encoding per topic, shared by its connections (as the front does).
        let text: Utf8Bytes =
            format!(r#"[null,null,{topic:?},"postgres_changes",{{"ids":[1],"data":{data}}}]"#)
                .into();
        conns.retain(|c| match c.tx.try_send(Message::Text(text.clone())) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                state.dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => false,
        });
    }
}

async fn health(State(s): State<Arc<Baseline>>) -> Json<Value> {
    let channels: usize = s
        .topics
        .lock()
        .map(|t| t.values().map(Vec::len).sum())
        .unwrap_or(0);
    Json(json!({
        "front": {
            "connections": s.connections.load(Ordering::Relaxed),
            "channels": channels,
        },
        "dropped": s.dropped.load(Ordering::Relaxed),
    }))
}

/// The baseline's tungstenite write buffer: frames are gathered up to this many bytes.
const BASELINE_WRITE_BUFFER: usize = 8 * 1024;

async fn upgrade(State(s): State<Arc<Baseline>>, ws: WebSocketUpgrade) -> Response {
    // The front's read buffer; tungstenite's write buffer at 8 KB, as an axum server
    // writing through tungstenite would have (the front writes its frames itself).
    ws.read_buffer_size(walcast_front::SOCKET_READ_BUFFER)
        .write_buffer_size(BASELINE_WRITE_BUFFER)
        .on_upgrade(move |socket| conn(s, socket))
}

async fn conn(s: Arc<Baseline>, socket: WebSocket) {
    s.connections.fetch_add(1, Ordering::Relaxed);
    let id = s.next.fetch_add(1, Ordering::Relaxed);
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<Message>(s.queue);
    let writer = tokio::spawn(async move {
        while let Some(m) = rx.recv().await {
            if sink.feed(m).await.is_err() {
                return;
            }
            let mut n = 1;
            while n < 64 {
                let Ok(m) = rx.try_recv() else { break };
                if sink.feed(m).await.is_err() {
                    return;
                }
                n += 1;
            }
            if sink.flush().await.is_err() {
                return;
            }
        }
    });
    let mut joined: Vec<String> = Vec::new();
    while let Some(Ok(m)) = stream.next().await {
        let Message::Text(t) = m else { continue };
        let Ok(Value::Array(f)) = serde_json::from_str::<Value>(&t) else {
            continue;
        };
        let (jr, r, topic, event) = (&f[0], &f[1], &f[2], f[3].as_str().unwrap_or(""));
        match event {
            "heartbeat" => {
                let reply = json!([null, r, "phoenix", "phx_reply", {"status":"ok","response":{}}]);
                let _ = tx.try_send(Message::Text(reply.to_string().into()));
            }
            "phx_join" => {
                let Some(name) = topic.as_str() else { continue };
                let mut bindings = f[4]["config"]["postgres_changes"].clone();
                if let Some(a) = bindings.as_array_mut() {
                    for b in a {
                        b["id"] = json!(1);
                    }
                }
                let reply = json!([jr, r, topic, "phx_reply",
                    {"status":"ok","response":{"postgres_changes": bindings}}]);
                let system = json!([jr, null, topic, "system",
                    {"extension":"postgres_changes","status":"ok","message":"Subscribed to PostgreSQL","channel": name.trim_start_matches("realtime:")}]);
                let mut topics = s.topics.lock().unwrap_or_else(|p| p.into_inner());
                let _ = tx.try_send(Message::Text(reply.to_string().into()));
                let _ = tx.try_send(Message::Text(system.to_string().into()));
                topics
                    .entry(name.to_string())
                    .or_default()
                    .push(Conn { id, tx: tx.clone() });
                joined.push(name.to_string());
            }
            _ => {}
        }
    }
    {
        let mut topics = s.topics.lock().unwrap_or_else(|p| p.into_inner());
        for t in &joined {
            if let Some(v) = topics.get_mut(t) {
                v.retain(|c| c.id != id);
            }
        }
    }
    drop(tx);
    writer.abort();
    s.connections.fetch_sub(1, Ordering::Relaxed);
}
