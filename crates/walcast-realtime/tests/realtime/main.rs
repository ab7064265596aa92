//! The fence alone stops the pipeline: a term whose fence is never renewed (its elector
//! stuck or frozen) publishes nothing once the deadline passed, acknowledges no position
//! it did not publish, and ends by itself. Real Postgres (wal2json) and nats-server, both
//! sources, writers running throughout.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use walcast_bus::{Bus, ChangeEvent};
use walcast_lease::Fence;
use walcast_pipeline::{ConsumerFactory, PipelineConfig, PipelineHealth, SourceKind};
use walcast_realtime::{Matcher, RealtimeConfig};
use walcast_testkit::{Nats, Postgres};
use walcast_wal2json::Lsn;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_stops_at_its_fence_deadline() {
    stops_at_its_fence_deadline(SourceKind::Stream).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_stops_at_its_fence_deadline() {
    stops_at_its_fence_deadline(SourceKind::Poll).await
}

/// Every change message received: (row `i`, arrival).
type Received = Arc<Mutex<Vec<(i64, Instant)>>>;

async fn collect(nats: &str) -> (Bus, Received) {
    let bus = Bus::nats(nats, "fence-test-collector")
        .await
        .expect("collector");
    let mut sub = bus.subscribe("walcast.realtime.>").await.expect("sub");
    bus.barrier().await.expect("barrier");
    let got: Received = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let ev: ChangeEvent = serde_json::from_slice(&m.payload).expect("event");
            let record: serde_json::Value =
                serde_json::from_str(ev.record.as_ref().expect("record").get()).expect("json");
            let i = record["i"].as_i64().expect("i");
            g.lock().unwrap().push((i, Instant::now()));
        }
    });
    (bus, got)
}

/// Row `i`s still in the slot (after its confirmed position).
async fn unacknowledged(db: &tokio_postgres::Client) -> Vec<i64> {
    let rows = db
        .query(
            "SELECT data FROM pg_logical_slot_peek_changes('fence_slot', NULL, NULL, 'format-version', '2')",
            &[],
        )
        .await
        .expect("peek");
    rows.iter()
        .filter_map(|r| {
            let v: serde_json::Value = serde_json::from_str(r.get(0)).ok()?;
            (v["action"] == "I" && v["table"] == "f").then(|| v["columns"][0]["value"].as_i64())?
        })
        .collect()
}

async fn confirmed(db: &tokio_postgres::Client) -> Lsn {
    let row = db
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'fence_slot'",
            &[],
        )
        .await
        .expect("slot");
    row.get::<_, String>(0).parse().expect("lsn")
}

/// Migrations, table `f` enabled, and the slot created before any row is written.
async fn setup(pg: &Postgres) -> tokio_postgres::Client {
    let mut db = pg.connect().await.expect("connect");
    walcast_control::migrate::migrate(&mut db)
        .await
        .expect("migrate");
    db.batch_execute(
        "CREATE TABLE f (i int PRIMARY KEY);
         INSERT INTO walcast.realtime_tables (schema_name, table_name) VALUES ('public', 'f');",
    )
    .await
    .expect("setup");
    // Before the writer starts: every row it writes is in the slot.
    db.batch_execute("SELECT pg_create_logical_replication_slot('fence_slot', 'wal2json')")
        .await
        .expect("slot");
    db
}

/// Rows 0, 1, 2, … one per transaction until `stop`.
async fn writer(pg: &Postgres, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
    let client = pg.connect().await.expect("writer");
    tokio::spawn(async move {
        let mut i = 0;
        while !stop.is_cancelled() {
            client
                .execute("INSERT INTO f VALUES ($1)", &[&i])
                .await
                .expect("insert");
            i += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
}

fn config(url: String, source: SourceKind) -> PipelineConfig {
    let mut cfg = PipelineConfig::for_test(&url, "fence_slot", source);
    cfg.origin = "fence-test".into();
    cfg.take_over_slot = true;
    cfg.read.min_batch = 100;
    cfg.read.max_batch = 1000;
    cfg
}

/// Realtime delivery of a pipeline, with its matcher.
fn realtime(pg: &Postgres, matcher: Arc<Matcher>) -> Vec<Arc<dyn ConsumerFactory>> {
    walcast_realtime::factories(
        RealtimeConfig::new(&pg.url(), &pg.check_url()),
        matcher,
        walcast_realtime::FrontLinks::new(Default::default()),
    )
}

/// Every row written is either received or still in the slot (nothing acknowledged that
/// was not published), and the slot moved.
async fn assert_acknowledged_only_what_was_published(
    db: &tokio_postgres::Client,
    received: &[(i64, Instant)],
) {
    let written: i64 = db
        .query_one("SELECT count(*) FROM f", &[])
        .await
        .expect("count")
        .get(0);
    let pending = unacknowledged(db).await;
    let seen: std::collections::HashSet<i64> = received
        .iter()
        .map(|(i, _)| *i)
        .chain(pending.iter().copied())
        .collect();
    let lost: Vec<i64> = (0..written).filter(|i| !seen.contains(i)).collect();
    assert!(
        lost.is_empty(),
        "{} rows acknowledged without being published, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(10)]
    );
    assert!(
        (pending.len() as i64) < written,
        "nothing acknowledged: {} of {written} rows still in the slot",
        pending.len()
    );
}

async fn stops_at_its_fence_deadline(source: SourceKind) {
    let pg = Postgres::start().expect("postgres");
    let nats = Nats::start().expect("nats");
    let db = setup(&pg).await;
    let (collector, got) = collect(&nats.url()).await;
    let writing = CancellationToken::new();
    let writer = writer(&pg, writing.clone()).await;
    let bus = Bus::nats(&nats.url(), "fence-test-worker")
        .await
        .expect("bus");
    let deadline = Instant::now() + Duration::from_secs(4);
    let fence = Fence::new(7, CancellationToken::new(), deadline);
    let health = Arc::new(PipelineHealth::new("fence_slot"));
    let cfg = config(pg.url(), source);
    let consumers = realtime(&pg, Matcher::new());
    let run = walcast_pipeline::run(cfg, bus.clone(), health, fence.clone(), consumers);
    let result = tokio::time::timeout(Duration::from_secs(30), run)
        .await
        .expect("the pipeline did not stop by itself after its fence closed");
    let stopped = Instant::now();
    assert!(result.is_ok(), "{result:?}");
    assert!(
        stopped < deadline + Duration::from_secs(1),
        "stopped {:?} after the deadline",
        stopped - deadline
    );
    assert!(fence.token().is_cancelled() && !fence.is_open());
    // Everything it handed to the bus is at the server now; let it reach the collector.
    bus.barrier().await.expect("barrier");
    collector.barrier().await.expect("barrier");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let received = got.lock().unwrap().clone();
    assert!(
        received.len() > 100,
        "{} changes before the deadline",
        received.len()
    );
    let late: Vec<_> = received
        .iter()
        .filter(|(_, at)| *at > deadline + Duration::from_millis(250))
        .collect();
    assert!(late.is_empty(), "published after the deadline: {late:?}");
    // Nothing moves once it stopped, while the writer goes on.
    let acked = confirmed(&db).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    writing.cancel();
    writer.await.expect("writer");
    assert_eq!(confirmed(&db).await, acked);
    assert_eq!(got.lock().unwrap().len(), received.len());
    assert_acknowledged_only_what_was_published(&db, &received).await;
}

mod claims;
