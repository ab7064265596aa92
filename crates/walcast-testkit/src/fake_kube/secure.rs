//! The fake API server over TLS, authenticating its clients as the real one does: a client
//! certificate signed by the client CA (asked for, not required, at the handshake; one
//! that does not verify fails the handshake), or the bearer token; any other request is
//! answered 401 `Unauthorized` and counted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::serve::{IncomingStream, Listener};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::{lock, status, Shared};

/// An endpoint's TLS and who it lets in.
#[derive(Clone, Debug)]
pub struct Secure {
    /// The server's certificate (for `127.0.0.1`) and key, PEM.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Clients with a certificate this CA signed are authenticated.
    pub client_ca: Option<PathBuf>,
    /// Requests carrying `Authorization: Bearer <token>` are authenticated.
    pub token: Option<String>,
}

/// Accepts TCP connections and completes their TLS handshake (bounded: a client that does
/// not finish it is dropped, the next one accepted).
pub(super) struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl TlsListener {
    pub(super) fn new(tcp: TcpListener, secure: &Secure) -> Self {
        TlsListener {
            tcp,
            acceptor: TlsAcceptor::from(Arc::new(server_config(secure))),
        }
    }
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let handshake = self.acceptor.accept(tcp);
            if let Ok(Ok(tls)) = tokio::time::timeout(Duration::from_secs(5), handshake).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

/// What the handshake established about the client.
#[derive(Clone, Copy, Debug)]
pub(super) struct Peer {
    /// It presented a certificate, which the client CA verified.
    client_cert: bool,
}

impl Connected<IncomingStream<'_, TlsListener>> for Peer {
    fn connect_info(stream: IncomingStream<'_, TlsListener>) -> Self {
        let (_, session) = stream.io().get_ref();
        Peer {
            client_cert: session.peer_certificates().is_some_and(|c| !c.is_empty()),
        }
    }
}

/// Who may pass, for [`authenticate`].
#[derive(Clone)]
pub(super) struct Gate {
    pub(super) shared: Arc<Shared>,
    pub(super) client: String,
    pub(super) token: Option<String>,
}

/// Let an authenticated request through; answer any other 401, as the API server does.
pub(super) async fn authenticate(
    State(gate): State<Gate>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    req: Request,
    next: Next,
) -> Response {
    let bearer = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let by_token = gate.token.is_some() && bearer == gate.token.as_deref();
    if peer.client_cert || by_token {
        return next.run(req).await;
    }
    *lock(&gate.shared.unauthorized)
        .entry(gate.client.clone())
        .or_default() += 1;
    status(
        StatusCode::UNAUTHORIZED,
        "Unauthorized",
        "Unauthorized".to_string(),
    )
}

fn server_config(secure: &Secure) -> rustls::ServerConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&secure.cert)
        .and_then(|it| it.collect())
        .expect("the fake API server's certificate");
    let key = PrivateKeyDer::from_pem_file(&secure.key).expect("the fake API server's key");
    let verifier = match &secure.client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).expect("the client CA") {
                roots
                    .add(c.expect("a client CA certificate"))
                    .expect("a usable client CA");
            }
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .allow_unauthenticated()
                .build()
                .expect("the client certificate verifier")
        }
        None => WebPkiClientVerifier::no_client_auth(),
    };
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .expect("the fake API server's TLS configuration")
}
