//! The load of the isolation benchmark: raw Phoenix (vsn 1.0.0) subscribers that record
//! what reaches them, paced writers, and REST requests.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::ws::now_micros;

/// What one subscriber saw.
#[derive(Default)]
pub(crate) struct Seen {
    /// Row id → INSERT→client latency in ms (the first copy).
    pub(crate) rows: HashMap<i64, f64>,
    /// Copies of rows already received.
    pub(crate) duplicates: u64,
    /// `system` messages with status `error` (their text).
    pub(crate) errors: Vec<String>,
    /// The socket closed or failed after the join.
    pub(crate) closed: Option<String>,
}

/// A subscriber's record, shared with its task.
pub(crate) type Shared = Arc<Mutex<Seen>>;

pub(crate) fn lock(s: &Shared) -> std::sync::MutexGuard<'_, Seen> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// Connect to the front on `port` with `apikey`, join `schema.table` and resolve once the
/// join is answered `ok`; the subscriber then records every change until `stop`.
pub(crate) async fn subscribe(
    port: u16,
    apikey: &str,
    schema: &str,
    table: &str,
    stop: CancellationToken,
) -> anyhow::Result<Shared> {
    let url = format!("ws://127.0.0.1:{port}/realtime/v1/websocket?apikey={apikey}&vsn=1.0.0");
    let (ws, _) = tokio_tungstenite::connect_async(&url)
        .await
        .context("connecting a subscriber")?;
    let (mut tx, rx) = ws.split();
    let join = json!({"topic": format!("realtime:{table}"), "event": "phx_join", "ref": "1",
        "join_ref": "1", "payload": {"config": {"postgres_changes":
            [{"event": "INSERT", "schema": schema, "table": table}]}}});
    tx.send(Message::Text(join.to_string().into())).await?;
    let seen: Shared = Arc::default();
    let (joined_tx, joined) = oneshot::channel();
    tokio::spawn(read_loop(tx, rx, seen.clone(), joined_tx, stop));
    match tokio::time::timeout(Duration::from_secs(60), joined).await {
        Ok(Ok(Ok(()))) => Ok(seen),
        Ok(Ok(Err(e))) => bail!("join of {schema}.{table} refused: {e}"),
        Ok(Err(_)) => bail!("subscriber of {schema}.{table} closed before its join reply"),
        Err(_) => bail!("no join reply for {schema}.{table} within 60 s"),
    }
}

type WsTx = futures_util::stream::SplitSink<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    Message,
>;
type WsRx = futures_util::stream::SplitStream<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
>;

async fn read_loop(
    mut tx: WsTx,
    mut rx: WsRx,
    seen: Shared,
    joined: oneshot::Sender<Result<(), String>>,
    stop: CancellationToken,
) {
    let mut joined = Some(joined);
    let mut hb = tokio::time::interval(Duration::from_secs(20));
    hb.tick().await;
    loop {
        let m = tokio::select! {
            _ = stop.cancelled() => return,
            _ = hb.tick() => {
                let f = r#"{"topic":"phoenix","event":"heartbeat","payload":{},"ref":"hb"}"#;
                let _ = tx.send(Message::Text(f.into())).await;
                continue;
            }
            m = rx.next() => m,
        };
        let text = match m {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(_)) => continue,
            other => {
                let why = format!("{other:?}");
                if let Some(j) = joined.take() {
                    let _ = j.send(Err(why));
                } else {
                    lock(&seen).closed = Some(why);
                }
                return;
            }
        };
        let recv = now_micros();
        let Ok(frame) = serde_json::from_str::<Value>(&text) else {
            continue;
        };
        if let Some(j) = joined.take_if(|_| frame["event"] == "phx_reply" && frame["ref"] == "1") {
            let ok = frame["payload"]["status"] == "ok";
            let _ = j.send(if ok { Ok(()) } else { Err(text.to_string()) });
            continue;
        }
        record(&seen, &frame, recv);
    }
}

/// Record a change (its latency) or a `system` error.
fn record(seen: &Shared, frame: &Value, recv: i64) {
    let payload = &frame["payload"];
    match frame["event"].as_str() {
        Some("postgres_changes") => {
            let rec = &payload["data"]["record"];
            let (Some(id), Some(at)) = (rec["id"].as_i64(), rec["at"].as_i64()) else {
                return;
            };
            let mut s = lock(seen);
            match s.rows.entry(id) {
                std::collections::hash_map::Entry::Occupied(_) => s.duplicates += 1,
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert((recv - at) as f64 / 1000.0);
                }
            }
        }
        Some("system") if payload["status"] == "error" => {
            let msg = payload["message"].as_str().unwrap_or("").to_string();
            lock(seen).errors.push(msg);
        }
        _ => {}
    }
}

/// Insert rows `first..first + n` into `table` (columns `id`, `at` and whatever
/// `extra_sql` adds) at `rate` per second, or until `stop`; returns how many were written.
/// `at` is the microsecond taken just before each INSERT is sent.
pub(crate) async fn write_paced(
    db: &tokio_postgres::Client,
    insert_sql: &str,
    first: i64,
    n: u64,
    rate: u64,
    stop: &CancellationToken,
) -> anyhow::Result<u64> {
    let stmt = db.prepare(insert_sql).await?;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut written = 0;
    while written < n {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        db.execute(&stmt, &[&(first + written as i64), &now_micros()])
            .await?;
        written += 1;
    }
    Ok(written)
}

/// `PUT path` with `body` and `apikey` on 127.0.0.1:`port` (HTTP/1.1, one connection):
/// the status and the body.
pub(crate) async fn put(
    port: u16,
    path: &str,
    apikey: &str,
    body: &str,
) -> anyhow::Result<(u16, String)> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        let req = format!(
            "PUT {path} HTTP/1.1\r\nHost: bench\r\napikey: {apikey}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        anyhow::Ok(String::from_utf8_lossy(&out).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(120), fut)
        .await
        .context("no answer within 120 s")??;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("not an HTTP answer: {text:.200}"))?;
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((status, body.to_string()))
}
