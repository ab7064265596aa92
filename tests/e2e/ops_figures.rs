//! A process's operational figures behind operator auth. A cdc-worker's (and `walcast
//! serve`'s, on its clients' port) full `/health` names projects (lagging lanes), tables
//! (the last skipped change) and error texts; its `/metrics` has series labelled by
//! project. Only `MANAGEMENT_API_KEY` or `METRICS_API_KEY` (`Authorization: Bearer`) get
//! them: no key, a wrong one, a tenant's anon or `service_role` key or the default
//! project's keys are refused, and the public `/health`, `/readyz` and `/livez` name no
//! project, table or error. The metrics key reads figures only: the management API
//! refuses it.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;

use crate::support::projects::{binding, create_project, keys, set, walcast, Project};
use crate::support::{ws, Stack, Worker};

const OPERATOR: &str = "operator-key-of-the-ops-figures-test-0123456789abcdef";
const READER: &str = "metrics-key-of-the-ops-figures-test-0123456789abcdef";
const STARTUP: Duration = Duration::from_secs(60);
/// A table name only its tenant knows.
const TABLE: &str = "ledger_q3_layoffs";
/// What the public `/health` may carry, at most.
const PUBLIC_FIELDS: &[&str] = &[
    "cdc_active",
    "leader",
    "lag_bytes",
    "bus",
    "bus_connected",
    "draining",
    "detail",
];

fn keys_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("MANAGEMENT_API_KEY", OPERATOR),
        ("METRICS_API_KEY", READER),
        // Rows larger than this are delivered without their large values, and named (by
        // table) as the last skipped change on the full `/health`.
        ("MAX_RECORD_BYTES", "4096"),
    ]
}

fn bearer(k: &str) -> String {
    format!("Bearer {k}")
}

/// `GET path` with these headers: (status, body).
fn get(w: &Worker, path: &str, headers: &[(&str, String)]) -> (u16, String) {
    let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
    w.request("GET", path, &h, None)
}

/// The tenant's table, enabled; a subscriber of the tenant on it (so the tenant has a
/// delivery lane), and a row too large for one message (so the table is the last skipped
/// change), received.
async fn tenant_activity(stack: &Stack, front: &Worker) -> Project {
    let tenant = create_project(stack, "Hidden");
    stack.sql(&format!(
        "CREATE TABLE \"{s}\".{TABLE} (id int PRIMARY KEY, body text);
         GRANT SELECT ON \"{s}\".{TABLE} TO anon, authenticated, service_role;",
        s = tenant.schema
    ));
    let qualified = format!("{}.{TABLE}", tenant.schema);
    let out = walcast(
        stack,
        &["realtime", "--project", &tenant.id, "enable", &qualified],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut sock = PhoenixClient::connect(&front.ws_url(&tenant.anon)).await;
    sock.join_subscribed("realtime:ledger", binding(&tenant.schema, TABLE))
        .await;
    let big = "x".repeat(20_000);
    stack.sql(&format!(
        "INSERT INTO \"{}\".{TABLE} VALUES (1, '{big}')",
        tenant.schema
    ));
    sock.wait_frame("postgres_changes", Duration::from_secs(30), |p| {
        p["data"]["record"]["id"] == 1
    })
    .await;
    tenant
}

/// The figures the keys get: the full `/health` names the tenant's table, `/metrics` has
/// a series labelled by the tenant (its delivery lane).
fn operator_sees_everything(w: &Worker, tenant: &Project) {
    let qualified = format!("{}.{TABLE}", tenant.schema);
    let deadline = Instant::now() + Duration::from_secs(20);
    for key in [OPERATOR, READER] {
        let auth = [("Authorization", bearer(key))];
        loop {
            let (hs, health) = get(w, "/health", &auth);
            let (ms, metrics) = get(w, "/metrics", &auth);
            assert_eq!((hs, ms), (200, 200), "{health}\n{metrics}");
            let full: Value = serde_json::from_str(&health).expect("JSON");
            let named = full["last_skipped_change"]["table"] == qualified.as_str();
            if named && metrics.contains(&tenant.id) {
                assert!(full.get("lagging").is_some(), "{full}");
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the full figures do not name the tenant: {full}\n{metrics}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Everything but the two keys: refused the figures, told nothing of the tenant.
fn others_learn_nothing(w: &Worker, tenant: &Project) {
    let default_service = ws::token(json!({"role": "service_role", "exp": ws::now() + 3600}));
    let refusals: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("no key", vec![]),
        (
            "a wrong key",
            vec![("Authorization", bearer("not-the-key"))],
        ),
        (
            "a prefix of the key",
            vec![("Authorization", bearer(&OPERATOR[..OPERATOR.len() - 1]))],
        ),
        ("the key as apikey", vec![("apikey", OPERATOR.to_string())]),
        (
            "the key without Bearer",
            vec![("Authorization", OPERATOR.to_string())],
        ),
        (
            "the tenant's anon key",
            vec![("Authorization", bearer(&tenant.anon))],
        ),
        (
            "the tenant's service_role key",
            vec![("Authorization", bearer(&tenant.service))],
        ),
        (
            "the tenant's key as apikey",
            vec![("apikey", tenant.service.clone())],
        ),
        (
            "the default anon key",
            vec![("Authorization", bearer(&ws::anon()))],
        ),
        (
            "the default service_role key",
            vec![("Authorization", bearer(&default_service))],
        ),
    ];
    let secrets = [tenant.id.as_str(), tenant.schema.as_str(), TABLE];
    let leaks = |body: &str| secrets.iter().copied().find(|s| body.contains(s));
    for (what, headers) in &refusals {
        let (status, body) = get(w, "/metrics", headers);
        assert!(
            status == 401 || status == 403,
            "{what}: /metrics answered {status}: {}",
            &body[..body.len().min(400)]
        );
        assert_eq!(leaks(&body), None, "{what}: /metrics: {body}");
        // The full health is refused; without an Authorization header the public one.
        let (status, body) = get(w, "/health", headers);
        assert_eq!(leaks(&body), None, "{what}: /health: {body}");
        let presents_authorization = headers.iter().any(|(k, _)| *k == "Authorization");
        if presents_authorization {
            assert!(
                status == 401 || status == 403,
                "{what}: /health {status}: {body}"
            );
        } else {
            assert_eq!(status, 200, "{what}: /health: {body}");
            public_health_only(&body, what);
        }
        for probe in ["/readyz", "/livez"] {
            let (status, body) = get(w, probe, headers);
            assert_eq!(status, 200, "{what}: {probe}: {body}");
            assert_eq!(leaks(&body), None, "{what}: {probe}: {body}");
        }
    }
}

/// The public `/health`: a load balancer's and a client's fields, nothing else.
fn public_health_only(body: &str, what: &str) {
    let v: Value = serde_json::from_str(body).expect("JSON");
    let (shown, allowed) = (keys(&v), set(PUBLIC_FIELDS));
    let extra: Vec<&String> = shown.difference(&allowed).collect();
    assert!(
        extra.is_empty(),
        "{what}: the public /health shows {extra:?}: {v}"
    );
    assert_eq!(v["bus_connected"], true, "{v}");
}

/// The metrics key reads figures, never manages: the management API refuses it.
fn metrics_key_does_not_manage(front: &Worker) {
    let path = "/management/v1/projects";
    let (status, body) = get(front, path, &[("Authorization", bearer(READER))]);
    assert!(
        status == 401 || status == 403,
        "the metrics key on the management API: {status}: {body}"
    );
    let (status, body) = get(front, path, &[("Authorization", bearer(OPERATOR))]);
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_figures_need_the_operator_key() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&keys_env());
    worker.wait_active(STARTUP);
    let mut front = Worker::front(&stack.nats.url(), &keys_env());
    front.wait_http(STARTUP);
    let tenant = tenant_activity(&stack, &front).await;

    let (status, public) = get(&worker, "/health", &[]);
    assert_eq!(status, 200, "{public}");
    public_health_only(&public, "the worker's public /health");
    // A route it does not serve: JSON saying what it serves, on the worker and the front.
    for (who, w) in [("worker", &worker), ("front", &front)] {
        let (status, body) = get(w, "/rest/v1/todos", &[]);
        assert_eq!(status, 404, "{who}: {body}");
        let answer: serde_json::Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{who}: not JSON ({e}): {body}"));
        assert!(
            answer["error"].is_string() && answer["routes"].is_array(),
            "{who}: {body}"
        );
    }
    others_learn_nothing(&worker, &tenant);
    operator_sees_everything(&worker, &tenant);
    // The front's own figures: the same rule.
    let (status, public) = get(&front, "/health", &[]);
    assert_eq!(status, 200, "{public}");
    public_health_only(&public, "the front's public /health");
    let (status, body) = get(&front, "/metrics", &[]);
    assert_eq!(status, 401, "the front's /metrics without a key: {body}");
    let (status, _) = get(&front, "/metrics", &[("Authorization", bearer(READER))]);
    assert_eq!(status, 200);
    metrics_key_does_not_manage(&front);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn walcast_serves_figures_need_the_operator_key() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut server = Worker::serve(&stack.pg.url(), &keys_env());
    server.wait_active(STARTUP);
    let tenant = tenant_activity(&stack, &server).await;

    let (status, public) = get(&server, "/health", &[]);
    assert_eq!(status, 200, "{public}");
    public_health_only(&public, "walcast serve's public /health");
    others_learn_nothing(&server, &tenant);
    operator_sees_everything(&server, &tenant);
    metrics_key_does_not_manage(&server);
}

/// Without any key configured nobody reads the figures: the public health and the probes
/// answer, `/metrics` and the full health are refused (403), and the process says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_key_nobody_reads_the_figures() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut worker = stack.worker(&[("METRICS_API_KEY", ""), ("MANAGEMENT_API_KEY", "")]);
    worker.wait_active(STARTUP);
    for key in [None, Some(OPERATOR)] {
        let auth: Vec<(&str, String)> = key
            .map(|k| ("Authorization", bearer(k)))
            .into_iter()
            .collect();
        let (status, body) = get(&worker, "/metrics", &auth);
        assert!(
            status == 401 || status == 403,
            "{key:?}: /metrics {status}: {body}"
        );
    }
    let (status, body) = get(&worker, "/health", &[("Authorization", bearer(OPERATOR))]);
    assert_eq!(status, 403, "{body}");
    let (status, body) = get(&worker, "/health", &[]);
    assert_eq!(status, 200, "{body}");
    public_health_only(&body, "without a key");
    assert!(
        worker.log_text().contains("METRICS_API_KEY"),
        "no word of the missing key in the log:\n{}",
        worker.log_text()
    );
}
