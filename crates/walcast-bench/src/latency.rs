//! Commit-to-NATS latency at a steady write rate, for both sources, with and without a
//! session idle in a transaction that wrote something (it pins `restart_lsn`, so every
//! poll re-decodes everything since it began).
//!
//! Each row carries `clock_timestamp()` taken inside its transaction, just before the
//! commit; the subscriber measures receive time minus that stamp (same machine clock).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use futures_util::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use walcast_bus::{Bus, ChangeEvent};
use walcast_lease::Fence;
use walcast_pipeline::{PipelineConfig, PipelineHealth, SourceKind};
use walcast_realtime::{Matcher, RealtimeConfig};

#[derive(Args)]
pub struct LatencyBench {
    /// Transactions per second to write.
    #[arg(long, default_value_t = 5000)]
    rate: u32,
    /// Seconds of steady load per scenario.
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// Fail when a scenario's changes have not all reached NATS this many seconds after
    /// its last write.
    #[arg(long, default_value_t = 60)]
    max_wait: u64,
}

struct Outcome {
    sent: usize,
    /// Distinct rows received.
    received: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    achieved_rate: f64,
}

pub async fn run(args: LatencyBench) -> anyhow::Result<()> {
    println!(
        "commit-to-NATS latency, {} single-row transactions/s for {} s per scenario",
        args.rate, args.secs
    );
    println!(
        "{:<8} {:<16} {:>10} {:>9} {:>9} {:>9} {:>10}",
        "source", "idle txn", "received", "p50 ms", "p99 ms", "max ms", "tx/s"
    );
    for source in [SourceKind::Stream, SourceKind::Poll] {
        for idle in [false, true] {
            let o = scenario(&args, source, idle).await?;
            println!(
                "{:<8} {:<16} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>10.0}",
                source.to_string(),
                if idle { "open, wrote" } else { "none" },
                format!("{}/{}", o.received, o.sent),
                o.p50_ms,
                o.p99_ms,
                o.max_ms,
                o.achieved_rate
            );
            anyhow::ensure!(
                o.received == o.sent,
                "{source}, idle txn {idle}: expected {} changes on NATS, got {} within {} s \
                 of the last write",
                o.sent,
                o.received,
                args.max_wait
            );
        }
    }
    Ok(())
}

fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or(0)
}

/// What the NATS subscriber saw: the latency of each change and the distinct row ids.
#[derive(Default)]
struct Received {
    seen: Mutex<(Vec<f64>, HashSet<i64>)>,
    changed: Notify,
}

impl Received {
    fn distinct(&self) -> usize {
        self.seen.lock().map(|s| s.1.len()).unwrap_or(0)
    }

    /// Wait until `n` distinct rows arrived, or `timeout` passed; returns the distinct count.
    async fn wait_for(&self, n: usize, timeout: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let got = self.distinct();
            if got >= n || tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.distinct();
            }
        }
    }

    fn record(&self, payload: &[u8], recv: i64) {
        let Ok(ev) = serde_json::from_slice::<ChangeEvent>(payload) else {
            return;
        };
        let Some(rec) = ev.record else { return };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(rec.get()) else {
            return;
        };
        let (Some(id), Some(at)) = (v["id"].as_i64(), v["at"].as_str()) else {
            return;
        };
        if let Ok(t) = walcast_protocol::timestamp::parse_pg_datetime(at) {
            if let Ok(mut s) = self.seen.lock() {
                s.0.push((recv - t.unix_micros()) as f64 / 1000.0);
                s.1.insert(id);
            }
            self.changed.notify_waiters();
        }
    }
}

/// Start the CDC worker on `pg` publishing to `nats`; returns once its pipeline is active.
async fn start_worker(
    pg: &walcast_testkit::Postgres,
    nats: &walcast_testkit::Nats,
    source: SourceKind,
    cancel: &CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<Result<(), walcast_pipeline::PipelineError>>> {
    let bus = Bus::nats(&nats.url(), "lat-pub").await?;
    let health = Arc::new(PipelineHealth::new("walcast_cdc_slot"));
    let mut cfg = PipelineConfig::new(&pg.url());
    cfg.source = source;
    cfg.origin = "bench".into();
    cfg.read.slot = "walcast_cdc_slot".to_string();

    let worker = tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        health.clone(),
        Fence::unfenced(cancel.clone()),
        walcast_realtime::factories(
            RealtimeConfig::new(&pg.url(), &pg.check_url()),
            Matcher::new(),
            walcast_realtime::FrontLinks::new(Default::default()),
        ),
    ));
    // PipelineHealth has no notification: poll it (bounded).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !health.is_active() {
        anyhow::ensure!(
            Instant::now() < deadline && !worker.is_finished(),
            "pipeline not active within 60 s: {:?}",
            health.report()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(worker)
}

async fn scenario(args: &LatencyBench, source: SourceKind, idle: bool) -> anyhow::Result<Outcome> {
    let crate::env::BenchEnv { pg, nats, .. } = crate::env::start(
        "CREATE TABLE lat (id int8 PRIMARY KEY, at timestamptz NOT NULL)",
        "lat",
    )
    .await?;

    let received = Arc::new(Received::default());
    let sub_bus = Bus::nats(&nats.url(), "lat-sub").await?;
    let mut sub = sub_bus
        .subscribe(walcast_bus::subject::REALTIME_ALL)
        .await?;
    sub_bus.barrier().await?;
    let sink = received.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            sink.record(&m.payload, now_micros());
        }
    });

    let cancel = CancellationToken::new();
    let worker = start_worker(&pg, &nats, source, &cancel).await?;
    let idle_client = if idle {
        let c = pg.connect().await?;
        c.batch_execute("BEGIN; INSERT INTO lat VALUES (-1, now())")
            .await?;
        Some(c)
    } else {
        None
    };

    // Steady load: a tick every millisecond sends the transactions due by then.
    let writer = pg.connect().await?;
    let stmt = writer
        .prepare("INSERT INTO lat VALUES ($1, clock_timestamp())")
        .await?;
    let total = (args.rate as u64 * args.secs) as usize;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut sent = 0usize;
    while sent < total {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * args.rate as f64) as usize).min(total);
        while sent < due {
            writer.execute(&stmt, &[&(sent as i64)]).await?;
            sent += 1;
        }
    }
    let achieved_rate = sent as f64 / started.elapsed().as_secs_f64();
    let distinct = received
        .wait_for(sent, Duration::from_secs(args.max_wait))
        .await;
    cancel.cancel();
    let _ = worker.await;
    drop(idle_client);
    let mut v = received
        .seen
        .lock()
        .map(|s| s.0.clone())
        .unwrap_or_default();
    v.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| {
        v.get(((v.len() as f64 * p) as usize).min(v.len().saturating_sub(1)))
            .copied()
            .unwrap_or(f64::NAN)
    };
    Ok(Outcome {
        sent,
        received: distinct,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        max_ms: v.last().copied().unwrap_or(f64::NAN),
        achieved_rate,
    })
}
