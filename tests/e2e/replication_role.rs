//! Two URLs, two jobs: the slot is read through `POSTGRES_REPLICATION_URL`, whose role may
//! only replicate, while the catalog and the RLS checks use `DATABASE_URL`.

use std::time::Duration;

use crate::support::{Collector, Stack};
use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
use walcast_bus::Bus;

both_sources!(a_replication_only_role_reads_the_slot_and_rls_checks_use_database_url);

async fn a_replication_only_role_reads_the_slot_and_rls_checks_use_database_url(
    source: &'static str,
) {
    let stack = Stack::start(source);
    stack.sql("CREATE TABLE notes (id int PRIMARY KEY, owner text NOT NULL, body text)");
    stack.enable("notes");
    stack.sql(
        "ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON notes FOR SELECT TO authenticated
           USING (owner = auth.jwt() ->> 'sub');
         CREATE ROLE replicator LOGIN REPLICATION;",
    );
    let replication_url = stack.pg.url_for("replicator", "postgres");
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[("POSTGRES_REPLICATION_URL", replication_url.as_str())]);
    worker.wait_active(Duration::from_secs(60));
    // The slot is read as the replication role (its walsender or polling session).
    let readers = stack.sql(
        "SELECT count(*) FROM pg_stat_activity
          WHERE usename = 'replicator' AND application_name LIKE 'walcast-cdc-%'",
    );
    assert_ne!(readers.trim(), "0", "no session of the replication role");

    let bus = Bus::nats(&stack.nats.url(), "replication-role-test")
        .await
        .unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let spec = |sub: &str| SubscriptionSpec {
        id: sub.into(),
        front: "f".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some("notes".into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims: serde_json::json!({"role": "authenticated", "sub": sub, "exp": 4102444800u64})
            .into(),
        from: None,
    };
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: vec![spec("u1"), spec("u2")],
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(reply.results.iter().all(|r| r.ok), "{:?}", reply.results);

    // Judged as each subscriber (which the replication role could not do: it may not
    // become `authenticated` nor read the table): each row reaches its owner only.
    stack.sql(
        "INSERT INTO notes VALUES (1, 'u1', 'one');
         INSERT INTO notes VALUES (2, 'u2', 'two');",
    );
    collector.wait_count(2, Duration::from_secs(60)).await;
    let events = collector.snapshot();
    let audience: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            e.variants()
                .unwrap()
                .iter()
                .flat_map(|v| v.subs.clone())
                .collect()
        })
        .collect();
    assert_eq!(
        audience,
        vec![vec!["u1".to_string()], vec!["u2".to_string()]]
    );
    assert_eq!(
        worker.metric("walcast_cdc_rls_errors_total").unwrap_or(0.0),
        0.0,
        "RLS checks failed: {}",
        worker.log_text()
    );
}
