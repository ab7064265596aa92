//! The management API end to end: a cdc-worker and two ws-fronts over NATS, the API on
//! one front, its effects on the other (within about a second): create / get / list /
//! update / delete, private-only, suspend, secret rotation, and the attacks (no key, a
//! wrong key, a project's keys, ids with SQL or path tricks, one project's operations
//! touching another). Also `walcast project …`, the same code on the command line.

use std::time::{Duration, Instant};

use crate::support::projects::{binding, keys, set, sign, walcast, VIEW_FIELDS};
use crate::support::ws;
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

pub(crate) const STARTUP: Duration = Duration::from_secs(60);
pub(crate) const OPERATOR: &str = "operator-key-for-the-e2e-tests-0123456789abcdef";
/// Within this a change made on one front is applied on the other.
pub(crate) const APPLIED: Duration = Duration::from_secs(3);

/// A management request with `auth` as the Authorization header: (status, JSON body).
pub(crate) fn api(
    w: &Worker,
    method: &str,
    path: &str,
    auth: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let header = auth.map(|a| format!("Bearer {a}"));
    let headers: Vec<(&str, &str)> = header
        .as_deref()
        .map(|h| ("Authorization", h))
        .into_iter()
        .collect();
    let (status, text) = w.request(method, path, &headers, body);
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

pub(crate) fn op(w: &Worker, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    api(w, method, path, Some(OPERATOR), body)
}

pub(crate) const PROJECTS: &str = "/management/v1/projects";

pub(crate) fn path(id: &str) -> String {
    format!("{PROJECTS}/{id}")
}

/// A project created through the API: (id, schema, secret, anon key).
pub(crate) struct Created {
    pub id: String,
    pub schema: String,
    pub secret: String,
    pub anon: String,
}

pub(crate) fn create(w: &Worker, name: &str) -> Created {
    let (status, v) = op(
        w,
        "POST",
        PROJECTS,
        Some(&json!({"name": name}).to_string()),
    );
    assert_eq!(status, 201, "{v}");
    let mut fields = set(VIEW_FIELDS);
    fields.extend(set(&["jwt_secret", "anon_key", "service_role_key"]));
    assert_eq!(keys(&v), fields, "{v}");
    assert_eq!(v["name"], name);
    let s = |k: &str| v[k].as_str().unwrap().to_string();
    Created {
        id: s("id"),
        schema: s("schema"),
        secret: s("jwt_secret"),
        anon: s("anon_key"),
    }
}

/// The HTTP status a WebSocket handshake with `key` gets (101: accepted).
pub(crate) async fn ws_status(w: &Worker, key: &str) -> u16 {
    use tokio_tungstenite::tungstenite::Error;
    match tokio::time::timeout(ws::TIMEOUT, tokio_tungstenite::connect_async(w.ws_url(key))).await {
        Ok(Ok(_)) => 101,
        Ok(Err(Error::Http(resp))) => resp.status().as_u16(),
        Ok(Err(e)) => panic!("handshake: {e}"),
        Err(_) => panic!("handshake: no answer"),
    }
}

/// Wait until the handshake with `key` gets `want`.
async fn wait_ws_status(w: &Worker, key: &str, want: u16, what: &str) {
    let deadline = Instant::now() + APPLIED;
    loop {
        let got = ws_status(w, key).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: handshake {got}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The socket gets a `system` error with `message` on `topic`, then is closed.
pub(crate) async fn assert_ended(sock: &mut PhoenixClient, topic: &str, message: &str) {
    let mut system = None;
    loop {
        match sock.try_recv(APPLIED).await {
            Some(Msg::Frame(f)) if f[3] == "system" && f[2] == topic => system = Some(f),
            Some(Msg::Frame(_)) => {}
            Some(Msg::Close(..)) | Some(Msg::Ended(_)) => break,
            Some(Msg::Binary(_)) => {}
            None => panic!("{topic}: the socket was not ended within {APPLIED:?}"),
        }
    }
    let f = system.unwrap_or_else(|| panic!("{topic}: closed without a system message"));
    assert_eq!(f[4]["status"], "error", "{f}");
    assert_eq!(f[4]["extension"], "system", "{f}");
    assert_eq!(f[4]["message"], message, "{f}");
}

/// A table `items` in the project's schema, realtime on (through the CLI).
pub(crate) fn items(stack: &Stack, p: &Created) {
    stack.sql(&format!(
        "CREATE TABLE \"{s}\".items (id int PRIMARY KEY, v text);
         GRANT SELECT ON \"{s}\".items TO anon, authenticated, service_role;",
        s = p.schema
    ));
    let out = walcast(
        stack,
        &[
            "realtime",
            "--project",
            &p.id,
            "enable",
            &format!("{}.items", p.schema),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub(crate) async fn subscribed(w: &Worker, p: &Created, topic: &str) -> PhoenixClient {
    let mut s = PhoenixClient::connect(&w.ws_url(&p.anon)).await;
    s.join_subscribed(topic, binding(&p.schema, "items")).await;
    s
}

/// The change of the row `id` reaches `sock`.
pub(crate) async fn gets_insert(stack: &Stack, p: &Created, sock: &mut PhoenixClient, id: i32) {
    stack.sql(&format!(
        "INSERT INTO \"{}\".items VALUES ({id}, 'x')",
        p.schema
    ));
    let f = sock
        .wait_frame("postgres_changes", APPLIED * 3, |d| {
            d["data"]["record"]["id"] == id
        })
        .await;
    assert_eq!(f[4]["data"]["schema"], p.schema.as_str(), "{f}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_management_api_refuses_anyone_but_the_operator() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    front.wait_http(STARTUP);
    let mut plain = Worker::front(&stack.nats.url(), &[]);
    plain.wait_http(STARTUP);
    let a = create(&front, "A");
    let service = sign(
        &a.secret,
        json!({"role": "service_role", "ref": a.id, "exp": ws::now() + 60}),
    );
    let default_service = ws::token(json!({"role": "service_role", "exp": ws::now() + 60}));
    let wrong = "x".repeat(OPERATOR.len());
    for (auth, want, what) in [
        (None, 401, "no key"),
        (Some(wrong.as_str()), 401, "a wrong key"),
        (
            Some(&OPERATOR[..OPERATOR.len() - 1]),
            401,
            "a prefix of the key",
        ),
        (
            Some(service.as_str()),
            403,
            "the project's service_role key",
        ),
        (Some(a.anon.as_str()), 403, "the project's anon key"),
        (
            Some(default_service.as_str()),
            403,
            "the default project's service_role key",
        ),
    ] {
        for (method, p) in [
            ("GET", PROJECTS.to_string()),
            ("GET", path(&a.id)),
            ("DELETE", path(&a.id)),
        ] {
            let (status, v) = api(&front, method, &p, auth, None);
            assert_eq!(status, want, "{what}: {method} {p}: {v}");
            assert!(
                !v.to_string().contains(&a.secret),
                "{what}: the secret leaked"
            );
        }
    }
    // The key in the apikey header (a project key's place) is not looked at.
    let (status, _) = front.request("GET", PROJECTS, &[("apikey", OPERATOR)], None);
    assert_eq!(status, 401);
    // Ids with SQL or path tricks: refused before anything is asked.
    for bad in [
        "x'%20OR%20'1'='1",
        "..%2Fdefault",
        "default",
        "a%3BDROP%20TABLE%20x",
        &"a".repeat(65),
    ] {
        let (status, v) = op(&front, "GET", &path(bad), None);
        assert_eq!(status, 400, "{bad}: {v}");
        assert_eq!(v["error"], "invalid_id", "{v}");
    }
    let (status, v) = op(
        &front,
        "PATCH",
        &path("0b7c6f0e-1c1a-4a53-9a1e-3f0a1f5d2c11"),
        Some(r#"{"name":"x"}"#),
    );
    assert_eq!(
        (status, v["error"].clone()),
        (404, json!("unknown_project")),
        "{v}"
    );
    for body in [
        "not json",
        "[1]",
        r#"{"name": 1}"#,
        r#"{"suspend": true}"#,
        r#"{"name": "  "}"#,
        r#"{"name": "a\u0000b"}"#,
        r#"{"name": "a\nb"}"#,
    ] {
        let (status, v) = op(&front, "PATCH", &path(&a.id), Some(body));
        assert_eq!(
            (status, v["error"].clone()),
            (422, json!("invalid_body")),
            "{body}: {v}"
        );
    }
    // Still there, unchanged; no secret in get or list.
    let (status, v) = op(&front, "GET", &path(&a.id), None);
    assert_eq!((status, v["name"].clone()), (200, json!("A")), "{v}");
    assert_eq!(keys(&v), set(VIEW_FIELDS), "{v}");
    let (_, list) = op(&front, "GET", PROJECTS, None);
    assert_eq!(list.as_array().map(Vec::len), Some(1), "{list}");
    assert!(
        !list.to_string().contains(&a.secret),
        "a secret in the list"
    );
    // Without MANAGEMENT_API_KEY the API is not served at all.
    let (status, _) = api(&plain, "GET", PROJECTS, Some(OPERATOR), None);
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn project_changes_reach_every_front_and_touch_no_other_project() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut api_front = Worker::front(&stack.nats.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    api_front.wait_http(STARTUP);
    let mut other = Worker::front(&stack.nats.url(), &[]);
    other.wait_http(STARTUP);
    let a = create(&api_front, "A");
    let b = create(&api_front, "B");
    items(&stack, &a);
    items(&stack, &b);
    let mut sb = subscribed(&other, &b, "realtime:b").await;

    // Rename.
    let (status, v) = op(&api_front, "PATCH", &path(&a.id), Some(r#"{"name": "A2"}"#));
    assert_eq!((status, v["name"].clone()), (200, json!("A2")), "{v}");

    // Private-only: A's public channel on the other front is ended, a new public join
    // refused with Supabase's error; B goes on.
    let mut sa = subscribed(&other, &a, "realtime:a").await;
    let (status, v) = op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"private_only": true}"#),
    );
    assert_eq!(
        (status, v["private_only"].clone()),
        (200, json!(true)),
        "{v}"
    );
    let private_only = "PrivateOnly: This project only allows private channels";
    assert_ended(&mut sa, "realtime:a", private_only).await;
    let mut sa = PhoenixClient::connect(&other.ws_url(&a.anon)).await;
    let (_, reply) = sa.join("realtime:a", json!({}), None).await;
    assert_eq!(reply[4]["status"], "error", "{reply}");
    assert_eq!(reply[4]["response"]["reason"], private_only, "{reply}");
    op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"private_only": false}"#),
    );
    let deadline = Instant::now() + APPLIED;
    loop {
        let (_, reply) = sa.join("realtime:a", json!({}), None).await;
        if reply[4]["status"] == "ok" {
            break;
        }
        assert!(Instant::now() < deadline, "still private-only: {reply}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Suspended: A's sockets ended, new ones refused (403) on both fronts; resumed.
    let mut sa = subscribed(&other, &a, "realtime:a").await;
    let (status, v) = op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"suspended": true}"#),
    );
    assert_eq!((status, v["suspended"].clone()), (200, json!(true)), "{v}");
    let suspended = "RealtimeDisabledForTenant: Realtime disabled for this tenant";
    assert_ended(&mut sa, "realtime:a", suspended).await;
    assert_eq!(ws_status(&api_front, &a.anon).await, 403);
    wait_ws_status(&other, &a.anon, 403, "suspended").await;
    op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"suspended": false}"#),
    );
    wait_ws_status(&other, &a.anon, 101, "resumed").await;

    // Rotation: the old secret's keys accepted until the window ends, then refused.
    let (status, v) = op(
        &api_front,
        "POST",
        &format!("{}/rotate", path(&a.id)),
        Some(r#"{"previous_valid_secs": 3}"#),
    );
    assert_eq!(status, 200, "{v}");
    let new_secret = v["jwt_secret"].as_str().unwrap().to_string();
    assert_ne!(new_secret, a.secret);
    let new_anon = v["anon_key"].as_str().unwrap().to_string();
    let rotated_at = Instant::now();
    wait_ws_status(&other, &new_anon, 101, "the new key").await;
    assert_eq!(
        ws_status(&other, &a.anon).await,
        101,
        "the old key within the window"
    );
    tokio::time::sleep(Duration::from_secs(4).saturating_sub(rotated_at.elapsed())).await;
    assert_eq!(
        ws_status(&other, &a.anon).await,
        401,
        "the old key after the window"
    );
    assert_eq!(ws_status(&other, &new_anon).await, 101);
    let (_, v) = op(&api_front, "GET", &path(&a.id), None);
    assert!(v.get("jwt_secret").is_none(), "{v}");

    // Deleted: its sockets told and closed, its keys refused, its table no longer
    // streamed (realtime off); B untouched.
    let a = Created {
        anon: new_anon,
        secret: new_secret,
        ..a
    };
    let mut sa = subscribed(&other, &a, "realtime:a").await;
    let (status, v) = op(&api_front, "DELETE", &path(&a.id), None);
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["tables"],
        json!([{"schema": a.schema, "table": "items"}]),
        "{v}"
    );
    assert_ended(
        &mut sa,
        "realtime:a",
        "TenantNotFound: this project was deleted",
    )
    .await;
    wait_ws_status(&other, &a.anon, 401, "a deleted project's key").await;
    assert_eq!(ws_status(&api_front, &a.anon).await, 401);
    let n = stack.sql(&format!(
        "SELECT count(*) FROM walcast.realtime_tables WHERE project_id = '{}'",
        a.id
    ));
    assert_eq!(n.trim(), "0", "A's tables still streamed");
    let (status, _) = op(&api_front, "GET", &path(&a.id), None);
    assert_eq!(status, 404);
    let (status, v) = op(&api_front, "GET", &path(&b.id), None);
    assert_eq!(
        (status, v["name"].clone(), v["suspended"].clone()),
        (200, json!("B"), json!(false)),
        "{v}"
    );
    // On NATS: a row of A's table, written before one of B's, is not published.
    let tap = crate::support::Collector::start(&stack.nats.url()).await;
    stack.sql(&format!(
        "INSERT INTO \"{}\".items VALUES (100, 'after delete')",
        a.schema
    ));
    gets_insert(&stack, &b, &mut sb, 1).await;
    tap.wait_until("B's row on NATS", APPLIED * 3, |e| {
        e.iter().any(|e| e.schema == b.schema)
    })
    .await;
    assert!(
        tap.snapshot().iter().all(|e| e.schema != a.schema),
        "A's table is still streamed after its delete"
    );
    assert_eq!(ws_status(&other, &b.anon).await, 101);
    let _ = a.secret;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_runs_the_same_operations() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let run = |args: &[&str]| -> Value {
        let out = walcast(&stack, args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("JSON")
    };
    let p = run(&["project", "create", "--name", "C", "--private-only"]);
    let id = p["id"].as_str().unwrap().to_string();
    assert_eq!(p["private_only"], true, "{p}");
    let v = run(&[
        "project",
        "update",
        &id,
        "--suspended",
        "true",
        "--name",
        "C2",
    ]);
    assert_eq!(
        (v["suspended"].clone(), v["name"].clone()),
        (json!(true), json!("C2")),
        "{v}"
    );
    assert!(v.get("jwt_secret").is_none(), "{v}");
    let v = run(&["project", "update", &id, "--max-concurrent-users", "5"]);
    assert_eq!(v["max_concurrent_users"], 5, "{v}");
    assert_eq!(v["effective_max_concurrent_users"], 5, "{v}");
    let v = run(&["project", "update", &id, "--suspended", "true"]);
    assert_eq!(
        v["max_concurrent_users"], 5,
        "unchanged when not given: {v}"
    );
    let v = run(&[
        "project",
        "--project-max-users",
        "7",
        "update",
        &id,
        "--max-concurrent-users",
        "default",
    ]);
    assert_eq!(v["max_concurrent_users"], Value::Null, "{v}");
    assert_eq!(v["effective_max_concurrent_users"], 7, "{v}");
    for bad in ["-1", "2147483648", "lots"] {
        let out = walcast(
            &stack,
            &["project", "update", &id, "--max-concurrent-users", bad],
        );
        assert!(!out.status.success(), "{bad} accepted");
    }
    let r = run(&["project", "rotate", &id, "--window-secs", "60"]);
    assert_ne!(r["jwt_secret"], p["jwt_secret"], "{r}");
    assert_eq!(r["previous_secret"], true, "{r}");
    let until = r["previous_secret_valid_until_ms"].as_i64().unwrap();
    let in_a_minute = (ws::now() + 60) * 1000;
    assert!((until - in_a_minute).abs() < 10_000, "{r}");
    let g = run(&["project", "get", &id]);
    assert_eq!(keys(&g), set(VIEW_FIELDS), "{g}");
    let d = run(&["project", "delete", &id]);
    assert_eq!(d["deleted"], true, "{d}");
    let out = walcast(&stack, &["project", "get", &id]);
    assert!(!out.status.success(), "a deleted project was found");
    let out = walcast(&stack, &["project", "get", "x' OR '1'='1"]);
    assert!(!out.status.success(), "a trick id was found");
}
