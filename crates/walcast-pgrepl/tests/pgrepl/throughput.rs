//! Measures streaming a slot vs. the SQL interface on the same data. Ignored by default:
//! `cargo test -p walcast-pgrepl --test pgrepl -- throughput --ignored --nocapture`
//! (`WALCAST_BENCH_TXNS` sets the number of single-row transactions, default 100000).

use std::time::Instant;

use walcast_core::Lsn;
use walcast_pgrepl::{ReplEvent, ReplicationClient};
use walcast_testkit::Postgres;

const OPTIONS: &[(&str, &str)] = &[
    ("format-version", "2"),
    ("include-lsn", "1"),
    ("include-transaction", "1"),
    ("include-timestamp", "1"),
    ("include-xids", "1"),
];
const SQL_OPTIONS: &str = "'format-version', '2', 'include-lsn', '1', \
    'include-transaction', '1', 'include-timestamp', '1', 'include-xids', '1'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with --ignored --nocapture"]
async fn stream_vs_sql_interface() {
    let txns: u64 = std::env::var("WALCAST_BENCH_TXNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let pg = Postgres::start().unwrap();
    pg.psql("CREATE TABLE t (id int PRIMARY KEY, v text)")
        .unwrap();
    for slot in ["by_stream", "by_get", "by_peek", "by_recvlogical"] {
        pg.psql(&format!(
            "SELECT pg_create_logical_replication_slot('{slot}', 'wal2json')"
        ))
        .unwrap();
    }
    let t = Instant::now();
    pg.psql(&format!(
        "DO $$ BEGIN FOR i IN 1..{txns} LOOP \
         INSERT INTO t VALUES (i, 'value ' || i); COMMIT; END LOOP; END $$"
    ))
    .unwrap();
    println!("insert {txns} single-row transactions: {:?}", t.elapsed());

    // Streaming replication.
    let t = Instant::now();
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client
        .start_logical("by_stream", Lsn::ZERO, OPTIONS)
        .await
        .unwrap();
    let (mut messages, mut bytes, mut commits) = (0u64, 0u64, 0u64);
    let mut last = Lsn::ZERO;
    while commits < txns {
        match stream.next_event().await.unwrap().unwrap() {
            ReplEvent::XLogData {
                wal_start, data, ..
            } => {
                messages += 1;
                bytes += data.len() as u64;
                if data.starts_with(br#"{"action":"C""#) {
                    commits += 1;
                    last = wal_start;
                }
            }
            ReplEvent::Keepalive {
                reply_requested: true,
                ..
            } => stream.send_status(last, false).await.unwrap(),
            ReplEvent::Keepalive { .. } => {}
        }
    }
    stream.send_status(last, false).await.unwrap();
    let streamed = t.elapsed();
    stream.stop().await.unwrap();
    println!(
        "START_REPLICATION stream: {messages} messages, {bytes} bytes in {streamed:?} \
         ({:.0} txn/s)",
        txns as f64 / streamed.as_secs_f64()
    );

    // The same stream read by Postgres' own C client, as a baseline for this client.
    let recvlogical = pg.bindir().join("pg_recvlogical");
    let mut cmd = std::process::Command::new(&recvlogical);
    cmd.args([
        "-d",
        &pg.url(),
        "--slot",
        "by_recvlogical",
        "--start",
        "--no-loop",
    ])
    .args(["--endpos", &last.to_string(), "-f", "/dev/null"]);
    for (k, v) in OPTIONS {
        cmd.args(["-o", &format!("{k}={v}")]);
    }
    let t = Instant::now();
    let status = tokio::task::spawn_blocking(move || cmd.status())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success());
    let recv = t.elapsed();
    println!(
        "pg_recvlogical (libpq) on the same data: {recv:?} ({:.0} txn/s)",
        txns as f64 / recv.as_secs_f64()
    );

    // SQL interface, everything in one call, rows fetched to the client.
    let sql = pg.connect().await.unwrap();
    let t = Instant::now();
    let rows = sql
        .query(
            &format!(
                "SELECT lsn::text, data FROM pg_logical_slot_get_changes('by_get', NULL, NULL, \
                 {SQL_OPTIONS})"
            ),
            &[],
        )
        .await
        .unwrap();
    let got = t.elapsed();
    let sql_bytes: usize = rows.iter().map(|r| r.get::<_, &str>(1).len()).sum();
    println!(
        "pg_logical_slot_get_changes (one call): {} rows, {sql_bytes} bytes in {got:?} \
         ({:.0} txn/s)",
        rows.len(),
        txns as f64 / got.as_secs_f64()
    );
    assert_eq!(rows.len() as u64, messages);

    // SQL interface the way a poller uses it: peek a batch, then advance past it.
    let batch = 30_000;
    let t = Instant::now();
    let mut peeked = 0u64;
    let mut calls = 0u64;
    loop {
        let rows = sql
            .query(
                &format!(
                    "SELECT lsn::text, data FROM pg_logical_slot_peek_changes('by_peek', NULL, \
                     {batch}, {SQL_OPTIONS})"
                ),
                &[],
            )
            .await
            .unwrap();
        calls += 1;
        let Some(last) = rows.last() else { break };
        peeked += rows.len() as u64;
        let lsn: &str = last.get(0);
        sql.execute(
            &format!("SELECT pg_replication_slot_advance('by_peek', '{lsn}')"),
            &[],
        )
        .await
        .unwrap();
    }
    let peek = t.elapsed();
    println!(
        "peek_changes({batch}) + advance loop: {peeked} rows in {calls} calls, {peek:?} \
         ({:.0} txn/s)",
        txns as f64 / peek.as_secs_f64()
    );
}
