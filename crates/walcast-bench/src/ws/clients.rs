//! The raw Phoenix clients: connecting, joining, and what they saw (counts, latency histograms).

use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio::sync::{Notify, Semaphore};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::{now_micros, WsBench, BUCKETS, BUCKET_US, PHASES, SECRET};

/// What the clients saw, shared by all client tasks.
pub(super) struct Stats {
    pub(super) connected: AtomicUsize,
    pub(super) joined: AtomicUsize,
    pub(super) join_errors: AtomicUsize,
    pub(super) disconnects: AtomicU64,
    pub(super) changed: Notify,
    pub(super) received: [AtomicU64; PHASES],
    pub(super) last_recv: [AtomicI64; PHASES],
    pub(super) per_client: Vec<[AtomicU32; PHASES]>,
    pub(super) hist: Vec<Vec<AtomicU32>>,
}

impl Stats {
    pub(super) fn new(clients: usize) -> Stats {
        Stats {
            connected: AtomicUsize::new(0),
            joined: AtomicUsize::new(0),
            join_errors: AtomicUsize::new(0),
            disconnects: AtomicU64::new(0),
            changed: Notify::new(),
            received: Default::default(),
            last_recv: Default::default(),
            per_client: (0..clients).map(|_| Default::default()).collect(),
            hist: (0..PHASES)
                .map(|_| (0..BUCKETS).map(|_| AtomicU32::new(0)).collect())
                .collect(),
        }
    }

    pub(super) fn record(&self, client: usize, ph: usize, latency_us: i64, now: i64) {
        if ph >= PHASES {
            return;
        }
        let b = ((latency_us.max(0) / BUCKET_US) as usize).min(BUCKETS - 1);
        self.hist[ph][b].fetch_add(1, Ordering::Relaxed);
        self.per_client[client][ph].fetch_add(1, Ordering::Relaxed);
        self.last_recv[ph].fetch_max(now, Ordering::Relaxed);
        self.received[ph].fetch_add(1, Ordering::Relaxed);
    }

    /// (min, p50, p99, max) in ms (min: the fastest delivery's bucket, lower edge).
    pub(super) fn percentiles(&self, ph: usize) -> (f64, f64, f64, f64) {
        let counts: Vec<u64> = self.hist[ph]
            .iter()
            .map(|c| u64::from(c.load(Ordering::Relaxed)))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
        }
        let at = |p: f64| percentile_ms(&counts, BUCKET_US, p);
        let max = counts
            .iter()
            .rposition(|c| *c > 0)
            .map_or(f64::NAN, |i| (i as f64 + 1.0) * BUCKET_US as f64 / 1000.0);
        let min = counts
            .iter()
            .position(|c| *c > 0)
            .map_or(f64::NAN, |i| i as f64 * BUCKET_US as f64 / 1000.0);
        (min, at(0.5), at(0.99), max)
    }
}

/// The `p` quantile (upper bucket edge, in ms) of a latency histogram whose buckets are
/// `bucket_us` wide; NaN when empty.
pub(crate) fn percentile_ms(counts: &[u64], bucket_us: i64, p: f64) -> f64 {
    let total: u64 = counts.iter().sum();
    let want = ((total as f64 * p).ceil() as u64).max(1);
    let mut acc = 0;
    for (i, c) in counts.iter().enumerate() {
        acc += c;
        if acc >= want {
            return (i as f64 + 1.0) * bucket_us as f64 / 1000.0;
        }
    }
    f64::NAN
}

/// `"key":<integer>` inside the `record` of a `postgres_changes` frame.
pub(crate) fn record_int(text: &str, key: &str) -> Option<i64> {
    let rec = text.find("\"record\":{")?;
    let rest = &text[rec..];
    let k = rest.find(key)?;
    let digits = &rest[k + key.len()..];
    let end = digits
        .find(|c: char| !(c.is_ascii_digit() || c == '-'))
        .unwrap_or(digits.len());
    digits[..end].parse().ok()
}

pub(crate) fn jwt() -> anyhow::Result<String> {
    let exp = now_micros() / 1_000_000 + 24 * 3600;
    Ok(jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"role": "anon", "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes())?,
    )?)
}

#[allow(clippy::too_many_arguments)]
async fn client(
    i: usize,
    url: Arc<str>,
    topic: String,
    stats: Arc<Stats>,
    limit: Arc<Semaphore>,
    join: CancellationToken,
    stop: CancellationToken,
) {
    let cfg = WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(0)
        .max_write_buffer_size(64 * 1024);
    let permit = limit.acquire().await;
    let ws = match tokio_tungstenite::connect_async_with_config(&*url, Some(cfg), true).await {
        Ok((ws, _)) => ws,
        Err(e) => {
            eprintln!("client {i}: connect failed: {e}");
            stats.disconnects.fetch_add(1, Ordering::Relaxed);
            stats.changed.notify_waiters();
            return;
        }
    };
    drop(permit);
    stats.connected.fetch_add(1, Ordering::Relaxed);
    stats.changed.notify_waiters();
    let (mut tx, mut rx) = ws.split();
    tokio::select! {
        _ = join.cancelled() => {}
        _ = stop.cancelled() => return,
    }
    let permit = limit.acquire().await;
    let join_frame = json!(["1", "1", topic, "phx_join", {
        "config": {
            "broadcast": {"ack": false, "self": false},
            "presence": {"key": "", "enabled": false},
            "postgres_changes": [{"event": "*", "schema": "public", "table": "bench"}],
            "private": false
        }
    }]);
    if tx
        .send(Message::Text(join_frame.to_string().into()))
        .await
        .is_err()
    {
        stats.disconnects.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut permit = Some(permit);
    let mut hb = tokio::time::interval(Duration::from_secs(25));
    hb.tick().await;
    let mut hb_ref = 0u64;
    loop {
        let m = tokio::select! {
            _ = stop.cancelled() => break,
            _ = hb.tick() => {
                hb_ref += 1;
                let f = format!(r#"[null,"hb{hb_ref}","phoenix","heartbeat",{{}}]"#);
                if tx.send(Message::Text(f.into())).await.is_err() {
                    stats.disconnects.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                continue;
            }
            m = rx.next() => m,
        };
        match text_of(i, m, &stats) {
            Ok(Some(text)) => on_text(i, &text, &stats, &mut permit),
            Ok(None) => continue,
            Err(()) => break,
        }
    }
    stats.changed.notify_waiters();
}

/// What client `i` read: a text frame, something else to skip (`Ok(None)`), or the end of
/// the socket (`Err`, counted as a disconnect).
fn text_of(
    i: usize,
    m: Option<Result<Message, tokio_tungstenite::tungstenite::Error>>,
    stats: &Stats,
) -> Result<Option<tokio_tungstenite::tungstenite::Utf8Bytes>, ()> {
    match m {
        Some(Ok(Message::Text(t))) => return Ok(Some(t)),
        Some(Ok(Message::Close(c))) => eprintln!("client {i}: closed by the server: {c:?}"),
        Some(Ok(_)) => return Ok(None),
        Some(Err(e)) => eprintln!("client {i}: {e}"),
        None => {}
    }
    stats.disconnects.fetch_add(1, Ordering::Relaxed);
    Err(())
}

/// A text frame for client `i`: a change (its latency recorded) or the join's reply
/// (which frees the client's join permit).
fn on_text<P>(i: usize, text: &str, stats: &Stats, permit: &mut Option<P>) {
    if text.contains(r#","postgres_changes",{"#) {
        let now = now_micros();
        if let (Some(ph), Some(at)) = (record_int(text, "\"ph\":"), record_int(text, "\"at\":")) {
            stats.record(i, ph as usize, now - at, now);
        }
        return;
    }
    if permit.is_some() && text.contains(r#","phx_reply","#) && text.starts_with(r#"["1","1""#) {
        *permit = None;
        if text.contains(r#""status":"ok""#) {
            stats.joined.fetch_add(1, Ordering::Relaxed);
        } else {
            eprintln!("client {i}: join refused: {text}");
            stats.join_errors.fetch_add(1, Ordering::Relaxed);
        }
        stats.changed.notify_waiters();
    }
}

/// Wait until `f(stats)` = (have, want) has have >= want, with a bound; the error says
/// how far it got.
pub(super) async fn wait_stats(
    stats: &Stats,
    what: &str,
    timeout: Duration,
    f: impl Fn(&Stats) -> (u64, u64),
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let notified = stats.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (have, want) = f(stats);
        if have >= want {
            return Ok(());
        }
        // Receive counters do not notify (too hot): re-check them every 20 ms.
        let wake = (tokio::time::Instant::now() + Duration::from_millis(20)).min(deadline);
        let _ = tokio::time::timeout_at(wake, notified).await;
        if tokio::time::Instant::now() >= deadline {
            let (have, want) = f(stats);
            if have >= want {
                return Ok(());
            }
            bail!("timed out after {timeout:?} waiting for {what}: {have} of {want}");
        }
    }
}

/// One client task per connection; client i joins `realtime:room<i mod topics>` once
/// `join` is cancelled.
pub(super) fn spawn_clients(
    args: &WsBench,
    topics: usize,
    port: u16,
    stats: &Arc<Stats>,
    join: &CancellationToken,
    stop: &CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let url: Arc<str> = format!(
        "ws://127.0.0.1:{port}/realtime/v1/websocket?apikey={}&vsn=2.0.0",
        jwt()?
    )
    .into();
    let limit = Arc::new(Semaphore::new(args.concurrency.max(1)));
    Ok((0..args.clients)
        .map(|i| {
            tokio::spawn(client(
                i,
                url.clone(),
                format!("realtime:room{}", i % topics),
                stats.clone(),
                limit.clone(),
                join.clone(),
                stop.clone(),
            ))
        })
        .collect())
}
