//! Snapshots (README "Change streams", `walcast snapshot`): a table's rows published on
//! its change stream as READ events, consistent with its changes. A table of 20,000 rows
//! under a writer (inserts, updates, deletes) is snapshotted while the leader is killed
//! (`kill -9`) mid-snapshot; the snapshot resumes from its last stored key on the new
//! leader; a mirror applying the stream by position (dropping `(commit_lsn, seq) ≤ last`
//! per key) ends equal to the table, and no READ event contradicts the state the changes
//! before it left. A forged unsigned watermark does nothing but get counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::changes::changes_stream;
use crate::support::outbox::{client, read_all, Stored};
use crate::support::{Stack, Worker};

const ROWS: i64 = 20_000;
const SUBJECT: &str = "walcast.changes.default.public.items";
const FORGED: &str = r#"walcast_cdc_messages_forged_total{prefix="walcast.snapshot"}"#;
const ENV: &[(&str, &str)] = &[
    ("LEASE_MODE", "postgres"),
    ("LEASE_DURATION_SECS", "3"),
    ("SNAPSHOT_ROWS_PER_SEC", "2000"),
    ("SNAPSHOT_CHUNK_ROWS", "500"),
];

/// `walcast <args>` as walcast's role.
fn walcast(stack: &Stack, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(args)
        .env("DATABASE_URL", stack.pg.url())
        .output()
        .expect("run walcast")
}

/// One writer: every few milliseconds a transaction updating, deleting, inserting and
/// re-inserting rows all over the key range (so before, inside and after the chunk being
/// read).
struct Writer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<i64>,
}

impl Writer {
    async fn start(stack: &Stack) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let c = client(&stack.pg).await;
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut i: i64 = 0;
            while !flag.load(Ordering::Relaxed) {
                let sql = format!(
                    "BEGIN;
                     UPDATE items SET v = v + 1 WHERE id = {u};
                     DELETE FROM items WHERE id = {d};
                     INSERT INTO items VALUES ({r}, 7, 'again') ON CONFLICT (id) DO UPDATE SET v = items.v + 100;
                     INSERT INTO items VALUES ({n}, 1, 'new');
                     COMMIT;",
                    u = (i * 7_919) % ROWS + 1,
                    d = (i * 104_729 + 13) % ROWS + 1,
                    r = (i * 31 + 5) % ROWS + 1,
                    n = ROWS + 1 + i,
                );
                c.batch_execute(&sql).await.expect("writer");
                i += 1;
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
            i
        });
        Writer { stop, task }
    }

    async fn stop(self) -> i64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("writer task")
    }
}

fn leading(workers: &[Worker]) -> Option<usize> {
    workers.iter().position(|w| {
        w.health()
            .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
    })
}

async fn wait_leader(workers: &[Worker]) -> usize {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(i) = leading(workers) {
            return i;
        }
        assert!(Instant::now() < deadline, "no leader within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `(state, rows_done, chunks_done)` of snapshot `id`.
async fn snapshot_row(db: &tokio_postgres::Client, id: i64) -> (String, i64, i64) {
    let r = db
        .query_one(
            "SELECT state, rows_done, chunks_done FROM walcast.snapshots WHERE id = $1",
            &[&id],
        )
        .await
        .expect("snapshot row");
    (r.get(0), r.get(1), r.get(2))
}

/// Wait until the snapshot has `rows` rows done (or is over).
async fn wait_rows(db: &tokio_postgres::Client, id: i64, rows: i64, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let (state, done, _) = snapshot_row(db, id).await;
        if done >= rows || state != "running" && state != "queued" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "snapshot {id}: {done} rows done, {rows} expected within {within:?} ({state})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `(commit_lsn, seq)` of a stored change.
fn position(m: &Stored) -> (u64, u64) {
    let lsn = m.payload["commit_lsn"].as_str().expect("commit_lsn");
    let (hi, lo) = lsn.split_once('/').expect("an LSN");
    let lsn = (u64::from_str_radix(hi, 16).unwrap() << 32) | u64::from_str_radix(lo, 16).unwrap();
    (lsn, m.payload["seq"].as_u64().expect("seq"))
}

type Row = Option<(i64, String)>;

fn row_of(record: &serde_json::Value) -> (i64, Row) {
    let id = record["id"].as_i64().expect("id");
    let v = record["v"].as_i64().expect("v");
    (
        id,
        Some((v, record["note"].as_str().unwrap_or("").to_string())),
    )
}

/// The id and row state a change leaves (`None`: deleted).
fn effect(m: &Stored) -> (i64, Row) {
    match m.payload["type"].as_str().unwrap() {
        "DELETE" => (row_of(&m.payload["old_record"]).0, None),
        _ => row_of(&m.payload["record"]),
    }
}

/// A mirror applying the messages in stream order, dropping a change at or before the
/// position that last set its row.
fn mirror(all: &[Stored]) -> HashMap<i64, Row> {
    let mut rows: HashMap<i64, ((u64, u64), Row)> = HashMap::new();
    for m in all {
        let (pos, (id, row)) = (position(m), effect(m));
        if rows.get(&id).is_some_and(|(last, _)| *last >= pos) {
            continue;
        }
        rows.insert(id, (pos, row));
    }
    rows.into_iter().map(|(id, (_, r))| (id, r)).collect()
}

/// READ events that contradict the state the changes before them (in position order)
/// left: a READ of a deleted row, or with other values than the last change set.
fn stale_reads(all: &[Stored]) -> Vec<String> {
    let mut sorted: Vec<&Stored> = all.iter().collect();
    sorted.sort_by_key(|m| position(m));
    let mut state: HashMap<i64, Row> = HashMap::new();
    let mut stale = Vec::new();
    for m in sorted {
        let (id, row) = effect(m);
        if m.payload["type"] == "READ" {
            if let Some(before) = state.get(&id) {
                if *before != row {
                    stale.push(format!(
                        "{id} at {:?}: {before:?} then READ {row:?}",
                        position(m)
                    ));
                }
            }
        }
        state.insert(id, row);
    }
    stale
}

async fn table(db: &tokio_postgres::Client) -> HashMap<i64, Row> {
    db.query("SELECT id, v, note FROM items", &[])
        .await
        .expect("items")
        .iter()
        .map(|r| (r.get(0), Some((r.get(1), r.get::<_, String>(2)))))
        .collect()
}

/// Every message of `items` up to the end marker (row -1), waiting for it (bounded).
async fn until_marker(nats_url: &str) -> Vec<Stored> {
    let mut stream = changes_stream(nats_url).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let all: Vec<Stored> = read_all(&mut stream)
            .await
            .into_iter()
            .filter(|m| m.subject == SUBJECT)
            .collect();
        if all.iter().any(|m| m.payload["record"]["id"] == -1) {
            return all;
        }
        assert!(
            Instant::now() < deadline,
            "the end marker not on the stream within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_under_writes_and_a_leader_kill_mirrors_the_table() {
    let _guard = crate::support::alone().await;
    let stack = Stack::start("stream");
    stack.sql(&format!(
        "CREATE TABLE items (id bigint PRIMARY KEY, v bigint NOT NULL, note text NOT NULL);
         INSERT INTO items SELECT g, 0, 'n' || g FROM generate_series(1, {ROWS}) g;
         ANALYZE items;
         CREATE TABLE other (id int PRIMARY KEY);
         CREATE ROLE mallory LOGIN;"
    ));
    let out = walcast(&stack, &["changes", "enable", "items"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Only a table whose change stream is on; a filter is parsed, never SQL.
    let out = walcast(&stack, &["snapshot", "start", "other"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no change stream"),
        "{err}"
    );
    let out = walcast(
        &stack,
        &[
            "snapshot",
            "start",
            "items",
            "--where",
            "id=eq.1; DROP TABLE items",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("bigint"),
        "a value is bound: {err}"
    );
    let out = walcast(
        &stack,
        &["snapshot", "start", "items", "--where", "nope=eq.1"],
    );
    assert!(
        !out.status.success(),
        "a filter on an unknown column is refused"
    );
    // The queue bound (the management API's 429 `queue_full` is the same check).
    stack.sql(
        "INSERT INTO walcast.snapshots (project_id, schema_name, table_name)
         SELECT 'ghost', 'public', 'other' FROM generate_series(1, 100)",
    );
    let out = walcast(&stack, &["snapshot", "start", "items"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("100 snapshots are queued or running"),
        "{err}"
    );
    stack.sql("DELETE FROM walcast.snapshots WHERE project_id = 'ghost'");

    let mut first = stack.worker(ENV);
    first.wait_active(Duration::from_secs(60));
    let mut second = stack.worker(ENV);
    second.wait_http(Duration::from_secs(30));
    let mut workers = vec![first, second];
    let db = client(&stack.pg).await;
    stack.sql("UPDATE items SET v = 1 WHERE id = 1");
    let _ = changes_stream(&stack.nats.url()).await;

    let writer = Writer::start(&stack).await;
    let out = walcast(&stack, &["snapshot", "start", "items"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id: i64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("an id");
    wait_rows(&db, id, 5_000, Duration::from_secs(60)).await;
    let old = wait_leader(&workers).await;
    let shown = workers[old].health().expect("health");
    assert_eq!(shown["snapshot"]["id"], id, "progress on /health: {shown}");
    assert!(shown["snapshot"]["rows_estimate"].as_i64().unwrap() >= ROWS);
    workers[old].kill9();
    let (_, at_kill, chunks_at_kill) = snapshot_row(&db, id).await;
    let new = wait_leader(&workers).await;
    assert_ne!(old, new);
    wait_rows(&db, id, at_kill + 2_000, Duration::from_secs(60)).await;
    let (state, _, chunks) = snapshot_row(&db, id).await;
    assert!(
        chunks > chunks_at_kill,
        "resumed: {chunks} chunks, {chunks_at_kill} at the kill ({state})"
    );
    wait_rows(&db, id, i64::MAX, Duration::from_secs(90)).await;
    let writes = writer.stop().await;
    let (state, rows_done, _) = snapshot_row(&db, id).await;
    assert_eq!(state, "done");
    assert!(rows_done >= ROWS / 2, "{rows_done} rows done");
    let status = walcast(&stack, &["snapshot", "status"]);
    let status = String::from_utf8_lossy(&status.stdout);
    assert!(
        status.contains(&format!("{id} done public.items")),
        "{status}"
    );

    // A forged (unsigned) watermark, then the end marker.
    let mallory = walcast_pipeline::connect(&stack.pg.url_for("mallory", "postgres"))
        .await
        .expect("mallory");
    for mark in ["low", "high"] {
        let body = format!(r#"{{"id":{id},"chunk":1,"mark":"{mark}"}}"#);
        mallory
            .execute(
                "SELECT pg_logical_emit_message(true, 'walcast.snapshot', $1::text)",
                &[&body],
            )
            .await
            .expect("any role may emit a message");
    }
    stack.sql("INSERT INTO items VALUES (-1, 0, 'end')");
    let all = until_marker(&stack.nats.url()).await;
    let reads = all.iter().filter(|m| m.payload["type"] == "READ").count();
    let stale = stale_reads(&all);
    assert!(
        stale.is_empty(),
        "{} stale READ events: {:?}",
        stale.len(),
        &stale[..stale.len().min(5)]
    );
    let mirrored = mirror(&all);
    let mirrored: HashMap<i64, Row> = mirrored.into_iter().filter(|(_, r)| r.is_some()).collect();
    let items = table(&db).await;
    let missing = items
        .iter()
        .filter(|(k, v)| mirrored.get(k) != Some(v))
        .count();
    let extra = mirrored.keys().filter(|k| !items.contains_key(k)).count();
    eprintln!(
        "{} messages, {reads} READ, {writes} writer transactions, rows_done {rows_done}",
        all.len()
    );
    assert_eq!((missing, extra), (0, 0), "mirror differs from the table");
    let forged = workers[new].metric(FORGED).unwrap_or(0.0);
    assert!(forged >= 2.0, "forged watermarks counted: {forged}");
}
