//! CDC drain benchmark.
//!
//! Loads N single-row transactions while several slots sit at the same start position,
//! then drains one slot with a single raw `pg_logical_slot_get_changes` call (the fastest
//! the SQL interface can go: one decode pass, nothing published) and each other slot with
//! the walcast poller publishing to a real nats-server, counting on a NATS subscriber.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;
use walcast_bus::Bus;
use walcast_pipeline::source::WAL2JSON_OPTIONS;
use walcast_pipeline::{PipelineConfig, SourceKind};
use walcast_realtime::{Matcher, RealtimeConfig};

#[derive(Args)]
pub struct CdcBench {
    /// Number of single-row transactions to load.
    #[arg(long, default_value_t = 100_000)]
    rows: usize,
    /// Leave one session idle in a transaction that wrote something during the load
    /// (it pins restart_lsn: every poll then re-decodes everything since).
    #[arg(long)]
    idle_txn: bool,
    /// Skip the fixed 1,000-rows-per-peek variant (slow: it shows the re-decoding cost).
    #[arg(long)]
    skip_fixed: bool,
    /// Fail when a drain has not delivered every change to NATS within this many seconds.
    #[arg(long, default_value_t = 600)]
    max_wait: u64,
}

/// [`WAL2JSON_OPTIONS`] as SQL arguments of `pg_logical_slot_get_changes`.
fn sql_options() -> String {
    WAL2JSON_OPTIONS
        .iter()
        .map(|(k, v)| format!("'{k}','{v}'"))
        .collect::<Vec<_>>()
        .join(",")
}

/// (name, source, min batch, max batch) of each walcast drain, in order.
const VARIANTS: &[(&str, SourceKind, usize, usize)] = &[
    (
        "stream (START_REPLICATION)",
        SourceKind::Stream,
        1000,
        100_000,
    ),
    (
        "poll, adaptive 1000..100000",
        SourceKind::Poll,
        1000,
        100_000,
    ),
    (
        "poll, fixed 1000 rows per peek",
        SourceKind::Poll,
        1000,
        1000,
    ),
];

pub async fn run(args: CdcBench) -> anyhow::Result<()> {
    let crate::env::BenchEnv { pg, nats, admin } =
        crate::env::start(crate::env::LOAD_TABLE_SQL, "bench").await?;
    anyhow::ensure!(args.rows > 0, "--rows must be at least 1");
    let slots = ["raw", "walcast_a", "walcast_b", "walcast_c", "recv"];
    crate::env::create_slots(&admin, &slots).await?;
    let idle = if args.idle_txn {
        let c = pg.connect().await?;
        c.batch_execute("BEGIN; INSERT INTO bench VALUES (-1, 'idle', false, now())")
            .await?;
        Some(c)
    } else {
        None
    };
    let secs = crate::env::load(&admin, args.rows).await?;
    println!(
        "loaded {} single-row transactions in {secs:.2}s{}",
        args.rows,
        if idle.is_some() {
            " (one session idle in a transaction that wrote)"
        } else {
            ""
        }
    );

    let raw_rate = raw_drain(&admin, args.rows).await?;
    let recv_rate = recvlogical_drain(&pg, &admin, args.rows, args.max_wait)
        .await
        .context("pg_recvlogical")?;

    let n_variants = if args.skip_fixed {
        VARIANTS.len() - 1
    } else {
        VARIANTS.len()
    };
    for ((name, source, min, max), slot) in VARIANTS[..n_variants].iter().zip(&slots[1..4]) {
        let secs = drain(&pg.url(), &nats.url(), slot, *source, (*min, *max), &args)
            .await
            .with_context(|| format!("walcast {name}"))?;
        let rate = args.rows as f64 / secs;
        println!(
            "walcast {name:<31}: {rate:>10.0} changes/s ({secs:.2}s)  ratio to pg_recvlogical = {:.2}, to raw = {:.2}",
            rate / recv_rate,
            rate / raw_rate
        );
    }
    drop(idle);
    Ok(())
}

/// Drain the `raw` slot with one `pg_logical_slot_get_changes` call, counting inserts in
/// Postgres; returns changes/s.
async fn raw_drain(admin: &tokio_postgres::Client, rows: usize) -> anyhow::Result<f64> {
    let filter =
        walcast_control::tables::table_filter(&walcast_control::tables::list(admin, None).await?);
    let t = Instant::now();
    let row = admin
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE data LIKE '{{\"action\":\"I\"%') FROM pg_logical_slot_get_changes('raw', NULL, NULL, {}, 'add-tables', $1)",
                sql_options()
            ),
            &[&filter],
        )
        .await?;
    let raw_secs = t.elapsed().as_secs_f64();
    let raw_n: i64 = row.get(0);
    anyhow::ensure!(
        raw_n as usize == rows,
        "raw drain: expected {rows} inserts, saw {raw_n}"
    );
    let raw_rate = rows as f64 / raw_secs;
    println!(
        "raw pg_logical_slot_get_changes, one call: {raw_rate:>10.0} changes/s ({raw_secs:.2}s)"
    );
    Ok(raw_rate)
}

/// Run the poller on `slot` until `args.rows` changes arrived on a NATS subscriber (or
/// fail after `args.max_wait` seconds, saying how many did).
async fn drain(
    db: &str,
    nats: &str,
    slot: &str,
    source: SourceKind,
    (min, max): (usize, usize),
    args: &CdcBench,
) -> anyhow::Result<f64> {
    let expect = args.rows;
    let sub_bus = Bus::nats(nats, "bench-sub").await?;
    let mut sub = sub_bus
        .subscribe(walcast_bus::subject::REALTIME_ALL)
        .await?;
    sub_bus.barrier().await?;
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    let done = async move {
        while sub.next().await.is_some() {
            if counter.fetch_add(1, Ordering::Relaxed) + 1 >= expect {
                return Ok(());
            }
        }
        anyhow::bail!("the subscription ended")
    };
    let mut cfg = PipelineConfig::new(db);
    cfg.source = source;
    cfg.origin = "bench".into();
    cfg.read.slot = slot.to_string();
    cfg.read.min_batch = min;
    cfg.read.max_batch = max;
    // No subscriber: nothing is checked, so no check login is needed.
    let consumers = walcast_realtime::factories(
        RealtimeConfig::new(db, ""),
        Matcher::new(),
        walcast_realtime::FrontLinks::new(Default::default()),
    );
    crate::env::run_pipeline_until(cfg, nats, consumers, done, args.max_wait)
        .await
        .with_context(|| {
            format!(
                "expected {expect} changes on NATS, got {}",
                seen.load(Ordering::Relaxed)
            )
        })
}

/// Drain the `recv` slot with `pg_recvlogical` (the walsender's pace: `START_REPLICATION`,
/// the same options, nothing published, its output to `/dev/null`) up to the WAL position
/// after the load (`--endpos`, where it exits); returns changes/s, its start included as
/// walcast's drains include theirs.
async fn recvlogical_drain(
    pg: &walcast_testkit::Postgres,
    admin: &tokio_postgres::Client,
    rows: usize,
    max_wait: u64,
) -> anyhow::Result<f64> {
    let filter =
        walcast_control::tables::table_filter(&walcast_control::tables::list(admin, None).await?);
    let end: String = admin
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    let mut cmd = tokio::process::Command::new(pg.bindir().join("pg_recvlogical"));
    cmd.args(["-d", &pg.url(), "-S", "recv", "--start", "--no-loop"])
        .args(["-E", &end, "-f", "/dev/null"]);
    for (k, v) in WAL2JSON_OPTIONS
        .iter()
        .chain(&[("add-tables", filter.as_str())])
    {
        cmd.arg("-o").arg(format!("{k}={v}"));
    }
    cmd.kill_on_drop(true);
    let t = Instant::now();
    let mut child = cmd.spawn().context("starting pg_recvlogical")?;
    let status = tokio::time::timeout(std::time::Duration::from_secs(max_wait), child.wait())
        .await
        .with_context(|| format!("not at {end} within {max_wait} s"))??;
    let secs = t.elapsed().as_secs_f64();
    anyhow::ensure!(status.success(), "pg_recvlogical: {status}");
    let rate = rows as f64 / secs;
    println!("pg_recvlogical (START_REPLICATION):   {rate:>10.0} changes/s ({secs:.2}s)");
    Ok(rate)
}
