//! HTTP routes: the WebSocket upgrade, SSE, the broadcast REST API and the REST API that
//! enables realtime per table; the inspector's, if enabled ([`crate::inspector`]).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use walcast_protocol::Vsn;

use crate::auth::AuthError;
use crate::credentials::Credentials;
use crate::limits::ConnSlot;
use crate::state::Shared;
use crate::{broadcast, conn, realtime_api, sse};

/// `{"error": msg}` with a status.
pub(crate) fn error_response(status: StatusCode, msg: &str) -> Response {
    (status, Json(serde_json::json!({ "error": msg }))).into_response()
}

/// 503 when the project directory could not be asked, else 401.
pub(crate) fn auth_status(e: &AuthError) -> StatusCode {
    match e {
        AuthError::DirectoryUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::UNAUTHORIZED,
    }
}

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    let inspector = shared.cfg.inspector;
    let mut router = Router::new()
        .route("/realtime/v1/websocket", get(websocket))
        .route("/socket/websocket", get(websocket))
        .route("/realtime/v1/sse", get(sse::handler))
        .route("/realtime/v1/api/broadcast", post(broadcast::rest_batch))
        .route(
            "/realtime/v1/api/broadcast/{topic}/events/{event}",
            post(broadcast::rest_single),
        )
        .route(
            "/v1/db/{project_id}/schema/tables/{table}/realtime",
            put(realtime_api::put)
                .delete(realtime_api::delete)
                .get(realtime_api::get_one),
        )
        .route(
            "/v1/db/{project_id}/realtime/tables",
            get(realtime_api::list),
        );
    if inspector {
        router = router.merge(crate::inspector::routes());
    }
    router.with_state(shared)
}

/// 503 while the front shuts down: the client reconnects (to another replica).
pub(crate) fn draining_response() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "this server is shutting down: reconnect",
    )
}

/// `GET /realtime/v1/websocket?apikey=<jwt>&vsn=<1.0.0|2.0.0>` (the key may also come
/// from the headers: see [`crate::credentials`]).
async fn websocket(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    if shared.is_draining() {
        return draining_response();
    }
    let vsn = match Vsn::from_query(q.get("vsn").map(String::as_str)) {
        Ok(v) => v,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, &e.to_string()),
    };
    let creds = Credentials::from_request(&q, &headers);
    let socket_auth = match shared.projects.verify(creds.key().unwrap_or("")).await {
        Ok(v) => v,
        Err(e) => {
            crate::telemetry::error("auth");
            return error_response(auth_status(&e), &e.to_string());
        }
    };
    let ws = match ws {
        Ok(ws) => ws,
        Err(r) => return r.into_response(),
    };
    let Some(slot) = ConnSlot::acquire(&shared) else {
        return error_response(StatusCode::TOO_MANY_REQUESTS, "too many connections");
    };
    let limit = shared.cfg.max_frame_bytes.saturating_mul(2).max(64 * 1024);
    ws.max_message_size(limit)
        .max_frame_size(limit)
        .read_buffer_size(4 * 1024)
        .write_buffer_size(8 * 1024)
        .on_upgrade(move |socket| {
            let tracker = shared.tracker.clone();
            tracker.track_future(conn::run(shared, socket, vsn, socket_auth, creds, slot))
        })
}
