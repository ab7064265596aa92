//! Scale: the leader's work per change as the audience grows. One cdc-worker (the leader)
//! and K ws-front processes over a real nats-server; N raw Phoenix clients spread over the
//! fronts, each with one channel whose binding is one of `--classes` distinct filters
//! (every filter matches every row, so every client receives every change). N grows in
//! steps; at each step the same number of single-row transactions is written and the
//! leader's CPU time and published bytes per change are measured, with the fronts' CPU
//! per delivery.
//!
//! The baseline is the first (smallest) step of the same run: with delivery by class and
//! by front, the leader's CPU and bytes per change should stay flat (ratio ≈ 1) however
//! many clients share the classes; what grows with N is the fronts' work, which scales
//! out by adding fronts.
//!
//! Processes: the worker and the fronts are children of this process running the real
//! `cdc-worker` and `ws-front` entry points (`walcast-bench scale-worker` /
//! `scale-front`), so their CPU is read from `/proc/<pid>/stat` apart from the load
//! generator's.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use crate::ws::{fd_limit, http_get, jwt, UNLIMITED_PROJECT};

#[derive(Args)]
pub struct ScaleBench {
    /// ws-front processes (clients are spread over them round robin).
    #[arg(long, default_value_t = 2)]
    fronts: usize,
    /// Client counts to step through, increasing (one connection and channel each).
    #[arg(long, value_delimiter = ',', default_values_t = vec![100, 2_000, 8_000, 16_000])]
    clients: Vec<usize>,
    /// Distinct bindings (filters) among the clients: the classes per front.
    #[arg(long, default_value_t = 10)]
    classes: usize,
    /// Single-row transactions written at each step.
    #[arg(long, default_value_t = 400)]
    changes: u64,
    /// Transactions per second while writing them.
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Connections opened (and joins sent) concurrently.
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Seconds to wait at each step for every client to receive every change.
    #[arg(long, default_value_t = 120)]
    max_wait: u64,
}

/// One step's measurements.
#[derive(Debug, Default, Clone)]
struct Step {
    clients: usize,
    join_secs: f64,
    leader_cpu_us_per_change: f64,
    bytes_per_change: f64,
    messages_per_change: f64,
    front_cpu_us_per_delivery: f64,
    deliveries_per_sec: f64,
}

/// A child process running a walcast entry point, killed on drop.
pub(crate) struct Proc {
    pub(crate) child: Child,
    pub(crate) port: u16,
    name: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub(crate) fn start(sub: &str, name: String, env: &[(&str, String)]) -> anyhow::Result<Proc> {
        Proc::start_logged(sub, name, env, None)
    }

    /// As [`Proc::start`], with the child's output (its logs) appended to `log` instead of
    /// this process's stdout and stderr.
    pub(crate) fn start_logged(
        sub: &str,
        name: String,
        env: &[(&str, String)],
        log: Option<&std::path::Path>,
    ) -> anyhow::Result<Proc> {
        let port = walcast_testkit::free_port()?;
        let (out, err) = match log {
            Some(path) => {
                let f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .with_context(|| format!("opening {}", path.display()))?;
                (Stdio::from(f.try_clone()?), Stdio::from(f))
            }
            None => (Stdio::inherit(), Stdio::inherit()),
        };
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.arg(sub)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("JWT_SECRET", crate::ws::SECRET)
            .env("SECRETS_KEY", walcast_testkit::SECRETS_KEY)
            .env("METRICS_API_KEY", crate::ws::FIGURES_KEY)
            .env("HOST", "127.0.0.1")
            .env("PORT", port.to_string())
            .env("LOG_FORMAT", "text")
            .env("LOG_LEVEL", "warn")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        // Every client is of one project: its per-project limits (a policy, not a
        // capacity) are lifted, so the run measures the servers.
        cmd.envs(UNLIMITED_PROJECT);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().with_context(|| format!("spawning {name}"))?;
        Ok(Proc { child, port, name })
    }

    pub(crate) async fn wait_healthy(&mut self, active: bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited: {status}", self.name);
            }
            let body = http_get(self.port, "/health").await.unwrap_or_default();
            let h: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if h.is_object() && (!active || h["cdc_active"] == true) {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("{} not healthy within 60 s: {body}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn cpu(&self) -> f64 {
        crate::cpu::secs(&self.child.id().to_string())
    }

    /// A counter from `/metrics`, summed over its label sets (a worker's carry `source`).
    async fn counter(&self, name: &str) -> f64 {
        let text = http_get(self.port, "/metrics").await.unwrap_or_default();
        text.lines()
            .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
            .filter_map(|l| l.rsplit_once(' ')?.1.trim().parse::<f64>().ok())
            .sum()
    }
}

/// What the clients saw.
#[derive(Default)]
struct Seen {
    joined: AtomicUsize,
    failed: AtomicUsize,
    /// Changes received, all clients together.
    received: AtomicU64,
}

/// The run's limits checked, and what it does said.
fn announce(args: &ScaleBench) -> anyhow::Result<()> {
    let max = args.clients.iter().copied().max().unwrap_or(0);
    if fd_limit().is_some_and(|n| n < max as u64 + 256) {
        bail!(
            "open file limit too low for {max} clients: raise it (ulimit -n {})",
            max + 1024
        );
    }
    if args.clients.windows(2).any(|w| w[1] < w[0]) || args.clients.is_empty() {
        bail!("--clients must be increasing");
    }
    println!(
        "Scale: 1 cdc-worker (leader) + {} ws-front processes over nats-server; clients step \
         through {:?}, spread round robin over the fronts, {} distinct bindings; {} single-row \
         transactions at {}/s per step; {} cores",
        args.fronts,
        args.clients,
        args.classes,
        args.changes,
        args.rate,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    Ok(())
}

/// The benchmark's script (start, join each size, measure, report), in order.
pub async fn run(args: ScaleBench) -> anyhow::Result<()> {
    announce(&args)?;
    let env = crate::env::start(
        "CREATE TABLE scale (id int8 PRIMARY KEY, pad text NOT NULL);
         GRANT SELECT ON scale TO anon, authenticated;",
        "scale",
    )
    .await?;
    let base = [
        ("DATABASE_URL", env.pg.url()),
        ("CHECK_DATABASE_URL", env.pg.check_url()),
        ("NATS_URL", env.nats.url()),
    ];
    let mut worker = Proc::start("scale-worker", "cdc-worker".into(), &base)?;
    worker.wait_healthy(true).await?;
    let mut fronts = Vec::new();
    for i in 0..args.fronts.max(1) {
        let mut f = Proc::start("scale-front", format!("ws-front {i}"), &base)?;
        f.wait_healthy(false).await?;
        fronts.push(f);
    }
    let seen = Arc::new(Seen::default());
    let stop = CancellationToken::new();
    let limit = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let token: Arc<str> = jwt()?.into();
    let mut tasks = Vec::new();
    let mut steps: Vec<Step> = Vec::new();
    let mut next_id = 1i64;
    for &n in &args.clients {
        let started = Instant::now();
        for i in tasks.len()..n {
            let front = &fronts[i % fronts.len()];
            let url = format!(
                "ws://127.0.0.1:{}/realtime/v1/websocket?apikey={token}&vsn=2.0.0",
                front.port
            );
            let filter = format!("pad=neq.c{}", i % args.classes.max(1));
            tasks.push(tokio::spawn(client(
                url,
                filter,
                seen.clone(),
                limit.clone(),
                stop.clone(),
            )));
        }
        wait_for(&seen, "every client joined", args.max_wait, |s| {
            let failed = s.failed.load(Ordering::Relaxed);
            if failed > 0 {
                bail!("{failed} client(s) failed to connect or join");
            }
            Ok(s.joined.load(Ordering::Relaxed) >= n)
        })
        .await?;
        let join_secs = started.elapsed().as_secs_f64();
        let step = measure(&args, &env.admin, &worker, &fronts, &seen, n, &mut next_id).await?;
        steps.push(Step { join_secs, ..step });
        println!("  {} clients: done", n);
    }
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    report(&args, &steps);
    Ok(())
}

/// Write `--changes` rows, wait until every client has them all; per-change costs.
async fn measure(
    args: &ScaleBench,
    db: &tokio_postgres::Client,
    worker: &Proc,
    fronts: &[Proc],
    seen: &Seen,
    n: usize,
    next_id: &mut i64,
) -> anyhow::Result<Step> {
    // Warm up: one change to everyone, so every join is settled and counted.
    let warm = seen.received.load(Ordering::Relaxed) + n as u64;
    insert(db, next_id).await?;
    wait_for(
        seen,
        "the warm-up change at every client",
        args.max_wait,
        |s| Ok(s.received.load(Ordering::Relaxed) >= warm),
    )
    .await?;
    let published = "walcast_cdc_changes_published_total";
    let (pub0, bytes0, msgs0) = (
        worker.counter(published).await,
        worker.counter("walcast_cdc_published_bytes_total").await,
        worker.counter("walcast_cdc_published_messages_total").await,
    );
    let cpu0 = worker.cpu();
    let front0: f64 = fronts.iter().map(Proc::cpu).sum();
    let recv0 = seen.received.load(Ordering::Relaxed);
    let t0 = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate.max(1) as f64));
    for _ in 0..args.changes {
        tick.tick().await;
        insert(db, next_id).await?;
    }
    // The leader's part ends when it has published them all.
    let deadline = Instant::now() + Duration::from_secs(args.max_wait);
    while worker.counter(published).await < pub0 + args.changes as f64 {
        if Instant::now() > deadline {
            bail!(
                "the worker did not publish {} changes in time",
                args.changes
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let leader_cpu = worker.cpu() - cpu0;
    let (bytes, msgs) = (
        worker.counter("walcast_cdc_published_bytes_total").await - bytes0,
        worker.counter("walcast_cdc_published_messages_total").await - msgs0,
    );
    let want = recv0 + args.changes * n as u64;
    wait_for(seen, "every change at every client", args.max_wait, |s| {
        Ok(s.received.load(Ordering::Relaxed) >= want)
    })
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    let front_cpu: f64 = fronts.iter().map(Proc::cpu).sum::<f64>() - front0;
    let deliveries = (args.changes * n as u64) as f64;
    let changes = args.changes as f64;
    Ok(Step {
        clients: n,
        join_secs: 0.0,
        leader_cpu_us_per_change: leader_cpu * 1e6 / changes,
        bytes_per_change: bytes / changes,
        messages_per_change: msgs / changes,
        front_cpu_us_per_delivery: front_cpu * 1e6 / deliveries,
        deliveries_per_sec: deliveries / secs,
    })
}

async fn insert(db: &tokio_postgres::Client, next_id: &mut i64) -> anyhow::Result<()> {
    db.execute(
        "INSERT INTO scale VALUES ($1, repeat('x', 100))",
        &[&*next_id],
    )
    .await?;
    *next_id += 1;
    Ok(())
}

/// Poll `done` every 20 ms until it holds, for at most `secs`.
async fn wait_for(
    seen: &Seen,
    what: &str,
    secs: u64,
    done: impl Fn(&Seen) -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !done(seen)? {
        if Instant::now() > deadline {
            bail!(
                "timed out after {secs} s waiting for {what} (joined {}, received {})",
                seen.joined.load(Ordering::Relaxed),
                seen.received.load(Ordering::Relaxed)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// One raw Phoenix client: connect, join one channel, count `postgres_changes` frames.
async fn client(
    url: String,
    filter: String,
    seen: Arc<Seen>,
    limit: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let cfg = WebSocketConfig::default()
        .read_buffer_size(8 * 1024)
        .write_buffer_size(0)
        .max_write_buffer_size(64 * 1024);
    let permit = limit.acquire().await;
    let Ok((ws, _)) = tokio_tungstenite::connect_async_with_config(&url, Some(cfg), true).await
    else {
        seen.failed.fetch_add(1, Ordering::Relaxed);
        return;
    };
    let (mut tx, mut rx) = ws.split();
    let join = json!(["1", "1", "realtime:scale", "phx_join", {"config": {
        "broadcast": {"ack": false, "self": false},
        "presence": {"key": "", "enabled": false},
        "postgres_changes": [{"event": "*", "schema": "public", "table": "scale", "filter": filter}],
        "private": false
    }}]);
    if tx
        .send(Message::Text(join.to_string().into()))
        .await
        .is_err()
    {
        seen.failed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut permit = Some(permit);
    let mut hb = tokio::time::interval(Duration::from_secs(25));
    loop {
        let m = tokio::select! {
            _ = stop.cancelled() => return,
            _ = hb.tick() => {
                let _ = tx.send(Message::Text(r#"[null,"hb","phoenix","heartbeat",{}]"#.into())).await;
                continue;
            }
            m = rx.next() => m,
        };
        let Some(Ok(Message::Text(text))) = m else {
            if matches!(m, Some(Ok(_))) {
                continue;
            }
            seen.failed.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if text.contains(r#","postgres_changes",{"#) {
            seen.received.fetch_add(1, Ordering::Relaxed);
        } else if permit.is_some() && text.starts_with(r#"["1","1","#) {
            permit = None;
            if text.contains(r#""status":"ok""#) {
                seen.joined.fetch_add(1, Ordering::Relaxed);
            } else {
                eprintln!("join refused: {text}");
                seen.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn report(args: &ScaleBench, steps: &[Step]) {
    let Some(first) = steps.first() else {
        return;
    };
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { f64::NAN };
    println!();
    println!(
        "{:>8} {:>9} {:>16} {:>7} {:>14} {:>7} {:>10} {:>15} {:>14}",
        "clients",
        "join (s)",
        "leader µs/chg",
        "ratio",
        "NATS B/chg",
        "ratio",
        "msgs/chg",
        "fronts µs/dlv",
        "deliveries/s"
    );
    for s in steps {
        println!(
            "{:>8} {:>9.2} {:>16.1} {:>7.2} {:>14.0} {:>7.2} {:>10.1} {:>15.2} {:>14.0}",
            s.clients,
            s.join_secs,
            s.leader_cpu_us_per_change,
            ratio(s.leader_cpu_us_per_change, first.leader_cpu_us_per_change),
            s.bytes_per_change,
            ratio(s.bytes_per_change, first.bytes_per_change),
            s.messages_per_change,
            s.front_cpu_us_per_delivery,
            s.deliveries_per_sec
        );
    }
    println!(
        "baseline: the first step ({} clients) of this run; {} fronts, {} classes per front; \
         target: the leader's CPU per change flat as clients grow",
        first.clients, args.fronts, args.classes
    );
}
