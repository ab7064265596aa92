//! Class identity under hostile bindings: an anon subscription and
//! a `service_role` one with the same other fields, on a table with row-level security,
//! through a real worker and front on NATS. Their classes differ (the key is a SHA-256 of
//! the full fields, and worker and front compare the fields before anything joins a
//! class), so anon receives only what it may `SELECT` while `service_role` receives all;
//! a `select` naming a column the table lacks is refused with Postgres's words.

use std::time::Duration;

use crate::support::ws::{anon, now, token};
use crate::support::Stack;
use crate::support::Worker;
use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, PhoenixClient};

fn ids_of(frames: &[Value]) -> Vec<i64> {
    frames
        .iter()
        .map(|f| f[4]["data"]["record"]["id"].as_i64().expect("id"))
        .collect()
}

/// The `postgres_changes` frames a socket receives within `d`.
async fn changes_within(c: &mut PhoenixClient, d: Duration) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + d;
    let mut out = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match c.try_recv(left).await {
            None => return out,
            Some(m) if m.event() == "postgres_changes" => out.push(m.frame().clone()),
            Some(_) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anon_and_service_role_classes_stay_apart_and_select_is_checked() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE secrets (id int PRIMARY KEY, owner text NOT NULL, body text)");
    stack.enable("secrets");
    stack.sql(
        "GRANT SELECT ON secrets TO anon, service_role;
         ALTER TABLE secrets ENABLE ROW LEVEL SECURITY;
         CREATE POLICY public_rows ON secrets FOR SELECT TO anon USING (owner = 'public');",
    );
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(Duration::from_secs(60));
    let service_key = token(json!({"role": "service_role", "exp": now() + 3600}));
    let all = json!([{"event": "*", "schema": "public", "table": "secrets"}]);
    let cols = json!([{"event": "*", "schema": "public", "table": "secrets",
                       "select": ["id", "owner", "body"]}]);

    // service_role first (its class is delivered by class, so the front treats it as
    // ready), then anon with the very same bindings, twice over.
    let mut service = PhoenixClient::connect(&front.ws_url(&service_key)).await;
    service.join_subscribed("realtime:s1", all.clone()).await;
    service.join_subscribed("realtime:s2", cols.clone()).await;
    let mut second = PhoenixClient::connect(&front.ws_url(&service_key)).await;
    second.join_subscribed("realtime:s3", all.clone()).await;
    let mut anon_c = PhoenixClient::connect(&front.ws_url(&anon())).await;
    anon_c.join_subscribed("realtime:a1", all.clone()).await;
    anon_c.join_subscribed("realtime:a2", cols.clone()).await;

    stack.sql("INSERT INTO secrets VALUES (1, 'private', 'hidden from anon')");
    stack.sql("INSERT INTO secrets VALUES (2, 'public', 'for everyone')");
    stack.sql("UPDATE secrets SET body = 'still hidden' WHERE id = 1");

    let got = changes_within(&mut service, Duration::from_secs(10)).await;
    assert_eq!(
        ids_of(&got),
        [1, 1, 2, 2, 1, 1],
        "service_role: every row, twice"
    );
    let got = changes_within(&mut second, Duration::from_secs(3)).await;
    assert_eq!(ids_of(&got), [1, 2, 1]);
    let got = changes_within(&mut anon_c, Duration::from_secs(3)).await;
    assert_eq!(
        ids_of(&got),
        [2, 2],
        "anon: only the row it may SELECT: {got:?}"
    );
    for f in &got {
        assert_eq!(f[4]["data"]["record"]["owner"], "public", "{f}");
    }

    // A `select` naming a column the table lacks: the join's system error, as Postgres
    // words it; the socket and its other channels live on.
    let bad = json!([{"event": "*", "schema": "public", "table": "secrets",
                      "select": ["id", "nope"]}]);
    let (_, reply) = anon_c.join("realtime:a3", pg_config(bad), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let sys = anon_c.recv_event("system").await;
    let sys = sys.frame();
    assert_eq!(sys[4]["status"], "error", "{sys}");
    let message = sys[4]["message"].as_str().unwrap_or_default();
    assert!(message.contains(r#"column "nope" does not exist"#), "{sys}");
    // Too many `select` entries, or too long a name: refused before any catalog read.
    let long = json!([{"event": "*", "schema": "public", "table": "secrets",
                       "select": ["x".repeat(64)]}]);
    let (_, reply) = anon_c.join("realtime:a4", pg_config(long), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    let sys = anon_c.recv_event("system").await;
    assert_eq!(sys.frame()[4]["status"], "error", "{:?}", sys);
    stack.sql("INSERT INTO secrets VALUES (3, 'public', 'after the refusals')");
    let got = changes_within(&mut anon_c, Duration::from_secs(5)).await;
    assert_eq!(ids_of(&got), [3, 3]);
}

/// One tenant cannot add classes without bound: past `CDC_MAX_CLASSES_PER_PROJECT`, a
/// registration of one more class is refused with a readable error, while joining an
/// existing class, and other projects' subscriptions, still work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_are_capped_per_project() {
    use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    stack.enable("t");
    let mut worker = stack.worker(&[("CDC_MAX_CLASSES_PER_PROJECT", "3")]);
    worker.wait_active(Duration::from_secs(60));
    let bus = walcast_bus::Bus::nats(&stack.nats.url(), "cap-front")
        .await
        .unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let spec = |n: u32, filter: &str| SubscriptionSpec {
        id: format!("cap-front:{n}"),
        front: "cap-front".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some("t".into()),
        event: "*".into(),
        filter: Some(filter.into()),
        select: None,
        claims: json!({"role": "anon"}).into(),
        from: None,
    };
    let filters = [
        "id=eq.1",
        "id=eq.2",
        "id=eq.3",
        "id=eq.4",
        "v=like.%x%",
        "id=eq.1",
    ];
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: (0..).zip(filters).map(|(n, f)| spec(n, f)).collect(),
            },
            Duration::from_secs(10),
        )
        .await
        .expect("worker answers");
    let oks: Vec<bool> = reply.results.iter().map(|r| r.ok).collect();
    assert_eq!(
        oks,
        [true, true, true, false, false, true],
        "{:?}",
        reply.results
    );
    let why = reply.results[3].error.as_deref().unwrap_or_default();
    assert!(
        why.contains(r#"project "default" has 3 distinct subscriptions"#),
        "{why}"
    );
    assert_eq!(
        worker.metric(r#"walcast_cdc_classes_refused_total{limit="project"}"#),
        Some(2.0)
    );
}
