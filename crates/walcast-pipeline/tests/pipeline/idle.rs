//! An idle database must not hold WAL: the tables the pipeline reads stay idle while
//! other WAL is written at about 5 MB/s (another table of the same database, or another
//! database of the instance), both sources, with and without the heartbeat. Sampled
//! every second: the slot's lag (`confirmed_flush_lsn`, what walcast acknowledges) and
//! the WAL the server keeps for it (`restart_lsn`, which Postgres moves only at a
//! running-transactions record it decoded: the bgwriter logs one every 15 s when WAL is
//! written, so up to that much WAL is kept whatever the client acknowledges).
//!
//! walcast acknowledges the positions the server says were read (stream keepalives, the
//! poll's flush position), so its slot keeps up without the heartbeat; a reader that
//! acknowledges only the commits it is handed (as Debezium does) keeps everything while
//! another database is written, unless a heartbeat gives it commits: measured beside the
//! pipelines in the same instance.
//!
//! `max_slot_wal_keep_size` is raised to 4 GB here, so a slot that held its WAL would
//! show it instead of being invalidated.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use walcast_bus::Bus;
use walcast_lease::Fence;
use walcast_pipeline::testing::{Recorder, Recording};
use walcast_pipeline::{
    Consumer, ConsumerError, Handled, Item, PipelineConfig, PipelineHealth, SourceKind,
};
use walcast_testkit::{Nats, Postgres};
use walcast_wal2json::Change;

/// How long the tables stay idle under the other writes (a minute: four of the 15 s
/// intervals between running-transactions records, so a held slot shows).
const IDLE: Duration = Duration::from_secs(60);
/// The other writes: this many bytes every 200 ms (about 5 MB/s).
const WRITE_BYTES_PER_TICK: usize = 1_000_000;
/// The heartbeat's interval in these tests.
const BEAT: Duration = Duration::from_secs(1);
/// Bound on the slot's lag (what walcast acknowledges), checked at every sample: about
/// 9 s of the other writes. Idle, a reader keeps within a second or two of them; on a
/// loaded machine a poll source's peek of 5 MB/s of WAL fell 17.5 MB behind (a CI run
/// beside the end-to-end tests), and a slot that acknowledged nothing would fall the
/// whole 300 MB behind.
const MAX_LAG: i64 = 48 << 20;
/// Bound on the WAL kept for the slot, checked at every sample. Postgres moves
/// `restart_lsn` to a running-transactions record once the client confirmed past it, and
/// takes a new candidate only once the last was confirmed, so a slot that acknowledges
/// everything still keeps up to two intervals of 15 s of the server's WAL: 165 MB at
/// 5.5 MB/s. A slot that acknowledged nothing would keep everything written (over 300 MB).
const MAX_RETAINED: i64 = 192 << 20;
/// How often the readers that acknowledge only commits read their slot.
const COMMITS_TICK: Duration = Duration::from_secs(3);
/// Their lag's bound with the heartbeat: up to a tick and a beat of WAL (22 MB), with room.
const MAX_COMMITS_LAG: i64 = 48 << 20;
/// The retained WAL must fall by more than this (MB) from one sample to the next at
/// least twice (a running-transactions record confirmed): it moves, it is not just below
/// the bound by chance. A held slot's only grows.
const DROP_MB: i64 = 16;

struct Pipeline {
    name: &'static str,
    cancel: CancellationToken,
    run: tokio::task::JoinHandle<Result<(), walcast_pipeline::PipelineError>>,
    health: Arc<PipelineHealth>,
}

/// What a slot's samples showed: the largest lag and retained WAL, and the retained WAL
/// of each sample in MB (printed).
#[derive(Default, Debug, Clone)]
struct Worst {
    lag: i64,
    retained: i64,
    samples: u32,
    series: Vec<i64>,
}

/// The idle table `public.idle` of the database `db` read by a pipeline on slot `slot`.
/// [`start`] for each `(database, slot, source, heartbeat)`.
async fn start_each(
    pg: &Postgres,
    nats: &Nats,
    specs: &[(&str, &'static str, SourceKind, bool)],
) -> Vec<Pipeline> {
    let mut out = Vec::new();
    for &(db, slot, source, beat) in specs {
        out.push(start(pg, nats, db, slot, source, beat).await);
    }
    out
}

async fn start(
    pg: &Postgres,
    nats: &Nats,
    db: &str,
    slot: &'static str,
    source: SourceKind,
    beat: bool,
) -> Pipeline {
    let client = connect(&pg.url_for("postgres", db)).await;
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS idle (i int PRIMARY KEY)")
        .await
        .expect("idle table");
    client
        .query_one(
            "SELECT pg_create_logical_replication_slot($1, 'wal2json')",
            &[&slot],
        )
        .await
        .expect("slot");
    let mut cfg = PipelineConfig::for_test(&pg.url_for("postgres", db), slot, source);
    if beat {
        cfg.heartbeat = BEAT;
    }
    let tables = vec![("public".to_string(), "idle".to_string())];
    let recorder = Recorder::factory(tables, Recording::default());
    let bus = Bus::nats(&nats.url(), slot).await.expect("bus");
    let cancel = CancellationToken::new();
    let health = Arc::new(PipelineHealth::new(slot));
    let run = tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        health.clone(),
        Fence::unfenced(cancel.clone()),
        vec![recorder],
    ));
    Pipeline {
        name: slot,
        cancel,
        run,
        health,
    }
}

/// Write about 5 MB/s into `table` of `db` until `until`; the bytes of WAL written.
async fn write_for(pg: &Postgres, db: &str, table: &str, until: Instant) -> i64 {
    let client = connect(&pg.url_for("postgres", db)).await;
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {table} (id bigserial PRIMARY KEY, v text)"
        ))
        .await
        .expect("noise table");
    let rows = WRITE_BYTES_PER_TICK / 1000;
    let sql =
        format!("INSERT INTO {table} (v) SELECT repeat('x', 1000) FROM generate_series(1, {rows})");
    let start = wal_lsn(&client).await;
    let mut tick = tokio::time::interval(Duration::from_millis(200));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() < until {
        tick.tick().await;
        client.batch_execute(&sql).await.expect("write");
    }
    wal_lsn(&client).await - start
}

async fn connect(url: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(conn);
    client
}

async fn wal_lsn(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8",
            &[],
        )
        .await
        .expect("lsn")
        .get(0)
}

/// Sample every slot's lag and retained WAL every second until `until`.
async fn sample(pg: &Postgres, until: Instant) -> BTreeMap<String, Worst> {
    let client = pg.connect().await.expect("sampler");
    let mut worst: BTreeMap<String, Worst> = BTreeMap::new();
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rows = client
            .query(
                "SELECT slot_name::text,
                        pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8,
                        pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8
                   FROM pg_replication_slots",
                &[],
            )
            .await
            .expect("slots");
        for row in rows {
            let w = worst.entry(row.get(0)).or_default();
            w.lag = w.lag.max(row.get(1));
            w.retained = w.retained.max(row.get(2));
            w.samples += 1;
            w.series.push(row.get::<_, i64>(2) >> 20);
        }
    }
    worst
}

/// Run `pipelines` while `writer` writes, sample, stop them, and check and print what
/// each slot kept.
async fn measure(
    pg: &Postgres,
    pipelines: Vec<Pipeline>,
    writer: impl std::future::Future<Output = i64>,
    until: Instant,
) -> BTreeMap<String, Worst> {
    let (written, worst) = tokio::join!(writer, sample(pg, until));
    let mut report = vec![format!("WAL written meanwhile: {} MB", written >> 20)];
    let mut results = Vec::new();
    for p in pipelines {
        let h = p.health.report();
        p.cancel.cancel();
        p.run.await.expect("join").expect("run");
        let w = worst.get(p.name).cloned().unwrap_or_default();
        report.push(format!(
            "{}: max lag {} MB, max retained {} MB ({} samples; /health retained_bytes {} MB; heartbeats {} ok, {} failed; changes {})\n  retained MB each second: {:?}",
            p.name,
            w.lag >> 20,
            w.retained >> 20,
            w.samples,
            h.retained_bytes >> 20,
            h.heartbeats_total,
            h.heartbeat_failures_total,
            h.changes_total,
            w.series,
        ));
        results.push((p.name, h, w));
    }
    println!("{}", report.join("\n"));
    for (name, h, w) in results {
        assert!(
            h.cdc_active || h.last_error.is_none(),
            "{}: {:?}",
            name,
            h.last_error
        );
        assert!(w.samples >= 30, "{name}: sampled {w:?}");
        if name.ends_with("_beat") {
            assert!(h.heartbeats_total >= 10, "{}: {h:?}", name);
        } else {
            assert_eq!(h.heartbeats_total, 0, "{}: heartbeat off", name);
        }
        assert_eq!(h.skipped_changes_total, 0, "{}: {h:?}", name);
        assert!(w.lag < MAX_LAG, "{}: lag {}", name, w.lag);
        assert!(
            w.retained < MAX_RETAINED,
            "{}: retained {}",
            name,
            w.retained
        );
        assert!(falls(&w) >= 2, "{name}: the retained WAL did not move");
    }
    assert!(
        written > MAX_RETAINED,
        "the writer wrote too little to tell ({written} bytes)"
    );
    worst
}

/// How often the retained WAL fell by more than [`DROP_MB`] between two samples.
fn falls(w: &Worst) -> usize {
    w.series
        .windows(2)
        .filter(|p| p[1] + DROP_MB < p[0])
        .count()
}

fn server() -> Postgres {
    Postgres::builder()
        .setting("max_slot_wal_keep_size", "4GB")
        .setting("max_wal_size", "4GB")
        .start()
        .expect("postgres")
}

/// Another table of the same database is written: each of its transactions reaches the
/// pipeline as an empty one (wal2json drops the rows), a commit to acknowledge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_table_holds_no_wal_while_another_table_is_written() {
    let pg = server();
    let nats = Nats::start().expect("nats");
    let pipelines = start_each(
        &pg,
        &nats,
        &[
            ("postgres", "stream_plain", SourceKind::Stream, false),
            ("postgres", "poll_plain", SourceKind::Poll, false),
            ("postgres", "stream_beat", SourceKind::Stream, true),
        ],
    )
    .await;
    let until = Instant::now() + IDLE;
    measure(
        &pg,
        pipelines,
        write_for(&pg, "postgres", "noise", until),
        until,
    )
    .await;
}

/// Another database of the instance is written: nothing of it is decoded for the slot's
/// database; only the server's keepalives (stream) or the flush position (poll) say how
/// far the WAL was read, and the heartbeat adds a commit of the slot's own database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_database_holds_no_wal_while_another_database_is_written() {
    let pg = server();
    let nats = Nats::start().expect("nats");
    let admin = pg.connect().await.expect("admin");
    for db in [
        "busy",
        "stream_plain",
        "poll_plain",
        "stream_beat",
        "poll_beat",
    ] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .expect("database");
    }
    // Readers that acknowledge only the commits they are handed (as Debezium does), one
    // beside a pipeline without the heartbeat and one beside a pipeline with it.
    for (db, slot) in [
        ("stream_plain", "commits_plain"),
        ("stream_beat", "commits_beat"),
    ] {
        connect(&pg.url_for("postgres", db))
            .await
            .query_one(
                "SELECT pg_create_logical_replication_slot($1, 'wal2json')",
                &[&slot],
            )
            .await
            .expect("slot");
    }
    let pipelines = start_each(
        &pg,
        &nats,
        &[
            ("stream_plain", "stream_plain", SourceKind::Stream, false),
            ("poll_plain", "poll_plain", SourceKind::Poll, false),
            ("stream_beat", "stream_beat", SourceKind::Stream, true),
            ("poll_beat", "poll_beat", SourceKind::Poll, true),
        ],
    )
    .await;
    let until = Instant::now() + IDLE;
    let writes = async {
        let (written, (), ()) = tokio::join!(
            write_for(&pg, "busy", "noise", until),
            acknowledge_commits(&pg, "stream_plain", "commits_plain", until),
            acknowledge_commits(&pg, "stream_beat", "commits_beat", until),
        );
        written
    };
    let worst = measure(&pg, pipelines, writes, until).await;
    // Without a commit of its own database, a reader that acknowledges only commits keeps
    // everything; the heartbeat of the pipeline beside it gives it one every second.
    let (plain, beat) = (&worst["commits_plain"], &worst["commits_beat"]);
    for (name, w) in [("commits_plain", plain), ("commits_beat", beat)] {
        println!(
            "{name}: max lag {} MB, max retained {} MB\n  retained MB each second: {:?}",
            w.lag >> 20,
            w.retained >> 20,
            w.series
        );
    }
    assert!(plain.retained > MAX_RETAINED, "commits_plain: {plain:?}");
    assert!(beat.retained < MAX_RETAINED, "commits_beat: {beat:?}");
    assert!(beat.lag < MAX_COMMITS_LAG, "commits_beat: {beat:?}");
    assert!(
        falls(beat) >= 2,
        "commits_beat: the retained WAL did not move"
    );
}

/// Every `COMMITS_TICK`: peek the slot and advance it to the end of the last commit it
/// returned, never further (a client that acknowledges only what it was handed).
async fn acknowledge_commits(pg: &Postgres, db: &str, slot: &str, until: Instant) {
    let client = connect(&pg.url_for("postgres", db)).await;
    let sql = "SELECT pg_replication_slot_advance($1, c.lsn)::text
                 FROM (SELECT max(lsn) AS lsn
                         FROM pg_logical_slot_peek_changes($1, NULL, NULL,
                                'format-version', '2', 'include-transaction', '1',
                                'add-tables', 'public.idle', 'add-msg-prefixes', 'walcast.none')
                        WHERE data LIKE '{\"action\":\"C\"%') c
                WHERE c.lsn IS NOT NULL";
    while Instant::now() < until {
        tokio::time::sleep(COMMITS_TICK).await;
        client.query(sql, &[&slot]).await.expect("advance");
    }
}

/// Records every message and row change it is handed.
struct Watch(Arc<std::sync::Mutex<Vec<String>>>);

impl Consumer for Watch {
    fn name(&self) -> &'static str {
        "watch"
    }

    fn tables(&self) -> Vec<(String, String)> {
        vec![("public".into(), "idle".into())]
    }

    fn handle<'a>(&'a mut self, item: Item<'a>) -> BoxFuture<'a, Result<Handled, ConsumerError>> {
        let seen = match item {
            Item::Change(_, Change::Message(m)) => Some(format!("message {}", m.prefix)),
            Item::Change(_, Change::Insert(r)) => Some(format!("insert {}", r.table)),
            _ => None,
        };
        self.0.lock().unwrap().extend(seen);
        Box::pin(async { Ok(Handled::Continue) })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), ConsumerError>> {
        Box::pin(async { Ok(()) })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_a_forged_heartbeat_is_only_a_position() {
    forged_heartbeat(SourceKind::Stream).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_a_forged_heartbeat_is_only_a_position() {
    forged_heartbeat(SourceKind::Poll).await
}

/// Any login may write a `walcast.heartbeat` message, with any content, transactional or
/// not: no consumer is handed it, nothing is skipped or counted as forged, the stream goes
/// on, and the slot is acknowledged past it (it is only a position).
async fn forged_heartbeat(source: SourceKind) {
    let pg = Postgres::start().expect("postgres");
    let nats = Nats::start().expect("nats");
    let admin = pg.connect().await.expect("admin");
    admin
        .batch_execute("CREATE TABLE idle (i int PRIMARY KEY); CREATE ROLE mallory LOGIN;")
        .await
        .expect("setup");
    admin
        .batch_execute("SELECT pg_create_logical_replication_slot('forged', 'wal2json')")
        .await
        .expect("slot");
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let watch = walcast_pipeline::factory(move |_| Box::new(Watch(s.clone())));
    let mut cfg = PipelineConfig::for_test(&pg.url(), "forged", source);
    cfg.heartbeat = Duration::from_millis(200);
    let health = Arc::new(PipelineHealth::new("forged"));
    let cancel = CancellationToken::new();
    let bus = Bus::nats(&nats.url(), "worker").await.expect("bus");
    let run = tokio::spawn(walcast_pipeline::run(
        cfg,
        bus,
        health.clone(),
        Fence::unfenced(cancel.clone()),
        vec![watch],
    ));
    let mallory = connect(&pg.url_for("mallory", "postgres")).await;
    mallory
        .batch_execute(
            "SELECT pg_logical_emit_message(true, 'walcast.heartbeat', '{\"forged\": true}');
             SELECT pg_logical_emit_message(false, 'walcast.heartbeat', 'not transactional');
             SELECT pg_logical_emit_message(true, 'walcast.heartbeat', repeat('x', 1000000));
             BEGIN; SELECT pg_logical_emit_message(true, 'walcast.heartbeat', ''); ROLLBACK;",
        )
        .await
        .expect("any login may emit it");
    let after_forgeries = wal_lsn(&admin).await;
    admin
        .batch_execute("INSERT INTO idle VALUES (1)")
        .await
        .expect("insert");
    let deadline = Instant::now() + Duration::from_secs(30);
    let confirmed = || async {
        admin
            .query_one(
                "SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::int8
                   FROM pg_replication_slots WHERE slot_name = 'forged'",
                &[],
            )
            .await
            .expect("slot")
            .get::<_, i64>(0)
    };
    while (seen.lock().unwrap().is_empty()
        || confirmed().await <= after_forgeries
        || health.report().heartbeats_total < 2)
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let report = health.report();
    cancel.cancel();
    run.await.expect("join").expect("run");
    assert_eq!(
        *seen.lock().unwrap(),
        ["insert idle"],
        "handed to the consumer"
    );
    assert!(
        confirmed().await > after_forgeries,
        "acknowledged past the forgeries"
    );
    assert_eq!(report.skipped_changes_total, 0, "{report:?}");
    assert!(report.last_skipped_change.is_none(), "{report:?}");
    assert!(report.heartbeats_total >= 2, "{report:?}");
    assert_eq!(report.heartbeat_failures_total, 0, "{report:?}");
}
