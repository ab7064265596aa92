//! Operator data behind operator auth: every project's counters (`/metrics/projects`) and
//! the inspector's deployment-wide numbers go to the operator only. Anyone, a tenant's
//! anon or `service_role` key, and the default project's keys (its anon key is public)
//! are refused the per-project figures; `MANAGEMENT_API_KEY` gets them.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use walcast_testkit::phoenix::PhoenixClient;

use crate::support::projects::create_project;
use crate::support::{ws, Stack, Worker};

const OPERATOR: &str = "operator-key-for-the-figures-test-0123456789abcdef";

/// `GET path` with these headers: (status, body).
fn get(w: &Worker, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    w.request("GET", path, headers, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_project_figures_need_the_operator_key() {
    let _machine = crate::support::shared().await;
    let stack = Stack::start("stream");
    let mut w = Worker::serve(&stack.pg.url(), &[("MANAGEMENT_API_KEY", OPERATOR)]);
    w.wait_active(Duration::from_secs(60));
    let tenant = create_project(&stack, "Tenant");
    // The tenant joins a channel, so it has counters on this front.
    let url = w.ws_url(&tenant.anon);
    let mut c = PhoenixClient::connect(&url).await;
    let (_, reply) = c.join("realtime:room", json!({}), None).await;
    assert_eq!(reply[4]["status"], "ok", "{reply}");

    let default_anon = ws::anon();
    let default_service = ws::token(json!({"role": "service_role", "exp": ws::now() + 3600}));
    let bearer = |k: &str| format!("Bearer {k}");
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
            vec![("Authorization", bearer(&default_anon))],
        ),
        (
            "the default service_role key",
            vec![("Authorization", bearer(&default_service))],
        ),
    ];
    for (what, headers) in &refusals {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, body) = get(&w, "/metrics/projects", &h);
        assert!(
            status == 401 || status == 403,
            "{what}: /metrics/projects answered {status}: {body}"
        );
        assert!(
            !body.contains(&tenant.id),
            "{what} learnt of the tenant: {body}"
        );
    }
    // The operator's key: every project's series, the tenant's join counted.
    let series = format!("walcast_project_joins_total{{project=\"{}\"}} 1", tenant.id);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = get(
            &w,
            "/metrics/projects",
            &[("Authorization", &bearer(OPERATOR))],
        );
        assert_eq!(status, 200, "{body}");
        if body.contains(&series) {
            break;
        }
        assert!(Instant::now() < deadline, "no {series} in:\n{body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The inspector: the default project's anon key sees its own project only, its
    // service_role key (the operator's) every project.
    let inspected = |key: &str| -> Value {
        let (status, body) = get(&w, "/inspector/api/health", &[("apikey", key)]);
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).expect("JSON")
    };
    let anon_view = inspected(&default_anon);
    assert!(
        anon_view["projects"].get(&tenant.id).is_none(),
        "the default anon key sees the tenant: {anon_view}"
    );
    let tenant_view = inspected(&tenant.anon);
    let others: Vec<&String> = tenant_view["projects"]
        .as_object()
        .expect("projects")
        .keys()
        .filter(|p| **p != tenant.id)
        .collect();
    assert!(others.is_empty(), "the tenant sees {others:?}");
    let operator_view = inspected(&default_service);
    assert!(
        operator_view["projects"].get(&tenant.id).is_some(),
        "the operator does not see the tenant: {operator_view}"
    );
}
