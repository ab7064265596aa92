//! Two real cdc-worker processes electing a leader through a Postgres lease row: exactly
//! one reads the slot; when it is killed the other takes over within the lease duration,
//! and the stream has no gap and stays in commit order.

mod support;

use std::time::{Duration, Instant};

use support::{assert_writers_complete_in_order, dedup, Collector, Stack, Worker, Writers};

both_sources!(a_killed_leader_is_replaced_within_the_lease_without_a_gap);

/// Seconds; the holder renews every second.
const LEASE_SECS: u64 = 3;
const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];

fn is_leader(w: &Worker) -> bool {
    w.health()
        .is_some_and(|h| h["leader"] == true && h["cdc_active"] == true)
}

/// Wait (bounded) until the worker serves `/health`.
fn wait_health(w: &Worker, what: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(h) = w.health() {
            return h;
        }
        assert!(Instant::now() < deadline, "{what} not serving /health");
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn a_killed_leader_is_replaced_within_the_lease_without_a_gap(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE l (writer int, i int, PRIMARY KEY (writer, i))");
    stack.enable("l");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut a = stack.worker(LEASE);
    a.wait_active(Duration::from_secs(60));
    let b = stack.worker(LEASE);
    // b is up (serving /health) but follows.
    let hb = wait_health(&b, "second worker");
    assert_eq!(hb["leader"], false, "{hb}");
    assert_eq!(hb["cdc_active"], false, "{hb}");
    assert_eq!(hb["lease_mode"], "postgres", "{hb}");
    assert!(is_leader(&a));
    let ha = a.health().unwrap();
    assert!(ha["lease_term"].as_u64().is_some_and(|t| t >= 1), "{ha}");
    assert!(
        ha["lease_expires_in_ms"]
            .as_u64()
            .is_some_and(|ms| ms <= LEASE_SECS * 1000),
        "{ha}"
    );
    // The row names the leader, whose sessions carry the tag recorded in it.
    let sessions = stack.sql(
        "SELECT count(*) FROM pg_stat_activity a JOIN walcast.leases l ON a.application_name = l.holder_session",
    );
    assert!(
        sessions.parse::<i64>().unwrap() >= 2,
        "lease, slot and pipeline sessions of the leader: {sessions}"
    );

    let writers = Writers::start(&stack.pg, "l", 2).await;
    let before = collector.len();
    collector
        .wait_until(
            "changes from the first leader",
            Duration::from_secs(60),
            |e| e.len() > before + 100,
        )
        .await;
    a.kill9();
    let killed = Instant::now();
    let deadline = killed + Duration::from_secs(30);
    while b.health().is_none_or(|h| h["leader"] != true) {
        assert!(Instant::now() < deadline, "no takeover: {:?}", b.health());
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = killed.elapsed();
    // The lease expires at most a duration after the last renewal, which came before the
    // kill; the follower reads again as soon as it can have expired.
    assert!(
        took <= Duration::from_secs(LEASE_SECS) + Duration::from_secs(1),
        "takeover took {took:?}, lease is {LEASE_SECS} s"
    );
    let mut b = b;
    b.wait_active(Duration::from_secs(60));
    let reading = killed.elapsed();
    let mid = collector.len();
    collector
        .wait_until(
            "changes from the new leader",
            Duration::from_secs(60),
            |e| e.len() > mid + 100,
        )
        .await;
    let written = writers.stop().await;
    let total = written.values().sum::<i64>() as usize;
    collector
        .wait_until(
            &format!("{total} distinct changes"),
            Duration::from_secs(120),
            |e| dedup(e).len() >= total,
        )
        .await;
    let kept = dedup(&collector.snapshot());
    assert_eq!(kept.len(), total);
    assert_writers_complete_in_order(&kept, &written, "gap or reorder across the failover");
    eprintln!(
        "failover ({source}): leader after {took:?}, reading after {reading:?} (kill -9 to first poll/stream); {total} changes, no gap"
    );
}
