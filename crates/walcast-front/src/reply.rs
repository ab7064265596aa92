//! The HTTP error answers every route shares: `{"error": msg}` with a status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::auth::AuthError;

/// `{"error": msg}` with a status.
pub(crate) fn error_response(status: StatusCode, msg: &str) -> Response {
    (status, Json(serde_json::json!({ "error": msg }))).into_response()
}

/// 503 when the project directory could not be asked, else 401.
pub(crate) fn auth_status(e: &AuthError) -> StatusCode {
    match e {
        AuthError::DirectoryUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        AuthError::Suspended(_) => StatusCode::FORBIDDEN,
        _ => StatusCode::UNAUTHORIZED,
    }
}

/// 503 while the front shuts down: the client reconnects (to another replica).
pub(crate) fn draining_response() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "this server is shutting down: reconnect",
    )
}
