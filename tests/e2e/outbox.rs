//! The transactional outbox relay, end to end: `walcast.emit` and outbox-table rows reach
//! JetStream in commit order, only once committed; a crash in either window loses
//! nothing and duplicates nothing on the stream; a poison event is quarantined while the
//! others flow.

both_sources!(
    committed_events_reach_jetstream_in_commit_order,
    a_crash_in_either_window_loses_nothing,
    a_poison_event_is_quarantined_and_the_rest_flow,
);

use std::time::{Duration, Instant};

use walcast_testkit::{Nats, Postgres};

use crate::support::outbox::{client, emit, stream_with, Stored};
use crate::support::Stack;

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
        "BEGIN;
         SELECT walcast.emit('orders.created', 'k2', '{\"n\": 99}');
         ROLLBACK;
         INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload, headers)
         VALUES ('orders', 'k2', 'shipped', '{\"n\": 2}', '{\"trace\": \"t-2\"}');",
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
    // The relay counts an event once it has read JetStream's PubAck, which it waits for
    // at its next barrier: the stream can hold an event a moment before.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let health = worker.health().expect("health");
        let outbox = &health["outbox"];
        if outbox["published_total"] == 4 && outbox["oldest_unpublished_ms"] == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "health does not show the 4 events published: {health}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Emit `n` events with `n` in `from..from+count`, one transaction each; their ids.
async fn emit_many(c: &tokio_postgres::Client, from: i64, count: i64) -> Vec<String> {
    let mut ids = Vec::new();
    for n in from..from + count {
        ids.push(emit(c, "t", &format!("k{}", n % 3), &format!(r#"{{"n": {n}}}"#)).await);
    }
    ids
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
    stream_with(&stack.nats.url(), 55, Duration::from_secs(60)).await;

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
        .get("/metrics")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("walcast_outbox_published_total{duplicate=\"true\"}"));
    assert!(
        dups,
        "the replayed events reached JetStream again as duplicates"
    );
}

async fn a_poison_event_is_quarantined_and_the_rest_flow(source: &'static str) {
    let pg = Postgres::builder().start().expect("start postgres");
    let stack = Stack {
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
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = worker.health().expect("health");
        if h["outbox"]["quarantined_total"] == 1 && h["outbox"]["quarantine_size"] == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "health does not show the quarantine: {h}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let row = stack.sql(&format!(
        "SELECT key || ' ' || subject || ' ' || (error LIKE '%max payload%')::text
         FROM walcast.outbox_quarantine WHERE id = '{poison}'"
    ));
    assert_eq!(
        row.trim(),
        "b walcast.outbox.default.t true",
        "quarantined with its error"
    );
}
