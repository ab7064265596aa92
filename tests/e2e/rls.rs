//! Row-level security checked as each subscriber, in the worker, against real policies:
//! visibility by policy (including rows moving out of sight), column privileges, DELETE
//! judged on the row deleted, fail-closed per subscriber, roles without access; versions lacking
//! a value their policy reads (unchanged TOAST). Each policy kind judged as a `SELECT` of
//! the version would, and the random-workload oracle, are tested through realtime-js:
//! tests/js/rls_policies.test.js and tests/js/rls_oracle.test.js.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::support::{Collector, Stack};
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
        claims: claims.into(),
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

both_sources!(
    rls_is_checked_per_subscriber_and_fails_closed,
    a_version_lacking_a_value_its_policy_reads_is_judged_by_its_row,
);

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
            walcast_bus::source::DEFAULT_SOURCE,
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
    // A role no token may act as (not in ALLOWED_ROLES) is refused, the others accepted.
    for r in &reply.results {
        assert_eq!(r.ok, r.id != "ghost", "{:?}", reply.results);
    }
    let ghost = reply.results.iter().find(|r| r.id == "ghost").unwrap();
    let why = ghost.error.as_deref().unwrap_or_default();
    assert!(why.contains("\"no_such_role\" is not allowed"), "{why}");

    // A filter is matched against every change: on a column the role may not read, it
    // would reveal values through what matches, so it is refused (on a readable one, not).
    let filtered = |id: &str, filter: &str| SubscriptionSpec {
        filter: Some(filter.into()),
        ..spec(id, "docs", user("u1"))
    };
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
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

    // Back to back: each version is judged by its own values, whatever the row holds
    // by the time it is checked.
    stack.sql(
        "INSERT INTO docs VALUES (1, 'u1', 'a', 's1');
         INSERT INTO docs VALUES (2, 'u2', 'b', 's2');
         UPDATE docs SET owner = 'u2', body = 'moved' WHERE id = 1;
         DELETE FROM docs WHERE id = 2;
         INSERT INTO open VALUES (1, 'x');",
    );
    collector.wait_count(5, Duration::from_secs(60)).await;
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
    // DELETE under RLS: judged on the row deleted, as a SELECT of it right before: its
    // owner only (u3's check raised: denied), with the columns its role may read.
    assert_eq!(
        got[3],
        BTreeMap::from([(
            "u2".into(),
            j(serde_json::json!({"id": 2, "owner": "u2", "body": "b"}))
        )])
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

async fn a_version_lacking_a_value_its_policy_reads_is_judged_by_its_row(source: &'static str) {
    let stack = Stack::start(source);
    for t in ["notes", "bignotes", "scores"] {
        let cols = if t == "scores" {
            "score float8"
        } else {
            "status text, big text"
        };
        stack.sql(&format!(
            "CREATE TABLE {t} (id int PRIMARY KEY, owner text NOT NULL, {cols})"
        ));
        stack.enable(t);
    }
    // Out-of-line TOAST, and only the key as old row: wal2json leaves an unchanged `big`
    // out of an UPDATE.
    stack.sql(
        "ALTER TABLE notes ALTER COLUMN big SET STORAGE EXTERNAL, REPLICA IDENTITY DEFAULT;
         ALTER TABLE bignotes ALTER COLUMN big SET STORAGE EXTERNAL, REPLICA IDENTITY DEFAULT;
         ALTER TABLE notes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON notes FOR SELECT TO authenticated
             USING (owner = auth.jwt() ->> 'sub');
         ALTER TABLE bignotes ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine_with_body ON bignotes FOR SELECT TO authenticated
             USING (owner = auth.jwt() ->> 'sub' AND length(big) > 0);
         ALTER TABLE scores ENABLE ROW LEVEL SECURITY;
         CREATE POLICY low ON scores FOR SELECT TO authenticated
             USING (owner = auth.jwt() ->> 'sub' AND coalesce(score, 0) < 10);",
    );
    let collector = Collector::start(&stack.nats.url()).await;
    let mut worker = stack.worker(&[]);
    worker.wait_active(Duration::from_secs(60));
    let bus = Bus::nats(&stack.nats.url(), "rls-toast").await.unwrap();
    let subs = SubsClient::new(&bus, None).unwrap();
    let u1 = serde_json::json!({"role": "authenticated", "sub": "u1", "exp": 4102444800u64});
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            RegisterRequest {
                subs: ["notes", "bignotes", "scores"]
                    .iter()
                    .map(|t| spec(t, t, u1.clone()))
                    .collect(),
            },
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert!(reply.results.iter().all(|r| r.ok), "{:?}", reply.results);

    stack.sql(
        "INSERT INTO notes VALUES (1, 'u1', 'new', repeat(md5('x'), 200));
         INSERT INTO bignotes VALUES (1, 'u1', 'new', repeat(md5('x'), 200));
         BEGIN;
         UPDATE notes SET status = 'sent' WHERE id = 1;
         UPDATE notes SET status = 'delivered' WHERE id = 1;
         UPDATE bignotes SET status = 'sent' WHERE id = 1;
         UPDATE bignotes SET status = 'delivered' WHERE id = 1;
         COMMIT;
         INSERT INTO scores VALUES (1, 'u1', 'NaN'), (2, 'u1', 5), (3, 'u1', NULL), (4, 'u1', 'Infinity');",
    );
    collector.wait_count(10, Duration::from_secs(60)).await;
    let events = collector.snapshot();
    let seen = |table: &str| -> Vec<(String, serde_json::Value)> {
        events
            .iter()
            .filter(|e| e.table == table)
            .filter_map(|e| {
                received(e)
                    .remove(table)
                    .map(|r| (format!("{:?}", e.kind), r))
            })
            .map(|(kind, r)| (kind, r.get("status").or(r.get("id")).cloned().unwrap()))
            .collect()
    };
    let s = |kind: &str, v: serde_json::Value| (kind.to_string(), v);
    // The UPDATEs lack `big`, which this policy does not read: judged by their own values.
    assert_eq!(
        seen("notes"),
        [
            s("Insert", "new".into()),
            s("Update", "sent".into()),
            s("Update", "delivered".into())
        ]
    );
    // This policy reads `big`: the UPDATEs are judged by the row, the one already
    // replaced when checked cannot be judged and is withheld.
    assert_eq!(
        seen("bignotes"),
        [s("Insert", "new".into()), s("Update", "delivered".into())]
    );
    // NaN and Infinity arrive as null: judged by the row (whose NaN fails `< 10`); a real
    // NULL passes, as a SELECT would have it.
    assert_eq!(
        seen("scores"),
        [s("Insert", 2.into()), s("Insert", 3.into())]
    );
    let metric = |name: &str| worker.metric(name).unwrap_or(0.0);
    assert_eq!(metric("walcast_cdc_rls_current_row_total"), 5.0);
    assert_eq!(metric("walcast_cdc_rls_superseded_total"), 1.0);
}
