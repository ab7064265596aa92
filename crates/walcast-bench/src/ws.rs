//! WebSocket fan-out: N raw Phoenix (vsn 2.0.0) clients on one walcast front, events from
//! Postgres. Prints deliveries/s, commit-to-client latency and server memory per idle
//! connection, and the same numbers for a minimal WebSocket fan-out server (the baseline)
//! driven by the same load generator in the same run.
//!
//! Processes: this process is the load generator (and writes the rows). The server under
//! test runs as a child process (`walcast-bench ws-server`, which runs exactly what
//! `walcast serve` runs with the in-process bus), so its resident memory and CPU time are
//! read from `/proc/<child>/` without the load generator in them. The baseline runs as
//! another child (`walcast-bench ws-baseline-server`).
//!
//! Per scenario (a channel layout) and server:
//! 1. memory: VmRSS of the server before any client, after N WebSocket connections, and
//!    after each of them joined one channel with a `postgres_changes` binding;
//! 2. warm-up: a few events, all delivered to all clients;
//! 3. throughput: `--events-per-sec` single-row transactions per second for `--secs`;
//!    deliveries/s = messages received by all clients / (last receive − first write);
//! 4. latency: a tenth of the target delivery rate (`--latency-deliveries` per second,
//!    i.e. that divided by N transactions per second) for `--secs`; each row carries
//!    `clock_timestamp()` (µs since the epoch) taken in its transaction, each client
//!    computes receive time minus that stamp (same machine clock).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, Semaphore};
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;
use walcast_testkit::Postgres;

pub(crate) const SECRET: &str = "walcast-bench-secret-0123456789abcdef";
/// Phases, tagged in each row's `ph` column.
const WARMUP: usize = 0;
const THROUGHPUT: usize = 1;
const LATENCY: usize = 2;
const PHASES: usize = 3;
/// Latency histogram: 20 µs buckets up to 10 s (the last bucket collects the rest).
const BUCKET_US: i64 = 20;
const BUCKETS: usize = 500_000;

#[derive(Args)]
pub struct WsBench {
    /// WebSocket clients (one connection each, one channel each).
    #[arg(long, default_value_t = 10_000)]
    clients: usize,
    /// Channel layouts to run, comma-separated: client i joins `realtime:room<i mod T>`
    /// (T = 1: everyone on one topic).
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 1])]
    topics: Vec<usize>,
    /// Throughput phase: transactions (one row each) per second.
    #[arg(long, default_value_t = 40)]
    events_per_sec: u32,
    /// Seconds of each measured phase.
    #[arg(long, default_value_t = 10)]
    secs: u64,
    /// Latency phase: target deliveries per second (transactions/s = this / clients).
    #[arg(long, default_value_t = 20_000)]
    latency_deliveries: u64,
    /// Bytes of the text column of each row.
    #[arg(long, default_value_t = 100)]
    pad: usize,
    /// OUTBOUND_QUEUE of both servers.
    #[arg(long, default_value_t = 1024)]
    outbound_queue: usize,
    /// Connections opened (and joins sent) concurrently.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Only walcast, no baseline.
    #[arg(long)]
    skip_baseline: bool,
    /// `KEY=VALUE` set in both servers' environment alike (repeatable): e.g. an
    /// allocator setting (`MALLOC_ARENA_MAX=2`) tried on walcast and the baseline.
    #[arg(long = "server-env", value_parser = parse_env)]
    server_env: Vec<(String, String)>,
    /// Seconds to wait, after each phase's last event, for every client to receive every
    /// event; a shortfall fails the run.
    #[arg(long, default_value_t = 60)]
    max_wait: u64,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

#[derive(Clone, Copy, PartialEq)]
enum Target {
    Walcast,
    Baseline,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Walcast => "walcast",
            Target::Baseline => "baseline",
        }
    }
}

#[derive(Default, Clone)]
struct Outcome {
    rss_base_kb: u64,
    per_conn_connected_b: f64,
    per_conn_joined_b: f64,
    connect_secs: f64,
    join_secs: f64,
    tput_sent: u64,
    tput_offered: f64,
    tput_received: u64,
    tput_deliveries_per_s: f64,
    tput_p50: f64,
    tput_p99: f64,
    tput_server_cpu: f64,
    tput_loadgen_cpu: f64,
    lat_rate: f64,
    lat_sent: u64,
    lat_received: u64,
    lat_server_us: f64,
    lat_loadgen_us: f64,
    lat_min: f64,
    lat_p50: f64,
    lat_p99: f64,
    lat_max: f64,
    incomplete_clients: usize,
    disconnects: u64,
    peak_rss_kb: u64,
}

pub async fn run(args: WsBench) -> anyhow::Result<()> {
    let fds = fd_limit();
    if fds.is_some_and(|n| n < args.clients as u64 + 256) {
        bail!(
            "open file limit {} is too low for {} clients: raise it (ulimit -n {})",
            fds.unwrap_or(0),
            args.clients,
            args.clients + 1024
        );
    }
    println!(
        "WebSocket fan-out: {} clients (vsn 2.0.0, one connection and one channel each, \
         binding {{event:*, table:bench}}), rows of ~{} bytes",
        args.clients, args.pad
    );
    println!(
        "server under test: `walcast serve` (in-process bus, OUTBOUND_QUEUE={}) as a child \
         process; load generator: this process (tokio + tokio-tungstenite); {} cores",
        args.outbound_queue,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "baseline: a minimal axum WebSocket fan-out server (child process) that generates \
         the same frames itself, one encoding per topic, same queues and read buffer, \
         written through axum/tungstenite (8 KB write buffers): no Postgres, no CDC, no \
         registry — the cost of pushing frames to N sockets and reading them with this \
         load generator on this machine"
    );
    if !args.server_env.is_empty() {
        let env: Vec<String> = args
            .server_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        println!("both servers' environment adds: {}", env.join(" "));
    }
    for &topics in &args.topics {
        let topics = topics.clamp(1, args.clients.max(1));
        println!();
        println!("== {} clients on {} topic(s) ==", args.clients, topics);
        let w = scenario(&args, topics, Target::Walcast).await?;
        let b = if args.skip_baseline {
            None
        } else {
            Some(scenario(&args, topics, Target::Baseline).await?)
        };
        report(&args, &w, b.as_ref());
        for (target, o) in [(Target::Walcast, Some(&w)), (Target::Baseline, b.as_ref())] {
            if let Some(why) = o.and_then(|o| shortfall(o, args.clients)) {
                bail!(
                    "{} clients on {topics} topic(s), {}: not everything was delivered \
                     within {} s of the last event: {why}",
                    args.clients,
                    target.name(),
                    args.max_wait
                );
            }
        }
    }
    Ok(())
}

/// One row of the report: its name, the number it shows, the decimals.
type Row = (&'static str, fn(&Outcome) -> f64, usize);

/// The report's table, top to bottom as docs/benchmarks.md shows it.
const ROWS: [Row; 23] = [
    (
        "server RSS before clients (MB)",
        |o| o.rss_base_kb as f64 / 1024.0,
        1,
    ),
    (
        "RSS per idle connection, connected (KB)",
        |o| o.per_conn_connected_b / 1024.0,
        1,
    ),
    (
        "RSS per idle connection, joined (KB)",
        |o| o.per_conn_joined_b / 1024.0,
        1,
    ),
    ("time to connect all (s)", |o| o.connect_secs, 1),
    ("time to join all (s)", |o| o.join_secs, 1),
    ("throughput: tx/s offered", |o| o.tput_offered, 0),
    (
        "throughput: deliveries received",
        |o| o.tput_received as f64,
        0,
    ),
    ("throughput: deliveries/s", |o| o.tput_deliveries_per_s, 0),
    ("throughput: latency p50 (ms)", |o| o.tput_p50, 2),
    ("throughput: latency p99 (ms)", |o| o.tput_p99, 2),
    ("throughput: server CPU (cores)", |o| o.tput_server_cpu, 2),
    (
        "throughput: load generator CPU (cores)",
        |o| o.tput_loadgen_cpu,
        2,
    ),
    ("latency run: tx/s", |o| o.lat_rate, 1),
    (
        "latency run: deliveries received",
        |o| o.lat_received as f64,
        0,
    ),
    (
        "latency run: server CPU per delivery (us)",
        |o| o.lat_server_us,
        2,
    ),
    (
        "latency run: load gen. CPU per delivery (us)",
        |o| o.lat_loadgen_us,
        2,
    ),
    ("latency run: min (ms)", |o| o.lat_min, 2),
    ("latency run: p50 (ms)", |o| o.lat_p50, 2),
    ("latency run: p99 (ms)", |o| o.lat_p99, 2),
    ("latency run: max (ms)", |o| o.lat_max, 2),
    (
        "clients missing deliveries",
        |o| o.incomplete_clients as f64,
        0,
    ),
    ("clients disconnected", |o| o.disconnects as f64, 0),
    ("server peak RSS (MB)", |o| o.peak_rss_kb as f64 / 1024.0, 1),
];

fn report(args: &WsBench, w: &Outcome, b: Option<&Outcome>) {
    let cell = |v: Option<f64>, prec: usize| v.map_or("-".into(), |v| format!("{v:.prec$}"));
    println!(
        "{:<44} {:>14} {:>14} {:>8}",
        "", "walcast", "baseline", "ratio"
    );
    for (name, f, prec) in ROWS {
        let (mine, theirs) = (f(w), b.map(f));
        let ratio = theirs.filter(|y| *y > 0.0).map(|y| mine / y);
        println!(
            "{:<44} {:>14} {:>14} {:>8}",
            name,
            format!("{mine:.prec$}"),
            cell(theirs, prec),
            cell(ratio, 2)
        );
    }
    let n = args.clients as f64;
    println!(
        "targets: >= 200,000 deliveries/s with 10,000 clients (here {:.0} with {}); p99 < 100 ms \
         at a tenth of that rate (here {:.2} ms at {:.0} deliveries/s); <= 32 KB per idle \
         connection (here {:.1} KB joined)",
        w.tput_deliveries_per_s,
        args.clients,
        w.lat_p99,
        w.lat_rate * n,
        w.per_conn_joined_b / 1024.0
    );
    println!(
        "throughput sent {} tx ({} expected deliveries), latency run sent {} tx ({} expected)",
        w.tput_sent,
        w.tput_sent * args.clients as u64,
        w.lat_sent,
        w.lat_sent * args.clients as u64
    );
}

/// The server under test as a child process.
struct Server {
    child: Child,
    port: u16,
    stdin: Option<ChildStdin>,
    pg: Option<Postgres>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn spawn(mut cmd: Command, label: &'static str) -> anyhow::Result<(Child, u16)> {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = cmd.spawn().context("spawning the server child")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .context("server exited before listening")?
            .context("reading the server's stdout")?;
        let port: u16 = first
            .strip_prefix("LISTENING ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("unexpected first line from the server: {first}"))?;
        // Forward the server's log (warnings and up) to our stderr.
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                eprintln!("[{label}] {l}");
            }
        });
        Ok((child, port))
    }

    async fn start(target: Target, args: &WsBench) -> anyhow::Result<Server> {
        let exe = std::env::current_exe().context("current exe")?;
        match target {
            Target::Walcast => {
                // The clients' tokens carry `role: anon`, and the worker sends a role only
                // the columns it may SELECT: grant the table as a Supabase project does.
                let env = crate::env::start(
                    "CREATE TABLE bench (id int8 PRIMARY KEY, ph int4 NOT NULL, \
                     at int8 NOT NULL, pad text NOT NULL);
                     GRANT SELECT ON bench TO anon, authenticated;",
                    "bench",
                )
                .await?;
                let pg = env.pg;
                let mut cmd = Command::new(exe);
                cmd.arg("ws-server")
                    .env_clear()
                    .env("PATH", std::env::var_os("PATH").unwrap_or_default())
                    .env("DATABASE_URL", pg.url())
                    .env("CHECK_DATABASE_URL", pg.check_url())
                    .env("JWT_SECRET", SECRET)
                    .env("SECRETS_KEY", walcast_testkit::SECRETS_KEY)
                    .env("METRICS_API_KEY", FIGURES_KEY)
                    .env("OUTBOUND_QUEUE", args.outbound_queue.to_string())
                    // One project holds every client: its per-project limits (a policy,
                    // not a capacity) are lifted, so the run measures the server.
                    .envs(UNLIMITED_PROJECT)
                    .env("HOST", "127.0.0.1")
                    .env("PORT", "0")
                    .env("LOG_FORMAT", "text")
                    .env("LOG_LEVEL", "warn")
                    .envs(args.server_env.iter().cloned());
                let (mut child, port) = Server::spawn(cmd, "walcast")?;
                drop(child.stdin.take());
                let s = Server {
                    child,
                    port,
                    stdin: None,
                    pg: Some(pg),
                };
                let deadline = Instant::now() + Duration::from_secs(60);
                loop {
                    if let Some(h) = s.health().await {
                        if h["cdc_active"] == true {
                            break;
                        }
                    }
                    if Instant::now() > deadline {
                        bail!(
                            "walcast serve not active within 60 s: {:?}",
                            s.health().await
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(s)
            }
            Target::Baseline => {
                let mut cmd = Command::new(exe);
                cmd.args([
                    "ws-baseline-server",
                    "--outbound-queue",
                    &args.outbound_queue.to_string(),
                    "--pad",
                    &args.pad.to_string(),
                ])
                .envs(args.server_env.iter().cloned());
                let (mut child, port) = Server::spawn(cmd, "baseline")?;
                let stdin = child.stdin.take();
                Ok(Server {
                    child,
                    port,
                    stdin,
                    pg: None,
                })
            }
        }
    }

    async fn health(&self) -> Option<Value> {
        let body = http_get(self.port, "/health").await?;
        serde_json::from_str(&body).ok()
    }

    async fn wait_front(&self, what: &str, f: impl Fn(&Value) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let h = self.health().await;
            if h.as_ref().is_some_and(|h| f(&h["front"])) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("server: timed out waiting for {what}; health {h:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `METRICS_API_KEY` of every server the benchmarks start: [`http_get`] reads their
/// `/metrics` and full `/health` with it.
pub(crate) const FIGURES_KEY: &str = "walcast-bench-figures-key-0123456789abcdef";

/// GET `path` of a server the benchmarks started, with [`FIGURES_KEY`]: the body.
pub(crate) async fn http_get(port: u16, path: &str) -> Option<String> {
    let fut = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        let head = format!(
            "GET {path} HTTP/1.0\r\nHost: bench\r\nAuthorization: Bearer {FIGURES_KEY}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).await.ok()?;
        out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .ok()
        .flatten()
}

/// `/proc/<pid>/status` field in kB (VmRSS, VmHWM).
pub(crate) fn proc_kb(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

pub(crate) fn fd_limit() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/limits").ok()?;
    let l = s.lines().find(|l| l.starts_with("Max open files"))?;
    l.split_whitespace().nth(3)?.parse().ok()
}

/// What the clients saw, shared by all client tasks.
struct Stats {
    connected: AtomicUsize,
    joined: AtomicUsize,
    join_errors: AtomicUsize,
    disconnects: AtomicU64,
    changed: Notify,
    received: [AtomicU64; PHASES],
    last_recv: [AtomicI64; PHASES],
    per_client: Vec<[AtomicU32; PHASES]>,
    hist: Vec<Vec<AtomicU32>>,
}

impl Stats {
    fn new(clients: usize) -> Stats {
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

    fn record(&self, client: usize, ph: usize, latency_us: i64, now: i64) {
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
    fn percentiles(&self, ph: usize) -> (f64, f64, f64, f64) {
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
async fn wait_stats(
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

/// Writes rows (walcast) or emit commands (baseline).
enum Source {
    Pg {
        client: tokio_postgres::Client,
        stmt: tokio_postgres::Statement,
        pad: String,
    },
    Baseline(ChildStdin),
}

impl Source {
    async fn send(&mut self, id: i64, ph: i32) -> anyhow::Result<()> {
        match self {
            Source::Pg { client, stmt, pad } => {
                client.execute(&*stmt, &[&id, &ph, &*pad]).await?;
            }
            Source::Baseline(stdin) => {
                writeln!(stdin, "{id} {ph}")?;
                stdin.flush()?;
            }
        }
        Ok(())
    }
}

/// Send `rate` events per second for `secs`, ids from `*next`; returns (sent, start µs).
async fn steady(
    src: &mut Source,
    next: &mut i64,
    ph: usize,
    rate: f64,
    secs: u64,
) -> anyhow::Result<(u64, i64)> {
    let total = (rate * secs as f64).round().max(1.0) as u64;
    let started = Instant::now();
    let start_us = now_micros();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut sent = 0u64;
    while sent < total {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * rate) as u64 + 1).min(total);
        while sent < due {
            src.send(*next, ph as i32).await?;
            *next += 1;
            sent += 1;
        }
    }
    Ok((sent, start_us))
}

/// A scenario whose clients are connected and joined.
struct Running {
    // Dropped in this order: the load source before the server (and its Postgres).
    src: Source,
    stats: Arc<Stats>,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    server: Server,
    pid: String,
    label: &'static str,
}

async fn scenario(args: &WsBench, topics: usize, target: Target) -> anyhow::Result<Outcome> {
    let mut o = Outcome::default();
    let mut run = connect_and_join(args, topics, target, &mut o).await?;
    let result = deliver(args, &mut run, &mut o).await;
    run.stop.cancel();
    for t in std::mem::take(&mut run.tasks) {
        let _ = t.await;
    }
    result?;
    Ok(o)
}

/// Rows into Postgres (walcast) or emit commands on the baseline's stdin.
async fn source(server: &mut Server, target: Target, args: &WsBench) -> anyhow::Result<Source> {
    Ok(match target {
        Target::Walcast => {
            let pg = server.pg.as_ref().context("postgres")?;
            let client = pg.connect().await?;
            let stmt = client
                .prepare(
                    "INSERT INTO bench VALUES ($1, $2, \
                     (extract(epoch from clock_timestamp()) * 1000000)::int8, $3)",
                )
                .await?;
            Source::Pg {
                client,
                stmt,
                pad: "x".repeat(args.pad),
            }
        }
        Target::Baseline => Source::Baseline(server.stdin.take().context("baseline stdin")?),
    })
}

/// One client task per connection; client i joins `realtime:room<i mod topics>` once
/// `join` is cancelled.
fn spawn_clients(
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

/// Start the server, connect and join every client; memory readings along the way.
async fn connect_and_join(
    args: &WsBench,
    topics: usize,
    target: Target,
    o: &mut Outcome,
) -> anyhow::Result<Running> {
    let (n, label) = (args.clients, target.name());
    let mut server = Server::start(target, args).await?;
    let pid = server.pid().to_string();
    let src = source(&mut server, target, args).await?;
    // Let the server settle before the first reading (memory: nothing to await).
    tokio::time::sleep(Duration::from_millis(500)).await;
    o.rss_base_kb = proc_kb(&pid, "VmRSS:");
    let stats = Arc::new(Stats::new(n));
    let (join, stop) = (CancellationToken::new(), CancellationToken::new());
    let t = Instant::now();
    let tasks = spawn_clients(args, topics, server.port, &stats, &join, &stop)?;
    let run = Running {
        src,
        stats: stats.clone(),
        stop,
        tasks,
        server,
        pid,
        label,
    };
    let all = Duration::from_secs(300);
    wait_stats(&stats, "all clients connected", all, |s| {
        let c = s.connected.load(Ordering::Relaxed) as u64;
        (c + s.disconnects.load(Ordering::Relaxed), n as u64)
    })
    .await?;
    let connected = stats.connected.load(Ordering::Relaxed);
    if connected < n {
        bail!("{label}: only {connected} of {n} clients connected");
    }
    let server = &run.server;
    server
        .wait_front("all connections accepted", |f| f["connections"] == n)
        .await?;
    o.connect_secs = t.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_connected = proc_kb(&run.pid, "VmRSS:");
    let t = Instant::now();
    join.cancel();
    wait_stats(&stats, "all joins answered", all, |s| {
        let j = s.joined.load(Ordering::Relaxed) + s.join_errors.load(Ordering::Relaxed);
        (j as u64, n as u64)
    })
    .await?;
    let joined = stats.joined.load(Ordering::Relaxed);
    if joined < n {
        bail!("{label}: only {joined} of {n} joins succeeded");
    }
    server
        .wait_front("all channels joined", |f| f["channels"] == n)
        .await?;
    o.join_secs = t.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_joined = proc_kb(&run.pid, "VmRSS:");
    let per_conn = |kb: u64| (kb.saturating_sub(o.rss_base_kb) as f64 * 1024.0) / n as f64;
    (o.per_conn_connected_b, o.per_conn_joined_b) = (per_conn(rss_connected), per_conn(rss_joined));
    eprintln!(
        "[{label}] {n} clients connected in {:.1} s, joined in {:.1} s; RSS {} -> {} -> {} kB",
        o.connect_secs, o.join_secs, o.rss_base_kb, rss_connected, rss_joined
    );
    Ok(run)
}

/// Send one phase's events at `rate` for `secs` and wait (bounded) until every client got
/// them (or disconnected); returns (sent, start µs). A timeout is reported, not returned:
/// the shortfall shows in the outcome.
async fn phase(
    args: &WsBench,
    run: &mut Running,
    next_id: &mut i64,
    (ph, what): (usize, &str),
    (rate, secs): (f64, u64),
) -> anyhow::Result<(u64, i64)> {
    let (sent, start_us) = steady(&mut run.src, next_id, ph, rate, secs).await?;
    let want = sent * args.clients as u64;
    let wait = Duration::from_secs(args.max_wait);
    if let Err(e) = wait_stats(&run.stats, what, wait, |s| {
        let got = s.received[ph].load(Ordering::Relaxed);
        (got + s.disconnects.load(Ordering::Relaxed) * sent, want)
    })
    .await
    {
        eprintln!("[{}] {e:#}", run.label);
    }
    Ok((sent, start_us))
}

/// Warm-up (must be complete), throughput and latency phases.
async fn deliver(args: &WsBench, run: &mut Running, o: &mut Outcome) -> anyhow::Result<()> {
    let n = args.clients as u64;
    let stats = run.stats.clone();
    let mut next_id = 1i64;
    let (warm, _) = steady(&mut run.src, &mut next_id, WARMUP, 5.0, 1).await?;
    let wait = Duration::from_secs(args.max_wait);
    wait_stats(&stats, "warm-up deliveries", wait, |s| {
        (s.received[WARMUP].load(Ordering::Relaxed), warm * n)
    })
    .await
    .with_context(|| {
        format!(
            "{}: not every client received the {warm} warm-up events",
            run.label
        )
    })?;

    let pid = run.pid.clone();
    let (cpu_server0, cpu_self0) = (crate::cpu::secs(&pid), crate::cpu::secs("self"));
    let wall0 = Instant::now();
    let rate = f64::from(args.events_per_sec.max(1));
    let tput = (THROUGHPUT, "throughput deliveries");
    let (sent, start_us) = phase(args, run, &mut next_id, tput, (rate, args.secs)).await?;
    let wall = wall0.elapsed().as_secs_f64();
    o.tput_server_cpu = (crate::cpu::secs(&pid) - cpu_server0) / wall;
    o.tput_loadgen_cpu = (crate::cpu::secs("self") - cpu_self0) / wall;
    (o.tput_sent, o.tput_offered) = (sent, rate);
    o.tput_received = stats.received[THROUGHPUT].load(Ordering::Relaxed);
    let last = stats.last_recv[THROUGHPUT].load(Ordering::Relaxed);
    o.tput_deliveries_per_s = o.tput_received as f64 / ((last - start_us).max(1) as f64 / 1e6);
    (_, o.tput_p50, o.tput_p99, _) = stats.percentiles(THROUGHPUT);

    // Latency at a tenth of the target rate.
    let lrate = (args.latency_deliveries as f64 / n as f64).max(0.1);
    let lat = (LATENCY, "latency deliveries");
    let (cpu_server0, cpu_self0) = (crate::cpu::secs(&pid), crate::cpu::secs("self"));
    let (lsent, _) = phase(args, run, &mut next_id, lat, (lrate, args.secs)).await?;
    (o.lat_rate, o.lat_sent) = (lrate, lsent);
    o.lat_received = stats.received[LATENCY].load(Ordering::Relaxed);
    let per = |secs: f64| secs * 1e6 / o.lat_received.max(1) as f64;
    o.lat_server_us = per(crate::cpu::secs(&pid) - cpu_server0);
    o.lat_loadgen_us = per(crate::cpu::secs("self") - cpu_self0);
    (o.lat_min, o.lat_p50, o.lat_p99, o.lat_max) = stats.percentiles(LATENCY);
    o.incomplete_clients = stats
        .per_client
        .iter()
        .filter(|c| {
            u64::from(c[THROUGHPUT].load(Ordering::Relaxed)) < sent
                || u64::from(c[LATENCY].load(Ordering::Relaxed)) < lsent
        })
        .count();
    o.disconnects = stats.disconnects.load(Ordering::Relaxed);
    o.peak_rss_kb = proc_kb(&pid, "VmHWM:");
    if run.server.pg.is_some() {
        if let Some(m) = http_get(run.server.port, "/metrics").await {
            for l in m.lines().filter(|l| {
                l.starts_with("walcast_front_slow_consumer_disconnects_total")
                    || l.starts_with("walcast_front_deliveries_total")
            }) {
                eprintln!("[{}] {l}", run.label);
            }
        }
    }
    Ok(())
}

/// What `o` misses of a complete run (every client got every event, none disconnected).
fn shortfall(o: &Outcome, clients: usize) -> Option<String> {
    let n = clients as u64;
    let complete = o.tput_received >= o.tput_sent * n
        && o.lat_received >= o.lat_sent * n
        && o.incomplete_clients == 0
        && o.disconnects == 0;
    (!complete).then(|| {
        format!(
            "throughput: {} of {} deliveries, latency run: {} of {}; {} clients missing \
             deliveries, {} disconnected",
            o.tput_received,
            o.tput_sent * n,
            o.lat_received,
            o.lat_sent * n,
            o.incomplete_clients,
            o.disconnects
        )
    })
}

/// The per-project limits of the benchmarks' servers: out of the way.
pub(crate) const UNLIMITED_PROJECT: [(&str, &str); 5] = [
    ("PROJECT_MAX_USERS", "1000000000"),
    ("PROJECT_MAX_JOINS_PER_SECOND", "1000000000"),
    ("PROJECT_MAX_EVENTS_PER_SECOND", "1000000000"),
    ("PROJECT_MAX_BYTES_PER_SECOND", "4000000000"),
    ("PROJECT_MAX_PRESENCE_EVENTS_PER_SECOND", "1000000000"),
];
