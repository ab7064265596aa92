//! Change-stream throughput: the same backlog of single-row transactions drained by the
//! pipeline twice from one position, each on its own slot: once by realtime delivery
//! alone (core NATS, the table subjects, counted on a subscriber), once by the change
//! stream alone (JetStream, each change acknowledged by a PubAck before the slot moves,
//! counted in the stream). Changes/s of each and the ratio, in the same run.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use futures_util::StreamExt;
use walcast_bus::Bus;
use walcast_changes::config::ChangeStreamConfig;
use walcast_pipeline::{ConsumerFactory, PipelineConfig};
use walcast_realtime::{Matcher, RealtimeConfig};

#[derive(Args)]
pub struct ChangesBench {
    /// Number of single-row transactions to load.
    #[arg(long, default_value_t = 100_000)]
    rows: usize,
    /// Fail when a drain has not delivered every change within this many seconds.
    #[arg(long, default_value_t = 600)]
    max_wait: u64,
}

pub async fn run(args: ChangesBench) -> anyhow::Result<()> {
    anyhow::ensure!(args.rows > 0, "--rows must be at least 1");
    let crate::env::BenchEnv { pg, nats, admin } =
        crate::env::start(crate::env::LOAD_TABLE_SQL, "bench").await?;
    walcast_changes::tables::enable(&admin, "default", "public", "bench").await?;
    crate::env::create_slots(&admin, &["core", "jetstream"]).await?;
    let secs = crate::env::load(&admin, args.rows).await?;
    println!("loaded {} single-row transactions in {secs:.2}s", args.rows);
    let db = pg.url();
    let core = core_drain(&db, &nats.url(), &args).await?;
    let js = stream_drain(&db, &nats.url(), &args).await?;
    let (core_rate, js_rate) = (args.rows as f64 / core, args.rows as f64 / js);
    println!("core NATS (realtime, table subjects): {core_rate:>10.0} changes/s ({core:.2}s)");
    println!("JetStream (change stream, PubAcks)  : {js_rate:>10.0} changes/s ({js:.2}s)");
    println!(
        "ratio JetStream / core NATS         : {:.2}",
        js_rate / core_rate
    );
    Ok(())
}

/// Run a pipeline on `slot` with `consumers` until `done` fires (bounded); seconds.
async fn drain(
    db: &str,
    nats: &str,
    slot: &str,
    consumers: Vec<Arc<dyn ConsumerFactory>>,
    done: impl std::future::Future<Output = anyhow::Result<()>>,
    max_wait: u64,
) -> anyhow::Result<f64> {
    let mut cfg = PipelineConfig::new(db);
    cfg.origin = "bench".into();
    cfg.read.slot = slot.to_string();
    crate::env::run_pipeline_until(cfg, nats, consumers, done, max_wait).await
}

/// Realtime delivery alone: until every change arrived on a core NATS subscriber.
async fn core_drain(db: &str, nats: &str, args: &ChangesBench) -> anyhow::Result<f64> {
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
    // No subscriber: nothing is checked, so no check login is needed.
    let consumers = walcast_realtime::factories(
        RealtimeConfig::new(db, ""),
        Matcher::new(),
        walcast_realtime::FrontLinks::new(Default::default()),
    );
    drain(db, nats, "core", consumers, done, args.max_wait).await
}

/// The change stream alone: until the stream holds every change.
async fn stream_drain(db: &str, nats: &str, args: &ChangesBench) -> anyhow::Result<f64> {
    let expect = args.rows as u64;
    let js = async_nats::jetstream::new(async_nats::connect(nats).await?);
    let done = async move {
        loop {
            if let Ok(mut s) = js
                .get_stream(walcast_changes::config::DEFAULT_CHANGES_STREAM)
                .await
            {
                if s.info().await?.state.messages >= expect {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    let consumers = vec![walcast_changes::factory(ChangeStreamConfig::new(db))];
    drain(db, nats, "jetstream", consumers, done, args.max_wait).await
}
