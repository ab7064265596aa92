//! The transactional outbox relay, end to end: `walcast.emit` and outbox-table rows reach
//! JetStream in commit order, only once committed; a crash in either window loses
//! nothing and duplicates nothing on the stream; a poison event is quarantined while the
//! others flow, and `walcast outbox redrive` sends it once it fits; `walcast outbox
//! replay` re-publishes retained events in order at its rate; a million outbox-table rows
//! flow with no UPDATE or DELETE, and the leader drops expired partitions.

/// A million events take both cores for a while: once (stream source), alone.
mod million {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_million_outbox_rows_flow_without_update_or_delete() {
        let _machine = crate::support::alone().await;
        super::a_million_outbox_rows_flow_without_update_or_delete("stream").await
    }
}

both_sources!(
    committed_events_reach_jetstream_in_commit_order,
    a_crash_in_either_window_loses_nothing,
    a_poison_event_is_quarantined_and_the_rest_flow,
    replay_republishes_retained_events_in_order_at_its_rate,
);

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use futures_util::StreamExt;
use walcast_testkit::{Nats, Postgres};

use crate::support::outbox::{client, emit};
use crate::support::Stack;

const STREAM: &str = "WALCAST_OUTBOX";

/// One message of the outbox stream.
#[derive(Debug, Clone)]
struct Stored {
    subject: String,
    headers: HashMap<String, String>,
    payload: serde_json::Value,
}

impl Stored {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    fn n(&self) -> i64 {
        self.payload["n"].as_i64().unwrap_or(-1)
    }
    /// A message as stored or delivered.
    fn of(subject: &str, headers: Option<&async_nats::HeaderMap>, payload: &[u8]) -> Stored {
        let headers = headers
            .iter()
            .flat_map(|h| h.iter())
            .map(|(k, v)| {
                (
                    k.to_string(),
                    v.first().map(|v| v.to_string()).unwrap_or_default(),
                )
            })
            .collect();
        Stored {
            subject: subject.to_string(),
            headers,
            payload: serde_json::from_slice(payload).expect("payload is JSON"),
        }
    }
}

/// The outbox stream once it holds at least `n` messages (bounded).
async fn stream_holding(nats_url: &str, n: u64, timeout: Duration) -> jetstream::stream::Stream {
    let client = async_nats::connect(nats_url)
        .await
        .expect("connect to NATS");
    let js = jetstream::new(client);
    let deadline = Instant::now() + timeout;
    let mut stream = loop {
        match js.get_stream(STREAM).await {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("the outbox stream {STREAM} was not created within {timeout:?}: {e}"),
        }
    };
    loop {
        let info = stream.info().await.expect("stream info");
        let have = info.state.messages;
        if have >= n {
            return stream;
        }
        assert!(
            Instant::now() < deadline,
            "the outbox stream holds {have} messages, {n} expected within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every message of the stream, in stream order, once it holds at least `n` (bounded).
async fn stream_with(nats_url: &str, n: u64, timeout: Duration) -> Vec<Stored> {
    let mut stream = stream_holding(nats_url, n, timeout).await;
    let last = stream
        .info()
        .await
        .expect("stream info")
        .state
        .last_sequence;
    let mut out = Vec::new();
    for seq in 1..=last {
        let Ok(m) = stream.get_raw_message(seq).await else {
            continue;
        };
        out.push(Stored::of(&m.subject, Some(&m.headers), &m.payload));
    }
    out
}

/// `walcast <args>` against the stack's Postgres and NATS: (success, stdout, stderr).
async fn walcast(stack: &Stack, args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("DATABASE_URL", stack.pg.url())
        .env("NATS_URL", stack.nats.url())
        .output()
        .await
        .expect("run walcast");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

/// `walcast <args>`'s stdout; fails the test if it fails.
async fn walcast_ok(stack: &Stack, args: &[&str]) -> String {
    let (ok, out, err) = walcast(stack, args).await;
    assert!(ok, "walcast {args:?} failed:\n{out}\n{err}");
    out
}

/// Wait until `/health`'s outbox object satisfies `pred` (bounded).
async fn wait_outbox_health(
    worker: &crate::support::Worker,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = worker.health().expect("health");
        if pred(&h["outbox"]) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "health does not show {what}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn committed_events_reach_jetstream_in_commit_order(source: &'static str) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    stack.sql("SELECT walcast.outbox_create('default', 'public', 'orders_outbox')");
    let (a, b) = (client(&stack.pg).await, client(&stack.pg).await);
    // `a` starts first and commits last: the stream follows commit order.
    a.batch_execute("BEGIN").await.unwrap();
    let late = emit(&a, "orders.created", "k1", r#"{"n": 3}"#).await;
    let first = emit(&b, "orders.created", "k1", r#"{"n": 1}"#).await;
    b.batch_execute(
        r#"BEGIN;
         SELECT walcast.emit('orders.created', 'k2', '{"n": 99}');
         ROLLBACK;
         INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('orders', 'k2', 'shipped', '{"n": 2}', '{"trace": "t-2"}');"#,
    )
    .await
    .unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("SET walcast.project = 'acme'")
        .await
        .unwrap();
    let acme = emit(&b, "billing", "k9", r#"{"n": 4}"#).await;

    let got = stream_with(&stack.nats.url(), 4, Duration::from_secs(30)).await;
    let ns: Vec<i64> = got.iter().map(Stored::n).collect();
    assert_eq!(
        ns,
        [1, 2, 3, 4],
        "commit order, the rolled-back event absent: {got:?}"
    );
    assert_eq!(got[0].subject, "walcast.outbox.default.orders.created");
    assert_eq!(got[0].header("Nats-Msg-Id"), Some(first.as_str()));
    assert_eq!(got[0].header("Walcast-Event-Id"), Some(first.as_str()));
    assert_eq!(got[0].header("Walcast-Key"), Some("k1"));
    assert!(got[0]
        .header("Walcast-Commit-Lsn")
        .is_some_and(|l| l.contains('/')));
    assert_eq!(got[1].subject, "walcast.outbox.default.orders");
    assert_eq!(got[1].header("Walcast-Key"), Some("k2"));
    assert_eq!(got[1].header("Walcast-Event-Type"), Some("shipped"));
    assert_eq!(got[1].header("trace"), Some("t-2"));
    assert_eq!(got[2].header("Nats-Msg-Id"), Some(late.as_str()));
    assert_eq!(got[3].subject, "walcast.outbox.acme.billing");
    assert_eq!(got[3].header("Nats-Msg-Id"), Some(acme.as_str()));

    // Outbox rows are never updated or deleted.
    let err = stack
        .pg
        .psql("UPDATE orders_outbox SET event_type = 'x'")
        .expect_err("an UPDATE of an outbox must fail");
    assert!(err.to_string().contains("insert-only"), "{err}");
    let bad = stack
        .pg
        .psql("SELECT walcast.emit('no spaces please', 'k', '{}')")
        .expect_err("a bad topic must fail at the caller");
    assert!(bad.to_string().contains("topic"), "{bad}");
    // The relay counts an event once it handled its PubAck, a moment after JetStream
    // stored it.
    wait_outbox_health(&worker, "4 events published, none waiting", |o| {
        o["published_total"] == 4 && o["oldest_unpublished_ms"] == 0
    })
    .await;
}

/// Emit `n` events with `n` in `from..from+count`, one transaction each; their ids.
async fn emit_many(c: &tokio_postgres::Client, from: i64, count: i64) -> Vec<String> {
    let mut ids = Vec::new();
    for n in from..from + count {
        ids.push(emit(c, "t", &format!("k{}", n % 3), &format!(r#"{{"n": {n}}}"#)).await);
    }
    ids
}

/// Wait until the slot is acknowledged up to `lsn` (bounded).
fn slot_past(stack: &Stack, lsn: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let sql = format!(
        "SELECT confirmed_flush_lsn >= '{lsn}' FROM pg_replication_slots WHERE slot_name = 'walcast_cdc_slot'"
    );
    while stack.sql(&sql).trim() != "t" {
        assert!(Instant::now() < deadline, "the slot never passed {lsn}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

async fn a_crash_in_either_window_loses_nothing(source: &'static str) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let c = client(&stack.pg).await;
    let mut ids = emit_many(&c, 0, 5).await;
    stream_with(&stack.nats.url(), 5, Duration::from_secs(30)).await;

    // Window 1: committed, not yet relayed (the worker is frozen), then killed.
    worker.signal("STOP");
    ids.extend(emit_many(&c, 5, 50).await);
    worker.kill9();
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let relayed = stream_with(&stack.nats.url(), 55, Duration::from_secs(60)).await;
    // The slot past them: otherwise the next worker replays them and its failpoint fires
    // before the test saw it active.
    slot_past(&stack, relayed[54].header("Walcast-Commit-Lsn").unwrap());

    // Window 2: JetStream acknowledged, the slot not yet advanced.
    worker.kill9();
    let mut crashing = stack.worker(&[("WALCAST_FAILPOINT", "outbox-after-ack")]);
    crashing.wait_active(Duration::from_secs(60));
    ids.extend(emit_many(&c, 55, 50).await);
    let (clean, log) = crashing.wait_exit(Duration::from_secs(60));
    assert!(!clean, "the failpoint should abort the worker:\n{log}");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let got = stream_with(&stack.nats.url(), 105, Duration::from_secs(60)).await;

    let stored: Vec<String> = got
        .iter()
        .map(|s| s.header("Nats-Msg-Id").unwrap_or_default().to_string())
        .collect();
    assert_eq!(stored, ids, "every event once, in commit order");
    // The replay after the second crash was sent again and dropped as a duplicate.
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker
        .health()
        .map_or(0, |h| h["outbox"]["published_total"].as_u64().unwrap_or(0))
        == 0
    {
        assert!(Instant::now() < deadline, "the replay was not relayed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dups = worker
        .metric("walcast_outbox_published_total{duplicate=\"true\"}")
        .is_some();
    assert!(
        dups,
        "the replayed events reached JetStream again as duplicates"
    );
}

async fn a_poison_event_is_quarantined_and_the_rest_flow(source: &'static str) {
    let pg = Postgres::builder().start().expect("start postgres");
    let mut stack = Stack {
        pg,
        nats: Nats::start_with_max_payload(Some(16 * 1024)).expect("start nats-server"),
        source,
    };
    let mut worker = stack.worker(&[("TABLE_FILTER_REFRESH_MS", "300")]);
    worker.wait_active(Duration::from_secs(60));
    let c = client(&stack.pg).await;
    emit(&c, "t", "a", r#"{"n": 1}"#).await;
    let big = format!(r#"{{"n": 2, "pad": "{}"}}"#, "x".repeat(64 * 1024));
    let poison = emit(&c, "t", "b", &big).await;
    emit(&c, "t", "c", r#"{"n": 3}"#).await;

    let got = stream_with(&stack.nats.url(), 2, Duration::from_secs(30)).await;
    let ns: Vec<i64> = got.iter().map(Stored::n).collect();
    assert_eq!(ns, [1, 3], "the others flow past the poison");
    wait_outbox_health(&worker, "the quarantine", |o| {
        o["quarantined_total"] == 1 && o["quarantine_size"] == 1
    })
    .await;
    let row = stack.sql(&format!(
        "SELECT key || ' ' || subject || ' ' || (error LIKE '%max payload%')::text
         FROM walcast.outbox_quarantine WHERE id = '{poison}'"
    ));
    assert_eq!(
        row.trim(),
        "b walcast.outbox.default.t true",
        "quarantined with its error"
    );

    // Still too large: refused again, kept, reported, and the command fails.
    let (ok, out, _) = walcast(&stack, &["outbox", "redrive", "--project", "default"]).await;
    assert!(!ok && out.contains("refused again, kept"), "{out}");
    // A server that takes it: redrive sends it and empties the quarantine.
    stack
        .nats
        .restart_with_max_payload(Some(1024 * 1024))
        .expect("restart nats-server");
    let out = walcast_ok(&stack, &["outbox", "redrive", "--id", &poison]).await;
    assert!(
        out.contains(&format!("{poison} walcast.outbox.default.t: sent")),
        "{out}"
    );
    let got = stream_with(&stack.nats.url(), 3, Duration::from_secs(30)).await;
    let ns: Vec<i64> = got.iter().map(Stored::n).collect();
    assert_eq!(ns, [1, 3, 2], "the redriven event is on the stream: {ns:?}");
    assert_eq!(got[2].header("Nats-Msg-Id"), Some(poison.as_str()));
    assert_eq!(got[2].header("Walcast-Key"), Some("b"));
    let left = stack.sql("SELECT count(*) FROM walcast.outbox_quarantine");
    assert_eq!(left.trim(), "0", "the quarantine is empty");
    wait_outbox_health(&worker, "an empty quarantine", |o| {
        o["quarantine_size"] == 0
    })
    .await;
}

/// Subscribe (core NATS) to `subject` and collect `n` messages with their arrival
/// times, in a task, from now on.
async fn collect(
    nats_url: &str,
    subject: &str,
    n: usize,
) -> tokio::task::JoinHandle<Vec<(Instant, Stored)>> {
    let client = async_nats::connect(nats_url).await.expect("connect");
    let mut sub = client
        .subscribe(subject.to_string())
        .await
        .expect("subscribe");
    client.flush().await.expect("flush");
    tokio::spawn(async move {
        let _client = client;
        let mut got = Vec::new();
        while got.len() < n {
            let next = tokio::time::timeout(Duration::from_secs(30), sub.next()).await;
            let Ok(Some(m)) = next else {
                panic!("{} of {n} replayed messages within 30 s", got.len());
            };
            let s = Stored::of(&m.subject, m.headers.as_ref(), &m.payload);
            got.push((Instant::now(), s));
        }
        got
    })
}

/// `walcast outbox replay` of project `default` over `range` (`--from …`, `--to …`).
async fn replay_cli(
    stack: &Stack,
    range: &[&str],
    prefix: &str,
    rate: &str,
) -> (bool, String, String) {
    let mut args = vec!["outbox", "replay", "--project", "default"];
    args.extend_from_slice(&["--subject-prefix", prefix, "--rate", rate]);
    args.extend_from_slice(range);
    walcast(stack, &args).await
}

/// Now, by the database's clock (JetStream's is this machine's too), as RFC 3339.
async fn now_rfc3339(c: &tokio_postgres::Client) -> String {
    let sql =
        r#"SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')"#;
    c.query_one(sql, &[]).await.expect("now").get(0)
}

async fn replay_republishes_retained_events_in_order_at_its_rate(source: &'static str) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let c = client(&stack.pg).await;
    emit_many(&c, 0, 5).await;
    stream_holding(&stack.nats.url(), 5, Duration::from_secs(30)).await;
    // Stored before this instant: not replayed.
    let from = now_rfc3339(&c).await;
    let ids = emit_many(&c, 5, 100).await;
    let stored = stream_with(&stack.nats.url(), 105, Duration::from_secs(30)).await;

    let replayed = collect(&stack.nats.url(), "replay.>", 100).await;
    let (ok, out, err) = replay_cli(&stack, &["--from", &from], "replay", "200").await;
    assert!(ok, "replay failed:\n{out}\n{err}");
    let progress = "replay: 100/100 read, 100 sent";
    assert!(err.contains(progress), "progress on stderr: {err}");
    assert!(out.contains("replayed 100 event(s)"), "{out}");
    let got = replayed.await.expect("collector");
    let ns: Vec<i64> = got.iter().map(|(_, s)| s.n()).collect();
    assert_eq!(ns, (5..105).collect::<Vec<_>>(), "in order, from --from on");
    for ((_, s), id) in got.iter().zip(&ids) {
        assert_eq!(s.subject, "replay.default.t");
        assert_eq!(s.header("Walcast-Replay-Of"), Some(id.as_str()));
        assert_eq!(s.header("Walcast-Event-Id"), Some(id.as_str()));
        assert_eq!(s.header("Nats-Msg-Id"), None, "no original msg id: {s:?}");
        assert!(s.header("Walcast-Commit-Lsn").is_some(), "{s:?}");
    }
    // 100 events at 200/s (bursts of 4): at least (100 - 4) / 200 = 0.48 s.
    let spread = got[99].0 - got[0].0;
    let ms = spread.as_millis();
    assert!(ms >= 400, "the rate was not respected: {spread:?}");
    assert!(ms < 10_000, "far below the rate: {spread:?}");
    replay_by_lsn(&stack, &stored).await;
}

/// By commit LSN, both ends inclusive; and a prefix the outbox stream captures refused.
async fn replay_by_lsn(stack: &Stack, stored: &[Stored]) {
    let lsn = |i: usize| stored[i].header("Walcast-Commit-Lsn").unwrap().to_string();
    let (from, to) = (lsn(50), lsn(59));
    let range = ["--from", &from, "--to", &to];
    let by_lsn = collect(&stack.nats.url(), "again.>", 10).await;
    let (ok, out, err) = replay_cli(stack, &range, "again", "1000").await;
    assert!(ok, "replay failed:\n{out}\n{err}");
    let got = by_lsn.await.expect("collector");
    let ns: Vec<i64> = got.iter().map(|(_, s)| s.n()).collect();
    assert_eq!(ns, (50..60).collect::<Vec<_>>());

    let (ok, _, err) = replay_cli(stack, &range, "walcast.outbox.again", "1000").await;
    assert!(!ok && err.contains("--allow-same-stream"), "{err}");
}

/// Events of the 1,000,000-row test, per transaction, one transaction per UTC day.
const DAY_ROWS: i64 = 250_000;

/// Per partition of outbox table `table`: (name, inserts, updates, deletes, dead rows),
/// once the statistics count `inserted` inserts in all (bounded wait).
async fn partition_stats(
    c: &tokio_postgres::Client,
    table: &str,
    inserted: i64,
) -> Vec<(String, i64, i64, i64, i64)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = c
            .query(
                "SELECT s.relname::text, s.n_tup_ins, s.n_tup_upd, s.n_tup_del, s.n_dead_tup
                   FROM pg_stat_user_tables s
                   JOIN pg_inherits i ON i.inhrelid = s.relid
                  WHERE i.inhparent = $1::text::regclass
                  ORDER BY 1",
                &[&table],
            )
            .await
            .expect("pg_stat_user_tables");
        let stats: Vec<_> = rows
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
            .collect();
        if stats.iter().map(|s| s.1).sum::<i64>() >= inserted {
            return stats;
        }
        assert!(
            Instant::now() < deadline,
            "the statistics count fewer than {inserted} inserts: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Partitions of `table`, as `walcast outbox create` and the maintenance name them.
fn partition_names(stack: &Stack, table: &str) -> Vec<String> {
    stack
        .sql(&format!(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = '{table}'::regclass ORDER BY 1"
        ))
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

/// The partition of outbox 1 for the UTC day `days_ago` days before today.
fn day_partition(stack: &Stack, days_ago: i64) -> String {
    let day = stack.sql(&format!(
        "SELECT to_char((now() AT TIME ZONE 'UTC')::date - {days_ago}, 'YYYYMMDD')"
    ));
    format!("o1_{}", day.trim())
}

/// Four transactions of [`DAY_ROWS`] rows into `events`, one per UTC day from three
/// days ago to today, `n` counting up through them.
async fn insert_days(c: &tokio_postgres::Client) {
    for days_ago in (0..4).rev() {
        let first = (3 - days_ago) * DAY_ROWS;
        c.batch_execute(&format!(
            "INSERT INTO events (aggregate_type, aggregate_id, event_type, payload, occurred_at)
             SELECT 'load', 'k' || (n % 100), 'tick', jsonb_build_object('n', n),
                    date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                      - interval '{days_ago} days' + n * interval '1 microsecond'
               FROM generate_series({first}, {first} + {DAY_ROWS} - 1) n"
        ))
        .await
        .expect("insert a day of events");
    }
    c.batch_execute("SELECT pg_stat_force_next_flush()")
        .await
        .expect("flush the statistics");
}

async fn a_million_outbox_rows_flow_without_update_or_delete(source: &'static str) {
    let stack = Stack::start(source);
    let mut worker = stack.worker(&[("OUTBOX_MAINTAIN_INTERVAL_SECS", "1")]);
    worker.wait_active(Duration::from_secs(60));
    let create = ["outbox", "create", "events", "--retention-days", "3"];
    let out = walcast_ok(&stack, &create).await;
    let made = "outbox public.events created: id 1, project default, retention 3 days";
    assert!(out.contains(made), "{out}");
    // Maintenance made yesterday on; these rows go three and two days back too.
    stack.sql(
        "SELECT walcast.outbox_partition(t, (now() AT TIME ZONE 'UTC')::date - d)
           FROM walcast.outbox_tables t, generate_series(2, 3) d WHERE t.table_name = 'events'",
    );
    let c = client(&stack.pg).await;
    let started = Instant::now();
    insert_days(&c).await;
    let inserted = started.elapsed();
    let total = 4 * DAY_ROWS;
    let stream = stream_holding(&stack.nats.url(), total as u64, Duration::from_secs(600)).await;
    let relayed = started.elapsed();
    let rate = total as f64 / relayed.as_secs_f64();
    eprintln!("{source}: {total} rows inserted in {inserted:?}, all on the stream after {relayed:?} ({rate:.0} events/s)");
    let seq = stream.cached_info().state.last_sequence;
    let last = stream.get_raw_message(seq).await.expect("last message");
    let last = Stored::of(&last.subject, Some(&last.headers), &last.payload);
    let want = ("walcast.outbox.default.load", total - 1);
    assert_eq!((last.subject.as_str(), last.n()), want);

    let stats = partition_stats(&c, "public.events", total).await;
    let full_days = stats.iter().filter(|s| s.1 == DAY_ROWS).count();
    assert_eq!(full_days, 4, "{stats:?}");
    for (name, _, upd, del, dead) in &stats {
        let what = format!("{name}: no UPDATE, no DELETE, no dead rows");
        assert_eq!((*upd, *del, *dead), (0, 0, 0), "{what}");
    }
    retention_drops_whole_days(&stack, &worker).await;
}

/// A shorter retention: the leader's maintenance drops the days now past it, whole, and
/// keeps the others.
async fn retention_drops_whole_days(stack: &Stack, worker: &crate::support::Worker) {
    let old = [3, 2].map(|d| day_partition(stack, d));
    let kept = [1, 0].map(|d| day_partition(stack, d));
    let again = walcast_ok(stack, &["outbox", "create", "events"]).await;
    let same = "exists: id 1, project default, retention 3 days";
    assert!(again.contains(same), "{again}");
    stack.sql("UPDATE walcast.outbox_tables SET retention = '1 day' WHERE table_name = 'events'");
    let deadline = Instant::now() + Duration::from_secs(30);
    while worker.metric("walcast_outbox_partitions_dropped_total") != Some(2.0) {
        let parts = partition_names(stack, "public.events");
        assert!(Instant::now() < deadline, "not dropped: {parts:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let parts = partition_names(stack, "public.events");
    assert!(
        old.iter().all(|p| !parts.contains(p)),
        "{old:?} dropped: {parts:?}"
    );
    assert!(
        kept.iter().all(|p| parts.contains(p)),
        "{kept:?} kept: {parts:?}"
    );
    let list = walcast_ok(stack, &["outbox", "list"]).await;
    assert!(list.contains("public.events  default  1 day"), "{list}");
}
