//! Preflight errors and the slot manager, against real Postgres configurations.

use crate::support;

use std::time::Duration;

use crate::support::{rec, Collector, Stack, Worker};
use walcast_testkit::Postgres;

const EXIT: Duration = Duration::from_secs(60);

fn failing_worker(pg: Postgres, extra: &[(&str, &str)]) -> (bool, String) {
    let stack = Stack::with_pg(pg, "poll");
    let mut worker = stack.worker(extra);
    worker.wait_exit(EXIT)
}

/// Without wal2json the worker does not exit: it waits, unready (`/readyz` 503, naming
/// the package to install to the operator's key, `/livez` 200), and starts by itself
/// once wal2json is there.
#[test]
fn missing_wal2json_says_which_package_to_install_and_is_waited_for() {
    // Postgres looks the plugin up in dynamic_library_path: an empty directory hides it.
    let empty = tempfile::tempdir().unwrap();
    let pg = Postgres::builder()
        .setting("dynamic_library_path", &empty.path().display().to_string())
        .start()
        .unwrap();
    let libdir = pg.bindir().join("../lib").canonicalize().unwrap();
    let stack = Stack::with_pg(pg, "poll");
    let mut worker = stack.worker(&[]);
    worker.wait_http(EXIT);
    let deadline = std::time::Instant::now() + EXIT;
    // The reason's detail (the pipeline's error) is the operator's.
    let auth = format!("Bearer {}", support::FIGURES_KEY);
    let operator = [("Authorization", auth.as_str())];
    let (status, why) = loop {
        let Some((status, why)) =
            support::http_request(worker.port, "GET", "/readyz", &operator, None)
        else {
            assert!(
                std::time::Instant::now() < deadline,
                "{}",
                worker.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if why.contains("wal2json") || std::time::Instant::now() > deadline {
            break (status, why);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("install postgresql-15-wal2json"), "{why}");
    let (status, public) = worker.status("/readyz");
    assert_eq!(status, 503, "{public}");
    assert!(
        !public.contains("wal2json"),
        "the error to anyone: {public}"
    );
    assert_eq!(worker.status("/livez").0, 200);
    assert!(worker.log_text().contains("install postgresql-15-wal2json"));
    // "Install" it: the server finds it at the next attempt.
    std::fs::copy(libdir.join("wal2json.so"), empty.path().join("wal2json.so")).unwrap();
    worker.wait_active(EXIT);
    assert_eq!(worker.status("/readyz"), (200, "ready".to_string()));
}

#[test]
fn wal_level_replica_is_refused_with_the_fix() {
    let pg = Postgres::builder()
        .setting("wal_level", "replica")
        .start()
        .unwrap();
    let (ok, log) = failing_worker(pg, &[]);
    assert!(!ok);
    assert!(
        log.contains("ALTER SYSTEM SET wal_level = logical"),
        "{log}"
    );
}

#[test]
fn unbounded_wal_is_refused_unless_allowed() {
    let pg = Postgres::builder()
        .setting("max_slot_wal_keep_size", "-1")
        .start()
        .unwrap();
    let stack = Stack::with_pg(pg, "poll");
    let (ok, log) = stack.worker(&[]).wait_exit(EXIT);
    assert!(!ok);
    assert!(log.contains("--allow-unbounded-wal"), "{log}");
    let mut allowed = stack.worker(&[("CDC_ALLOW_UNBOUNDED_WAL", "true")]);
    allowed.wait_active(EXIT);
}

#[test]
fn a_role_without_replication_is_told_how_to_grant_it() {
    let stack = Stack::start("poll");
    stack.sql("CREATE ROLE plain LOGIN");
    let mut worker = Worker::spawn(
        &stack.pg.url_for("plain", "postgres"),
        &stack.nats.url(),
        &[],
    );
    let (ok, log) = worker.wait_exit(EXIT);
    assert!(!ok);
    assert!(
        log.contains("ALTER ROLE \\\"plain\\\" WITH REPLICATION")
            || log.contains("ALTER ROLE \"plain\" WITH REPLICATION"),
        "{log}"
    );
}

#[test]
fn a_slot_held_by_another_plugin_is_refused() {
    let stack = Stack::start("poll");
    stack.sql("SELECT pg_create_logical_replication_slot('walcast_cdc_slot', 'test_decoding')");
    let (ok, log) = stack.worker(&[]).wait_exit(EXIT);
    assert!(!ok);
    assert!(
        log.contains("plugin") && log.contains("test_decoding"),
        "{log}"
    );
}

both_sources!(
    a_lost_slot_is_recreated_logged_counted_and_reported,
    a_postgres_outage_turns_cdc_inactive_and_delivery_resumes_after
);

#[test]
fn no_free_replication_slot_is_refused_with_the_fix() {
    let pg = Postgres::builder()
        .setting("max_replication_slots", "1")
        .start()
        .unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('someone_else', 'wal2json')")
        .unwrap();
    let (ok, log) = failing_worker(pg, &[]);
    assert!(!ok);
    assert!(
        log.contains("no free replication slot") && log.contains("max_replication_slots"),
        "{log}"
    );
}

async fn a_postgres_outage_turns_cdc_inactive_and_delivery_resumes_after(source: &'static str) {
    let mut stack = Stack::start(source);
    stack.sql("CREATE TABLE t (id int PRIMARY KEY)");
    stack.enable("t");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(EXIT);
    stack.sql("INSERT INTO t VALUES (1)");
    collector.wait_count(1, EXIT).await;

    stack.pg.stop();
    let deadline = std::time::Instant::now() + EXIT;
    loop {
        let h = worker.health().expect("health while postgres is down");
        if h["cdc_active"] == false {
            assert!(h["last_error"].is_string(), "{h}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still active with postgres down: {h}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stack.pg.restart().expect("restart postgres");
    worker.wait_active(EXIT);
    stack.sql("INSERT INTO t VALUES (2)");
    collector
        .wait_until("row 2 after the outage", EXIT, |e| {
            e.iter().any(|e| e.record.is_some() && rec(e)["id"] == 2)
        })
        .await;
    let ids: Vec<i64> = support::dedup(&collector.snapshot())
        .iter()
        .map(|e| rec(e)["id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, [1, 2], "nothing lost, replays dropped by position");
    assert!(
        worker
            .metric("walcast_cdc_source_errors_total")
            .unwrap_or(0.0)
            >= 1.0
    );
}

async fn a_lost_slot_is_recreated_logged_counted_and_reported(source: &'static str) {
    let pg = Postgres::builder()
        .setting("max_slot_wal_keep_size", "2MB")
        .setting("min_wal_size", "2MB")
        .setting("max_wal_size", "4MB")
        .start()
        .unwrap();
    let stack = Stack::with_pg(pg, source);
    stack.sql("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE filler (v text)");
    stack.enable("t");
    let mut worker = stack.worker(&[]);
    worker.wait_active(EXIT);
    assert_eq!(worker.health().unwrap()["slot_lost_total"], 0);
    worker.kill9();

    // While nobody reads the slot, write far more WAL than it may keep, then checkpoint.
    stack.sql("INSERT INTO t VALUES (1)");
    for _ in 0..3 {
        stack.sql(
            "INSERT INTO filler SELECT repeat(md5(g::text), 20) FROM generate_series(1, 20000) g",
        );
        stack.sql("SELECT pg_switch_wal()");
        stack.sql("CHECKPOINT");
    }
    let status = stack
        .sql("SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'walcast_cdc_slot'");
    assert_eq!(status, "lost", "test setup: the slot should be invalidated");

    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(EXIT);
    let health = worker.health().unwrap();
    assert_eq!(health["slot_lost_total"], 1, "{health}");
    assert!(health["last_slot_loss"]["to"].is_string(), "{health}");
    assert_eq!(worker.metric("walcast_cdc_slot_lost_total"), Some(1.0));
    let log = worker.log_text();
    assert!(
        log.contains("\"level\":\"ERROR\"") && log.contains("replication slot was lost"),
        "{log}"
    );
    // The change in the lost range is gone (and said so); new changes flow again.
    stack.sql("INSERT INTO t VALUES (2)");
    collector.wait_count(1, EXIT).await;
    let events = collector.snapshot();
    assert_eq!(events.len(), 1);
    assert_eq!(rec(&events[0])["id"], 2);
}

/// Removing walcast cleanly: `walcast slot status` shows the slot and who reads it;
/// `walcast slot drop` refuses while a worker reads it, ends that session with `--force`,
/// and the slot is gone (no WAL retained for it any more).
#[test]
fn slot_drop_refuses_a_slot_in_use_and_removes_it() {
    use crate::support::projects::walcast;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(EXIT);
    let out = walcast(&stack, &["slot", "status"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).expect("status JSON");
    assert_eq!(status["slot"], "walcast_cdc_slot", "{status}");
    assert_eq!(status["plugin"], "wal2json", "{status}");
    assert_eq!(status["active"], true, "{status}");

    let refused = walcast(&stack, &["slot", "drop"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success(),
        "a slot in use must not be dropped"
    );
    assert!(err.contains("stop every cdc-worker first"), "{err}");
    let count = || stack.sql("SELECT count(*) FROM pg_replication_slots");
    assert_eq!(count(), "1");

    worker.kill9();
    let forced = walcast(&stack, &["slot", "drop", "--force"]);
    assert!(
        forced.status.success(),
        "{}",
        String::from_utf8_lossy(&forced.stderr)
    );
    assert_eq!(count(), "0");
    let again = walcast(&stack, &["slot", "drop"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("no replication slot named"));
}
