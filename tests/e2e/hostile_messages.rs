//! Logical messages and outbox rows from a hostile database login: any role may call
//! `pg_logical_emit_message`, so a `walcast.ddl` notice or a
//! `walcast.outbox` event is trusted only when signed by walcast (`walcast-control/sql/0013`); `walcast.emit`
//! writes only for projects the caller is mapped to; and an outbox row whose header text
//! NATS cannot carry is skipped and counted while the worker stays up.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::support::outbox::{outbox_stream, read_all, stream_with};
use crate::support::ws::anon;
use crate::support::{Stack, Worker};

/// A plain login role: no grant of any kind.
async fn plain_login(stack: &Stack, name: &str) -> tokio_postgres::Client {
    stack.sql(&format!("CREATE ROLE {name} LOGIN"));
    walcast_pipeline::connect(&stack.pg.url_for(name, "postgres"))
        .await
        .expect("connect as a plain login role")
}

/// The SQLSTATE of a failed statement.
fn sqlstate(e: &tokio_postgres::Error) -> String {
    e.code().map(|c| c.code().to_string()).unwrap_or_default()
}

/// A sample, labels included (`name{label="v"}`), or 0.
fn sample(worker: &Worker, name: &str) -> f64 {
    worker.metric(name).unwrap_or(0.0)
}

/// Wait until a sample reaches `n` (bounded).
fn wait_sample(worker: &Worker, name: &str, n: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while sample(worker, name) < n {
        assert!(
            Instant::now() < deadline,
            "{name} = {} (want {n}); health {:?}",
            sample(worker, name),
            worker.health()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

const FORGED_DDL: &str = r#"walcast_cdc_messages_forged_total{prefix="walcast.ddl"}"#;
const FORGED_OUTBOX: &str = r#"walcast_cdc_messages_forged_total{prefix="walcast.outbox"}"#;

/// Notices as the trigger writes them (`walcast.catalog_notice`): one claiming RLS off
/// and anon bypassing it for `docs`, at an epoch before the real one (so its carried
/// state would be the one used), and one claiming `docs` was dropped.
fn forged_notices(epoch: i64) -> (String, String) {
    let cols = json!(["id", "public", "body"]);
    let rls_off = json!({
        "epoch": epoch, "tag": "ALTER TABLE",
        "tables": [{"schema": "public", "table": "docs"}],
        "states": [{
            "schema": "public", "table": "docs", "rls": false,
            "pk": [["id", "integer"]],
            "columns": [["id", "integer", false], ["public", "boolean", false],
                        ["body", "text", false]],
            "roles": {"anon": {"bypass": true, "columns": cols},
                      "authenticated": {"bypass": true, "columns": cols}}
        }]
    });
    let dropped = json!({
        "epoch": null, "tag": "DROP TABLE",
        "tables": [{"schema": "public", "table": "docs", "dropped": true}]
    });
    (rls_off.to_string(), dropped.to_string())
}

/// `pg_logical_emit_message(true, prefix, content)` as `who`.
async fn emit_as(who: &tokio_postgres::Client, prefix: &str, content: &str) {
    who.execute(
        "SELECT pg_logical_emit_message(true, $1::text, $2::text)",
        &[&prefix, &content],
    )
    .await
    .expect("any role may emit a logical message");
}

/// Every frame anon's socket gets up to the change of row `id`: never the private row,
/// never the end of its subscription.
async fn frames_until_row(sock: &mut PhoenixClient, id: i64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let frame = match sock.try_recv(left).await {
            Some(Msg::Frame(f)) => f,
            other => panic!("anon's socket: {other:?} before row {id}"),
        };
        let text = frame.to_string();
        assert!(!text.contains("private two"), "RLS bypassed: {text}");
        assert!(
            frame[3] != "system" || frame[4]["status"] == "ok",
            "anon's subscription was ended: {text}"
        );
        if frame[3] == "postgres_changes" && frame[4]["data"]["record"]["id"] == id {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_catalog_notices_are_skipped_and_counted() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE docs (id int PRIMARY KEY, public bool NOT NULL, body text)");
    stack.enable("docs");
    stack.sql(
        "ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
         CREATE POLICY pub ON docs FOR SELECT TO anon USING (public);",
    );
    let mut server = Worker::serve(&stack.pg.url(), &[]);
    server.wait_active(Duration::from_secs(60));
    let mut sock = PhoenixClient::connect(&server.ws_url(&anon())).await;
    let docs = json!([{"event": "*", "schema": "public", "table": "docs"}]);
    sock.join_subscribed("realtime:docs", docs).await;
    stack.sql("INSERT INTO docs VALUES (1, true, 'public one')");
    sock.wait_frame("postgres_changes", Duration::from_secs(30), |p| {
        p["data"]["record"]["id"] == 1
    })
    .await;

    let mallory = plain_login(&stack, "mallory").await;
    // walcast's own functions are not hers to call.
    for call in [
        "SELECT walcast.catalog_notice('GRANT', NULL)",
        "SELECT walcast.emit_signed('walcast.ddl', '{}')",
        "SELECT walcast.table_state('docs'::regclass, 'public', 'docs')",
    ] {
        let e = mallory.batch_execute(call).await.unwrap_err();
        assert_eq!(sqlstate(&e), "42501", "{call}: {e:?}");
    }
    let epoch: i64 = stack
        .sql("SELECT n FROM walcast.catalog_epoch")
        .parse()
        .unwrap();
    let (rls_off, dropped) = forged_notices(epoch - 1);
    // "RLS off, anon bypasses": unsigned, and with a made-up MAC.
    let fake_mac = format!("{}{rls_off}", "0".repeat(64));
    emit_as(&mallory, "walcast.ddl", &rls_off).await;
    emit_as(&mallory, "walcast.ddl", &fake_mac).await;
    stack.sql("INSERT INTO docs VALUES (2, false, 'private two')");
    stack.sql("INSERT INTO docs VALUES (3, true, 'public three')");
    frames_until_row(&mut sock, 3).await;
    // "docs was dropped": the subscription must live on.
    emit_as(&mallory, "walcast.ddl", &dropped).await;
    stack.sql("INSERT INTO docs VALUES (4, true, 'public four')");
    frames_until_row(&mut sock, 4).await;
    wait_sample(&server, FORGED_DDL, 3.0);
    let health = server.health().expect("health");
    let skipped = &health["last_skipped_change"];
    assert_eq!(skipped["table"], "walcast.ddl", "{health}");
    assert!(
        skipped["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("forged_message")),
        "{health}"
    );
    // Real DDL still applies at its position: a GRANT's notice is signed and honoured.
    stack.sql("REVOKE SELECT ON docs FROM anon");
    stack.sql("INSERT INTO docs VALUES (5, true, 'after revoke')");
    stack.sql("GRANT SELECT ON docs TO anon");
    stack.sql("INSERT INTO docs VALUES (6, true, 'after grant')");
    let f = sock
        .wait_frame("postgres_changes", Duration::from_secs(30), |p| {
            p["data"]["record"]["id"].as_i64().is_some_and(|id| id >= 5)
        })
        .await;
    assert_eq!(f[4]["data"]["record"]["id"], 6, "{f}");
    assert_eq!(sample(&server, FORGED_DDL), 3.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_events_are_bound_to_the_callers_project() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mallory = plain_login(&stack, "mallory").await;
    let acme = plain_login(&stack, "acme_app").await;
    stack.sql("INSERT INTO walcast.project_roles (project, role) VALUES ('acme', 'acme_app')");

    // Another project's subject through walcast.emit: refused.
    mallory
        .batch_execute("SET walcast.project = 'acme'")
        .await
        .unwrap();
    let e = mallory
        .batch_execute("SELECT walcast.emit('payments.approved', 'k', '{\"n\": 1}')")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42501", "{e:?}");
    // Straight into the WAL, unsigned and with a made-up MAC: skipped.
    let forged = json!({"id": "0b6c6e1a-1a52-4c3e-9d3c-1f1d2e3a4b5c", "project": "acme",
                        "topic": "payments.approved", "key": "k", "payload": {"n": 2},
                        "headers": null})
    .to_string();
    for content in [forged.clone(), format!("{}{forged}", "a".repeat(64))] {
        mallory
            .execute(
                "SELECT pg_logical_emit_message(true, 'walcast.outbox', $1::text)",
                &[&content],
            )
            .await
            .unwrap();
    }
    // What each may do still works: acme's app for acme, anyone for `default`.
    acme.batch_execute(
        "SET walcast.project = 'acme'; SELECT walcast.emit('payments.approved', 'k', '{\"n\": 3}')",
    )
    .await
    .unwrap();
    mallory
        .batch_execute(
            "SET walcast.project = 'default'; SELECT walcast.emit('notes', 'k', '{\"n\": 4}')",
        )
        .await
        .unwrap();

    let got = stream_with(&stack.nats.url(), 2, Duration::from_secs(30)).await;
    let seen: Vec<(String, i64)> = got.iter().map(|m| (m.subject.clone(), m.n())).collect();
    assert_eq!(
        seen,
        [
            ("walcast.outbox.acme.payments.approved".to_string(), 3),
            ("walcast.outbox.default.notes".to_string(), 4),
        ]
    );
    assert_eq!(sample(&worker, FORGED_OUTBOX), 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_with_a_line_break_in_a_header_is_skipped_and_the_rest_flows() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    stack.sql("SELECT walcast.outbox_create('default', 'public', 'orders_outbox')");
    stack.sql(
        r#"INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('orders', 'k1', E'shipped\r\nX-Injected: 1', '{"n": 1}');
           INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('orders', 'k2', E'tab\there', '{"n": 2}');
           INSERT INTO orders_outbox (aggregate_type, aggregate_id, event_type, payload)
           VALUES ('orders', 'k3', 'shipped', '{"n": 3}');"#,
    );
    stack.sql(r#"SELECT walcast.emit('orders', 'k4', '{"n": 4}')"#);
    let got = stream_with(&stack.nats.url(), 2, Duration::from_secs(30)).await;
    let ns: Vec<i64> = got.iter().map(|m| m.n()).collect();
    assert_eq!(ns, [3, 4], "{got:?}");
    assert_eq!(got[0].header("Walcast-Event-Type"), Some("shipped"));
    assert!(
        worker.child.try_wait().unwrap().is_none(),
        "{}",
        worker.log_text()
    );
    assert_eq!(sample(&worker, "walcast_outbox_malformed_total"), 2.0);
    let health: Value = worker.health().expect("health");
    assert_eq!(health["cdc_active"], true, "{health}");
    assert_eq!(
        health["last_skipped_change"]["reason"], "outbox_malformed",
        "{health}"
    );
    // Nothing more on the stream, nothing stuck: a later event arrives too.
    stack.sql(r#"SELECT walcast.emit('orders', 'k5', '{"n": 5}')"#);
    let mut stream = outbox_stream(&stack.nats.url(), Duration::from_secs(10)).await;
    crate::support::outbox::wait_stored(&mut stream, 3, Duration::from_secs(30)).await;
    let ns: Vec<i64> = read_all(&mut stream).await.iter().map(|m| m.n()).collect();
    assert_eq!(ns, [3, 4, 5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_before_signing_started_are_still_relayed() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    // The slot exists (a worker ran), then no worker runs while events are emitted.
    let mut first = stack.worker(&[]);
    first.wait_active(Duration::from_secs(60));
    first.kill9();
    let event = |n: i64| {
        json!({"id": format!("00000000-0000-4000-8000-00000000000{n}"), "project": "default",
               "topic": "legacy", "key": "k", "payload": {"n": n}, "headers": null})
        .to_string()
    };
    // As the functions before migration 13 wrote them (unsigned), then the upgrade: what
    // follows must be signed.
    let sql = |n: i64| {
        format!(
            "SELECT pg_logical_emit_message(true, 'walcast.outbox', '{}')",
            event(n)
        )
    };
    stack.sql(&sql(1));
    stack.sql("UPDATE walcast.message_signing SET since = pg_current_wal_lsn()");
    stack.sql(&sql(2));
    stack.sql(r#"SELECT walcast.emit('legacy', 'k', '{"n": 3}')"#);
    let worker = stack.worker(&[]);
    let got = stream_with(&stack.nats.url(), 2, Duration::from_secs(60)).await;
    let ns: Vec<i64> = got.iter().map(|m| m.n()).collect();
    assert_eq!(ns, [1, 3], "{got:?}");
    assert_eq!(sample(&worker, FORGED_OUTBOX), 1.0);
}
