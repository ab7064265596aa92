//! Row-level-security cost: N WebSocket subscribers with distinct claims (`sub` = their
//! own uuid) on one table with a policy `owner = auth.uid() OR shared`, served by
//! `walcast serve` (a child process, in-process bus), in the default batched mode and in
//! the naive mode (`CDC_RLS_MODE=naive`: one check per subscriber per change, one
//! statement per round trip), each on a fresh Postgres, in the same run.
//!
//! Two phases per mode, each on its own stack so a backlog of one never pollutes the other:
//! * throughput: `--rows` rows inserted as fast as one session can (one transaction each);
//!   RLS-checked deliveries/s from the first insert to the last delivery (or to the
//!   `--max-wait` deadline, whichever is first, counting what arrived);
//! * latency: `--rate` rows/s for `--latency-secs`; commit-to-client latency (a row
//!   carries the time it was written; clients compare with their clock: one machine).
//!
//! 90% of rows are shared (every subscriber may see them), 10% private to a random
//! subscriber: every delivery is a checked one (the table has RLS; `authenticated` does
//! not bypass it).

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio::sync::{Notify, Semaphore};
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::ws::{http_get, now_micros, record_int};

const SECRET: &str = "walcast-bench-rls-secret-0123456789abcdef";
/// Latency histogram: 1 ms buckets up to 5 minutes.
const BUCKET_US: i64 = 1000;
const BUCKETS: usize = 300_000;

#[derive(Args, Debug, Clone)]
pub struct RlsBench {
    /// WebSocket subscribers, each with its own claims.
    #[arg(long, default_value_t = 1000)]
    subscribers: usize,
    /// Rows of the throughput phase.
    #[arg(long, default_value_t = 300)]
    rows: usize,
    /// Give up waiting for the throughput phase's deliveries after this many seconds.
    #[arg(long, default_value_t = 60)]
    max_wait: u64,
    /// Rows per second in the latency phase.
    #[arg(long, default_value_t = 20)]
    rate: u64,
    /// Duration of the latency phase, in seconds.
    #[arg(long, default_value_t = 10)]
    latency_secs: u64,
    /// Write the policy as `owner = (SELECT auth.uid())` (Supabase's advice: evaluated once
    /// per statement instead of once per row).
    #[arg(long)]
    initplan: bool,
    /// Modes to run, in order.
    #[arg(long, value_delimiter = ',', default_value = "batched,naive")]
    modes: Vec<String>,
    /// Fail also when the naive mode has not delivered everything by the deadline (the
    /// batched mode always must; the naive one cannot keep up at the default size, and
    /// what it delivered by the deadline is its measurement).
    #[arg(long)]
    strict: bool,
}

fn uid(i: usize) -> String {
    format!("00000000-0000-4000-8000-{i:012}")
}

struct Stats {
    joined: AtomicUsize,
    failed: AtomicUsize,
    delivered: AtomicU64,
    /// Deliveries of rows not visible to that subscriber (must stay 0).
    unauthorized: AtomicU64,
    last_us: AtomicU64,
    hist: Vec<AtomicU32>,
    changed: Notify,
}

impl Stats {
    fn new() -> Stats {
        Stats {
            joined: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            delivered: AtomicU64::new(0),
            unauthorized: AtomicU64::new(0),
            last_us: AtomicU64::new(0),
            hist: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            changed: Notify::new(),
        }
    }

    fn percentile(&self, p: f64) -> f64 {
        let counts: Vec<u64> = self
            .hist
            .iter()
            .map(|c| u64::from(c.load(Ordering::Relaxed)))
            .collect();
        crate::ws::percentile_ms(&counts, BUCKET_US, p)
    }
}

struct Stack {
    child: Child,
    port: u16,
    _pg: walcast_testkit::Postgres,
    admin: tokio_postgres::Client,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn policy(initplan: bool) -> &'static str {
    if initplan {
        "owner = (SELECT auth.uid()) OR shared"
    } else {
        "owner = auth.uid() OR shared"
    }
}

/// The server's `REALTIME_MAX_LAG_MS` here: longer than any phase may wait.
const BACKLOG_LAG_MS: u64 = 600_000;

async fn start_stack(mode: &str, initplan: bool) -> anyhow::Result<Stack> {
    let setup = format!(
        "CREATE TABLE items (id int8 PRIMARY KEY, owner uuid NOT NULL, shared bool NOT NULL, \
                             at int8 NOT NULL, pad text NOT NULL);
         ALTER TABLE items ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own_or_shared ON items FOR SELECT TO authenticated USING ({});
         GRANT SELECT ON items TO authenticated;",
        policy(initplan)
    );
    let env = crate::env::start(&setup, "items").await?;
    let exe = std::env::current_exe().context("current exe")?;
    let mut cmd = Command::new(exe);
    cmd.arg("ws-server")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", env.pg.url())
        .env("CHECK_DATABASE_URL", env.pg.check_url())
        .env("JWT_SECRET", SECRET)
        .env("SECRETS_KEY", walcast_testkit::SECRETS_KEY)
        .env("METRICS_API_KEY", crate::ws::FIGURES_KEY)
        .env("CDC_RLS_MODE", mode)
        // The throughput phase queues its whole backlog at once and measures how fast it
        // drains: the project lag bound (fault isolation, 10 s by default) would skip the
        // tail of a slow drain instead. This run's own deadline (`--max-wait`) bounds it.
        .env("REALTIME_MAX_LAG_MS", BACKLOG_LAG_MS.to_string())
        .envs(crate::ws::UNLIMITED_PROJECT)
        .env("HOST", "127.0.0.1")
        .env("PORT", "0")
        .env("LOG_FORMAT", "text")
        .env(
            "LOG_LEVEL",
            std::env::var("RLS_BENCH_LOG_LEVEL").unwrap_or_else(|_| "warn".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = cmd.spawn().context("spawning walcast serve")?;
    let stdout = child.stdout.take().context("child stdout")?;
    let port = tokio::task::spawn_blocking(move || -> anyhow::Result<u16> {
        use std::io::BufRead;
        let mut lines = std::io::BufReader::new(stdout).lines();
        let first = lines.next().context("server exited before listening")??;
        std::thread::spawn(move || {
            lines
                .map_while(Result::ok)
                .for_each(|l| eprintln!("[walcast] {l}"))
        });
        first
            .strip_prefix("LISTENING ")
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("unexpected first line: {first}"))
    })
    .await??;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let h: Option<Value> = http_get(port, "/health")
            .await
            .and_then(|b| serde_json::from_str(&b).ok());
        if h.as_ref().is_some_and(|h| h["cdc_active"] == true) {
            break;
        }
        if Instant::now() > deadline {
            bail!("walcast serve not active within 60 s: {h:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Stack {
        child,
        port,
        _pg: env.pg,
        admin: env.admin,
    })
}

fn token(i: usize) -> anyhow::Result<String> {
    let exp = now_micros() / 1_000_000 + 24 * 3600;
    Ok(jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"role": "authenticated", "sub": uid(i), "exp": exp}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes())?,
    )?)
}

/// One subscriber: join, then count deliveries (and check each against the policy).
async fn client(
    i: usize,
    port: u16,
    stats: Arc<Stats>,
    limit: Arc<Semaphore>,
    stop: CancellationToken,
) -> anyhow::Result<()> {
    let url = format!(
        "ws://127.0.0.1:{port}/realtime/v1/websocket?apikey={}&vsn=1.0.0",
        token(i)?
    );
    let permit = limit.acquire().await?;
    let (ws, _) = tokio_tungstenite::connect_async(&url).await?;
    let (mut tx, mut rx) = ws.split();
    let join = json!({"topic": "realtime:items", "event": "phx_join", "ref": "1", "join_ref": "1",
        "payload": {"config": {"postgres_changes": [{"event": "*", "schema": "public", "table": "items"}]}}});
    tx.send(Message::Text(join.to_string().into())).await?;
    let mut permit = Some(permit);
    let me = format!("\"owner\":\"{}\"", uid(i));
    let mut hb = tokio::time::interval(Duration::from_secs(25));
    hb.tick().await;
    loop {
        let m = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = hb.tick() => {
                let f = r#"{"topic":"phoenix","event":"heartbeat","payload":{},"ref":"hb"}"#;
                tx.send(Message::Text(f.into())).await?;
                continue;
            }
            m = rx.next() => m,
        };
        let text = match m {
            Some(Ok(Message::Text(t))) => t,
            Some(Ok(_)) => continue,
            Some(Err(e)) => bail!("client {i}: {e}"),
            None => bail!("client {i}: closed by the server"),
        };
        if text.contains("\"event\":\"postgres_changes\"") {
            let now = now_micros();
            if let Some(at) = record_int(&text, "\"at\":") {
                let b = (((now - at).max(0) / BUCKET_US) as usize).min(BUCKETS - 1);
                stats.hist[b].fetch_add(1, Ordering::Relaxed);
            }
            if !(text.contains("\"shared\":true") || text.contains(&me)) {
                stats.unauthorized.fetch_add(1, Ordering::Relaxed);
            }
            stats.delivered.fetch_add(1, Ordering::Relaxed);
            stats.last_us.fetch_max(now as u64, Ordering::Relaxed);
            stats.changed.notify_waiters();
        } else if permit.is_some() && text.contains("phx_reply") && text.contains("\"ref\":\"1\"") {
            permit = None;
            if text.contains("\"status\":\"ok\"") {
                stats.joined.fetch_add(1, Ordering::Relaxed);
            } else {
                eprintln!("client {i}: join refused: {text}");
                stats.failed.fetch_add(1, Ordering::Relaxed);
            }
            stats.changed.notify_waiters();
        }
    }
}

async fn wait_for(stats: &Stats, deadline: Instant, f: impl Fn(&Stats) -> bool) -> bool {
    loop {
        let notified = stats.changed.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if f(stats) {
            return true;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || tokio::time::timeout(left, notified).await.is_err() {
            return f(stats);
        }
    }
}

/// A stack with `n` joined subscribers.
async fn setup(
    mode: &str,
    n: usize,
    initplan: bool,
) -> anyhow::Result<(
    Stack,
    Arc<Stats>,
    CancellationToken,
    Vec<tokio::task::JoinHandle<()>>,
)> {
    let stack = start_stack(mode, initplan).await?;
    let stats = Arc::new(Stats::new());
    let stop = CancellationToken::new();
    let limit = Arc::new(Semaphore::new(64));
    let tasks = (0..n)
        .map(|i| {
            let (stats, limit, stop) = (stats.clone(), limit.clone(), stop.clone());
            let port = stack.port;
            tokio::spawn(async move {
                if let Err(e) = client(i, port, stats.clone(), limit, stop).await {
                    eprintln!("{e:#}");
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    stats.changed.notify_waiters();
                }
            })
        })
        .collect();
    let t = Instant::now();
    let ok = wait_for(&stats, Instant::now() + Duration::from_secs(300), |s| {
        s.joined.load(Ordering::Relaxed) + s.failed.load(Ordering::Relaxed) >= n
    })
    .await;
    if !ok || stats.failed.load(Ordering::Relaxed) > 0 {
        bail!(
            "{mode}: only {} of {n} subscribers joined ({} failed)",
            stats.joined.load(Ordering::Relaxed),
            stats.failed.load(Ordering::Relaxed)
        );
    }
    eprintln!(
        "{mode}: {n} subscribers joined in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok((stack, stats, stop, tasks))
}

/// Insert one row; returns how many subscribers may see it.
async fn insert(
    admin: &tokio_postgres::Client,
    stmt: &tokio_postgres::Statement,
    id: i64,
    rng: &mut rand::rngs::StdRng,
    n: usize,
) -> anyhow::Result<u64> {
    let shared = rng.random_bool(0.9);
    let owner = uid(rng.random_range(0..n));
    admin
        .execute(
            stmt,
            &[&id, &owner, &shared, &now_micros(), &"x".repeat(64)],
        )
        .await?;
    Ok(if shared { n as u64 } else { 1 })
}

struct Measured {
    deliveries_per_sec: f64,
    delivered: u64,
    expected: u64,
    p50: f64,
    p99: f64,
    unauthorized: u64,
}

async fn throughput(args: &RlsBench, mode: &str) -> anyhow::Result<Measured> {
    let (stack, stats, stop, tasks) = setup(mode, args.subscribers, args.initplan).await?;
    let stmt = stack
        .admin
        .prepare("INSERT INTO items VALUES ($1, $2::text::uuid, $3, $4, $5)")
        .await?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let start = Instant::now();
    let start_us = now_micros();
    let mut expected = 0;
    for id in 0..args.rows as i64 {
        expected += insert(&stack.admin, &stmt, id, &mut rng, args.subscribers).await?;
    }
    let deadline = start + Duration::from_secs(args.max_wait);
    wait_for(&stats, deadline, |s| {
        s.delivered.load(Ordering::Relaxed) >= expected
    })
    .await;
    let delivered = stats.delivered.load(Ordering::Relaxed);
    let end_us = if delivered >= expected {
        stats.last_us.load(Ordering::Relaxed) as i64
    } else {
        now_micros()
    };
    let secs = ((end_us - start_us) as f64 / 1e6).max(1e-6);
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    Ok(Measured {
        deliveries_per_sec: delivered as f64 / secs,
        delivered,
        expected,
        p50: stats.percentile(0.5),
        p99: stats.percentile(0.99),
        unauthorized: stats.unauthorized.load(Ordering::Relaxed),
    })
}

async fn latency(args: &RlsBench, mode: &str) -> anyhow::Result<Measured> {
    let (stack, stats, stop, tasks) = setup(mode, args.subscribers, args.initplan).await?;
    let stmt = stack
        .admin
        .prepare("INSERT INTO items VALUES ($1, $2::text::uuid, $3, $4, $5)")
        .await?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let total = (args.rate * args.latency_secs) as i64;
    let every = Duration::from_secs_f64(1.0 / args.rate.max(1) as f64);
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let start = Instant::now();
    let mut expected = 0;
    for id in 0..total {
        tick.tick().await;
        expected += insert(&stack.admin, &stmt, id, &mut rng, args.subscribers).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(args.max_wait);
    wait_for(&stats, deadline, |s| {
        s.delivered.load(Ordering::Relaxed) >= expected
    })
    .await;
    let delivered = stats.delivered.load(Ordering::Relaxed);
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    // Deliveries that never came count as arriving at the deadline (a floor, not a guess).
    let missing = expected.saturating_sub(delivered);
    if missing > 0 {
        let late = ((deadline - start).as_micros() as i64 / BUCKET_US) as usize;
        stats.hist[late.min(BUCKETS - 1)].fetch_add(missing as u32, Ordering::Relaxed);
    }
    Ok(Measured {
        deliveries_per_sec: delivered as f64 / start.elapsed().as_secs_f64(),
        delivered,
        expected,
        p50: stats.percentile(0.5),
        p99: stats.percentile(0.99),
        unauthorized: stats.unauthorized.load(Ordering::Relaxed),
    })
}

/// Fail when a phase did not deliver everything it should have (see `--strict`) or
/// delivered a row to a subscriber that may not see it.
fn complete(args: &RlsBench, mode: &str, phase: &str, m: &Measured) -> anyhow::Result<()> {
    if m.unauthorized > 0 {
        bail!(
            "{mode}, {phase} phase: {} unauthorized deliveries",
            m.unauthorized
        );
    }
    if m.delivered < m.expected && (mode == "batched" || args.strict) {
        bail!(
            "{mode}, {phase} phase: expected {} deliveries, got {} within {} s",
            m.expected,
            m.delivered,
            args.max_wait
        );
    }
    Ok(())
}

pub async fn run(args: RlsBench) -> anyhow::Result<()> {
    let mut results: Vec<(String, Measured, Measured)> = Vec::new();
    for mode in &args.modes {
        if mode != "batched" && mode != "naive" {
            bail!("unknown mode {mode:?} (batched or naive)");
        }
        let t = throughput(&args, mode).await?;
        eprintln!(
            "{mode}: throughput {:.0} deliveries/s ({} of {})",
            t.deliveries_per_sec, t.delivered, t.expected
        );
        complete(&args, mode, "throughput", &t)?;
        let l = latency(&args, mode).await?;
        eprintln!(
            "{mode}: latency at {} rows/s: p50 {:.0} ms p99 {:.0} ms ({} of {} delivered)",
            args.rate, l.p50, l.p99, l.delivered, l.expected
        );
        complete(&args, mode, "latency", &l)?;
        results.push((mode.clone(), t, l));
    }
    println!(
        "rls: {} subscribers with distinct claims, policy `{}` (90% shared)",
        args.subscribers,
        policy(args.initplan)
    );
    println!(
        "{:<8} {:>16} {:>22} {:>26} {:>13}",
        "mode", "deliveries/s", "delivered/expected", "latency p50 / p99 (ms)", "unauthorized"
    );
    for (mode, t, l) in &results {
        println!(
            "{:<8} {:>16.0} {:>22} {:>26} {:>13}",
            mode,
            t.deliveries_per_sec,
            format!("{}/{}", t.delivered, t.expected),
            format!(
                "{:.0} / {:.0} @{}/s ({}/{})",
                l.p50, l.p99, args.rate, l.delivered, l.expected
            ),
            t.unauthorized + l.unauthorized
        );
    }
    if let (Some(b), Some(n)) = (
        results.iter().find(|r| r.0 == "batched"),
        results.iter().find(|r| r.0 == "naive"),
    ) {
        println!(
            "ratio batched/naive: {:.1}x deliveries/s (target >= 30,000/s batched)",
            b.1.deliveries_per_sec / n.1.deliveries_per_sec.max(1e-9)
        );
    }
    Ok(())
}
