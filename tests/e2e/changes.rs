//! Change streams (README "Change streams"): a service consuming `WALCAST_CHANGES`
//! through `walcast-inbox` mirrors a table exactly, across a leader `kill -9`, a NATS
//! restart and its own restart; a TRUNCATE reaches the stream and empties the mirror; a
//! tenant cannot put anything on the stream.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use tokio_postgres::Transaction;
use tokio_util::sync::CancellationToken;
use walcast_inbox::{ConsumerConfig, Event, Handler, HandlerError, Inbox, InboxConsumer};

use crate::support::outbox::{client, read_all, stored_count};
use crate::support::{Stack, Worker};

const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];
const STREAM: &str = "WALCAST_CHANGES";

/// `walcast changes enable <table>` (as walcast's role), asserting it worked.
fn enable(stack: &Stack, table: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["changes", "enable", table])
        .env("DATABASE_URL", stack.pg.url())
        .output()
        .expect("run walcast changes enable");
    assert!(
        out.status.success(),
        "walcast changes enable {table}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The change stream, once a leader created it (bounded).
pub(crate) async fn changes_stream(nats_url: &str) -> stream::Stream {
    let js = jetstream::new(async_nats::connect(nats_url).await.expect("nats"));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match js.get_stream(STREAM).await {
            Ok(s) => return s,
            Err(e) => assert!(Instant::now() < deadline, "no {STREAM} within 60 s: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Applies `public.items`' changes to `public.mirror`, logging each message applied. By
/// position, as a mirror must: each row keeps the `(commit_lsn, seq)` of the change that
/// last set it (a deleted row stays as a tombstone) and `mirror_meta` the last TRUNCATE's,
/// so a change that arrives after a later one (a resend after a lost publish, a
/// redelivery) changes nothing it should not.
struct Mirror;

const UPSERT: &str = "INSERT INTO mirror (id, v, lsn, seq, deleted)
     SELECT $1, $2, $3, $4, $5 WHERE ($3::int8, $4::int4) > (SELECT lsn, seq FROM mirror_meta)
     ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v, lsn = EXCLUDED.lsn, seq = EXCLUDED.seq,
         deleted = EXCLUDED.deleted
     WHERE (mirror.lsn, mirror.seq) < (EXCLUDED.lsn, EXCLUDED.seq)";

impl Handler for Mirror {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), HandlerError> {
        let c = event.change_event()?;
        let id = event.header("Nats-Msg-Id").unwrap_or_default().to_string();
        tx.execute("INSERT INTO applied_log (msg_id) VALUES ($1)", &[&id])
            .await?;
        let (lsn, seq) = (c.commit_lsn.0 as i64, c.seq as i32);
        let row = |r: &Option<serde_json::Value>| -> Result<(i64, i64), HandlerError> {
            let r = r.as_ref().ok_or("no row")?;
            Ok((r["id"].as_i64().ok_or("id")?, r["v"].as_i64().unwrap_or(-1)))
        };
        match c.kind.as_str() {
            "INSERT" | "UPDATE" => {
                let (id, v) = row(&c.record)?;
                tx.execute(UPSERT, &[&id, &v, &lsn, &seq, &false]).await?;
            }
            "DELETE" => {
                let (id, _) = row(&c.old_record)?;
                tx.execute(UPSERT, &[&id, &0i64, &lsn, &seq, &true]).await?;
            }
            "TRUNCATE" => {
                tx.execute(
                    "UPDATE mirror_meta SET lsn = $1, seq = $2 WHERE (lsn, seq) < ($1, $2)",
                    &[&lsn, &seq],
                )
                .await?;
                tx.execute(
                    "DELETE FROM mirror WHERE (lsn, seq) < ($1, $2)",
                    &[&lsn, &seq],
                )
                .await?;
            }
            other => return Err(format!("unknown change type {other}").into()),
        }
        Ok(())
    }
}

/// The service: an inbox consumer of the change stream in a task of its own.
struct Service {
    task: tokio::task::JoinHandle<()>,
    cancel: CancellationToken,
}

impl Service {
    async fn start(stack: &Stack) -> Service {
        let js = jetstream::new(async_nats::connect(stack.nats.url()).await.expect("nats"));
        let db = client(&stack.pg).await;
        let mut config = ConsumerConfig::changes("mirror");
        config.filter_subject = "walcast.changes.default.public.items".into();
        config.ack_wait = Duration::from_secs(5);
        config.fetch_wait = Duration::from_secs(1);
        config.max_deliver = -1;
        config.retry_base = Duration::from_millis(100);
        config.retry_max = Duration::from_secs(1);
        let mut consumer = InboxConsumer::bind(&js, db, &Inbox::default(), config)
            .await
            .expect("bind the inbox consumer");
        let cancel = CancellationToken::new();
        let token = cancel.clone();
        let task = tokio::spawn(async move {
            if let Err(e) = consumer.run(&Mirror, &token).await {
                eprintln!("mirror consumer stopped: {e}");
            }
        });
        Service { task, cancel }
    }

    /// Killed: its task and connections dropped wherever it was.
    fn kill(self) {
        self.task.abort();
        drop(self.cancel);
    }
}

/// Writers on `items`: inserts, updates and deletes, several per transaction.
struct Writers {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    async fn start(stack: &Stack, n: i64) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for w in 0..n {
            let c = client(&stack.pg).await;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut i: i64 = 0;
                while !stop.load(Ordering::Relaxed) {
                    let id = w * 1_000_000 + i;
                    let sql = format!(
                        "BEGIN;
                         INSERT INTO items (id, v) VALUES ({id}, 0);
                         UPDATE items SET v = v + 1 WHERE id = {} ;
                         DELETE FROM items WHERE id = {} AND {i} % 3 = 0;
                         COMMIT;",
                        id - 3,
                        id - 10
                    );
                    c.batch_execute(&sql).await.expect("writer");
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }));
        }
        Writers { stop, tasks }
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("writer task");
        }
    }
}

async fn applied(db: &tokio_postgres::Client) -> i64 {
    let row = db
        .query_one("SELECT count(*) FROM applied_log", &[])
        .await
        .expect("count");
    row.get(0)
}

/// Wait until `n` more messages were applied than `from` (bounded); the new count.
async fn progress(db: &tokio_postgres::Client, from: i64, n: i64, what: &str) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let have = applied(db).await;
        if have >= from + n {
            return have;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {have} applied, {} expected within 90 s",
            from + n
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rows in one of `items` and `mirror` and not the other (same id and value).
async fn differences(db: &tokio_postgres::Client) -> i64 {
    let row = db
        .query_one(
            "SELECT count(*) FROM ((TABLE items EXCEPT TABLE mirrored)
                                   UNION ALL (TABLE mirrored EXCEPT TABLE items)) d",
            &[],
        )
        .await
        .expect("compare");
    row.get(0)
}

async fn converge(db: &tokio_postgres::Client, nats_url: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let d = differences(db).await;
        if d == 0 {
            return;
        }
        if Instant::now() > deadline {
            explain(db, nats_url).await;
            panic!("{what}: mirror differs from items by {d} rows after 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Say what the stream holds for the first rows that differ.
async fn explain(db: &tokio_postgres::Client, nats_url: &str) {
    let rows = db
        .query(
            "SELECT 'items' AS t, id, v FROM (TABLE items EXCEPT TABLE mirrored) a
             UNION ALL SELECT 'mirror', id, v FROM (TABLE mirrored EXCEPT TABLE items) b
             ORDER BY 2 LIMIT 6",
            &[],
        )
        .await
        .expect("differences");
    let mut stream = changes_stream(nats_url).await;
    let all = read_all(&mut stream).await;
    eprintln!(
        "stream: {} messages; applied: {}",
        all.len(),
        applied(db).await
    );
    for r in rows {
        let (t, id, v): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
        let about: Vec<String> = all
            .iter()
            .filter(|m| {
                [&m.payload["record"], &m.payload["old_record"]]
                    .iter()
                    .any(|x| x["id"].as_i64() == Some(id))
            })
            .map(|m| {
                format!(
                    "{} {} {}",
                    m.seq,
                    m.payload["type"],
                    m.header("Nats-Msg-Id").unwrap_or("")
                )
            })
            .collect();
        eprintln!("only in {t}: ({id}, {v}); on the stream: {about:?}");
    }
}

fn leading(workers: &[Worker; 2]) -> Option<usize> {
    workers.iter().position(|w| {
        w.health()
            .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
    })
}

async fn wait_leader(workers: &[Worker; 2]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(i) = leading(workers) {
            return i;
        }
        assert!(Instant::now() < deadline, "no leader within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn setup(stack: &Stack) {
    stack.sql(
        "CREATE TABLE items (id bigint PRIMARY KEY, v bigint NOT NULL);
         CREATE TABLE mirror (id bigint PRIMARY KEY, v bigint NOT NULL, lsn int8 NOT NULL,
                              seq int4 NOT NULL, deleted bool NOT NULL);
         CREATE VIEW mirrored AS SELECT id, v FROM mirror WHERE NOT deleted;
         CREATE TABLE mirror_meta (lsn int8 NOT NULL, seq int4 NOT NULL);
         INSERT INTO mirror_meta VALUES (0, 0);
         CREATE TABLE applied_log (msg_id text NOT NULL, at timestamptz DEFAULT now());",
    );
    enable(stack, "items");
}

/// The acceptance test of change streams: every change of `items` applied exactly once
/// to `mirror` across a leader `kill -9`, a NATS restart and a restart of the service,
/// the mirror equal to the table at the end; then a TRUNCATE empties both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mirror_applies_every_change_once_across_kills_and_restarts() {
    let _guard = crate::support::alone().await;
    let mut stack = Stack::start("stream");
    setup(&stack);
    let mut first = stack.worker(LEASE);
    first.wait_active(Duration::from_secs(60));
    let mut workers = [first, stack.worker(LEASE)];
    workers[1].wait_http(Duration::from_secs(30));
    let db = client(&stack.pg).await;
    Inbox::default().migrate(&db).await.expect("inbox table");
    stack.sql("INSERT INTO items VALUES (-1, 0)");
    let _ = changes_stream(&stack.nats.url()).await;
    let mut service = Service::start(&stack).await;
    let writers = Writers::start(&stack, 3).await;
    let mut done = progress(&db, 0, 300, "before the kill").await;
    // A leader kill -9: the other worker takes over and replays from the slot.
    let old = wait_leader(&workers).await;
    workers[old].kill9();
    let new = wait_leader(&workers).await;
    assert_ne!(old, new);
    workers[old] = stack.worker(LEASE);
    done = progress(&db, done, 300, "after the takeover").await;
    // A NATS restart (SIGKILL, same store): publishes and pulls fail, then resume.
    stack.nats.restart().expect("restart nats");
    done = progress(&db, done, 300, "after the NATS restart").await;
    // The service killed and started again: unacked deliveries come back.
    service.kill();
    service = Service::start(&stack).await;
    progress(&db, done, 300, "after the service restart").await;
    writers.stop().await;
    converge(&db, &stack.nats.url(), "after the writers stopped").await;
    // Exactly once: every message of the stream applied, none twice.
    let mut stream = changes_stream(&stack.nats.url()).await;
    let stored = stored_count(&mut stream).await as i64;
    let wait = Instant::now() + Duration::from_secs(60);
    while applied(&db).await < stored && Instant::now() < wait {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let twice: i64 = db
        .query_one(
            "SELECT count(*) FROM (SELECT msg_id FROM applied_log GROUP BY 1 HAVING count(*) > 1) d",
            &[],
        )
        .await
        .expect("twice")
        .get(0);
    assert_eq!(twice, 0, "messages applied more than once");
    assert_eq!(
        applied(&db).await,
        stored,
        "every stored change applied once"
    );
    let rows: i64 = db
        .query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0);
    // TRUNCATE: on the stream, and the mirror ends empty.
    stack.sql("TRUNCATE items");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left: i64 = db
            .query_one("SELECT count(*) FROM mirror", &[])
            .await
            .unwrap()
            .get(0);
        if left == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the mirror still has {left} rows 60 s after TRUNCATE"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = read_all(&mut stream).await;
    let last = all.last().expect("messages");
    assert_eq!(last.payload["type"], "TRUNCATE", "{:?}", last.payload);
    assert_eq!(last.subject, "walcast.changes.default.public.items");
    let ids: std::collections::HashSet<_> =
        all.iter().filter_map(|m| m.header("Nats-Msg-Id")).collect();
    assert_eq!(ids.len(), all.len(), "a Nats-Msg-Id stored twice");
    let replays = workers
        .iter()
        .filter_map(|w| w.metric("walcast_change_stream_published_total{duplicate=\"true\"}"))
        .sum::<f64>();
    let reordered = workers
        .iter()
        .filter_map(|w| w.metric("walcast_change_stream_reordered_total"))
        .sum::<f64>();
    let late = all
        .windows(2)
        .filter(|w| {
            let pos = |m: &crate::support::outbox::Stored| {
                (m.commit_lsn(), m.payload["seq"].as_u64().unwrap_or(0))
            };
            pos(&w[1]) < pos(&w[0])
        })
        .inspect(|w| {
            let id = |m: &crate::support::outbox::Stored| {
                format!("{} {}", m.seq, m.header("Nats-Msg-Id").unwrap_or_default())
            };
            eprintln!("stored out of order: {} then {}", id(&w[0]), id(&w[1]));
        })
        .count();
    eprintln!(
        "change stream: {} messages stored, each applied once ({rows} rows mirrored, then TRUNCATE); {replays} duplicates dropped by the duplicate window (the takeover's replay, the resends after the NATS restart); {late} stored before an older one ({reordered} counted by the workers alive at the end)",
        all.len()
    );
    service.kill();
}

/// Nobody but walcast's role changes which tables stream, and a forged logical message
/// puts nothing on the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_put_anything_on_the_change_stream() {
    let _guard = crate::support::shared().await;
    let stack = Stack::start("stream");
    setup(&stack);
    stack.sql(
        "CREATE ROLE tenant LOGIN PASSWORD 'tenant';
         CREATE SCHEMA other AUTHORIZATION tenant;
         CREATE TABLE other.secrets (id bigint PRIMARY KEY, v bigint);
         GRANT ALL ON other.secrets TO tenant;",
    );
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let url = stack.pg.url_for("tenant", "postgres");
    let tenant = walcast_pipeline::connect(&url).await.expect("tenant login");
    let denied = tenant
        .execute(
            "INSERT INTO walcast.change_stream_tables (project_id, schema_name, table_name)
             VALUES ('default', 'other', 'secrets')",
            &[],
        )
        .await;
    assert!(denied.is_err(), "a tenant enabled a change stream");
    for prefix in ["walcast.changes", "walcast.change_stream", "walcast.notice"] {
        tenant
            .batch_execute(&format!(
                "SELECT pg_logical_emit_message(true, '{prefix}',
                   '{{\"project\":\"default\",\"schema\":\"public\",\"table\":\"items\"}}')"
            ))
            .await
            .expect("emit");
    }
    tenant
        .batch_execute("INSERT INTO other.secrets VALUES (1, 1)")
        .await
        .expect("tenant write");
    stack.sql("INSERT INTO items VALUES (1, 1)");
    let mut stream = changes_stream(&stack.nats.url()).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while stored_count(&mut stream).await < 1 {
        assert!(
            Instant::now() < deadline,
            "the legitimate change never arrived"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let all = read_all(&mut stream).await;
    let subjects: Vec<_> = all.iter().map(|m| m.subject.as_str()).collect();
    assert_eq!(
        subjects,
        ["walcast.changes.default.public.items"],
        "{all:?}"
    );
}

/// A TRUNCATE of a realtime table reaches its table subject (core NATS) as a change of
/// its own, after the table's earlier changes, with no rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncate_reaches_the_table_subject() {
    use futures_util::StreamExt;
    let _guard = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE notes (id bigint PRIMARY KEY, body text)");
    stack.enable("notes");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let nats = async_nats::connect(stack.nats.url()).await.expect("nats");
    let mut sub = nats
        .subscribe("walcast.realtime.default.public.notes")
        .await
        .expect("subscribe");
    nats.flush().await.expect("flush");
    stack.sql("INSERT INTO notes VALUES (1, 'a'), (2, 'b'); TRUNCATE notes;");
    let mut kinds = Vec::new();
    while kinds.len() < 3 {
        let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .unwrap_or_else(|_| panic!("only {kinds:?} within 30 s"))
            .expect("subscription");
        let ev: serde_json::Value = serde_json::from_slice(&m.payload).expect("json");
        kinds.push(ev["type"].as_str().unwrap_or_default().to_string());
        if ev["type"] == "TRUNCATE" {
            assert!(
                ev.get("record").is_none() && ev.get("old_record").is_none(),
                "{ev}"
            );
            assert_eq!(ev["seq"], 2, "{ev}");
        }
    }
    assert_eq!(kinds, ["INSERT", "INSERT", "TRUNCATE"]);
}

/// The change stream has a position of its own: while JetStream cannot take its changes
/// (another stream holds its subjects, so `WALCAST_CHANGES` cannot be created) realtime
/// delivery goes on, the slot keeps the WAL the change stream needs, and once the way is
/// clear every change is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_change_stream_stalls_nothing_else_and_catches_up() {
    use futures_util::StreamExt;
    let _guard = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE items (id bigint PRIMARY KEY, v bigint NOT NULL)");
    stack.enable("items");
    enable(&stack, "items");
    let nats = async_nats::connect(stack.nats.url()).await.expect("nats");
    let js = jetstream::new(nats.clone());
    js.create_stream(stream::Config {
        name: "SQUATTER".into(),
        subjects: vec!["walcast.changes.>".into()],
        ..Default::default()
    })
    .await
    .expect("squatter stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut sub = nats
        .subscribe("walcast.realtime.default.public.items")
        .await
        .expect("subscribe");
    nats.flush().await.expect("flush");
    stack.sql("INSERT INTO items SELECT g, g FROM generate_series(1, 50) g");
    for i in 0..50 {
        tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .unwrap_or_else(|_| panic!("realtime stalled after {i} changes"))
            .expect("subscription");
    }
    let lag = r#"walcast_cdc_consumer_lag_bytes{consumer="change_stream"}"#;
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker.metric(lag).unwrap_or(0.0) <= 0.0 {
        assert!(Instant::now() < deadline, "no change-stream lag reported");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        js.get_stream(STREAM).await.is_err(),
        "{STREAM} exists beside the squatter"
    );
    js.delete_stream("SQUATTER")
        .await
        .expect("delete the squatter");
    let mut stream = changes_stream(&stack.nats.url()).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while stored_count(&mut stream).await < 50 {
        assert!(
            Instant::now() < deadline,
            "the change stream did not catch up in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = read_all(&mut stream).await;
    let seqs: Vec<u64> = all
        .iter()
        .map(|m| m.payload["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (0..50).collect::<Vec<_>>(),
        "one transaction, in order"
    );
}
