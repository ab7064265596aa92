//! Tokens for the servers the end-to-end tests start; sockets are the test kit's
//! [`walcast_testkit::phoenix::PhoenixClient`].

use std::time::Duration;

use serde_json::{json, Value};

/// `JWT_SECRET` of the servers the tests start.
pub const SECRET: &str = "e2e-secret-with-enough-bytes-0123456789";
/// Bound of every single wait for a message (the client's own).
pub const TIMEOUT: Duration = walcast_testkit::phoenix::DEFAULT_TIMEOUT;

pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

/// An HS256 token signed with [`SECRET`].
pub fn token(claims: Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).expect("jwt secret"),
    )
    .expect("sign jwt")
}

/// An `anon` token valid for an hour.
pub fn anon() -> String {
    token(json!({"role": "anon", "exp": now() + 3600}))
}
