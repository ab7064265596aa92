//! What a request for a route the front does not serve gets: a JSON answer saying what
//! walcast serves, never an empty 404. `/` says what this server is; the other Supabase
//! services' paths (`/rest/v1`, `/auth/v1` …) say that walcast serves only realtime; the
//! management API and the inspector, when off, say how to turn them on.

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

/// Which optional parts this front serves.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Served {
    pub management: bool,
    pub inspector: bool,
}

/// At most this much of a requested path is repeated in an answer.
const PATH_SHOWN: usize = 200;

/// Supabase services walcast does not serve, by path prefix, and what they are.
const OTHER_SERVICES: &[(&str, &str)] = &[
    ("/rest/v1", "the REST API (PostgREST)"),
    ("/auth/v1", "Auth (GoTrue)"),
    ("/storage/v1", "Storage"),
    ("/functions/v1", "Edge Functions"),
    ("/graphql/v1", "GraphQL (pg_graphql)"),
    ("/pg", "postgres-meta"),
];

/// The routes every front serves, for the answers.
fn routes(served: Served) -> Value {
    let mut routes = vec![
        "GET /realtime/v1/websocket (Phoenix, as supabase-js connects)",
        "GET /realtime/v1/sse",
        "POST /realtime/v1/api/broadcast",
        "PUT|GET|DELETE /v1/db/{project}/schema/tables/{table}/realtime",
        "GET /health, /livez, /readyz",
    ];
    if served.management {
        routes.push("/management/v1/projects");
    }
    if served.inspector {
        routes.push("GET /inspector");
    }
    json!(routes)
}

/// The answer to `method path` that no route serves.
pub(crate) fn answer(method: &Method, path: &str, served: Served) -> Response {
    if path == "/" && (method == Method::GET || method == Method::HEAD) {
        let about = json!({
            "name": "walcast",
            "about": "a Supabase Realtime server: point a Supabase client's realtime at /realtime/v1",
            "routes": routes(served),
            "inspector": if served.inspector { json!("/inspector") } else { json!("off (INSPECTOR=true serves it)") },
            "docs": "the README and docs/ of walcast's repository",
        });
        return (StatusCode::OK, Json(about)).into_response();
    }
    let (status, error) = why(path, served);
    let shown: String = path.chars().take(PATH_SHOWN).collect();
    // `message` too: supabase-js hands the body over as `error`, and apps read
    // `error.message` (PostgREST's shape).
    let body = json!({ "error": error, "message": error, "path": shown, "routes": routes(served) });
    (status, Json(body)).into_response()
}

/// The status and the words for a path no route serves.
fn why(path: &str, served: Served) -> (StatusCode, String) {
    let under = |prefix: &str| path == prefix || path.starts_with(&format!("{prefix}/"));
    if let Some((prefix, what)) = OTHER_SERVICES.iter().find(|(p, _)| under(p)) {
        return (
            StatusCode::NOT_FOUND,
            format!("walcast serves only /realtime/v1 (Supabase Realtime); {prefix} is {what}, which another server serves: route it there (as Supabase's API gateway does)"),
        );
    }
    if under("/management/v1") && !served.management {
        return (
            StatusCode::NOT_FOUND,
            "the management API is off on this server: set MANAGEMENT_API_KEY (the operator's key) to serve it".into(),
        );
    }
    if under("/inspector") && !served.inspector {
        return (
            StatusCode::NOT_FOUND,
            "the inspector is off on this server: set INSPECTOR=true to serve it".into(),
        );
    }
    (
        StatusCode::NOT_FOUND,
        "no such route: see `routes` for what walcast serves".into(),
    )
}

/// The answer to a method a route does not take.
pub(crate) fn method_not_allowed(method: &Method, uri: &Uri) -> Response {
    let shown: String = uri.path().chars().take(PATH_SHOWN).collect();
    let error = format!("{method} is not served on this route");
    let body = json!({ "error": error, "message": error, "path": shown });
    (StatusCode::METHOD_NOT_ALLOWED, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn body(r: Response) -> (StatusCode, Value) {
        let status = r.status();
        let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    #[tokio::test]
    async fn every_unknown_path_gets_json_saying_what_is_served() {
        let off = Served::default();
        let (s, b) = body(answer(&Method::GET, "/", off)).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(b["name"], "walcast");
        assert!(b["inspector"].as_str().unwrap().contains("INSPECTOR=true"));

        let (s, b) = body(answer(&Method::GET, "/rest/v1/todos", off)).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(b["message"], b["error"], "supabase-js reads `message`");
        assert!(b["error"]
            .as_str()
            .unwrap()
            .contains("serves only /realtime/v1"));
        assert!(b["error"].as_str().unwrap().contains("PostgREST"));
        let (_, b) = body(answer(&Method::POST, "/auth/v1/token", off)).await;
        assert!(b["error"].as_str().unwrap().contains("GoTrue"));
        let (_, b) = body(answer(&Method::GET, "/rest/v10", off)).await;
        assert!(b["error"].as_str().unwrap().starts_with("no such route"));

        let (_, b) = body(answer(&Method::GET, "/management/v1/projects", off)).await;
        assert!(b["error"].as_str().unwrap().contains("MANAGEMENT_API_KEY"));
        let on = Served {
            management: true,
            inspector: true,
        };
        let (_, b) = body(answer(&Method::GET, "/management/v1/nope", on)).await;
        assert!(b["error"].as_str().unwrap().starts_with("no such route"));
        let (s, b) = body(answer(&Method::GET, "/", on)).await;
        assert_eq!(
            (s, b["inspector"].as_str()),
            (StatusCode::OK, Some("/inspector"))
        );
    }

    #[tokio::test]
    async fn a_hostile_path_is_cut_and_escaped() {
        let path = format!("/x\"<script>{}", "a".repeat(10_000));
        let (s, b) = body(answer(&Method::GET, &path, Served::default())).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
        assert_eq!(b["path"].as_str().unwrap().chars().count(), PATH_SHOWN);
        let uri: Uri = "/realtime/v1/sse".parse().unwrap();
        let (s, b) = body(method_not_allowed(&Method::DELETE, &uri)).await;
        assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(b["error"], "DELETE is not served on this route");
    }
}
