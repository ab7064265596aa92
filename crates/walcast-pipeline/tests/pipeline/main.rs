//! The pipeline with consumers of its own, and nothing of realtime: how a newcomer adds a
//! consumer. `Relay` publishes each row of `public.relayed` through the [`Publisher`] the
//! session hands it; `CountTransactions` counts committed transactions touching
//! `public.counted`; the test kit's [`Recorder`] records both tables. Real Postgres
//! (wal2json) and nats-server, both sources.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;
use walcast_bus::{Bus, HEADER_LSN, HEADER_ORIGIN, HEADER_TERM};
use walcast_lease::Fence;
use walcast_pipeline::testing::{Recorder, Recording};
use walcast_pipeline::{
    factory, Consumer, ConsumerError, Handled, Item, PipelineConfig, PipelineHealth, Position,
    Publisher, SourceKind,
};
use walcast_testkit::{Nats, Postgres};
use walcast_wal2json::Change;

mod idle;

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

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
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

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Publishes column `i` of each insert into `public.relayed` on `example.relayed`; its
/// barrier waits for NATS, so the slot moves past a row only once it was published.
struct Relay {
    publisher: Publisher,
}

impl Consumer for Relay {
    fn name(&self) -> &'static str {
        "relay"
    }

    fn tables(&self) -> Vec<(String, String)> {
        vec![("public".into(), "relayed".into())]
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        Box::pin(async move {
            if let Item::Change(txn, Change::Insert(row)) = item {
                if row.table == "relayed" {
                    let i = row
                        .column("i")
                        .and_then(|c| c.value)
                        .map(|v| v.get().to_string());
                    let payload = Bytes::from(i.unwrap_or_default());
                    let at = Position::commit(txn.commit_lsn);
                    let subject = "example.relayed".to_string();
                    self.publisher.publish(subject, at, &[], payload).await?;
                }
            }
            Ok(Handled::Continue)
        })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async { Ok(self.publisher.barrier().await?) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_feeds_consumers() {
    feeds_consumers(SourceKind::Stream).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_feeds_consumers() {
    feeds_consumers(SourceKind::Poll).await
}

/// `(i, term header)` of every relayed message received.
type Relayed = Arc<Mutex<Vec<(i64, String)>>>;

async fn collect(bus: &Bus) -> Relayed {
    let mut sub = bus.subscribe("example.>").await.expect("sub");
    bus.barrier().await.expect("barrier");
    let got: Relayed = Arc::default();
    let g = got.clone();
    tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            assert!(m.header(HEADER_ORIGIN).is_some() && m.header(HEADER_LSN).is_some());
            let term = m.header(HEADER_TERM).expect("term header").to_string();
            let i = std::str::from_utf8(&m.payload).unwrap().parse().unwrap();
            g.lock().unwrap().push((i, term));
        }
    });
    got
}

async fn feeds_consumers(source: SourceKind) {
    let pg = Postgres::start().expect("postgres");
    let nats = Nats::start().expect("nats");
    let db = prepare(&pg).await;
    let collector = Bus::nats(&nats.url(), "collector").await.expect("bus");
    let got = collect(&collector).await;

    let committed = Arc::new(AtomicUsize::new(0));
    let c = committed.clone();
    let count = factory(move |_| {
        Box::new(CountTransactions {
            seen: false,
            committed: c.clone(),
        })
    });
    let relay = factory(|s| {
        Box::new(Relay {
            publisher: s.publisher("relay"),
        })
    });
    let recording = Recording::default();
    let tables = vec![
        ("public".to_string(), "counted".to_string()),
        ("public".to_string(), "relayed".to_string()),
    ];
    let recorder = Recorder::factory(tables, recording.clone());
    let bus = Bus::nats(&nats.url(), "worker").await.expect("bus");
    let cancel = CancellationToken::new();
    let run = tokio::spawn(walcast_pipeline::run(
        PipelineConfig::for_test(&pg.url(), "example_slot", source),
        bus,
        Arc::new(PipelineHealth::new("example_slot")),
        Fence::unfenced(cancel.clone()),
        vec![count, relay, recorder],
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
    let mut relayed = got.lock().unwrap().clone();
    relayed.sort();
    let expected: Vec<(i64, String)> = (0..15).map(|i| (i, "0".to_string())).collect();
    assert_eq!(relayed, expected, "relayed rows, each with the term");
    let recorded = recording.items();
    let count = |t: &str| recorded.iter().filter(|r| r.table == t).count();
    assert_eq!(count("public.counted"), 45, "{recorded:?}");
    assert_eq!(count("public.relayed"), 15, "{recorded:?}");
}

/// A closed fence stops the consumers' publishing and the run: nothing of the ended term
/// reaches NATS after it closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_published_after_the_fence_closes() {
    let pg = Postgres::start().expect("postgres");
    let nats = Nats::start().expect("nats");
    let db = prepare(&pg).await;
    let collector = Bus::nats(&nats.url(), "collector").await.expect("bus");
    let got = collect(&collector).await;
    let relay = factory(|s| {
        Box::new(Relay {
            publisher: s.publisher("relay"),
        })
    });
    let cancel = CancellationToken::new();
    let fence = Fence::new(7, cancel.clone(), Instant::now() + Duration::from_secs(60));
    let bus = Bus::nats(&nats.url(), "worker").await.expect("bus");
    let run = tokio::spawn(walcast_pipeline::run(
        PipelineConfig::for_test(&pg.url(), "example_slot", SourceKind::Stream),
        bus,
        Arc::new(PipelineHealth::new("example_slot")),
        fence.clone(),
        vec![relay],
    ));
    db.execute("INSERT INTO relayed VALUES (1)", &[])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.lock().unwrap().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(*got.lock().unwrap(), [(1, "7".to_string())]);
    // The lease is lost without the token being cancelled (the deadline passed, say).
    fence.revoke();
    db.execute("INSERT INTO relayed VALUES (2)", &[])
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    cancel.cancel();
    run.await
        .expect("join")
        .expect("a fenced term ends quietly");
    assert_eq!(
        *got.lock().unwrap(),
        [(1, "7".to_string())],
        "after the fence"
    );
}

/// Tables `counted` and `relayed`, and the slot.
async fn prepare(pg: &Postgres) -> tokio_postgres::Client {
    let db = pg.connect().await.expect("connect");
    db.batch_execute(
        "CREATE TABLE relayed (i int PRIMARY KEY);
         CREATE TABLE counted (i int PRIMARY KEY);",
    )
    .await
    .expect("setup");
    db.batch_execute("SELECT pg_create_logical_replication_slot('example_slot', 'wal2json')")
        .await
        .expect("slot");
    db
}

/// 20 transactions on `counted` (two rows each), 10 on `relayed`, 5 on both.
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
        db.execute("INSERT INTO relayed VALUES ($1)", &[&i])
            .await
            .expect("relayed");
    }
    for i in 10..15 {
        db.batch_execute(&format!(
            "BEGIN; INSERT INTO relayed VALUES ({i}); INSERT INTO counted VALUES ({}); COMMIT;",
            100 + i
        ))
        .await
        .expect("both");
    }
}
