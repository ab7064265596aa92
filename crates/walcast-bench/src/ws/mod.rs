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

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use clap::Args;
use tokio_util::sync::CancellationToken;

mod clients;
mod load;
mod server;

pub(crate) use clients::{jwt, percentile_ms, record_int};
use clients::{spawn_clients, wait_stats, Stats};
use load::{steady, Source};
use server::Server;
pub(crate) use server::{fd_limit, http_get, proc_kb, FIGURES_KEY};

pub(crate) const SECRET: &str = "walcast-bench-secret-0123456789abcdef";
/// Phases, tagged in each row's `ph` column.
pub(super) const WARMUP: usize = 0;
pub(super) const THROUGHPUT: usize = 1;
pub(super) const LATENCY: usize = 2;
pub(super) const PHASES: usize = 3;
/// Latency histogram: 20 µs buckets up to 10 s (the last bucket collects the rest).
pub(super) const BUCKET_US: i64 = 20;
pub(super) const BUCKETS: usize = 500_000;

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
