//! Projects end to end: `walcast project create|list`, the REST API that enables realtime
//! per table (every error code), and tenant isolation between two projects of one
//! database, over the in-process bus (`walcast serve`) and over NATS (cdc-worker +
//! ws-front, the front knowing no project but through the worker).

use std::collections::BTreeSet;
use std::time::Duration;

use crate::support::projects::{
    binding, call, create_project, keys, next_change, realtime_path, refused, set, sign, walcast,
    Project, VIEW_FIELDS,
};
use crate::support::ws;
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_testkit::phoenix::{pg_config, PhoenixClient};

const STARTUP: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_creates_and_lists_projects() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let a = create_project(&stack, "Project A");
    let b = create_project(&stack, "Project B");
    assert_ne!(a.id, b.id);
    assert_ne!(a.secret, b.secret);
    // Each key verifies with its own project's secret only.
    let mut v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
    v.required_spec_claims.clear();
    let wrong = jsonwebtoken::decode::<Value>(
        &a.service,
        &jsonwebtoken::DecodingKey::from_secret(b.secret.as_bytes()).expect("jwt secret"),
        &v,
    );
    assert!(wrong.is_err(), "A's key verified with B's secret");

    // The schemas exist, usable by the API roles; the secrets are readable by no one but us.
    let db = stack.pg.connect().await.expect("connect");
    for role in ["anon", "authenticated", "service_role"] {
        for p in [&a, &b] {
            let row = db
                .query_one(
                    "SELECT has_schema_privilege($1::text, $2::text, 'USAGE')",
                    &[&role, &p.schema],
                )
                .await
                .expect("schema privilege");
            assert!(row.get::<_, bool>(0), "{role} cannot use {}", p.schema);
        }
        let row = db
            .query_one(
                "SELECT has_table_privilege($1::text, 'walcast.projects', 'SELECT')",
                &[&role],
            )
            .await
            .expect("table privilege");
        assert!(!row.get::<_, bool>(0), "{role} can read walcast.projects");
    }

    let out = walcast(&stack, &["project", "list"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let list: Value = serde_json::from_str(&text).expect("project list prints JSON");
    let list = list.as_array().expect("an array");
    assert_eq!(list.len(), 2, "{text}");
    for (item, p, name) in [(&list[0], &a, "Project A"), (&list[1], &b, "Project B")] {
        assert_eq!(keys(item), set(VIEW_FIELDS), "{item}");
        assert_eq!(item["id"], p.id.as_str());
        assert_eq!(item["name"], name);
        assert_eq!(item["schema"], p.schema.as_str());
        assert!(
            item["created_at"].as_str().unwrap().ends_with('Z'),
            "{item}"
        );
    }
    for secret in [&a.secret, &b.secret] {
        assert!(!text.contains(secret.as_str()), "a secret in project list");
    }

    let out = walcast(&stack, &["project", "create", "--name", "  "]);
    assert!(!out.status.success(), "an empty name was accepted");
    let list: Value = serde_json::from_slice(&walcast(&stack, &["project", "list"]).stdout)
        .expect("project list prints JSON");
    assert_eq!(list.as_array().map(Vec::len), Some(2), "{list}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_api_toggles_realtime_with_service_keys_and_refuses_everything_else() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut w = Worker::serve(&stack.pg.url(), &[("CDC_SOURCE", "stream")]);
    w.wait_active(STARTUP);
    // Created while the server runs: it learns them on their first key.
    let a = create_project(&stack, "A");
    let b = create_project(&stack, "B");
    let q = |s: &str| format!("\"{s}\"");
    stack.sql(&format!(
        "CREATE TABLE {s}.items (id int PRIMARY KEY, v text);
         CREATE TABLE {s}.other (id int PRIMARY KEY, v text);
         CREATE TABLE {s}.nopk (v text);
         CREATE TABLE {s}.parted (id int, day date, PRIMARY KEY (id, day)) PARTITION BY RANGE (day);
         CREATE TABLE {s}.parted_2026 PARTITION OF {s}.parted FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
         GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO anon, authenticated, service_role;",
        s = q(&a.schema)
    ));
    let tables = format!("/v1/db/{}/realtime/tables", a.id);
    let items = realtime_path(&a.id, "items");
    let svc = Some(a.service.as_str());

    assert_eq!(call(&w, "GET", &tables, svc, None), (200, json!([])));
    let on = Some(r#"{"enabled": true}"#);
    assert_eq!(
        call(&w, "PUT", &items, svc, on),
        (
            200,
            json!({"schema": a.schema, "table": "items", "enabled": true, "changed": true})
        )
    );
    // Idempotent, and the key may come as a bearer token.
    let bearer = format!("Bearer {}", a.service);
    let (status, text) = w.request("PUT", &items, &[("Authorization", &bearer)], on);
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["changed"],
        false
    );
    let other = realtime_path(&a.id, "other");
    assert_eq!(call(&w, "PUT", &other, svc, on).0, 200);
    assert_eq!(
        call(&w, "GET", &tables, svc, None),
        (
            200,
            json!([{"schema": a.schema, "table": "items"}, {"schema": a.schema, "table": "other"}])
        )
    );
    assert_eq!(
        call(&w, "GET", &items, svc, None),
        (
            200,
            json!({"schema": a.schema, "table": "items", "enabled": true})
        )
    );

    // A subscriber of A gets the newly enabled table's changes: no restart.
    let mut sub = PhoenixClient::connect(&w.ws_url(&a.anon)).await;
    sub.join_subscribed("realtime:items", binding(&a.schema, "items"))
        .await;
    sub.join_subscribed("realtime:other", binding(&a.schema, "other"))
        .await;
    stack.sql(&format!(
        "INSERT INTO {}.items VALUES (1, 'one')",
        q(&a.schema)
    ));
    let data = next_change(&mut sub).await;
    assert_eq!(data["schema"], a.schema.as_str(), "{data}");
    assert_eq!(data["table"], "items", "{data}");
    assert_eq!(data["type"], "INSERT", "{data}");
    assert_eq!(data["record"], json!({"id": 1, "v": "one"}), "{data}");

    // Disabled: its next insert is not sent; `other`, written after it, arrives first.
    assert_eq!(
        call(&w, "DELETE", &items, svc, None),
        (
            200,
            json!({"schema": a.schema, "table": "items", "enabled": false, "changed": true})
        )
    );
    stack.sql(&format!(
        "INSERT INTO {}.items VALUES (2, 'two')",
        q(&a.schema)
    ));
    stack.sql(&format!(
        "INSERT INTO {}.other VALUES (1, 'barrier')",
        q(&a.schema)
    ));
    let data = next_change(&mut sub).await;
    assert_eq!(
        (data["table"].as_str(), &data["record"]["v"]),
        (Some("other"), &json!("barrier")),
        "{data}"
    );
    assert_eq!(
        call(&w, "GET", &tables, svc, None),
        (200, json!([{"schema": a.schema, "table": "other"}]))
    );

    // Every refusal, each with its code.
    let exp = ws::now() + 3600;
    let claims = json!({"role": "service_role", "ref": a.id, "exp": exp});
    refused(
        call(&w, "PUT", &items, None, on),
        401,
        "unauthorized",
        "no key",
    );
    refused(
        call(
            &w,
            "PUT",
            &items,
            Some(&sign("not-the-secret", claims.clone())),
            on,
        ),
        401,
        "unauthorized",
        "bad signature",
    );
    let expired = sign(
        &a.secret,
        json!({"role": "service_role", "ref": a.id, "exp": ws::now() - 10}),
    );
    let m = refused(
        call(&w, "PUT", &items, Some(&expired), on),
        401,
        "unauthorized",
        "expired",
    );
    assert!(m.contains("expired"), "{m}");
    refused(
        call(&w, "PUT", &items, Some(&a.anon), on),
        403,
        "forbidden",
        "anon key",
    );
    refused(
        call(&w, "GET", &tables, Some(&a.anon), None),
        403,
        "forbidden",
        "anon key",
    );
    let m = refused(
        call(&w, "PUT", &items, Some(&b.service), on),
        403,
        "forbidden",
        "B's service key on A",
    );
    assert!(m.contains(&b.id), "{m}");
    let default_service = ws::token(json!({"role": "service_role", "exp": exp}));
    refused(
        call(&w, "DELETE", &other, Some(&default_service), None),
        403,
        "forbidden",
        "the default project's service key on A",
    );
    refused(
        call(
            &w,
            "PUT",
            &realtime_path("no-such-project", "items"),
            Some(&default_service),
            on,
        ),
        404,
        "unknown_project",
        "unknown project",
    );
    refused(
        call(
            &w,
            "GET",
            "/v1/db/no-such-project/realtime/tables",
            Some(&default_service),
            None,
        ),
        404,
        "unknown_project",
        "unknown project (list)",
    );
    let missing = realtime_path(&a.id, "missing");
    refused(
        call(&w, "PUT", &missing, svc, on),
        404,
        "unknown_table",
        "unknown table",
    );
    refused(
        call(&w, "PUT", &realtime_path(&a.id, "x%00y"), svc, on),
        404,
        "unknown_table",
        "a NUL in the name",
    );
    refused(
        call(&w, "DELETE", &missing, svc, None),
        404,
        "unknown_table",
        "unknown table",
    );
    // B has no `items`: A's table is out of B's reach.
    refused(
        call(
            &w,
            "PUT",
            &realtime_path(&b.id, "items"),
            Some(&b.service),
            on,
        ),
        404,
        "unknown_table",
        "A's table through B",
    );
    let m = refused(
        call(&w, "PUT", &realtime_path(&a.id, "nopk"), svc, on),
        422,
        "no_primary_key",
        "no primary key",
    );
    assert!(m.contains("primary key"), "{m}");
    // wal2json names a partitioned table's changes by partition: accepted, it would never
    // stream; refused with the reason instead.
    let m = refused(
        call(&w, "PUT", &realtime_path(&a.id, "parted"), svc, on),
        422,
        "partitioned_table",
        "a partitioned table",
    );
    assert!(m.contains("partitions"), "{m}");
    for body in [
        "not json",
        r#"{"enabled": "yes"}"#,
        r#"{"enabled": 1}"#,
        "{}",
        "[true]",
    ] {
        refused(
            call(&w, "PUT", &items, svc, Some(body)),
            422,
            "invalid_body",
            body,
        );
    }
    refused(
        call(&w, "PUT", &items, svc, None),
        422,
        "invalid_body",
        "no body",
    );

    // None of that changed anything.
    assert_eq!(
        call(&w, "GET", &tables, svc, None),
        (200, json!([{"schema": a.schema, "table": "other"}]))
    );
    assert_eq!(
        call(
            &w,
            "GET",
            &format!("/v1/db/{}/realtime/tables", b.id),
            Some(&b.service),
            None
        ),
        (200, json!([]))
    );
    // The health API is scoped to the caller: another project sees up or down, not
    // the deployment's numbers nor the pipeline's last error.
    let (status, health) = call(&w, "GET", "/inspector/api/health", Some(&b.service), None);
    assert_eq!(status, 200, "{health}");
    for p in health["processes"].as_array().expect("processes") {
        if let Some(worker) = p.get("worker") {
            assert_eq!(worker["changes_total"], 0, "{p}");
            assert_eq!(worker["lag_bytes"], 0, "{p}");
        }
        if let Some(front) = p.get("front") {
            assert_eq!(front["connections"], 0, "{p}");
        }
    }
    let metrics = w.get("/metrics").unwrap_or_default();
    for (status, error) in [
        ("401", "unauthorized"),
        ("403", "forbidden"),
        ("404", "unknown_project"),
        ("404", "unknown_table"),
        ("422", "no_primary_key"),
        ("422", "partitioned_table"),
        ("422", "invalid_body"),
    ] {
        let counted = metrics.lines().any(|l| {
            l.starts_with("walcast_front_admin_api_errors_total{")
                && l.contains(&format!("status=\"{status}\""))
                && l.contains(&format!("error=\"{error}\""))
        });
        assert!(counted, "{status} {error} not counted:\n{metrics}");
    }
}

/// A WebSocket handshake refused with HTTP 401.
async fn assert_ws_refused(w: &Worker, key: &str, what: &str) {
    use tokio_tungstenite::tungstenite::Error;
    match tokio::time::timeout(ws::TIMEOUT, tokio_tungstenite::connect_async(w.ws_url(key))).await {
        Ok(Err(Error::Http(resp))) => assert_eq!(resp.status().as_u16(), 401, "{what}"),
        Ok(Err(e)) => panic!("{what}: expected HTTP 401, got {e}"),
        Ok(Ok(_)) => panic!("{what}: the WebSocket was accepted"),
        Err(_) => panic!("{what}: no answer within {:?}", ws::TIMEOUT),
    }
}

/// A join refused with the protocol's error reply, for schema `schema`.
async fn assert_join_refused(sock: &mut PhoenixClient, topic: &str, schema: &str) {
    let (_, reply) = sock
        .join(topic, pg_config(binding(schema, "messages")), None)
        .await;
    assert_eq!(reply[4]["status"], "error", "{reply}");
    let reason = reply[4]["response"]["reason"].as_str().unwrap_or_default();
    assert!(
        reason.starts_with(&format!(
            "Unauthorized: You do not have permissions to read from schema \"{schema}\""
        )),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projects_are_isolated_across_cdc_worker_and_ws_front() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let a = create_project(&stack, "A");
    let b = create_project(&stack, "B");
    for p in [&a, &b] {
        stack.sql(&format!(
            "CREATE TABLE \"{s}\".messages (id int PRIMARY KEY, body text);
             GRANT SELECT ON \"{s}\".messages TO anon, authenticated, service_role;",
            s = p.schema
        ));
        // Enabled through the front's REST API: over NATS to the worker.
        let (status, v) = call(
            &front,
            "PUT",
            &realtime_path(&p.id, "messages"),
            Some(&p.service),
            Some(r#"{"enabled": true}"#),
        );
        assert_eq!(status, 200, "{v}");
    }

    let mut sa = PhoenixClient::connect(&front.ws_url(&a.anon)).await;
    sa.join_subscribed("realtime:a", binding(&a.schema, "messages"))
        .await;
    sa.join_subscribed("realtime:any", binding("*", "messages"))
        .await;
    let mut sb = PhoenixClient::connect(&front.ws_url(&b.anon)).await;
    sb.join_subscribed("realtime:b", binding(&b.schema, "messages"))
        .await;

    // B's row is committed first: had A's socket any share of it, it would come first.
    let insert = |p: &Project, id: i32, body: &str| {
        stack.sql(&format!(
            "INSERT INTO \"{}\".messages VALUES ({id}, '{body}')",
            p.schema
        ))
    };
    insert(&b, 1, "b1");
    insert(&a, 1, "a1");
    let mut got_a = Vec::new();
    while got_a.len() < 2 {
        let f = sa.recv_frame().await;
        if f[3] == "postgres_changes" {
            got_a.push((f[2].clone(), f[4]["data"].clone()));
        }
    }
    for (topic, data) in &got_a {
        assert_eq!(data["schema"], a.schema.as_str(), "{topic}: {data}");
        assert_eq!(
            data["record"],
            json!({"id": 1, "body": "a1"}),
            "{topic}: {data}"
        );
    }
    let topics: BTreeSet<&str> = got_a.iter().filter_map(|(t, _)| t.as_str()).collect();
    assert_eq!(topics, BTreeSet::from(["realtime:a", "realtime:any"]));
    // B gets its own, then (barrier) its next one with nothing of A's in between; A
    // gets a2 and a3 on both channels with nothing of B's (b2) in between.
    let data = next_change(&mut sb).await;
    assert_eq!(data["record"], json!({"id": 1, "body": "b1"}), "{data}");
    insert(&a, 2, "a2");
    insert(&b, 2, "b2");
    insert(&a, 3, "a3");
    let data = next_change(&mut sb).await;
    assert_eq!(data["schema"], b.schema.as_str(), "{data}");
    assert_eq!(data["record"], json!({"id": 2, "body": "b2"}), "{data}");
    let mut got = Vec::new();
    while got.len() < 4 {
        got.push(next_change(&mut sa).await["record"]["body"].clone());
    }
    assert_eq!(got, [json!("a2"), json!("a2"), json!("a3"), json!("a3")]);

    // Another project's schema is refused at join, whoever asks.
    assert_join_refused(&mut sa, "realtime:steal", &b.schema).await;
    assert_join_refused(&mut sa, "realtime:public", "public").await;
    let mut sd = PhoenixClient::connect(&front.ws_url(&ws::anon())).await;
    assert_join_refused(&mut sd, "realtime:steal", &a.schema).await;
    // A's socket is still served, B's did not get A's rows.
    insert(&a, 4, "a4");
    insert(&b, 3, "b3");
    assert_eq!(next_change(&mut sa).await["record"]["body"], "a4");
    let data = next_change(&mut sb).await;
    assert_eq!(data["record"], json!({"id": 3, "body": "b3"}), "{data}");

    // The worker holds the line on its own: registered directly (no front), A's
    // subscription to B's table is refused, A's own accepted.
    let bus = walcast_bus::Bus::nats(&stack.nats.url(), "projects-test")
        .await
        .expect("connect NATS");
    let subs = walcast_bus::subs::SubsClient::new(&bus, None).expect("subs client");
    let spec = |id: &str, schema: &str| walcast_bus::subs::SubscriptionSpec {
        id: id.into(),
        front: "test".into(),
        project: a.id.clone(),
        schema: schema.into(),
        table: Some("messages".into()),
        event: "*".into(),
        filter: None,
        select: None,
        claims: json!({"role": "anon"}).into(),
        from: None,
    };
    let reply = subs
        .register(
            walcast_bus::source::DEFAULT_SOURCE,
            walcast_bus::subs::RegisterRequest {
                subs: vec![spec("steal", &b.schema), spec("own", &a.schema)],
            },
            ws::TIMEOUT,
        )
        .await
        .expect("registration answered");
    let verdicts: Vec<(&str, bool)> = reply
        .results
        .iter()
        .map(|r| (r.id.as_str(), r.ok))
        .collect();
    assert_eq!(
        verdicts,
        [("steal", false), ("own", true)],
        "{:?}",
        reply.results
    );

    // Keys naming an unknown project, or signed with another project's secret.
    let exp = ws::now() + 3600;
    let unknown = sign(
        &a.secret,
        json!({"role": "anon", "ref": "no-such-project", "exp": exp}),
    );
    assert_ws_refused(&front, &unknown, "unknown ref").await;
    let forged = sign(&b.secret, json!({"role": "anon", "ref": a.id, "exp": exp}));
    assert_ws_refused(&front, &forged, "A's ref signed with B's secret").await;
    let forged = sign(ws::SECRET, json!({"role": "anon", "ref": a.id, "exp": exp}));
    assert_ws_refused(&front, &forged, "A's ref signed with the default secret").await;
}
