//! A client of the Kubernetes API server for the one kind walcast writes:
//! `coordination.k8s.io/v1` Leases (read, create, replace), over HTTP/1.1 (hyper), with
//! TLS (rustls) and the service account's token in the cluster.
//!
//! The elector needs three calls and the API's compare-and-set (a replace carries the
//! `resourceVersion` it read; 409 when someone wrote in between), not a general client.
//! Every request opens its own connection: a Lease is read or written once every few
//! seconds. Fields of the object that walcast does not know (labels, owner references,
//! `uid`, …) are kept as read and sent back on a replace. An answer larger than
//! [`MAX_BODY`] is refused.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// The largest answer read (a Lease is a few hundred bytes).
pub const MAX_BODY: usize = 1 << 20;
/// The service account's files in a pod.
const SERVICE_ACCOUNT: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A Lease as the API serves it; what walcast does not read is kept in `rest`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Lease {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<LeaseSpec>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMeta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// `LeaseSpec`; the times are `MicroTime` text (RFC 3339 with microseconds).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder_identity: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_duration_seconds: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_transitions: Option<i32>,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

/// Now as a `MicroTime`.
pub fn micro_time_now() -> String {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    walcast_core::timestamp::format_rfc3339_micros(micros)
}

/// Why a call failed. Every kind may pass: the elector tries again at its next turn.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The API server answered with an error status (409: a concurrent write).
    #[error("the API server answered {status}: {message}")]
    Status { status: u16, message: String },
    #[error("connecting to the API server: {0}")]
    Connect(#[source] std::io::Error),
    #[error("HTTP with the API server: {0}")]
    Http(#[from] hyper::Error),
    #[error("the API server's answer: {0}")]
    Body(String),
    #[error("the API server's answer is not a Lease: {0}")]
    Json(#[from] serde_json::Error),
    #[error("reading the service account token {path}: {source}")]
    Token {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ApiError {
    /// A concurrent write won (409 `Conflict` or `AlreadyExists`).
    pub fn is_conflict(&self) -> bool {
        matches!(self, ApiError::Status { status: 409, .. })
    }
}

/// Why a client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid Kubernetes API URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    #[error("Kubernetes in-cluster configuration: {0}")]
    InCluster(String),
}

/// Where the API server is and how to talk to it.
#[derive(Clone)]
pub struct Client {
    host: String,
    port: u16,
    /// TLS (https), with the name the server's certificate must carry.
    tls: Option<(tokio_rustls::TlsConnector, ServerName<'static>)>,
    /// The bearer token's file, read at each request (projected tokens are rotated).
    token: Option<PathBuf>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// An explicit URL: `http://host:port` (tests) or `https://…`, trusting the cluster's
    /// CA when running in a pod, else the system's; the pod's token when there is one.
    pub fn for_url(url: &str) -> Result<Client, ConfigError> {
        let bad = |reason: &str| ConfigError::Url {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let (https, rest) = match url.split_once("://") {
            Some(("http", rest)) => (false, rest),
            Some(("https", rest)) => (true, rest),
            _ => return Err(bad("not an http:// or https:// URL")),
        };
        let authority = rest.trim_end_matches('/');
        if authority.contains('/') || authority.contains('@') || authority.is_empty() {
            return Err(bad("expected scheme://host[:port] only"));
        }
        let (host, port) = split_host_port(authority, if https { 443 } else { 80 })
            .ok_or_else(|| bad("bad host or port"))?;
        let sa = Path::new(SERVICE_ACCOUNT);
        let token = Some(sa.join("token")).filter(|p| p.exists());
        let tls = match https {
            false => None,
            true => {
                let ca = Some(sa.join("ca.crt")).filter(|p| p.exists());
                let name = ServerName::try_from(host.clone()).map_err(|e| bad(&e.to_string()))?;
                Some((connector(ca.as_deref()).map_err(|e| bad(&e))?, name))
            }
        };
        Ok(Client {
            host,
            port,
            tls,
            token,
        })
    }

    /// In a pod: `KUBERNETES_SERVICE_HOST`/`_PORT`, the service account's token and CA.
    pub fn in_cluster() -> Result<Client, ConfigError> {
        let env = |k: &str| {
            std::env::var(k)
                .map_err(|_| ConfigError::InCluster(format!("{k} is not set (not in a pod?)")))
        };
        let host = env("KUBERNETES_SERVICE_HOST")?;
        let port: u16 = env("KUBERNETES_SERVICE_PORT")?
            .parse()
            .map_err(|_| ConfigError::InCluster("KUBERNETES_SERVICE_PORT is not a port".into()))?;
        let sa = Path::new(SERVICE_ACCOUNT);
        let ca = sa.join("ca.crt");
        let name = ServerName::try_from(host.clone())
            .map_err(|e| ConfigError::InCluster(format!("KUBERNETES_SERVICE_HOST: {e}")))?;
        let tls = connector(Some(&ca)).map_err(ConfigError::InCluster)?;
        Ok(Client {
            host,
            port,
            tls: Some((tls, name)),
            token: Some(sa.join("token")),
        })
    }

    /// The Lease `name` of `namespace`; `None`: there is none (404).
    pub async fn get(&self, namespace: &str, name: &str) -> Result<Option<Lease>, ApiError> {
        match self
            .call(Method::GET, &lease_path(namespace, Some(name)), None)
            .await
        {
            Err(ApiError::Status { status: 404, .. }) => Ok(None),
            r => r.map(Some),
        }
    }

    /// Create `lease` (409 when it exists).
    pub async fn create(&self, namespace: &str, lease: &Lease) -> Result<Lease, ApiError> {
        let body = serde_json::to_vec(&with_kind(lease))?;
        self.call(Method::POST, &lease_path(namespace, None), Some(body))
            .await
    }

    /// Replace the Lease `name` with `lease`, whose `resourceVersion` must still be the
    /// stored one (409 when it is not).
    pub async fn replace(
        &self,
        namespace: &str,
        name: &str,
        lease: &Lease,
    ) -> Result<Lease, ApiError> {
        let body = serde_json::to_vec(&with_kind(lease))?;
        self.call(Method::PUT, &lease_path(namespace, Some(name)), Some(body))
            .await
    }

    async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Lease, ApiError> {
        let tcp = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(ApiError::Connect)?;
        let _ = tcp.set_nodelay(true);
        let req = self.request(method, path, body)?;
        let (status, bytes) = match &self.tls {
            None => exchange(tcp, req).await?,
            Some((connector, name)) => {
                let tls = connector
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(ApiError::Connect)?;
                exchange(tls, req).await?
            }
        };
        if !status.is_success() {
            return Err(ApiError::Status {
                status: status.as_u16(),
                message: status_message(&bytes),
            });
        }
        Ok(serde_json::from_slice(&bytes)?)
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<Request<Full<Bytes>>, ApiError> {
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, host_header(&self.host, self.port))
            .header(hyper::header::ACCEPT, "application/json");
        if body.is_some() {
            req = req.header(hyper::header::CONTENT_TYPE, "application/json");
        }
        if let Some(path) = &self.token {
            let token = std::fs::read_to_string(path).map_err(|source| ApiError::Token {
                path: path.clone(),
                source,
            })?;
            req = req.header(
                hyper::header::AUTHORIZATION,
                format!("Bearer {}", token.trim()),
            );
        }
        req.body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| ApiError::Body(e.to_string()))
    }
}

/// One request on a new connection: the status and the whole (bounded) body.
async fn exchange<S>(io: S, req: Request<Full<Bytes>>) -> Result<(StatusCode, Bytes), ApiError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let conn = tokio::spawn(conn);
    let result = async {
        let res = sender.send_request(req).await?;
        let status = res.status();
        let body = Limited::new(res.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| ApiError::Body(e.to_string()))?;
        Ok((status, body.to_bytes()))
    }
    .await;
    conn.abort();
    result
}

/// The `message` of a `Status` answer, else the start of the body.
fn status_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned())
}

fn lease_path(namespace: &str, name: Option<&str>) -> String {
    let base = format!(
        "/apis/coordination.k8s.io/v1/namespaces/{}/leases",
        path_segment(namespace)
    );
    match name {
        Some(n) => format!("{base}/{}", path_segment(n)),
        None => base,
    }
}

/// A name as one path segment: Kubernetes names are DNS labels or subdomains; anything
/// else is percent-encoded so that it can never change the path.
fn path_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The object with its `apiVersion` and `kind`, as the API wants them on a write.
fn with_kind(lease: &Lease) -> Lease {
    let mut l = lease.clone();
    l.rest
        .insert("apiVersion".into(), "coordination.k8s.io/v1".into());
    l.rest.insert("kind".into(), "Lease".into());
    l
}

/// The `Host` header: `host:port`, an IPv6 address in brackets.
fn host_header(host: &str, port: u16) -> String {
    match host.contains(':') {
        true => format!("[{host}]:{port}"),
        false => format!("{host}:{port}"),
    }
}

/// `host[:port]` (an IPv6 host in brackets).
fn split_host_port(authority: &str, default_port: u16) -> Option<(String, u16)> {
    let (host, port) = match authority.strip_prefix('[') {
        Some(v6) => {
            let (host, after) = v6.split_once(']')?;
            (host, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let port = match port {
        Some(p) => p.parse().ok()?,
        None => default_port,
    };
    (!host.is_empty()).then(|| (host.to_string(), port))
}

/// A TLS connector trusting the CA file `ca`, else the system's roots.
fn connector(ca: Option<&Path>) -> Result<tokio_rustls::TlsConnector, String> {
    const SYSTEM: &str = "/etc/ssl/certs/ca-certificates.crt";
    let path = ca.unwrap_or(Path::new(SYSTEM));
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("CA certificates {}: {e}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!("no usable CA certificate in {}", path.display()));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_keeps_what_walcast_does_not_read() {
        let text = r#"{"apiVersion":"coordination.k8s.io/v1","kind":"Lease",
            "metadata":{"name":"w","namespace":"ns","resourceVersion":"7","uid":"u1","labels":{"a":"b"}},
            "spec":{"holderIdentity":"pod-1","leaseDurationSeconds":15,"leaseTransitions":2,
                    "renewTime":"2026-12-03T08:00:00.123456Z","preferredHolder":"x"}}"#;
        let lease: Lease = serde_json::from_str(text).unwrap();
        assert_eq!(lease.metadata.resource_version.as_deref(), Some("7"));
        let spec = lease.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("pod-1"));
        assert_eq!(spec.lease_transitions, Some(2));
        let back: Value = serde_json::to_value(with_kind(&lease)).unwrap();
        let orig: Value = serde_json::from_str(text).unwrap();
        assert_eq!(back, orig);
    }

    #[test]
    fn a_released_lease_sends_no_holder() {
        let lease = Lease {
            spec: Some(LeaseSpec {
                lease_transitions: Some(3),
                ..LeaseSpec::default()
            }),
            ..Lease::default()
        };
        let v = serde_json::to_value(&lease).unwrap();
        assert_eq!(v["spec"], serde_json::json!({"leaseTransitions": 3}));
    }

    #[test]
    fn urls_and_names() {
        let c = Client::for_url("http://127.0.0.1:8080").unwrap();
        assert_eq!(
            (c.host.as_str(), c.port, c.tls.is_none()),
            ("127.0.0.1", 8080, true)
        );
        let v6 = Client::for_url("http://[::1]:81/").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 81));
        assert_eq!(host_header(&v6.host, v6.port), "[::1]:81");
        assert_eq!(Client::for_url("http://api").unwrap().port, 80);
        for bad in [
            "ftp://x",
            "http://x/path",
            "http://u@x",
            "http://x:port",
            "x:80",
        ] {
            assert!(Client::for_url(bad).is_err(), "{bad}");
        }
        assert_eq!(
            lease_path("ns", Some("a/../b")),
            "/apis/coordination.k8s.io/v1/namespaces/ns/leases/a%2F..%2Fb"
        );
        assert_eq!(
            lease_path("n s", None),
            "/apis/coordination.k8s.io/v1/namespaces/n%20s/leases"
        );
    }

    #[test]
    fn error_messages_come_from_the_status_object() {
        let body = br#"{"kind":"Status","status":"Failure","message":"the object has been modified","code":409}"#;
        assert_eq!(status_message(body), "the object has been modified");
        assert_eq!(status_message(b"oops"), "oops");
        let e = ApiError::Status {
            status: 409,
            message: String::new(),
        };
        assert!(e.is_conflict());
    }
}
