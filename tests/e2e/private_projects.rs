//! Hostile tenants on private channels and database broadcasts: everything in
//! `realtime.messages` belongs to one project, so another
//! project's key gets none of it, replayed or live; a login role writes only for the
//! projects it is mapped to; tokens act only as allowed roles; `nbf` is honoured; a
//! short `JWT_SECRET` is refused at start; an oversized database broadcast is skipped
//! and the pipeline goes on.

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use walcast_testkit::phoenix::{Msg, PhoenixClient};

use crate::support::projects::{create_project, Project};
use crate::support::{ws, Stack, Worker};

const STARTUP: Duration = Duration::from_secs(60);
/// How long "nothing arrives" is watched.
const QUIET: Duration = Duration::from_millis(1500);

fn private_config(replay: bool) -> Value {
    let mut c = json!({"private": true, "broadcast": {"self": false}});
    if replay {
        c["broadcast"]["replay"] = json!({"since": 0, "limit": 25});
    }
    c
}

/// A socket URL of `w` speaking vsn 1.0.0 (broadcasts as text frames).
fn url(w: &Worker, key: &str) -> String {
    w.ws_url(key).replace("vsn=2.0.0", "vsn=1.0.0")
}

/// Join `topic` privately; the join must be accepted.
async fn join_private(sock: &mut PhoenixClient, topic: &str, replay: bool) {
    let (_, reply) = sock.join(topic, private_config(replay), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
}

/// The next broadcast's payload on `sock`, or `None` within `within`.
async fn next_broadcast(sock: &mut PhoenixClient, within: Duration) -> Option<Value> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match sock.try_recv(left).await {
            None | Some(Msg::Ended(_)) => return None,
            Some(Msg::Frame(f)) if f[3] == "broadcast" => return Some(f[4].clone()),
            Some(Msg::Frame(_)) => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }
}

/// `realtime.send` as `login` (a session authorisation: its `session_user`) for
/// `project`; returns psql's output (warnings included).
fn send_as(stack: &Stack, login: &str, project: &str, body: &str) -> String {
    stack.sql(&format!(
        "SET SESSION AUTHORIZATION {login}; SET walcast.project = '{project}';
         SELECT realtime.send('{{\"n\": \"{body}\"}}'::jsonb, 'msg', 'room', true);"
    ))
}

fn start(stack: &Stack) -> (Worker, Worker) {
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    (worker, front)
}

/// Policies that let every role read and write every topic: only the project keeps
/// one tenant's messages from another.
const OPEN_POLICIES: &str = "
    CREATE POLICY open_read ON realtime.messages FOR SELECT TO PUBLIC USING (true);
    CREATE POLICY open_write ON realtime.messages FOR INSERT TO PUBLIC WITH CHECK (true);
    CREATE ROLE alice LOGIN; CREATE ROLE mallory LOGIN;
    GRANT USAGE ON SCHEMA realtime TO alice, mallory;
    GRANT SELECT, INSERT ON realtime.messages TO alice, mallory;";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_channels_replay_and_database_broadcasts_are_scoped_by_project() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_worker, front) = start(&stack);
    let a = create_project(&stack, "A");
    let b = create_project(&stack, "B");
    stack.sql(OPEN_POLICIES);
    stack.sql(&format!(
        "INSERT INTO walcast.project_roles VALUES ('{}', 'alice')",
        a.id
    ));
    // A stored message of A's topic `room`, written in A's context.
    send_as(&stack, "alice", &a.id, "a-stored");

    // B's service_role key on the same topic, with replay: none of A's messages.
    let mut sb = PhoenixClient::connect(&url(&front, &b.service)).await;
    join_private(&mut sb, "realtime:room", true).await;
    assert_eq!(
        next_broadcast(&mut sb, QUIET).await,
        None,
        "B got A's replay"
    );
    // A's own client gets it replayed.
    let mut sa = PhoenixClient::connect(&url(&front, &a.service)).await;
    join_private(&mut sa, "realtime:room", true).await;
    let got = next_broadcast(&mut sa, ws::TIMEOUT)
        .await
        .expect("A's replay");
    assert_eq!(got["payload"]["n"], "a-stored", "{got}");
    assert_eq!(got["meta"]["replayed"], true, "{got}");

    // Live: a send in A's context reaches A's channel, not B's of the same topic.
    send_as(&stack, "alice", &a.id, "a-live");
    let got = next_broadcast(&mut sa, ws::TIMEOUT)
        .await
        .expect("A's send");
    assert_eq!(got["payload"]["n"], "a-live", "{got}");
    assert_eq!(next_broadcast(&mut sb, QUIET).await, None, "B got A's send");
    // And B's own send reaches B only.
    send_as(&stack, "postgres", &b.id, "b-live");
    let got = next_broadcast(&mut sb, ws::TIMEOUT)
        .await
        .expect("B's send");
    assert_eq!(got["payload"]["n"], "b-live", "{got}");

    refused_writes(&stack, &a).await;
    assert_eq!(
        next_broadcast(&mut sa, QUIET).await,
        None,
        "a refused write arrived"
    );
    // The default project's send (mallory may act for it) stays the default project's.
    send_as(&stack, "mallory", "default", "d-live");
    assert_eq!(
        next_broadcast(&mut sa, QUIET).await,
        None,
        "A got the default's send"
    );
    let mut sd = PhoenixClient::connect(&url(&front, &ws::anon())).await;
    let (_, reply) = sd
        .join("realtime:room", json!({"private": false}), None)
        .await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    stack.sql("SELECT realtime.send('{\"n\": \"d-public\"}', 'msg', 'room', false)");
    let got = next_broadcast(&mut sd, ws::TIMEOUT)
        .await
        .expect("default send");
    assert_eq!(got["payload"]["n"], "d-public", "{got}");
}

/// mallory is not mapped to A: it can write nothing for A, however it asks.
async fn refused_writes(stack: &Stack, a: &Project) {
    let out = send_as(stack, "mallory", &a.id, "m-send");
    assert!(out.contains("may not act for project"), "{out}");
    let insert = |set: &str, project: &str| {
        stack.pg.psql(&format!(
            "SET SESSION AUTHORIZATION mallory; {set}
             INSERT INTO realtime.messages (topic, extension, payload, event, private{c})
             VALUES ('room', 'broadcast', '{{\"n\": \"m-insert\"}}', 'msg', true{v})",
            c = if project.is_empty() { "" } else { ", project" },
            v = if project.is_empty() {
                String::new()
            } else {
                format!(", '{project}'")
            },
        ))
    };
    let asked = format!("SET walcast.project = '{}';", a.id);
    for (set, project) in [(asked.as_str(), ""), ("", a.id.as_str())] {
        let e = insert(set, project).expect_err("mallory wrote for A");
        assert!(e.to_string().contains("walcast:"), "{e}");
    }
    let rows = stack.sql(&format!(
        "SELECT count(*) FROM realtime.messages WHERE project = '{}' AND payload->>'n' LIKE 'm-%'",
        a.id
    ));
    assert_eq!(rows.trim(), "0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_act_only_as_allowed_roles_and_nbf_is_honoured() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    stack.sql(OPEN_POLICIES);
    // A role that borrows walcast's own (the test kit's superuser) through membership.
    stack.sql("CREATE ROLE insider; GRANT postgres TO insider;");
    // The front lets `postgres` and `insider` through: the worker must refuse them.
    let listed = "anon,authenticated,service_role,postgres,insider";
    let mut lax = Worker::front(&stack.nats.url(), &[("ALLOWED_ROLES", listed)]);
    lax.wait_http(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &[]);
    front.wait_http(STARTUP);
    let exp = ws::now() + 3600;
    let as_role = |role: &str| ws::token(json!({"role": role, "exp": exp}));

    for role in ["none", "postgres", "insider"] {
        let status = ws_status(&front, &as_role(role)).await;
        assert_eq!(status, Some(401), "connect as {role}");
        let mut s = PhoenixClient::connect(&url(&front, &ws::anon())).await;
        let (_, reply) = s.join("realtime:r", json!({}), Some(&as_role(role))).await;
        assert_eq!(reply[4]["status"], "error", "{role}: {reply}");
        let reason = reply[4]["response"]["reason"].as_str().unwrap_or_default();
        let want = format!("InvalidJWTToken: Invalid token: the role \"{role}\" is not allowed");
        assert_eq!(reason, want, "{reply}");
    }
    for role in ["postgres", "insider"] {
        let mut s = PhoenixClient::connect(&url(&lax, &as_role(role))).await;
        let (_, reply) = s.join("realtime:r", private_config(false), None).await;
        assert_eq!(reply[4]["status"], "error", "{role} at the worker: {reply}");
    }
    for role in ["anon", "authenticated", "service_role"] {
        let mut s = PhoenixClient::connect(&url(&front, &as_role(role))).await;
        join_private(&mut s, "realtime:r", false).await;
    }
    let later = ws::token(json!({"role": "anon", "exp": exp, "nbf": ws::now() + 600}));
    assert_eq!(ws_status(&front, &later).await, Some(401), "nbf ahead");
    let mut s = PhoenixClient::connect(&url(&front, &ws::anon())).await;
    let (_, reply) = s.join("realtime:r", json!({}), Some(&later)).await;
    let reason = reply[4]["response"]["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("not valid yet"), "{reply}");
    let now = ws::token(json!({"role": "anon", "exp": exp, "nbf": ws::now() - 5}));
    assert_eq!(ws_status(&front, &now).await, None, "nbf passed");
}

/// The HTTP status of a refused WebSocket handshake (`None`: accepted).
async fn ws_status(w: &Worker, key: &str) -> Option<u16> {
    use tokio_tungstenite::tungstenite::Error;
    match tokio::time::timeout(ws::TIMEOUT, tokio_tungstenite::connect_async(w.ws_url(key))).await {
        Ok(Err(Error::Http(resp))) => Some(resp.status().as_u16()),
        Ok(Err(e)) => panic!("handshake failed: {e}"),
        Ok(Ok(_)) => None,
        Err(_) => panic!("no answer within {:?}", ws::TIMEOUT),
    }
}

#[test]
fn a_short_jwt_secret_is_refused_at_start() {
    for (bin, args, extra) in [
        (
            env!("CARGO_BIN_EXE_walcast"),
            &["serve"][..],
            ("DATABASE_URL", "postgres://x@127.0.0.1:1/x"),
        ),
        (
            env!("CARGO_BIN_EXE_ws-front"),
            &[][..],
            ("NATS_URL", "nats://127.0.0.1:1"),
        ),
    ] {
        for secret in ["", "short-secret-0123456789abcdef01"] {
            let out = Command::new(bin)
                .args(args)
                .env_clear()
                .env(extra.0, extra.1)
                .env("JWT_SECRET", secret)
                .env("PORT", "0")
                .output()
                .expect("run");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{bin} started with {secret:?}");
            let want = format!(
                "JWT_SECRET is {} bytes long: it must be at least 32 bytes",
                secret.len()
            );
            assert!(err.contains(&want), "{bin}: {err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_database_broadcast_is_skipped_and_the_pipeline_goes_on() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (id int PRIMARY KEY, v text)");
    stack.enable("t");
    let (worker, front) = start(&stack);
    let mut s = PhoenixClient::connect(&url(&front, &ws::anon())).await;
    let config = json!({"private": false, "postgres_changes": [{"event": "*", "schema": "public", "table": "t"}]});
    let (_, reply) = s.join("realtime:room", config, None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");
    s.recv_event("system").await;

    stack.sql(
        "SELECT realtime.send(jsonb_build_object('big', repeat('x', 1100000)), 'msg', 'room', false);
         INSERT INTO t VALUES (1, 'after');
         SELECT realtime.send('{\"n\": \"small\"}', 'msg', 'room', false);",
    );
    let mut got = Vec::new();
    while got.len() < 2 {
        let f = s.recv_frame().await;
        match f[3].as_str() {
            Some("postgres_changes") => got.push(f[4]["data"]["record"]["v"].clone()),
            Some("broadcast") => got.push(f[4]["payload"]["n"].clone()),
            _ => {}
        }
    }
    // Row changes and broadcasts travel separate paths: no order between them.
    got.sort_by_key(|v| v.to_string());
    assert_eq!(got, [json!("after"), json!("small")]);
    let skipped = "walcast_cdc_changes_skipped_total{reason=\"payload_too_large\"}";
    assert_eq!(worker.metric(skipped), Some(1.0), "{}", worker.log_text());
    let health = worker.health().expect("health");
    assert_eq!(health["cdc_active"], true, "{health}");
    assert_eq!(
        health["last_skipped_change"]["table"], "realtime.messages",
        "{health}"
    );
}
