//! Helpers for the project tests: `walcast project create` with its output checked, keys,
//! and the realtime REST API.

use std::collections::BTreeSet;
use std::process::Command;

use serde_json::{json, Value};

use super::ws;
use super::{Stack, Worker};
use walcast_testkit::phoenix::PhoenixClient;

/// What `walcast project create` printed.
pub struct Project {
    pub id: String,
    pub schema: String,
    pub secret: String,
    pub anon: String,
    pub service: String,
}

pub fn walcast(stack: &Stack, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_walcast"))
        .args(args)
        .env("DATABASE_URL", stack.pg.url())
        .env("SECRETS_KEY", super::SECRETS_KEY)
        .output()
        .unwrap_or_else(|e| panic!("run walcast {args:?}: {e}"))
}

pub fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

pub fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

pub fn claims_of(key: &str, secret: &str) -> Value {
    let mut v = jsonwebtoken::Validation::new(jsonwebtoken::Algorithm::HS256);
    v.required_spec_claims.clear();
    jsonwebtoken::decode::<Value>(
        key,
        &jsonwebtoken::DecodingKey::from_secret(secret.as_bytes()).expect("jwt secret"),
        &v,
    )
    .unwrap_or_else(|e| panic!("key does not verify with the project's secret: {e}"))
    .claims
}

pub fn sign(secret: &str, claims: Value) -> String {
    walcast_testkit::tokens::sign(secret, &claims)
}

/// `walcast project create --name <name>`, its output checked field by field.
pub fn create_project(stack: &Stack, name: &str) -> Project {
    let out = walcast(stack, &["project", "create", "--name", name]);
    assert!(
        out.status.success(),
        "project create failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("project create prints JSON");
    let mut fields = set(VIEW_FIELDS);
    fields.extend(set(&["jwt_secret", "anon_key", "service_role_key"]));
    assert_eq!(keys(&v), fields, "{v}");
    let s = |k: &str| {
        v[k].as_str()
            .unwrap_or_else(|| panic!("{k}: {v}"))
            .to_string()
    };
    let (id, schema, secret) = (s("id"), s("schema"), s("jwt_secret"));
    assert_eq!(s("name"), name);
    assert_eq!(id.len(), 36, "a uuid: {id}");
    assert_eq!(id.matches('-').count(), 4, "a uuid: {id}");
    assert_eq!(schema, format!("project_{}", id.replace('-', "")));
    assert_eq!(secret.len(), 64, "{secret}");
    assert!(secret.bytes().all(|b| b.is_ascii_hexdigit()), "{secret}");
    let ten_years = 10 * 365 * 24 * 3600;
    for (key, role) in [("anon_key", "anon"), ("service_role_key", "service_role")] {
        let c = claims_of(&s(key), &secret);
        assert_eq!(keys(&c), set(&["role", "ref", "iss", "iat", "exp"]), "{c}");
        assert_eq!(c["role"], role, "{c}");
        assert_eq!(c["ref"], id.as_str(), "{c}");
        assert_eq!(c["iss"], "walcast", "{c}");
        let life = c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap();
        assert_eq!(life, ten_years, "{c}");
        assert!((c["iat"].as_i64().unwrap() - ws::now()).abs() < 60, "{c}");
    }
    Project {
        id,
        schema,
        secret,
        anon: s("anon_key"),
        service: s("service_role_key"),
    }
}

/// What `walcast project get|list` and the management API show of a project.
pub const VIEW_FIELDS: &[&str] = &[
    "id",
    "name",
    "schema",
    "created_at",
    "suspended",
    "private_only",
    "previous_secret",
    "previous_secret_valid_until_ms",
    "max_concurrent_users",
    "effective_max_concurrent_users",
    "max_joins_per_second",
    "effective_max_joins_per_second",
    "max_channels_per_client",
    "effective_max_channels_per_client",
    "max_events_per_second",
    "effective_max_events_per_second",
    "max_bytes_per_second",
    "effective_max_bytes_per_second",
    "max_presence_events_per_second",
    "effective_max_presence_events_per_second",
    "max_payload_size_in_kb",
    "effective_max_payload_size_in_kb",
    "jwks",
    "source",
];

pub fn realtime_path(project: &str, table: &str) -> String {
    format!("/v1/db/{project}/schema/tables/{table}/realtime")
}

/// Send a request; (status, JSON body).
pub fn call(
    w: &Worker,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&str>,
) -> (u16, Value) {
    let headers: Vec<(&str, &str)> = key.map(|k| ("apikey", k)).into_iter().collect();
    let (status, text) = w.request(method, path, &headers, body);
    let v = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{method} {path}: {status} with a non-JSON body ({e}): {text}"));
    (status, v)
}

/// Expect an error answer: the status, `{"error": code, "message": …}` and nothing else.
pub fn refused(got: (u16, Value), status: u16, code: &str, what: &str) -> String {
    let (s, v) = got;
    assert_eq!(s, status, "{what}: {v}");
    assert_eq!(keys(&v), set(&["error", "message"]), "{what}: {v}");
    assert_eq!(v["error"], code, "{what}: {v}");
    let message = v["message"].as_str().unwrap_or_default().to_string();
    assert!(!message.is_empty(), "{what}: {v}");
    message
}

/// Wait for the next `postgres_changes` frame; returns its `data`.
pub async fn next_change(ws: &mut PhoenixClient) -> Value {
    loop {
        let f = ws.recv_frame().await;
        if f[3] == "postgres_changes" {
            return f[4]["data"].clone();
        }
    }
}

pub fn binding(schema: &str, table: &str) -> Value {
    json!([{"event": "*", "schema": schema, "table": table}])
}
