//! The consumer seam: a consumer of decoded transactions is added next to realtime
//! delivery without touching the sources or the realtime consumer. Here one counts the
//! committed transactions that changed a table realtime does not stream (so it is decoded
//! only because this consumer asked for it), while realtime keeps publishing its own
//! table. Real Postgres (wal2json) and nats-server, both sources.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use walcast_bus::{Bus, ChangeEvent};
use walcast_cdc::consumer::{Consumer, Handled, Item};
use walcast_cdc::{matcher::Matcher, CdcConfig, CdcHealth, ReadConfig, SourceKind};
use walcast_lease::Fence;
use walcast_testkit::{Nats, Postgres};
use walcast_wal2json::Change;

/// Counts committed transactions with at least one row change of `public.counted`.
struct CountTransactions {
    seen: bool,
    committed: Arc<AtomicUsize>,
}

impl Consumer for CountTransactions {
    fn name(&self) -> &'static str {
        "count"
    }

    fn tables(&self) -> Vec<(String, String)> {
        vec![("public".into(), "counted".into())]
    }

    fn handle<'a>(
        &'a mut self,
        item: Item<'a>,
    ) -> BoxFuture<'a, Result<Handled, walcast_cdc::CdcError>> {
        match item {
            Item::Begin(_) => self.seen = false,
            Item::Change(_, Change::Insert(row) | Change::Update(row) | Change::Delete(row)) => {
                self.seen |= row.table == "counted";
            }
            Item::Change(..) => {}
            Item::Commit(_) => {
                if std::mem::take(&mut self.seen) {
                    self.committed.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
        Box::pin(async { Ok(Handled::Continue) })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), walcast_cdc::CdcError>> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_feeds_an_added_consumer() {
    feeds_an_added_consumer(SourceKind::Stream).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_feeds_an_added_consumer() {
    feeds_an_added_consumer(SourceKind::Poll).await
}

fn config(url: String, source: SourceKind) -> CdcConfig {
    CdcConfig {
        database_url: url.clone(),
        replication_url: url,
        source,
        ack_interval: Duration::from_millis(50),
        allow_unbounded_wal: false,
        origin: "consumer-test".into(),
        take_over_slot: true,
        rls: walcast_cdc::RlsOptions::default(),
        max_record_bytes: walcast_cdc::DEFAULT_MAX_RECORD_BYTES,
        read: ReadConfig {
            slot: "consumer_slot".into(),
            min_batch: 100,
            max_batch: 1000,
            idle: Duration::from_millis(20),
            filter_refresh: Duration::from_secs(3),
        },
    }
}

/// Row `i` of every realtime change received.
async fn collect(bus: &Bus) -> Arc<Mutex<Vec<i64>>> {
    let mut sub = bus.subscribe("walcast.realtime.>").await.expect("sub");
    bus.barrier().await.expect("barrier");
    let got: Arc<Mutex<Vec<i64>>> = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let ev: ChangeEvent = serde_json::from_slice(&m.payload).expect("event");
            let record: serde_json::Value =
                serde_json::from_str(ev.record.as_ref().expect("record").get()).expect("json");
            g.lock().unwrap().push(record["i"].as_i64().expect("i"));
        }
    });
    got
}

async fn feeds_an_added_consumer(source: SourceKind) {
    let pg = Postgres::start().expect("postgres");
    let nats = Nats::start().expect("nats");
    let db = prepare(&pg).await;
    let collector = Bus::nats(&nats.url(), "consumer-test-collector")
        .await
        .expect("collector");
    let got = collect(&collector).await;

    let committed = Arc::new(AtomicUsize::new(0));
    let c = committed.clone();
    let count: walcast_cdc::ConsumerFactory = Arc::new(move || {
        Box::new(CountTransactions {
            seen: false,
            committed: c.clone(),
        })
    });
    let bus = Bus::nats(&nats.url(), "consumer-test-worker")
        .await
        .expect("bus");
    let cancel = CancellationToken::new();
    let run = tokio::spawn(walcast_cdc::run_with_consumers(
        config(pg.url(), source),
        bus,
        Matcher::new(),
        Arc::new(CdcHealth::new("consumer_slot")),
        Fence::unfenced(cancel.clone()),
        vec![count],
    ));

    write_transactions(&db).await;

    let deadline = Instant::now() + Duration::from_secs(20);
    while (committed.load(Ordering::SeqCst) < 25 || got.lock().unwrap().len() < 15)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing more arrives (no duplicates from restarts).
    tokio::time::sleep(Duration::from_millis(500)).await;
    cancel.cancel();
    run.await.expect("join").expect("run");

    assert_eq!(committed.load(Ordering::SeqCst), 25, "transactions counted");
    let mut received = got.lock().unwrap().clone();
    received.sort();
    assert_eq!(received, (0..15).collect::<Vec<i64>>(), "realtime changes");
}

/// A migrated database with `rt` (a realtime table), `counted` (not one) and the slot.
async fn prepare(pg: &Postgres) -> tokio_postgres::Client {
    let mut db = pg.connect().await.expect("connect");
    walcast_cdc::migrate::migrate(&mut db)
        .await
        .expect("migrate");
    db.batch_execute(
        "CREATE TABLE rt (i int PRIMARY KEY);
         CREATE TABLE counted (i int PRIMARY KEY);
         INSERT INTO walcast.realtime_tables (schema_name, table_name) VALUES ('public', 'rt');",
    )
    .await
    .expect("setup");
    db.batch_execute("SELECT pg_create_logical_replication_slot('consumer_slot', 'wal2json')")
        .await
        .expect("slot");
    db
}

/// 20 transactions on `counted` (two rows each), 10 on `rt`, 5 on both.
async fn write_transactions(db: &tokio_postgres::Client) {
    for i in 0..20 {
        db.batch_execute(&format!(
            "INSERT INTO counted VALUES ({}), ({})",
            2 * i,
            2 * i + 1
        ))
        .await
        .expect("counted");
    }
    for i in 0..10 {
        db.execute("INSERT INTO rt VALUES ($1)", &[&i])
            .await
            .expect("rt");
    }
    for i in 10..15 {
        db.batch_execute(&format!(
            "BEGIN; INSERT INTO rt VALUES ({i}); INSERT INTO counted VALUES ({}); COMMIT;",
            100 + i
        ))
        .await
        .expect("both");
    }
}
