//! The HTTP error answers every route shares: `{"error": msg}` with a status; and the
//! error of the two operator-facing JSON APIs (the realtime REST API and the management
//! API), `{"error": code, "message": text}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use walcast_bus::admin::{AdminError, AdminErrorKind};

/// A refused or failed request of the realtime REST API or the management API.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    /// A stable code (`unknown_project`, `invalid_body`, …).
    pub error: &'static str,
    pub message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, error: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            error,
            message: message.into(),
        }
    }

    pub(crate) fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    pub(crate) fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub(crate) fn unknown_project(project: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_project",
            format!("project {project:?} does not exist"),
        )
    }

    pub(crate) fn invalid_body(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_body", message)
    }

    /// Logged (`warn` for a failure, `info` for a refusal) with `what` (the API) and `op`.
    pub(crate) fn log(&self, what: &str, op: &str, project: Option<&str>) {
        let (status, error, message) = (self.status.as_u16(), self.error, &self.message);
        if self.status.is_server_error() {
            tracing::warn!(op, project, status, error, %message, "{what} request failed");
        } else {
            tracing::info!(op, project, status, error, %message, "{what} request refused");
        }
    }

    /// `{"error", "message"}` with its status.
    pub(crate) fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.error, "message": self.message });
        (self.status, Json(body)).into_response()
    }
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> ApiError {
        let (status, error) = match e.kind {
            AdminErrorKind::UnknownProject => (StatusCode::NOT_FOUND, "unknown_project"),
            AdminErrorKind::UnknownTable => (StatusCode::NOT_FOUND, "unknown_table"),
            AdminErrorKind::NoPrimaryKey => (StatusCode::UNPROCESSABLE_ENTITY, "no_primary_key"),
            AdminErrorKind::InvalidRequest => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_body"),
            AdminErrorKind::PartitionedTable => {
                (StatusCode::UNPROCESSABLE_ENTITY, "partitioned_table")
            }
            AdminErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            AdminErrorKind::Refused => (StatusCode::FORBIDDEN, "refused"),
            AdminErrorKind::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            AdminErrorKind::NotStreaming => (StatusCode::CONFLICT, "not_streaming"),
            AdminErrorKind::InvalidFilter => (StatusCode::UNPROCESSABLE_ENTITY, "invalid_filter"),
            AdminErrorKind::QueueFull => (StatusCode::TOO_MANY_REQUESTS, "queue_full"),
            AdminErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        };
        ApiError::new(status, error, e.message)
    }
}

/// `{"error": msg}` with a status.
pub(crate) fn error_response(status: StatusCode, msg: &str) -> Response {
    (status, Json(serde_json::json!({ "error": msg }))).into_response()
}

/// 503 while the front shuts down: the client reconnects (to another replica).
pub(crate) fn draining_response() -> Response {
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "this server is shutting down: reconnect",
    )
}
