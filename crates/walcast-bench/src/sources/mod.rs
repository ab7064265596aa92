//! Many sources: what each source read by the cdc-workers costs, on many small
//! databases. `--sources` databases spread round robin over `--instances` Postgres
//! instances (several databases per instance, each its own source with its own slot),
//! besides the control database (the default source) on an instance of its own, read by
//! `--workers` cdc-workers (children of this process running the real entry point) with
//! Postgres leases of `--lease-secs`.
//!
//! Each number is measured twice in the same run: first with the default source alone
//! (the baseline), then with every source registered:
//!
//! 1. **idle cost**: the workers' VmRSS (`/proc/<pid>/status`) and CPU time
//!    (`/proc/<pid>/stat`, utime + stime) over `--idle-secs` with nothing written; the
//!    difference per added source.
//! 2. **commit-to-NATS latency**: `--rate` single-row transactions per second into every
//!    source's table at once for `--secs`; per source and overall p50/p99, from a
//!    `clock_timestamp()` column to the change's arrival on `walcast.realtime.>`.
//! 3. **takeover**: kill -9 the worker leading the most sources; for each of them, the
//!    time until another worker's `/health` shows it `leader && cdc_active`. The baseline
//!    kills the default source's leader when it is the only source (and starts a
//!    replacement worker before the rest of the run).
//!
//! Fails (after printing) when a change written was not received within `--max-wait`, or
//! a source was not taken over within it.

mod cluster;
mod load;
mod report;
mod setup;

use std::time::Instant;

use anyhow::ensure;
use clap::Args;

use cluster::Cluster;
use setup::Src;

#[derive(Args, Debug, Clone)]
pub struct SourcesBench {
    /// Sources besides the default one, one database each.
    #[arg(long, default_value_t = 20)]
    sources: usize,
    /// Postgres instances their databases are spread over (the control database is on
    /// one more).
    #[arg(long, default_value_t = 4)]
    instances: usize,
    /// cdc-worker processes (at least 2: one is killed).
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Seconds the idle workers are measured, alone and with every source.
    #[arg(long, default_value_t = 10)]
    idle_secs: u64,
    /// Single-row transactions per second into each source's table.
    #[arg(long, default_value_t = 20)]
    rate: u32,
    /// Seconds of steady load, alone and with every source.
    #[arg(long, default_value_t = 10)]
    secs: u64,
    /// The workers' LEASE_DURATION_SECS (LEASE_MODE=postgres).
    #[arg(long, default_value_t = 3)]
    lease_secs: u64,
    /// Fail when the changes written are not all on NATS this many seconds after the last
    /// write, or a killed worker's sources not all taken over within it.
    #[arg(long, default_value_t = 60)]
    max_wait: u64,
}

/// Everything measured, for the report.
#[derive(Debug, Default)]
struct Results {
    idle_alone: cluster::Idle,
    idle_all: cluster::Idle,
    latency_alone: std::collections::BTreeMap<String, load::PerSource>,
    latency_all: std::collections::BTreeMap<String, load::PerSource>,
    takeover_alone: cluster::Takeover,
    takeover_all: cluster::Takeover,
    /// From registering the sources to all of them led and spread.
    spread_secs: f64,
    spread: Vec<Vec<String>>,
}

fn announce(args: &SourcesBench) -> anyhow::Result<()> {
    ensure!(
        args.workers >= 2,
        "--workers must be at least 2 (one is killed)"
    );
    ensure!(
        args.instances >= 1 && args.sources >= 1,
        "--instances and --sources must be at least 1"
    );
    println!(
        "Sources: {} sources ({} databases over {} Postgres instances, plus the default on \
         the control instance), {} cdc-workers, LEASE_MODE=postgres, lease {} s; idle {} s; \
         {} tx/s per source for {} s; {} cores",
        args.sources + 1,
        args.sources,
        args.instances,
        args.workers,
        args.lease_secs,
        args.idle_secs,
        args.rate,
        args.secs,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    Ok(())
}

/// The benchmark's script: fixtures, the baseline with the default source alone, then
/// every source; report; completeness.
pub async fn run(args: SourcesBench) -> anyhow::Result<()> {
    announce(&args)?;
    let ctl = crate::env::start(
        &format!("CREATE TABLE {} {}", setup::DEFAULT_TABLE, setup::TABLE_DDL),
        setup::DEFAULT_TABLE,
    )
    .await?;
    let per_instance = args.sources.div_ceil(args.instances);
    let instances = setup::start_instances(args.instances, per_instance).await?;
    let others = setup::create_sources(&instances, args.sources).await?;
    let default = Src::default_of(&ctl.pg.url());
    let recv = load::Received::subscribe(&ctl.nats.url()).await?;
    let log =
        std::env::temp_dir().join(format!("walcast-bench-sources-{}.log", std::process::id()));
    println!("  workers' logs: {}", log.display());
    let mut cluster = Cluster::start(
        args.workers,
        ctl.pg.url(),
        ctl.nats.url(),
        args.lease_secs,
        log,
    )
    .await?;
    let mut r = Results::default();
    let only_default = vec![default.name.clone()];
    cluster
        .wait_spread(&only_default, args.max_wait.max(60))
        .await?;
    r.takeover_alone = cluster.takeover(args.max_wait).await?;
    cluster.spawn()?;
    if let Some(p) = cluster.procs.last_mut() {
        p.wait_healthy(false).await?;
    }
    println!("  baseline takeover done");
    let alone = std::slice::from_ref(&default);
    r.latency_alone = load::steady(alone, args.rate, args.secs, 0, args.max_wait, &recv).await?;
    r.idle_alone = cluster.idle(args.idle_secs).await;
    println!("  baseline load and idle done");
    let started = Instant::now();
    setup::register(&ctl.admin, &others).await?;
    let mut all = vec![default];
    all.extend(others);
    let names: Vec<String> = all.iter().map(|s| s.name.clone()).collect();
    r.spread = cluster.wait_spread(&names, args.max_wait.max(120)).await?;
    r.spread_secs = started.elapsed().as_secs_f64();
    println!("  every source led after {:.1} s", r.spread_secs);
    r.idle_all = cluster.idle(args.idle_secs).await;
    r.latency_all = load::steady(&all, args.rate, args.secs, 1 << 32, args.max_wait, &recv).await?;
    println!("  load with every source done");
    r.takeover_all = cluster.takeover(args.max_wait).await?;
    report::print(&args, &all, &r);
    complete(&args, &r)
}

/// Every change written received (both load phases).
fn complete(args: &SourcesBench, r: &Results) -> anyhow::Result<()> {
    for (phase, m) in [
        ("alone", &r.latency_alone),
        ("with every source", &r.latency_all),
    ] {
        for (name, s) in m {
            ensure!(
                s.received == s.sent,
                "{name} ({phase}): expected {} changes on NATS, got {} within {} s of the last write",
                s.sent,
                s.received,
                args.max_wait
            );
        }
    }
    Ok(())
}
