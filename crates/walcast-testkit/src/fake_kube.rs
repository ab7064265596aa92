//! An honest fake of the Kubernetes API server, for Leases only.
//!
//! Serves `GET/PUT /apis/coordination.k8s.io/v1/namespaces/{ns}/leases/{name}` and
//! `POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases` with the real semantics:
//! 404 `NotFound` when missing, POST 409 `AlreadyExists`, PUT 409 `Conflict` when
//! `metadata.resourceVersion` is not the stored one (an empty one is an unconditional
//! update, as Leases allow), a new `resourceVersion` on every write, and `Status` objects
//! as error bodies.
//!
//! Each client gets its own endpoint (`endpoint(name)`, plain HTTP with no authentication,
//! as behind `kubectl proxy`; `secure_endpoint(name, …)`, HTTPS authenticating by client
//! certificate or bearer token, see [`Secure`]), so faults can target one client:
//! `cut_off` makes all its requests hang. `chaos` injects 500s and hangs at random (some
//! hangs after the write was applied, as when a reply is lost). `delay_release_replies`
//! answers a release (a write that empties the holder) only some time after applying it,
//! as when the releasing worker is not scheduled for a while right after its write.
//!
//! `walcast-testenv` serves it to tests in other languages when
//! `WALCAST_TESTENV_FAKE_KUBE=1` (its URL is `kube_api_url`).

mod secure;

pub use secure::Secure;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::time::Instant;

/// A successful write, as the server saw it.
#[derive(Clone, Debug)]
pub struct Write {
    pub client: String,
    pub holder: Option<String>,
    pub resource_version: String,
    /// When the request reached the server (after the client sent it).
    pub arrived: Instant,
}

#[derive(Default)]
struct Faults {
    cut_off: HashSet<String>,
    fail_per_mille: u64,
    hang_per_mille: u64,
    rng: u64,
    release_reply_delay: Duration,
}

impl Faults {
    fn roll(&mut self) -> u64 {
        // xorshift64*: deterministic, no dependency.
        let mut x = self.rng | 1;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D) % 1000
    }
}

#[derive(Default)]
struct Shared {
    leases: Mutex<HashMap<(String, String), Value>>,
    version: Mutex<u64>,
    faults: Mutex<Faults>,
    writes: Mutex<Vec<Write>>,
    /// Requests answered 401, by client.
    unauthorized: Mutex<HashMap<String, u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Clone, Default)]
pub struct FakeApi {
    shared: Arc<Shared>,
}

type St = State<(Arc<Shared>, String)>;

enum Fault {
    None,
    Fail,
    HangBefore,
    HangAfter,
}

impl FakeApi {
    pub fn new() -> Self {
        let api = FakeApi::default();
        lock(&api.shared.faults).rng = 0x9E37_79B9_7F4A_7C15;
        api
    }

    /// A base URL for one client, served on its own 127.0.0.1 port.
    pub async fn endpoint(&self, client: &str) -> String {
        let listener = bind().await;
        let addr = listener.local_addr().expect("local address");
        let router = self.router(client);
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        format!("http://{addr}")
    }

    /// A base URL for one client, served over TLS on its own 127.0.0.1 port, letting in
    /// only requests that `secure` authenticates.
    pub async fn secure_endpoint(&self, client: &str, secure: &Secure) -> String {
        let tcp = bind().await;
        let addr = tcp.local_addr().expect("local address");
        let listener = secure::TlsListener::new(tcp, secure);
        let gate = secure::Gate {
            shared: self.shared.clone(),
            client: client.to_string(),
            token: secure.token.clone(),
        };
        let router = self
            .router(client)
            .layer(axum::middleware::from_fn_with_state(
                gate,
                secure::authenticate,
            ))
            .into_make_service_with_connect_info::<secure::Peer>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        format!("https://{addr}")
    }

    fn router(&self, client: &str) -> Router {
        let base = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases";
        Router::new()
            .route(base, post(create))
            .route(&format!("{base}/{{name}}"), get(read).put(replace))
            .with_state((self.shared.clone(), client.to_string()))
    }

    /// How many requests of `client` were refused as unauthenticated (401).
    pub fn unauthorized(&self, client: &str) -> u64 {
        lock(&self.shared.unauthorized)
            .get(client)
            .copied()
            .unwrap_or(0)
    }

    /// All requests of `client` hang (never answer) until `restore`.
    pub fn cut_off(&self, client: &str) {
        lock(&self.shared.faults).cut_off.insert(client.to_string());
    }

    pub fn restore(&self, client: &str) {
        lock(&self.shared.faults).cut_off.remove(client);
    }

    /// Random faults on every request: 500s and hangs, per mille.
    pub fn chaos(&self, fail_per_mille: u64, hang_per_mille: u64) {
        let mut f = lock(&self.shared.faults);
        f.fail_per_mille = fail_per_mille;
        f.hang_per_mille = hang_per_mille;
    }

    /// Answer every release (a write that leaves the holder empty) `delay` after it was
    /// applied: the others can read the free Lease before the releasing client learns
    /// that its release went through.
    pub fn delay_release_replies(&self, delay: Duration) {
        lock(&self.shared.faults).release_reply_delay = delay;
    }

    pub fn writes(&self) -> Vec<Write> {
        lock(&self.shared.writes).clone()
    }

    pub fn lease(&self, ns: &str, name: &str) -> Option<Value> {
        lock(&self.shared.leases)
            .get(&(ns.to_string(), name.to_string()))
            .cloned()
    }
}

async fn bind() -> tokio::net::TcpListener {
    tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the fake API server")
}

fn fault(shared: &Shared, client: &str) -> Fault {
    let mut f = lock(&shared.faults);
    if f.cut_off.contains(client) {
        return Fault::HangBefore;
    }
    let (fail, hang) = (f.fail_per_mille, f.hang_per_mille);
    if fail + hang == 0 {
        return Fault::None;
    }
    let r = f.roll();
    if r < fail {
        Fault::Fail
    } else if r < fail + hang {
        if f.roll() < 500 {
            Fault::HangBefore
        } else {
            Fault::HangAfter
        }
    } else {
        Fault::None
    }
}

fn status(code: StatusCode, reason: &str, message: String) -> Response {
    let body = json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code.as_u16(),
    });
    (code, Json(body)).into_response()
}

fn internal() -> Response {
    status(
        StatusCode::INTERNAL_SERVER_ERROR,
        "InternalError",
        "Internal error occurred: injected".to_string(),
    )
}

fn not_found(name: &str) -> Response {
    status(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!("leases.coordination.k8s.io \"{name}\" not found"),
    )
}

/// Apply the fault that comes before any effect; HangAfter is returned for the caller.
async fn before(shared: &Shared, client: &str) -> Result<bool, Response> {
    match fault(shared, client) {
        Fault::None => Ok(false),
        Fault::Fail => Err(internal()),
        Fault::HangBefore => std::future::pending().await,
        Fault::HangAfter => Ok(true),
    }
}

/// What the API server accepts as an object name.
fn is_dns_subdomain(name: &str) -> bool {
    let ok_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.';
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    name.len() <= 253
        && name.chars().all(ok_char)
        && alnum(name.chars().next())
        && alnum(name.chars().last())
}

fn next_version(shared: &Shared) -> String {
    let mut v = lock(&shared.version);
    *v += 1;
    v.to_string()
}

fn holder(obj: &Value) -> Option<String> {
    obj.pointer("/spec/holderIdentity")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

async fn finish(hang_after: bool, code: StatusCode, obj: Value) -> Response {
    if hang_after {
        std::future::pending::<()>().await;
    }
    (code, Json(obj)).into_response()
}

async fn read(State((shared, client)): St, Path((ns, name)): Path<(String, String)>) -> Response {
    let hang_after = match before(&shared, &client).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let got = lock(&shared.leases).get(&(ns, name.clone())).cloned();
    match got {
        Some(obj) => finish(hang_after, StatusCode::OK, obj).await,
        None => not_found(&name),
    }
}

async fn create(
    State((shared, client)): St,
    Path(ns): Path<String>,
    Json(mut obj): Json<Value>,
) -> Response {
    let arrived = Instant::now();
    let hang_after = match before(&shared, &client).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    let Some(name) = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .map(str::to_owned)
    else {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            "Lease.coordination.k8s.io is invalid: metadata.name: Required value".into(),
        );
    };
    if !is_dns_subdomain(&name) {
        return status(
            StatusCode::UNPROCESSABLE_ENTITY,
            "Invalid",
            format!("Lease.coordination.k8s.io \"{name}\" is invalid: metadata.name: Invalid value: \"{name}\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character"),
        );
    }
    let rv = {
        let mut leases = lock(&shared.leases);
        let key = (ns.clone(), name.clone());
        if leases.contains_key(&key) {
            return status(
                StatusCode::CONFLICT,
                "AlreadyExists",
                format!("leases.coordination.k8s.io \"{name}\" already exists"),
            );
        }
        let rv = next_version(&shared);
        obj["metadata"]["resourceVersion"] = json!(rv);
        obj["metadata"]["namespace"] = json!(ns);
        obj["metadata"]["uid"] = json!(format!("uid-{name}"));
        obj["apiVersion"] = json!("coordination.k8s.io/v1");
        obj["kind"] = json!("Lease");
        leases.insert(key, obj.clone());
        rv
    };
    lock(&shared.writes).push(Write {
        client,
        holder: holder(&obj),
        resource_version: rv,
        arrived,
    });
    finish(hang_after, StatusCode::CREATED, obj).await
}

async fn replace(
    State((shared, client)): St,
    Path((ns, name)): Path<(String, String)>,
    Json(mut obj): Json<Value>,
) -> Response {
    let arrived = Instant::now();
    let hang_after = match before(&shared, &client).await {
        Ok(h) => h,
        Err(r) => return r,
    };
    if obj.pointer("/metadata/name").and_then(Value::as_str) != Some(name.as_str()) {
        return status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "the name of the object does not match the name on the URL".into(),
        );
    }
    let sent_rv = obj
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let rv = {
        let mut leases = lock(&shared.leases);
        let key = (ns.clone(), name.clone());
        let Some(stored) = leases.get(&key) else {
            return not_found(&name);
        };
        let stored_rv = stored
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .unwrap_or("");
        if !sent_rv.is_empty() && sent_rv != stored_rv {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                format!("Operation cannot be fulfilled on leases.coordination.k8s.io \"{name}\": the object has been modified; please apply your changes to the latest version and try again"),
            );
        }
        let uid = stored.pointer("/metadata/uid").cloned();
        let rv = next_version(&shared);
        obj["metadata"]["resourceVersion"] = json!(rv);
        obj["metadata"]["namespace"] = json!(ns);
        if let Some(uid) = uid {
            obj["metadata"]["uid"] = uid;
        }
        obj["apiVersion"] = json!("coordination.k8s.io/v1");
        obj["kind"] = json!("Lease");
        leases.insert(key, obj.clone());
        rv
    };
    let released = holder(&obj).unwrap_or_default().is_empty();
    lock(&shared.writes).push(Write {
        client,
        holder: holder(&obj),
        resource_version: rv,
        arrived,
    });
    if released {
        let delay = lock(&shared.faults).release_reply_delay;
        tokio::time::sleep(delay).await;
    }
    finish(hang_after, StatusCode::OK, obj).await
}
