//! A project's own connected-users limit (`max_concurrent_users`) through the management
//! API: applied by every front (the API on one, the users on the other) to that project
//! only, lowered without ending anyone, reset to the default with `null`; bad values
//! refused (422), and no project key may set it.

use std::time::{Duration, Instant};

use crate::management::{api, create, op, path, Created, APPLIED, OPERATOR, PROJECTS, STARTUP};
use crate::support::projects::sign;
use crate::support::ws;
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;

/// A project's `max_users` as `w`'s inspector shows it to the project's `key`.
fn inspected_limit(w: &Worker, p: &Created, key: &str) -> Value {
    let auth = format!("Bearer {key}");
    let (status, text) = w.request(
        "GET",
        "/inspector/api/health",
        &[("Authorization", &auth)],
        None,
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    v["projects"][&p.id]["max_users"].clone()
}

/// Wait until `w` applies `want` as `p`'s limit.
async fn wait_limit(w: &Worker, p: &Created, want: u64) {
    let deadline = Instant::now() + APPLIED;
    loop {
        let got = inspected_limit(w, p, &p.anon);
        if got == want {
            return;
        }
        assert!(Instant::now() < deadline, "limit {got}, want {want}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A socket of `p` on `w` with one joined channel, or the join's refusal.
async fn user(w: &Worker, p: &Created) -> Result<PhoenixClient, String> {
    let mut s = PhoenixClient::connect(&w.ws_url(&p.anon)).await;
    let (_, reply) = s.join("realtime:room", json!({}), None).await;
    match reply[4]["status"].as_str() {
        Some("ok") => Ok(s),
        _ => Err(reply[4]["response"]["reason"].to_string()),
    }
}

/// `n` users of `p` on `w`, each admitted.
async fn users(w: &Worker, p: &Created, n: usize) -> Vec<PhoenixClient> {
    let mut v = Vec::new();
    for i in 0..n {
        match user(w, p).await {
            Ok(s) => v.push(s),
            Err(e) => panic!("user {i} of {} refused: {e}", p.id),
        }
    }
    v
}

async fn refused_user(w: &Worker, p: &Created) {
    match user(w, p).await {
        Ok(_) => panic!("{}: a user beyond the limit was admitted", p.id),
        Err(e) => assert!(
            e.contains("ConnectionRateLimitReached: Too many connected users"),
            "{e}"
        ),
    }
}

/// A worker and two fronts (the default limit 3), the management API on the first.
fn three(stack: &Stack) -> (Worker, Worker, Worker) {
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let env = [("MANAGEMENT_API_KEY", OPERATOR), ("PROJECT_MAX_USERS", "3")];
    let mut api_front = Worker::front(&stack.nats.url(), &env);
    api_front.wait_http(STARTUP);
    let mut other = Worker::front(&stack.nats.url(), &[("PROJECT_MAX_USERS", "3")]);
    other.wait_http(STARTUP);
    (worker, api_front, other)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_s_own_limit_holds_on_every_front_and_not_for_others() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_worker, api_front, other) = three(&stack);
    let a = create(&api_front, "A");
    let b = create(&api_front, "B");
    let (_, v) = op(&api_front, "GET", &path(&a.id), None);
    assert_eq!(v["max_concurrent_users"], Value::Null, "{v}");
    assert_eq!(v["effective_max_concurrent_users"], 3, "{v}");

    // A's own limit, 1: applied on the other front; B keeps the default, 3.
    let (status, v) = op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"max_concurrent_users": 1}"#),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["max_concurrent_users"], 1, "{v}");
    assert_eq!(v["effective_max_concurrent_users"], 1, "{v}");
    wait_limit(&other, &a, 1).await;
    assert_eq!(inspected_limit(&other, &b, &b.anon), 3);
    let a_users = users(&other, &a, 1).await;
    refused_user(&other, &a).await;
    let b_users = users(&other, &b, 3).await;
    refused_user(&other, &b).await;

    // A PATCH without the field leaves it; the list shows it.
    let (_, v) = op(&api_front, "PATCH", &path(&a.id), Some(r#"{"name": "A2"}"#));
    assert_eq!(v["max_concurrent_users"], 1, "{v}");
    let (_, list) = op(&api_front, "GET", PROJECTS, None);
    let limits: Vec<(Value, Value)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["max_concurrent_users"].clone(),
                p["effective_max_concurrent_users"].clone(),
            )
        })
        .collect();
    assert_eq!(
        limits,
        [(json!(1), json!(1)), (Value::Null, json!(3))],
        "{list}"
    );

    // Lowered to 0 under a connected user: the user stays, nobody new comes in.
    op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"max_concurrent_users": 0}"#),
    );
    wait_limit(&other, &a, 0).await;
    refused_user(&other, &a).await;
    let mut kept = a_users.into_iter().next().unwrap();
    // Still connected (a heartbeat answered), after the directory applied the change.
    kept.heartbeat_ok().await;

    // Back to the default (null): A takes 3 again.
    let (status, v) = op(
        &api_front,
        "PATCH",
        &path(&a.id),
        Some(r#"{"max_concurrent_users": null}"#),
    );
    assert_eq!(
        (status, v["max_concurrent_users"].clone()),
        (200, Value::Null),
        "{v}"
    );
    assert_eq!(v["effective_max_concurrent_users"], 3, "{v}");
    wait_limit(&other, &a, 3).await;
    let more = users(&other, &a, 2).await;
    refused_user(&other, &a).await;
    drop((kept, more, b_users));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_operator_sets_a_limit_and_only_a_valid_one() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let (_worker, api_front, _other) = three(&stack);
    let a = create(&api_front, "A");

    // Bad values: 422, nothing changed.
    for bad in ["-1", "1.5", "\"10\"", "2147483648", "true", "[]", "1e400"] {
        let body = format!(r#"{{"max_concurrent_users": {bad}}}"#);
        let (status, v) = op(&api_front, "PATCH", &path(&a.id), Some(&body));
        assert_eq!(
            (status, v["error"].clone()),
            (422, json!("invalid_body")),
            "{bad}: {v}"
        );
    }
    let (status, v) = op(
        &api_front,
        "POST",
        PROJECTS,
        Some(r#"{"name": "C", "max_concurrent_users": -5}"#),
    );
    assert_eq!(status, 422, "{v}");
    // A project's own keys cannot raise its limit; no key at all: 401.
    let service = sign(
        &a.secret,
        json!({"role": "service_role", "ref": a.id, "exp": ws::now() + 60}),
    );
    let body = Some(r#"{"max_concurrent_users": 1000000}"#);
    for (auth, want) in [
        (Some(service.as_str()), 403),
        (Some(a.anon.as_str()), 403),
        (None, 401),
    ] {
        let (status, v) = api(&api_front, "PATCH", &path(&a.id), auth, body);
        assert_eq!(status, want, "{v}");
    }
    let (_, v) = op(&api_front, "GET", &path(&a.id), None);
    assert_eq!(v["max_concurrent_users"], Value::Null, "{v}");
    let stored = stack.sql(&format!(
        "SELECT coalesce(max_concurrent_users::text, 'null') FROM walcast.projects WHERE id = '{}'",
        a.id
    ));
    assert_eq!(stored.trim(), "null");
    // Created with a limit.
    let (status, v) = op(
        &api_front,
        "POST",
        PROJECTS,
        Some(r#"{"name": "D", "max_concurrent_users": 2}"#),
    );
    assert_eq!(
        (status, v["max_concurrent_users"].clone()),
        (201, json!(2)),
        "{v}"
    );
}
