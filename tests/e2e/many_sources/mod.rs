//! Several sources (README "Sources"): three Postgres instances, each a source with a
//! project, read by two cdc-workers. The sources are spread over both workers, every row
//! of every source is published once and in commit order per source, and a source whose
//! database is down stops nothing else.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::Value;
use walcast_bus::ChangeEvent;
use walcast_testkit::Postgres;

use crate::support::{rec, sealed, shared, Collector, Stack, Worker};
use walcast_control::secrets::Place;

mod takeover;

const LEASE: &[(&str, &str)] = &[("LEASE_MODE", "postgres"), ("LEASE_DURATION_SECS", "3")];

/// A source `name` reading `pg`, its project `project` with table `<schema>.t`.
pub struct Source {
    pub name: &'static str,
    pub project: &'static str,
    pub pg: Postgres,
}

impl Source {
    pub fn start(name: &'static str, project: &'static str) -> Source {
        let pg = Postgres::builder().start().expect("start postgres");
        Source { name, project, pg }
    }

    pub fn schema(&self) -> String {
        format!("project_{}", self.project)
    }

    pub fn sql(&self, sql: &str) -> String {
        self.pg
            .psql(sql)
            .unwrap_or_else(|e| panic!("sql on {} failed: {e}\n{sql}", self.name))
    }

    /// Register the source and its project in the control database, migrate the
    /// source's database, and create and enable the project's table there.
    pub fn register(&self, stack: &Stack) {
        let secret = sealed(
            Place::project("jwt_secret", self.project),
            &format!("secret-{}", self.project),
        );
        stack.sql(&format!(
            "INSERT INTO walcast.sources (name, database_url, slot_name, check_url)
             VALUES {};
             INSERT INTO walcast.projects (id, name, schema_name, jwt_secret, source)
             VALUES ('{}', '{}', '{}', '{secret}', '{}')",
            source_row(self.name, &self.pg.url(), &self.pg.check_url()),
            self.project,
            self.project,
            self.schema(),
            self.name
        ));
        migrate(&self.pg.url());
        let s = self.schema();
        self.sql(&format!(
            "CREATE SCHEMA {s}; GRANT USAGE ON SCHEMA {s} TO anon, authenticated, service_role;
             CREATE TABLE {s}.t (i int PRIMARY KEY, v text);
             GRANT SELECT ON {s}.t TO anon, authenticated, service_role;
             ALTER TABLE {s}.t REPLICA IDENTITY FULL;
             INSERT INTO walcast.realtime_tables (project_id, schema_name, table_name)
             VALUES ('{}', '{s}', 't')",
            self.project
        ));
    }
}

/// The values of a `walcast.sources` row (name, URLs encrypted as walcast stores them,
/// slot `walcast_src_<name>`), for an `INSERT`.
pub fn source_row(name: &str, database_url: &str, check_url: &str) -> String {
    format!(
        "('{name}', '{}', 'walcast_src_{name}', '{}')",
        sealed(Place::source("database_url", name), database_url),
        sealed(Place::source("check_url", name), check_url)
    )
}

/// `walcast migrate` on a database.
pub fn migrate(url: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(["migrate"])
        .env("DATABASE_URL", url)
        .output()
        .expect("run walcast migrate");
    assert!(
        out.status.success(),
        "walcast migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The sources a worker leads with an active pipeline, by name (the default included).
pub fn leading(w: &Worker) -> Vec<String> {
    let Some(h) = w.health() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    if h["leader"] == true && h["cdc_active"] == true {
        out.push("default".to_string());
    }
    for s in h["sources"].as_array().into_iter().flatten() {
        if s["leader"] == true && s["cdc_active"] == true {
            out.push(s["name"].as_str().unwrap_or_default().to_string());
        }
    }
    out.sort();
    out
}

/// Wait until the workers together lead every one of `names`, each by one worker.
pub fn wait_spread(workers: &[&Worker], names: &[&str], timeout: Duration) -> Vec<Vec<String>> {
    let deadline = Instant::now() + timeout;
    loop {
        let held: Vec<Vec<String>> = workers.iter().map(|w| leading(w)).collect();
        let mut all: Vec<String> = held.iter().flatten().cloned().collect();
        all.sort();
        let mut want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        want.sort();
        let spread = held.iter().all(|h| h.len() < names.len());
        if all == want && spread {
            return held;
        }
        assert!(
            Instant::now() < deadline,
            "sources not spread over the workers: {held:?} (want each of {want:?} once, no worker with all)\n{}",
            workers
                .iter()
                .map(|w| match w.health() {
                    Some(h) => format!("{h}"),
                    None => format!("no /health; its log ends:\n{}", w.log_tail(30)),
                })
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Each project's `i` values in the order they were published (table subjects), once.
fn published(events: &[ChangeEvent]) -> BTreeMap<String, Vec<i64>> {
    let mut out: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for e in events {
        if e.table != "t" {
            continue;
        }
        if let Some(i) = rec(e)["i"].as_i64() {
            out.entry(e.project.clone()).or_default().push(i);
        }
    }
    out
}

/// A stack whose default source has table `t`, and sources s1 and s2 (projects p1 and
/// p2, each with its table `t`), with a collector on NATS.
async fn three_sources() -> (Stack, [Source; 2], Collector) {
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (i int PRIMARY KEY, v text)");
    stack.enable("t");
    let sources = [Source::start("s1", "p1"), Source::start("s2", "p2")];
    for s in &sources {
        s.register(&stack);
    }
    let collector = Collector::start(&stack.nats.url()).await;
    (stack, sources, collector)
}

#[tokio::test(flavor = "multi_thread")]
async fn three_sources_are_spread_over_two_workers_and_each_row_published_once_in_order() {
    let _machine = shared().await;
    let (stack, sources, collector) = three_sources().await;
    let a = stack.worker(LEASE);
    let b = stack.worker(LEASE);
    let held = wait_spread(&[&a, &b], &["default", "s1", "s2"], Duration::from_secs(90));
    eprintln!("spread: a leads {:?}, b leads {:?}", held[0], held[1]);

    const ROWS: i64 = 60;
    for i in 1..=ROWS {
        stack.sql(&format!("INSERT INTO t VALUES ({i}, 'default')"));
        for s in &sources {
            s.sql(&format!(
                "INSERT INTO {}.t VALUES ({i}, '{}')",
                s.schema(),
                s.name
            ));
        }
    }
    let want: BTreeMap<String, Vec<i64>> = ["default", "p1", "p2"]
        .iter()
        .map(|p| (p.to_string(), (1..=ROWS).collect()))
        .collect();
    collector
        .wait_until("every row of every source", Duration::from_secs(120), |e| {
            published(e).values().map(Vec::len).sum::<usize>() >= 3 * ROWS as usize
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        published(&collector.snapshot()),
        want,
        "each source's rows once, in commit order"
    );
    let other_sources: Vec<Value> = a
        .health()
        .and_then(|h| h["sources"].as_array().cloned())
        .unwrap_or_default();
    assert_eq!(other_sources.len(), 2, "{other_sources:?}");
    let (both, w) = if held[0].len() == 2 {
        (&held[0], &a)
    } else {
        (&held[1], &b)
    };
    crate::source_metrics::assert_labelled_per_source(w, both, ROWS as f64);
    a_source_cannot_speak_for_another_s_project(&sources[0], &collector, &[&a, &b]).await;
}

/// The sum of a counter's samples (every label set) over `workers`.
fn counter(workers: &[&Worker], name: &str) -> f64 {
    workers
        .iter()
        .filter_map(|w| w.get("/metrics"))
        .flat_map(|body| {
            body.lines()
                .filter(|l| l.starts_with(name))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// s1's database (its owner may be a tenant) names p2's project and the default
/// project for its own tables, and its owner writes a broadcast and emits an outbox event
/// as p2's: none of it is published; it is counted.
async fn a_source_cannot_speak_for_another_s_project(
    s1: &Source,
    collector: &Collector,
    workers: &[&Worker],
) {
    const DROPPED: &str = "walcast_source_foreign_project_dropped_total";
    let before = counter(workers, DROPPED);
    s1.sql(
        "CREATE TABLE public.forged (i int PRIMARY KEY);
         ALTER TABLE public.forged REPLICA IDENTITY FULL;
         CREATE TABLE public.forged_default (i int PRIMARY KEY);
         ALTER TABLE public.forged_default REPLICA IDENTITY FULL;
         INSERT INTO walcast.realtime_tables (project_id, schema_name, table_name)
         VALUES ('p2', 'public', 'forged'), ('default', 'public', 'forged_default');
",
    );
    s1.sql("INSERT INTO public.forged VALUES (1); INSERT INTO public.forged_default VALUES (1)");
    // Its owner (a superuser there) may act for any project in its own database.
    s1.sql(
        "SET walcast.project = 'p2';
         INSERT INTO realtime.messages (payload, event, topic, private, extension)
         VALUES ('{\"x\":1}', 'ev', 'room', false, 'broadcast');
         SELECT walcast.emit('orders.created', 'k', '{\"n\": 1}')",
    );
    s1.sql(&format!(
        "INSERT INTO {}.t VALUES (1000, 'marker')",
        s1.schema()
    ));
    collector
        .wait_until(
            "the marker after the forged rows",
            Duration::from_secs(60),
            |e| published(e).get("p1").is_some_and(|v| v.contains(&1000)),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while counter(workers, DROPPED) < before + 4.0 {
        assert!(
            Instant::now() < deadline,
            "forged changes, broadcast and outbox event not counted: {} -> {}",
            before,
            counter(workers, DROPPED)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let forged: Vec<String> = collector
        .subjects()
        .into_iter()
        .filter(|s| {
            s.contains("forged")
                || s.starts_with("walcast.broadcast")
                || s.starts_with("walcast.outbox.p2")
        })
        .collect();
    assert!(
        forged.is_empty(),
        "published for another source's project: {forged:?}"
    );
}

/// A source's entry in a worker's `/health`.
fn source_health(w: &Worker, name: &str) -> Option<Value> {
    let h = w.health()?;
    h["sources"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name)
        .cloned()
}

#[tokio::test(flavor = "multi_thread")]
async fn sources_come_and_go_at_run_time_and_a_broken_one_stops_nothing_else() {
    let _machine = shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (i int PRIMARY KEY, v text)");
    stack.enable("t");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut w = stack.worker(LEASE);
    w.wait_active(Duration::from_secs(60));

    // Added while the worker runs: a good source, one without logical decoding, and one
    // whose database does not answer.
    let s1 = Source::start("s1", "p1");
    s1.register(&stack);
    let no_logical = Postgres::builder()
        .setting("wal_level", "replica")
        .without_wal2json_check()
        .start()
        .expect("start postgres without logical decoding");
    stack.sql(&format!(
        "INSERT INTO walcast.sources (name, database_url, slot_name, check_url) VALUES {}, {}",
        source_row("replica", &no_logical.url(), &no_logical.check_url()),
        source_row(
            "down",
            "postgres://postgres@127.0.0.1:1/postgres?connect_timeout=2",
            "postgres://walcast_check@127.0.0.1:1/postgres?connect_timeout=2"
        )
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let good = source_health(&w, "s1").is_some_and(|s| s["cdc_active"] == true);
        let replica =
            source_health(&w, "replica").and_then(|s| s["last_error"].as_str().map(String::from));
        let down =
            source_health(&w, "down").and_then(|s| s["last_error"].as_str().map(String::from));
        if let (true, Some(replica), Some(down)) = (good, &replica, &down) {
            assert!(replica.contains("wal_level"), "the fix is named: {replica}");
            eprintln!("replica: {replica}\ndown: {down}");
            crate::source_metrics::assert_reported_inactive(&w, "down");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sources not started or not reported: {:?}",
            w.health()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, why) = w.status("/readyz");
    assert_eq!(
        code, 200,
        "a broken source this worker does not lead: still ready ({why})"
    );
    stack.sql("INSERT INTO t VALUES (1, 'default')");
    s1.sql(&format!("INSERT INTO {}.t VALUES (1, 's1')", s1.schema()));
    collector
        .wait_until(
            "both sources stream beside the broken ones",
            Duration::from_secs(60),
            |e| {
                let got = published(e);
                got.get("default").is_some_and(|v| v == &[1])
                    && got.get("p1").is_some_and(|v| v == &[1])
            },
        )
        .await;

    // Removed: its pipeline stops and its slot goes inactive, so it can be dropped.
    stack.sql("DELETE FROM walcast.projects WHERE id = 'p1'; DELETE FROM walcast.sources WHERE name IN ('s1', 'replica', 'down')");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let gone = w
            .health()
            .is_some_and(|h| h["sources"].as_array().is_none_or(|a| a.is_empty()));
        let active = s1.sql("SELECT count(*) FROM pg_replication_slots WHERE active");
        if gone && active.trim() == "0" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "s1 not stopped: {:?}, active slots {active}",
            w.health()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for removed in ["s1", "replica", "down"] {
        crate::source_metrics::assert_no_series(&w, removed);
    }
    s1.sql("SELECT pg_drop_replication_slot('walcast_src_s1')");
    stack.sql("INSERT INTO t VALUES (2, 'default')");
    collector
        .wait_until(
            "the default source streams on",
            Duration::from_secs(60),
            |e| published(e).get("default").is_some_and(|v| v == &[1, 2]),
        )
        .await;
}
