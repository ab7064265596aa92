//! JetStream without a quorum does not hold realtime: a three-node NATS cluster, the
//! outbox stream with three replicas, a worker and a front on the node that stays up, a
//! writer committing a realtime row and an outbox event together at a steady rate. Two
//! nodes are killed for 12 s (JetStream has no quorum; core NATS on the surviving node
//! works), then started again. The rows committed meanwhile reach the client with
//! p99 < 500 ms (commit → receipt), and every event emitted is on the stream exactly once
//! after recovery.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use walcast_testkit::phoenix::{Msg, PhoenixClient};
use walcast_testkit::{NatsCluster, Postgres};

use crate::support::outbox::{outbox_stream, read_all, wait_stored};
use crate::support::ws::anon;
use crate::support::Worker;

const STARTUP: Duration = Duration::from_secs(60);
/// One transaction (a row and an event) every this.
const EVERY: Duration = Duration::from_millis(50);
const OUTAGE: Duration = Duration::from_secs(12);
const P99_BOUND: Duration = Duration::from_millis(500);

/// When each row `n` committed (the writer's `COMMIT` returned) and reached the client.
#[derive(Default)]
struct Times {
    committed: HashMap<i64, Instant>,
    received: HashMap<i64, Instant>,
}

type Shared = Arc<Mutex<Times>>;

/// Rows into `ticks`, each with a `walcast.emit` of the same `n`, one statement (one
/// transaction) every [`EVERY`], until cancelled; how many were written.
fn writer(pg: &Postgres, times: Shared, stop: CancellationToken) -> tokio::task::JoinHandle<i64> {
    let url = pg.url();
    tokio::spawn(async move {
        let c = walcast_pipeline::connect(&url).await.expect("connect");
        let mut tick = tokio::time::interval(EVERY);
        let mut n = 0i64;
        while !stop.is_cancelled() {
            tick.tick().await;
            c.execute(
                "WITH r AS (INSERT INTO ticks (n) VALUES ($1) RETURNING n) \
                 SELECT walcast.emit('ticks', 'k' || (n % 5), jsonb_build_object('n', n)) FROM r",
                &[&n],
            )
            .await
            .expect("insert and emit");
            times.lock().unwrap().committed.insert(n, Instant::now());
            n += 1;
        }
        n
    })
}

/// A client subscribed to `ticks`'s inserts; records when each row arrives.
async fn reader(front: &Worker, times: Shared) {
    let mut sock = PhoenixClient::connect(&front.ws_url(&anon())).await;
    let bindings = json!([{"event": "INSERT", "schema": "public", "table": "ticks"}]);
    sock.join_subscribed("realtime:ticks", bindings).await;
    tokio::spawn(async move {
        loop {
            match sock.try_recv(Duration::from_secs(600)).await {
                None | Some(Msg::Ended(_)) | Some(Msg::Close(..)) => return,
                Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                    let n = f[4]["data"]["record"]["n"].as_i64().unwrap_or(-1);
                    times
                        .lock()
                        .unwrap()
                        .received
                        .entry(n)
                        .or_insert_with(Instant::now);
                }
                Some(_) => {}
            }
        }
    });
}

async fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Latencies (commit → receipt) of the rows committed in `[from, to]`, sorted; rows not
/// received count as `None`.
fn latencies(times: &Times, from: Instant, to: Instant) -> Vec<Option<Duration>> {
    let mut out: Vec<Option<Duration>> = times
        .committed
        .iter()
        .filter(|(_, at)| **at >= from && **at <= to)
        .map(|(n, at)| {
            times
                .received
                .get(n)
                .map(|r| r.saturating_duration_since(*at))
        })
        .collect();
    out.sort_by_key(|l| l.unwrap_or(Duration::MAX));
    out
}

fn percentile(sorted: &[Option<Duration>], p: f64) -> Option<Duration> {
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jetstream_without_quorum_does_not_hold_realtime_and_loses_no_event() {
    let _machine = crate::support::alone().await;
    let worker = outage(&[]).await;
    assert_eq!(detached(&worker), 0, "the relay's buffer held the outage");
}

/// The same with a relay that may hold 40 events only: it is detached during the
/// outage, handed what it missed from the slot once JetStream is back, and still every
/// event is on the stream once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_buffer_fills_is_detached_and_catches_up_from_the_slot() {
    let _machine = crate::support::alone().await;
    let worker = outage(&[("OUTBOX_MAX_QUEUED", "40")]).await;
    assert!(detached(&worker) >= 1, "the relay was never detached");
}

/// Times the outbox relay was detached (its buffer full).
fn detached(worker: &Worker) -> u64 {
    worker
        .metric("walcast_cdc_consumer_detached_total{consumer=\"outbox\"}")
        .map_or(0, |v| v as u64)
}

/// The scenario (see the module docs), with `extra` environment for the worker; the
/// worker, to look at afterwards.
async fn outage(extra: &[(&str, &str)]) -> Worker {
    let pg = Postgres::builder().start().expect("start postgres");
    let mut cluster = NatsCluster::start(3).expect("start a NATS cluster");
    cluster
        .wait_meta_leader(STARTUP)
        .expect("the cluster elects a JetStream meta leader");
    let nats = cluster.url(0);
    pg.psql("CREATE TABLE ticks (n int8 PRIMARY KEY)")
        .expect("create table");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["realtime", "enable", "ticks"])
        .env("DATABASE_URL", pg.url())
        .output()
        .expect("walcast realtime enable");
    assert!(out.status.success(), "{out:?}");
    pg.psql("GRANT SELECT ON ticks TO anon, authenticated, service_role")
        .expect("grant");
    let mut env = vec![
        ("CDC_SOURCE", "stream"),
        ("OUTBOX_STREAM_REPLICAS", "3"),
        ("OUTBOX_ACK_TIMEOUT_MS", "2000"),
        ("OUTBOX_RETRY_MAX_MS", "1000"),
    ];
    env.extend_from_slice(extra);
    let mut worker = Worker::spawn(&pg.url(), &nats, &env);
    worker.source = Some("stream");
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&nats, &[]);
    front.wait_http(STARTUP);

    let times: Shared = Arc::default();
    reader(&front, times.clone()).await;
    let stop = CancellationToken::new();
    let writing = writer(&pg, times.clone(), stop.clone());
    // The stream (three replicas) exists and takes events; rows flow.
    let mut stream = outbox_stream(&nats, STARTUP).await;
    wait_stored(&mut stream, 20, STARTUP).await;
    wait_for("20 rows at the client", STARTUP, || {
        times.lock().unwrap().received.len() >= 20
    })
    .await;
    let replicas = stream.info().await.expect("info").config.num_replicas;
    assert_eq!(replicas, 3, "the outbox stream has three replicas");

    let lost: Vec<usize> = (0..3).filter(|&i| i != 0).collect();
    let killed_at = Instant::now();
    for &i in &lost {
        cluster.kill(i);
    }
    tokio::time::sleep(OUTAGE).await;
    // JetStream took nothing meanwhile: the relay holds the events, and says so.
    let outbox = worker.health().expect("health")["outbox"].clone();
    let waiting = outbox["oldest_unpublished_ms"].as_i64().unwrap_or(0);
    let queued = outbox["queued_events"].as_u64().unwrap_or(0);
    assert!(
        waiting > 5_000 && queued > 0,
        "the relay holds the events of the outage: {outbox}"
    );
    let restarted_at = Instant::now();
    for &i in &lost {
        cluster.restart(i).expect("restart a node");
    }
    cluster
        .wait_meta_leader(STARTUP)
        .expect("a meta leader after the restarts");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let written = writing.await.expect("writer");

    wait_for("every row at the client", STARTUP, || {
        times.lock().unwrap().received.len() as i64 >= written
    })
    .await;
    let slot = worker
        .health()
        .map(|h| h["consumers"].clone())
        .unwrap_or_default();
    eprintln!("relay at the end of the outage: {outbox}; consumers now {slot}");
    let during = latencies(&times.lock().unwrap(), killed_at, restarted_at);
    assert!(
        during.len() >= 100,
        "{} rows during the outage",
        during.len()
    );
    let p50 = percentile(&during, 0.5);
    let p99 = percentile(&during, 0.99);
    let max = during.last().copied().flatten();
    eprintln!(
        "JetStream without quorum for {OUTAGE:?}: {} rows committed meanwhile, \
         commit→client p50 {p50:?} p99 {p99:?} max {max:?}; {written} rows and events in all",
        during.len()
    );

    // Every event, once, after recovery.
    let mut stream = outbox_stream(&nats, STARTUP).await;
    wait_stored(&mut stream, written as u64, Duration::from_secs(120)).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stored = read_all(&mut stream).await;
    let mut count: HashMap<i64, usize> = HashMap::new();
    for s in &stored {
        *count.entry(s.n()).or_default() += 1;
    }
    let twice: Vec<_> = count.iter().filter(|(_, c)| **c > 1).collect();
    assert!(twice.is_empty(), "events stored twice: {twice:?}");
    let missing: Vec<i64> = (0..written).filter(|n| !count.contains_key(n)).collect();
    assert!(missing.is_empty(), "events missing: {missing:?}");
    assert_eq!(stored.len() as i64, written, "one message per event");
    eprintln!(
        "after recovery: {} events on the stream, each once; worker outbox health {}",
        stored.len(),
        worker
            .health()
            .map(|h| h["outbox"].clone())
            .unwrap_or_default()
    );
    assert!(
        p99.is_some_and(|p| p < P99_BOUND),
        "realtime rows committed while JetStream had no quorum: p99 {p99:?} (bound {P99_BOUND:?})"
    );
    worker
}
