//! CDC drain benchmark.
//!
//! Loads N single-row transactions while several slots sit at the same start position,
//! then drains one slot with a single raw `pg_logical_slot_get_changes` call (the fastest
//! the SQL interface can go: one decode pass, nothing published) and each other slot with
//! the walcast poller publishing to a real nats-server, counting on a NATS subscriber.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_lease::Fence;
use walcast_pipeline::{PipelineConfig, PipelineHealth, SourceKind};
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

const OPTIONS: &str = "'format-version','2','include-transaction','1','include-xids','1',\
    'include-timestamp','1','include-lsn','1','include-pk','1','include-type-oids','1',\
    'include-typmod','0'";

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
    let crate::env::BenchEnv { pg, nats, admin } = crate::env::start(
        "CREATE TABLE bench (id int8 PRIMARY KEY, title text, done bool, at timestamptz);
             CREATE PROCEDURE load(n int) LANGUAGE plpgsql AS $$
             BEGIN
               FOR i IN 1..n LOOP
                 INSERT INTO bench VALUES (i, 'row ' || i, i % 2 = 0, now());
                 COMMIT;
               END LOOP;
             END $$;",
        "bench",
    )
    .await?;
    anyhow::ensure!(args.rows > 0, "--rows must be at least 1");
    let slots = ["raw", "walcast_a", "walcast_b", "walcast_c"];
    for s in slots {
        admin
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'wal2json')",
                &[&s],
            )
            .await?;
    }
    let idle = if args.idle_txn {
        let c = pg.connect().await?;
        c.batch_execute("BEGIN; INSERT INTO bench VALUES (-1, 'idle', false, now())")
            .await?;
        Some(c)
    } else {
        None
    };
    let t = Instant::now();
    admin
        .execute("CALL load($1)", &[&i32::try_from(args.rows)?])
        .await?;
    println!(
        "loaded {} single-row transactions in {:.2}s{}",
        args.rows,
        t.elapsed().as_secs_f64(),
        if idle.is_some() {
            " (one session idle in a transaction that wrote)"
        } else {
            ""
        }
    );

    let raw_rate = raw_drain(&admin, args.rows).await?;

    let n_variants = if args.skip_fixed {
        VARIANTS.len() - 1
    } else {
        VARIANTS.len()
    };
    for ((name, source, min, max), slot) in VARIANTS[..n_variants].iter().zip(&slots[1..]) {
        let secs = drain(&pg.url(), &nats.url(), slot, *source, (*min, *max), &args)
            .await
            .with_context(|| format!("walcast {name}"))?;
        let rate = args.rows as f64 / secs;
        println!(
            "walcast {name:<31}: {rate:>10.0} changes/s ({secs:.2}s)  ratio to raw = {:.2}",
            rate / raw_rate
        );
    }
    drop(idle);
    Ok(())
}

/// Drain the `raw` slot with one `pg_logical_slot_get_changes` call, counting inserts in
/// Postgres; returns changes/s.
async fn raw_drain(admin: &tokio_postgres::Client, rows: usize) -> anyhow::Result<f64> {
    let filter = walcast_realtime::catalog::tables::table_filter(
        &walcast_realtime::catalog::tables::list(admin, None).await?,
    );
    let t = Instant::now();
    let row = admin
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE data LIKE '{{\"action\":\"I\"%') FROM pg_logical_slot_get_changes('raw', NULL, NULL, {OPTIONS}, 'add-tables', $1)"
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
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let counter = seen.clone();
    tokio::spawn(async move {
        let mut done_tx = Some(done_tx);
        while sub.next().await.is_some() {
            if counter.fetch_add(1, Ordering::Relaxed) + 1 == expect {
                if let Some(tx) = done_tx.take() {
                    let _ = tx.send(Instant::now());
                }
            }
        }
    });
    let bus = Bus::nats(nats, "bench-pub").await?;
    let cancel = CancellationToken::new();
    let mut cfg = PipelineConfig::new(db);
    cfg.source = source;
    cfg.origin = "bench".into();
    cfg.read.slot = slot.to_string();
    cfg.read.min_batch = min;
    cfg.read.max_batch = max;

    let started = Instant::now();
    let task = tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        Arc::new(PipelineHealth::new(slot)),
        Fence::unfenced(cancel.clone()),
        walcast_realtime::factories(
            RealtimeConfig::new(db),
            Matcher::new(),
            walcast_realtime::FrontLinks::new(Default::default()),
        ),
    ));
    let finished = tokio::time::timeout(Duration::from_secs(args.max_wait), done_rx).await;
    cancel.cancel();
    let worker = task.await;
    let Ok(Ok(finished)) = finished else {
        anyhow::bail!(
            "expected {expect} changes on NATS, got {} within {} s (worker: {worker:?})",
            seen.load(Ordering::Relaxed),
            args.max_wait
        );
    };
    worker??;
    Ok((finished - started).as_secs_f64())
}
