//! One project's filters cannot stall another's changes, nor hold the worker's memory
//! (docs/security.md, "Filters"). Project A's sockets ask for hundreds of classes with
//! costly patterns (`v=match.a.{N}c`, a distinct N each) and write 20 KB rows; project B's
//! subscriber times its own changes, alone and then beside the attack: its p99 must stay
//! within 2× its p99 alone + 100 ms, a join of B's must be answered meanwhile, the
//! worker's memory must stay within its bound while A's classes exist, and come back once
//! they are gone.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, Msg, PhoenixClient};

use crate::support::projects::{binding, create_project, realtime_path, Project};
use crate::support::{Stack, Worker};

const STARTUP: Duration = Duration::from_secs(60);
/// Probes of B's latency per phase, one at a time, this far apart.
const PROBES: usize = 60;
const PROBE_EVERY: Duration = Duration::from_millis(100);
/// A's costly classes asked for: sockets × channels, one binding each.
const SOCKETS: usize = 3;
const CHANNELS: usize = 100;
/// How much more the worker may hold while A's classes exist (the per-project budget of
/// compiled patterns is 16 MiB; the rest is A's subscriptions and rows in flight).
const MEMORY_BOUND_KB: u64 = 128 * 1024;
/// How close to where it started the worker's memory comes back once A has left.
const RETURNED_KB: u64 = 48 * 1024;

fn enable(front: &Worker, p: &Project, table: &str) {
    let path = realtime_path(&p.id, table);
    let (status, body) = front.request(
        "PUT",
        &path,
        &[("apikey", p.service.as_str())],
        Some(r#"{"enabled": true}"#),
    );
    assert_eq!(status, 200, "enable {table}: {body}");
}

/// B's latency: `PROBES` rows written one at a time, each timed until its change arrives.
async fn probe(
    db: &tokio_postgres::Client,
    b: &Project,
    sock: &mut PhoenixClient,
    from: i64,
) -> Vec<Duration> {
    let mut took = Vec::with_capacity(PROBES);
    for i in from..from + PROBES as i64 {
        if i % 20 == 0 {
            let r = format!("hb{i}");
            sock.send(None, Some(&r), "phoenix", "heartbeat", json!({}))
                .await;
        }
        let sent = Instant::now();
        db.execute(
            &format!("INSERT INTO {}.pings VALUES ($1)", b.schema),
            &[&i],
        )
        .await
        .expect("insert");
        loop {
            match sock.try_recv(Duration::from_secs(30)).await {
                Some(Msg::Frame(f)) if f[3] == "postgres_changes" => {
                    if f[4]["data"]["record"]["id"] == json!(i) {
                        break;
                    }
                }
                Some(Msg::Frame(_)) => {}
                other => panic!("B's change {i} within 30 s: got {other:?}"),
            }
        }
        took.push(sent.elapsed());
        tokio::time::sleep(PROBE_EVERY).await;
    }
    took
}

fn p99(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[(v.len() * 99 / 100).min(v.len() - 1)]
}

/// A's sockets joining one costly binding per channel; returns the sockets and how many
/// bindings were accepted.
async fn attack(front: &Worker, a: &Project) -> (Vec<PhoenixClient>, usize) {
    let mut socks = Vec::new();
    let mut accepted = 0;
    for s in 0..SOCKETS {
        let mut sock = PhoenixClient::connect(&front.ws_url(&a.anon)).await;
        for c in 0..CHANNELS {
            let n = s * CHANNELS + c;
            let bindings: Value = json!([{"event": "*", "schema": a.schema, "table": "notes",
                                          "filter": filter_of(n)}]);
            let topic = format!("realtime:a{s}-{c}");
            let (_, reply) = sock.join(&topic, pg_config(bindings), None).await;
            if reply[4]["status"] == "ok" {
                // Subscribed, or refused with a system error: read which.
                let sys = sock.recv_frame().await;
                if sys[4]["status"] == "ok" {
                    accepted += 1;
                }
            }
        }
        socks.push(sock);
    }
    (socks, accepted)
}

/// A distinct costly pattern: `a.{N}c` with N about 200, and a distinct tail.
fn filter_of(n: usize) -> String {
    format!("v=match.a.{{{}}}c|z{n}", 190 + n % 50)
}

/// A writer of 20 KB rows into A's table, ten a second, until dropped.
fn writer(stack: &Stack, a: &Project) -> tokio::task::JoinHandle<()> {
    let url = stack.pg.url();
    let table = format!("{}.notes", a.schema);
    tokio::spawn(async move {
        let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .expect("writer");
        tokio::spawn(conn);
        for i in 0i64.. {
            let sql = format!("INSERT INTO {table} VALUES ($1, repeat('ab', 10000))");
            if db.execute(&sql, &[&i]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_projects_costly_filters_stall_no_other_project_nor_hold_memory() {
    let _machine = crate::support::alone().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let (a, b) = (create_project(&stack, "A"), create_project(&stack, "B"));
    stack.sql(&format!(
        "CREATE TABLE {a}.notes (id bigint PRIMARY KEY, v text NOT NULL);
         GRANT SELECT ON {a}.notes TO anon;
         CREATE TABLE {b}.pings (id bigint PRIMARY KEY, at timestamptz NOT NULL DEFAULT clock_timestamp());
         GRANT SELECT ON {b}.pings TO anon;",
        a = a.schema,
        b = b.schema
    ));
    enable(&front, &a, "notes");
    enable(&front, &b, "pings");
    let db = walcast_pipeline::connect(&stack.pg.url())
        .await
        .expect("db");
    let mut sb = PhoenixClient::connect(&front.ws_url(&b.anon)).await;
    sb.join_subscribed("realtime:pings", binding(&b.schema, "pings"))
        .await;
    let _ = probe(&db, &b, &mut sb, 0).await; // warm up
    let alone = p99(probe(&db, &b, &mut sb, 1_000).await);
    let rss_before = worker.proc_kb("VmRSS");

    let (socks, accepted) = attack(&front, &a).await;
    assert!(accepted > 0, "the attacker had some classes");
    let w = writer(&stack, &a);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // A join of B's is answered while A's filters run.
    let asked = Instant::now();
    let (_, reply) = sb
        .join(
            "realtime:pings2",
            pg_config(binding(&b.schema, "pings")),
            None,
        )
        .await;
    let join_took = asked.elapsed();
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let beside = p99(probe(&db, &b, &mut sb, 2_000).await);
    let rss_attack = worker.proc_kb("VmRSS").max(rss_before);
    w.abort();
    drop(socks);
    eprintln!(
        "B's p99 alone {alone:?}, beside A's {accepted} accepted costly classes {beside:?}; \
         B's join {join_took:?}; worker RSS {rss_before} kB before, {rss_attack} kB with A"
    );
    let bound = alone * 2 + Duration::from_millis(100);
    assert!(
        beside <= bound,
        "B's p99 beside A's {accepted} costly classes: {beside:?}, alone {alone:?} (bound {bound:?})"
    );
    assert!(
        join_took <= Duration::from_secs(1) + alone,
        "B's join took {join_took:?} beside A's filters"
    );
    assert!(
        rss_attack <= rss_before + MEMORY_BOUND_KB,
        "the worker went from {rss_before} kB to {rss_attack} kB with A's {accepted} classes"
    );
    // A gone: its classes go (the front unregisters its sockets' subscriptions), and the
    // memory they held with them.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rss = worker.proc_kb("VmRSS");
        if rss <= rss_before + RETURNED_KB {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the worker kept {rss} kB after A left (started at {rss_before} kB, {rss_attack} kB with A)"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
