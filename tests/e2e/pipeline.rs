//! The CDC pipeline end to end: real Postgres + wal2json → cdc-worker → real NATS.

both_sources!(
    insert_update_delete_arrive_with_content_in_commit_order,
    eight_concurrent_writers_10k_transactions_all_arrive_once_in_commit_order,
    a_50k_row_transaction_arrives_whole_and_in_order,
    enabling_and_disabling_takes_effect_exactly_in_wal_order,
    an_idle_open_transaction_neither_stalls_nor_reorders_others
);

use std::collections::HashMap;
use std::time::Duration;

use crate::support::{dedup, old, rec, Collector, Stack};
use walcast_bus::ChangeKind;

const ACTIVE: Duration = Duration::from_secs(60);
const ARRIVE: Duration = Duration::from_secs(120);

async fn insert_update_delete_arrive_with_content_in_commit_order(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql(
        "CREATE TYPE mood AS ENUM ('sad', 'happy');
         CREATE TABLE todos (id int8 PRIMARY KEY, title text, done bool, score numeric,
                             tags text[], meta jsonb, at timestamptz, m mood);
         CREATE TABLE \"Odd Schema.x\" (id int PRIMARY KEY);
         CREATE TABLE untracked (id int PRIMARY KEY);",
    );
    stack.enable("todos");
    stack.enable("\"Odd Schema.x\"");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(ACTIVE);

    // One transaction each (psql -c would run them all in one).
    for stmt in [
        "INSERT INTO todos VALUES (1, 'it''s \"quoted\"\n€', false, 123456789012345678901234567890.25,
                                   '{a,NULL}', '{\"k\": [1, 2]}', '2026-11-30 10:00:00.123456+02', 'happy')",
        "INSERT INTO untracked VALUES (1)",
        "UPDATE todos SET done = true WHERE id = 1",
        "INSERT INTO \"Odd Schema.x\" VALUES (7)",
        "DELETE FROM todos WHERE id = 1",
    ] {
        stack.sql(stmt);
    }
    collector.wait_count(4, ARRIVE).await;
    let events = collector.snapshot();
    let subjects = collector.subjects();
    assert_eq!(
        events.len(),
        4,
        "exactly four changes, none from `untracked`: {events:?}"
    );
    let kinds: Vec<_> = events.iter().map(|e| (e.table.as_str(), e.kind)).collect();
    assert_eq!(
        kinds,
        [
            ("todos", ChangeKind::Insert),
            ("todos", ChangeKind::Update),
            ("Odd Schema.x", ChangeKind::Insert),
            ("todos", ChangeKind::Delete)
        ]
    );
    assert!(
        events.windows(2).all(|w| w[0].commit_lsn < w[1].commit_lsn),
        "commit order"
    );
    assert_eq!(subjects[0], "walcast.realtime.default.public.todos");
    assert_eq!(
        subjects[2],
        "walcast.realtime.default.public.Odd~20Schema~2Ex"
    );

    let ins = &events[0];
    assert_eq!(ins.schema, "public");
    assert_eq!(ins.project, "default");
    let types: Vec<(&str, &str)> = ins
        .columns
        .iter()
        .map(|c| (c.name.as_str(), c.type_name.as_str()))
        .collect();
    assert_eq!(
        types,
        [
            ("id", "int8"),
            ("title", "text"),
            ("done", "bool"),
            ("score", "numeric"),
            ("tags", "_text"),
            ("meta", "jsonb"),
            ("at", "timestamptz"),
            ("m", "mood")
        ]
    );
    let r = rec(ins);
    assert_eq!(r["id"], 1);
    assert_eq!(r["title"], "it's \"quoted\"\n€");
    assert_eq!(r["done"], false);
    assert!(
        ins.record
            .as_ref()
            .unwrap()
            .get()
            .contains("123456789012345678901234567890.25"),
        "numeric keeps every digit"
    );
    assert_eq!(
        r["tags"],
        serde_json::json!(["a", null]),
        "arrays as JSON arrays"
    );
    assert_eq!(r["meta"], serde_json::json!({"k": [1, 2]}));
    assert_eq!(
        r["at"], "2026-11-30T08:00:00.123456+00:00",
        "timestamptz as to_jsonb"
    );
    assert_eq!(r["m"], "happy");
    assert!(ins.old_record.is_none());
    assert_eq!(ins.pk, ["id"]);
    assert!(
        ins.commit_timestamp.ends_with('Z') && ins.commit_timestamp.len() == 24,
        "commit_timestamp {}",
        ins.commit_timestamp
    );

    let upd = &events[1];
    assert_eq!(rec(upd)["done"], true);
    assert_eq!(
        old(upd)["done"],
        false,
        "REPLICA IDENTITY FULL gives the old row"
    );
    let del = &events[3];
    assert!(del.record.is_none());
    assert_eq!(old(del)["id"], 1);
    assert_eq!(old(del)["title"], "it's \"quoted\"\n€");
}

async fn eight_concurrent_writers_10k_transactions_all_arrive_once_in_commit_order(
    source: &'static str,
) {
    const WRITERS: i32 = 8;
    const PER: i32 = 1250;
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE w (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("w");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(ACTIVE);

    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let client = stack.pg.connect().await.expect("writer connect");
        tasks.push(tokio::spawn(async move {
            let stmt = client
                .prepare("INSERT INTO w VALUES ($1, $2)")
                .await
                .unwrap();
            for i in 0..PER {
                client.execute(&stmt, &[&writer, &i]).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let total = (WRITERS * PER) as usize;
    collector.wait_count(total, ARRIVE).await;
    // Anything extra would arrive right behind; give it a moment to show up.
    stack.sql("INSERT INTO w VALUES (-1, -1)");
    collector.wait_count(total + 1, ARRIVE).await;
    let events = collector.snapshot();
    assert_eq!(events.len(), total + 1, "no duplicates in an orderly run");
    assert!(
        events.windows(2).all(|w| w[0].commit_lsn < w[1].commit_lsn),
        "strictly increasing commit LSN (one change per transaction)"
    );
    let mut next: HashMap<i64, i64> = HashMap::new();
    for e in &events[..total] {
        let r = rec(e);
        let (w, i) = (r["writer"].as_i64().unwrap(), r["i"].as_i64().unwrap());
        let expected = next.entry(w).or_insert(0);
        assert_eq!(i, *expected, "writer {w} out of order");
        *expected += 1;
    }
    assert_eq!(next.len(), WRITERS as usize);
    assert!(next.values().all(|&n| n == PER as i64));
    assert_eq!(rec(&events[total])["writer"], -1);
}

async fn a_50k_row_transaction_arrives_whole_and_in_order(source: &'static str) {
    const ROWS: usize = 50_000;
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE big (id int PRIMARY KEY, v text)");
    stack.enable("big");
    let collector = Collector::start(&stack.nats.url()).await;
    // A small starting batch: Postgres checks the row limit only between WAL records,
    // so the 50,000-row transaction still comes out of one peek, whole.
    let mut worker = stack.worker(&[("CDC_POLL_BATCH", "1000"), ("CDC_POLL_MAX_BATCH", "1000")]);
    worker.wait_active(ACTIVE);
    stack.sql("INSERT INTO big VALUES (0, 'before')");
    stack.sql(&format!(
        "INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, {ROWS}) g"
    ));
    stack.sql("INSERT INTO big VALUES (-1, 'after')");
    collector.wait_count(ROWS + 2, ARRIVE).await;
    let events = collector.snapshot();
    assert_eq!(events.len(), ROWS + 2);
    assert_eq!(rec(&events[0])["id"], 0);
    let txn = &events[1..=ROWS];
    let lsn = txn[0].commit_lsn;
    for (k, e) in txn.iter().enumerate() {
        assert_eq!(e.commit_lsn, lsn, "one transaction, one commit LSN");
        assert_eq!(e.seq as usize, k, "position inside the transaction");
        assert_eq!(rec(e)["id"], (k + 1) as i64);
    }
    assert_eq!(rec(&events[ROWS + 1])["id"], -1);
}

async fn enabling_and_disabling_takes_effect_exactly_in_wal_order(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE a (id int PRIMARY KEY); CREATE TABLE b (id int PRIMARY KEY);");
    stack.enable("a");
    let collector = Collector::start(&stack.nats.url()).await;
    // A long refresh interval: only the in-band registry change can explain delivery.
    let mut worker = stack.worker(&[("TABLE_FILTER_REFRESH_MS", "600000")]);
    worker.wait_active(ACTIVE);
    stack.sql("INSERT INTO b VALUES (1)");
    stack.enable("b");
    stack.sql("INSERT INTO b VALUES (2)");
    stack.sql("DELETE FROM walcast.realtime_tables WHERE table_name = 'b'");
    stack.sql("INSERT INTO b VALUES (3)");
    stack.sql("INSERT INTO a VALUES (100)");
    collector
        .wait_until("the marker row in a", ARRIVE, |e| {
            e.iter().any(|e| e.table == "a" && rec(e)["id"] == 100)
        })
        .await;
    let seen: Vec<(String, i64)> = collector
        .snapshot()
        .iter()
        .map(|e| (e.table.clone(), rec(e)["id"].as_i64().unwrap()))
        .collect();
    assert_eq!(seen, [("b".to_string(), 2), ("a".to_string(), 100)]);
}

async fn an_idle_open_transaction_neither_stalls_nor_reorders_others(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, who text)");
    stack.enable("t");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(ACTIVE);

    // This session writes and then sits idle in its transaction for the whole test.
    let idle = stack.pg.connect().await.unwrap();
    idle.batch_execute("BEGIN; INSERT INTO t VALUES (0, 'idle')")
        .await
        .unwrap();

    let client = stack.pg.connect().await.unwrap();
    let stmt = client
        .prepare("INSERT INTO t VALUES ($1, 'busy')")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    const N: i32 = 4000;
    for i in 1..=N {
        client.execute(&stmt, &[&i]).await.unwrap();
    }
    collector.wait_count(N as usize, ARRIVE).await;
    let elapsed = started.elapsed();
    let events = collector.snapshot();
    let ids: Vec<i64> = events
        .iter()
        .map(|e| rec(e)["id"].as_i64().unwrap())
        .collect();
    assert_eq!(
        ids,
        (1..=N as i64).collect::<Vec<_>>(),
        "in order, and nothing from the open transaction"
    );
    let polls = worker
        .metric("walcast_cdc_poll_duration_seconds_count")
        .unwrap_or(0.0);
    let poll_secs = worker
        .metric("walcast_cdc_poll_duration_seconds_sum")
        .unwrap_or(0.0);
    eprintln!(
        "idle-in-transaction: {N} transactions delivered in {:.2}s while a writer sat idle; \
         {polls} polls, {:.2}s spent polling ({:.1} ms/poll: each peek re-decodes from the pinned restart_lsn)",
        elapsed.as_secs_f64(),
        poll_secs,
        if polls > 0.0 { poll_secs * 1000.0 / polls } else { 0.0 }
    );

    idle.batch_execute("COMMIT").await.unwrap();
    collector.wait_count(N as usize + 1, ARRIVE).await;
    let last = collector.snapshot().pop().unwrap();
    assert_eq!(
        rec(&last)["who"],
        "idle",
        "the long transaction arrives when it commits, last"
    );
    assert_eq!(dedup(&collector.snapshot()).len(), N as usize + 1);
}
