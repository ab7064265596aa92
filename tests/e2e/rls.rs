//! Row-level security checked as each subscriber, in the worker, against real policies:
//! visibility by policy (including rows moving out of sight), column privileges, DELETE
//! reduced to the key, fail-closed per subscriber, roles without access.

mod support;

use std::collections::BTreeMap;
use std::time::Duration;

use support::{Collector, Stack};
use walcast_bus::subs::{RegisterRequest, SubsClient, SubscriptionSpec};
use walcast_bus::Bus;

fn spec(id: &str, table: &str, claims: serde_json::Value) -> SubscriptionSpec {
    SubscriptionSpec {
        id: id.into(),
        front: "f".into(),
        project: "default".into(),
        schema: "public".into(),
        table: Some(table.into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims,
        from: None,
    }
}

/// What each subscriber receives of an event: id → record (or old_record) JSON.
fn received(ev: &walcast_bus::ChangeEvent) -> BTreeMap<String, serde_json::Value> {
    let mut out = BTreeMap::new();
    for v in ev.variants().unwrap() {
        let body = v
            .record
            .as_ref()
            .or(v.old_record.as_ref())
            .unwrap()
            .get()
            .to_string();
        for s in &v.subs {
            out.insert(s.clone(), serde_json::from_str(&body).unwrap());
        }
    }
    out
}

both_sources!(rls_is_checked_per_subscriber_and_fails_closed);

async fn rls_is_checked_per_subscriber_and_fails_closed(source: &'static str) {
    let stack = Stack::start(source);
    stack.sql(
        "CREATE TABLE docs (id int PRIMARY KEY, owner text NOT NULL, body text, secret text);
         CREATE TABLE open (id int PRIMARY KEY, v text);",
    );
    stack.enable("docs");
    stack.enable("open"); // also applies the migrations: roles and auth.* helpers
    stack.sql(
        "CREATE FUNCTION owned(owner text) RETURNS bool LANGUAGE plpgsql AS $$
         BEGIN
           IF auth.jwt() ->> 'sub' = 'u3' THEN RAISE EXCEPTION 'policy failure for u3'; END IF;
           RETURN owner = auth.jwt() ->> 'sub';
         END $$;
         REVOKE ALL ON docs FROM anon, authenticated;
         ALTER TABLE docs ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own ON docs FOR SELECT TO authenticated USING (owned(owner));
         GRANT SELECT (id, owner, body) ON docs TO authenticated;
",
    );
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let bus = Bus::nats(&stack.nats.url(), "rls-test").await.unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let user =
        |sub: &str| serde_json::json!({"role": "authenticated", "sub": sub, "exp": 4102444800u64});
    let reply = subs
        .register(
            RegisterRequest {
                subs: vec![
                    spec("u1", "docs", user("u1")),
                    spec("u2", "docs", user("u2")),
                    spec("u3", "docs", user("u3")),
                    spec("anon-docs", "docs", serde_json::json!({"role": "anon"})),
                    spec("ghost", "docs", serde_json::json!({"role": "no_such_role"})),
                    spec("anon-open", "open", serde_json::json!({"role": "anon"})),
                ],
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(reply.results.iter().all(|r| r.ok), "{:?}", reply.results);

    // A filter is matched against every change: on a column the role may not read, it
    // would reveal values through what matches, so it is refused (on a readable one, not).
    let filtered = |id: &str, filter: &str| SubscriptionSpec {
        filter: Some(filter.into()),
        ..spec(id, "docs", user("u1"))
    };
    let reply = subs
        .register(
            RegisterRequest {
                subs: vec![
                    filtered("peek", "secret=eq.s1"),
                    filtered("peek-in", "id=gt.0,secret=like.s*"),
                    filtered("fine", "body=eq.zzz-never"),
                ],
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    for r in &reply.results[..2] {
        assert!(!r.ok, "{r:?}");
        let e = r.error.as_deref().unwrap_or_default();
        assert!(
            e.starts_with("Error parsing `filter` params: permission denied for column \"secret\""),
            "{e}"
        );
    }
    assert!(reply.results[2].ok, "{:?}", reply.results[2]);

    // Like Supabase, a check reads the row's *current* state by primary key, so each
    // change is awaited before the next one alters the row it would be checked against.
    let steps = [
        "INSERT INTO docs VALUES (1, 'u1', 'a', 's1')",
        "INSERT INTO docs VALUES (2, 'u2', 'b', 's2')",
        "UPDATE docs SET owner = 'u2', body = 'moved' WHERE id = 1",
        "DELETE FROM docs WHERE id = 2",
        "INSERT INTO open VALUES (1, 'x')",
    ];
    for (n, step) in steps.iter().enumerate() {
        stack.sql(step);
        collector.wait_count(n + 1, Duration::from_secs(60)).await;
    }
    let events = collector.snapshot();
    let got: Vec<BTreeMap<String, serde_json::Value>> = events.iter().map(received).collect();
    let j = |v: serde_json::Value| v;
    // INSERT owned by u1: only u1, and never the `secret` column.
    assert_eq!(
        got[0],
        BTreeMap::from([(
            "u1".into(),
            j(serde_json::json!({"id": 1, "owner": "u1", "body": "a"}))
        )])
    );
    assert_eq!(
        got[1],
        BTreeMap::from([(
            "u2".into(),
            j(serde_json::json!({"id": 2, "owner": "u2", "body": "b"}))
        )])
    );
    // The UPDATE moves row 1 out of u1's sight: only u2 gets it.
    assert_eq!(
        got[2],
        BTreeMap::from([(
            "u2".into(),
            j(serde_json::json!({"id": 1, "owner": "u2", "body": "moved"}))
        )])
    );
    // DELETE under RLS: every role that may read the table, the key only.
    let key = serde_json::json!({"id": 2});
    assert_eq!(
        got[3],
        BTreeMap::from([
            ("u1".into(), key.clone()),
            ("u2".into(), key.clone()),
            ("u3".into(), key)
        ])
    );
    // A table without RLS, readable by anon: everything.
    assert_eq!(
        got[4],
        BTreeMap::from([(
            "anon-open".into(),
            j(serde_json::json!({"id": 1, "v": "x"}))
        )])
    );
    // u3's policy raised: denied (and counted), while the others were served.
    assert!(worker.metric("walcast_cdc_rls_errors_total").unwrap_or(0.0) >= 1.0);
    assert!(worker.metric("walcast_cdc_rls_denied_total").unwrap_or(0.0) >= 1.0);
}
