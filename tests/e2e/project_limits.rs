//! A project's own connected-users limit (`max_concurrent_users`) through the management
//! API: applied by every front (the API on one, the users on the other) to that project
//! only, lowered without ending anyone, reset to the default with `null`; bad values
//! refused (422), and no project key may set it. And every other limit of a project
//! (joins/s, channels per client, events/s, bytes/s, presence events/s, payload size):
//! stored, shown with the one in force, reset, through the API and the CLI.

use std::time::{Duration, Instant};

use crate::management::{api, create, op, path, Created, APPLIED, OPERATOR, PROJECTS, STARTUP};
use crate::support::projects::{sign, walcast};
use crate::support::ws;
use crate::support::{Stack, Worker};
use serde_json::{json, Value};
use walcast_bus::admin::{ProjectLimits, LIMITS};
use walcast_testkit::phoenix::PhoenixClient;

/// A project's `max_users` as `w`'s inspector shows it to the project's `key`.
fn inspected_limit(w: &Worker, p: &Created, key: &str) -> Value {
    inspected(w, p, key)["max_users"].clone()
}

/// A project as `w`'s inspector shows it to `key` (its users, limits, counters).
pub(crate) fn inspected(w: &Worker, p: &Created, key: &str) -> Value {
    let auth = format!("Bearer {key}");
    let (status, text) = w.request(
        "GET",
        "/inspector/api/health",
        &[("Authorization", &auth)],
        None,
    );
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).expect("JSON");
    v["projects"][&p.id].clone()
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

/// Every limit's column in `walcast.projects` for `id`: its value or `null`.
fn stored(stack: &Stack, id: &str) -> Vec<Value> {
    let cols: Vec<String> = ProjectLimits::FIELDS
        .iter()
        .map(|c| format!("coalesce({c}::text, 'null')"))
        .collect();
    let out = stack.sql(&format!(
        "SELECT {} FROM walcast.projects WHERE id = '{id}'",
        cols.join(" || ',' || ")
    ));
    out.trim()
        .split(',')
        .map(|v| serde_json::from_str(v).expect("a number or null"))
        .collect()
}

/// A view's limits and effective limits, in the order of [`ProjectLimits::FIELDS`].
fn shown(v: &Value) -> (Vec<Value>, Vec<Value>) {
    let own = ProjectLimits::FIELDS
        .iter()
        .map(|k| v[*k].clone())
        .collect();
    let effective = ProjectLimits::FIELDS
        .iter()
        .map(|k| v[format!("effective_{k}")].clone())
        .collect();
    (own, effective)
}

/// The defaults of a front started with `PROJECT_MAX_USERS=3` and
/// `MAX_CHANNELS_PER_SOCKET=5` (the others: the built-in ones).
fn defaults() -> Vec<Value> {
    [3, 1000, 5, 50_000, 50_000_000, 1000, 1024]
        .map(|n: u32| json!(n))
        .to_vec()
}

/// Each limit set alone through the management API: stored in its column, shown with
/// its effective value, the others untouched; `null` brings it back to the front's
/// default; bad values (422 naming the field) change nothing. Then the same through
/// `walcast project update` (`N`, then `default`), and every limit at creation by both.
/// The limits shown when only the `i`th is `n`: (own, effective).
fn only(i: usize, n: u32) -> (Vec<Value>, Vec<Value>) {
    let mut own = vec![Value::Null; LIMITS];
    own[i] = json!(n);
    let mut effective = defaults();
    effective[i] = json!(n);
    (own, effective)
}

/// `walcast project` with the front's defaults; its JSON output.
fn cli(stack: &Stack, args: &[&str]) -> Value {
    let mut all = vec![
        "project",
        "--project-max-users",
        "3",
        "--max-channels-per-socket",
        "5",
    ];
    all.extend(args);
    let out = walcast(stack, &all);
    assert!(
        out.status.success(),
        "{all:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON")
}

/// Each limit of `id` set alone through the API, checked, refused when bad (422 naming
/// it, nothing changed, on update and create), back to the default with `null`.
fn each_limit_through_the_api(stack: &Stack, front: &Worker, id: &str) {
    let nulls = vec![Value::Null; LIMITS];
    for (i, k) in ProjectLimits::FIELDS.into_iter().enumerate() {
        let n = 11 + i as u32;
        let body = format!(r#"{{"{k}": {n}}}"#);
        let (status, v) = op(front, "PATCH", &path(id), Some(&body));
        assert_eq!(status, 200, "{k}: {v}");
        assert_eq!(shown(&v), only(i, n), "{k}: {v}");
        assert_eq!(stored(stack, id), only(i, n).0, "{k}");
        let (_, got) = op(front, "GET", &path(id), None);
        assert_eq!(shown(&got), only(i, n), "{k}: {got}");
        for bad in ["-1", "2.5", "\"7\"", "2147483648", "{}", "true"] {
            let body = format!(r#"{{"name": "X", "{k}": {bad}}}"#);
            let (status, e) = op(front, "PATCH", &path(id), Some(&body));
            assert_eq!(
                (status, e["error"].clone()),
                (422, json!("invalid_body")),
                "{k} {bad}: {e}"
            );
            let message = e["message"].as_str().unwrap_or("");
            assert!(message.contains(k), "{k} {bad}: {e}");
            let (status, _) = op(front, "POST", PROJECTS, Some(&body));
            assert_eq!(status, 422, "create {k} {bad}");
        }
        assert_eq!(
            stored(stack, id),
            only(i, n).0,
            "{k}: a refused body changed it"
        );
        let body = format!(r#"{{"{k}": null}}"#);
        let (status, v) = op(front, "PATCH", &path(id), Some(&body));
        assert_eq!(status, 200, "{k}: {v}");
        assert_eq!(shown(&v), (nulls.clone(), defaults()), "{k} back: {v}");
        assert_eq!(stored(stack, id), nulls, "{k}");
    }
    let (_, v) = op(front, "GET", &path(id), None);
    assert_eq!(v["name"], "A", "a refused body renamed it: {v}");
}

/// Each limit of `id` set alone through `walcast project update --max-…`, seen by the
/// API, refused when bad, back to the default with `default`.
fn each_limit_through_the_cli(stack: &Stack, front: &Worker, id: &str) {
    let nulls = vec![Value::Null; LIMITS];
    for (i, k) in ProjectLimits::FIELDS.into_iter().enumerate() {
        let opt = format!("--{}", k.replace('_', "-"));
        let n = 100 + i as u32;
        let v = cli(stack, &["update", id, &opt, &n.to_string()]);
        assert_eq!(shown(&v), only(i, n), "{opt}: {v}");
        assert_eq!(stored(stack, id), only(i, n).0, "{opt}");
        let (_, got) = op(front, "GET", &path(id), None);
        assert_eq!(shown(&got), only(i, n), "{opt}: {got}");
        for bad in ["-1", "2147483648", "lots", ""] {
            let out = walcast(stack, &["project", "update", id, &opt, bad]);
            assert!(!out.status.success(), "{opt} {bad:?} accepted");
        }
        assert_eq!(stored(stack, id), only(i, n).0, "{opt}: refused, changed");
        let v = cli(stack, &["update", id, &opt, "default"]);
        assert_eq!(shown(&v), (nulls.clone(), defaults()), "{opt} default: {v}");
        assert_eq!(stored(stack, id), nulls, "{opt}");
    }
}

/// Every limit at creation: through the API, and through the CLI.
fn every_limit_at_creation(stack: &Stack, front: &Worker) {
    let all: Vec<Value> = (0..LIMITS).map(|i| json!(i)).collect();
    let mut body = serde_json::Map::new();
    body.insert("name".into(), json!("B"));
    for (k, n) in ProjectLimits::FIELDS.into_iter().zip(&all) {
        body.insert(k.into(), n.clone());
    }
    let body = Value::Object(body).to_string();
    let (status, b) = op(front, "POST", PROJECTS, Some(&body));
    assert_eq!(status, 201, "{b}");
    assert_eq!(shown(&b), (all.clone(), all.clone()), "{b}");
    assert_eq!(stored(stack, b["id"].as_str().unwrap()), all);
    let mut args = vec!["create".to_string(), "--name".into(), "C".into()];
    for (i, k) in ProjectLimits::FIELDS.into_iter().enumerate() {
        args.push(format!("--{}", k.replace('_', "-")));
        args.push(i.to_string());
    }
    let c = cli(stack, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(shown(&c), (all.clone(), all.clone()), "{c}");
    let id = c["id"].as_str().unwrap();
    assert_eq!(stored(stack, id), all);
    let (_, c) = op(front, "GET", &path(id), None);
    assert_eq!(shown(&c), (all.clone(), all), "{c}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_limit_is_stored_shown_and_reset_through_the_api_and_the_cli() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[]);
    worker.wait_active(STARTUP);
    let env = [
        ("MANAGEMENT_API_KEY", OPERATOR),
        ("PROJECT_MAX_USERS", "3"),
        ("MAX_CHANNELS_PER_SOCKET", "5"),
    ];
    let mut front = Worker::front(&stack.nats.url(), &env);
    front.wait_http(STARTUP);
    let a = create(&front, "A");
    let (_, v) = op(&front, "GET", &path(&a.id), None);
    assert_eq!(shown(&v), (vec![Value::Null; LIMITS], defaults()), "{v}");
    assert_eq!(stored(&stack, &a.id), vec![Value::Null; LIMITS]);
    each_limit_through_the_api(&stack, &front, &a.id);
    each_limit_through_the_cli(&stack, &front, &a.id);
    every_limit_at_creation(&stack, &front);
}
