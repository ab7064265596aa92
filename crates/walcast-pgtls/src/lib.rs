//! TLS for every Postgres connection walcast makes — catalog, row-level security, lease
//! and the replication stream — with libpq's `sslmode` and `sslrootcert` parameters in the
//! connection URL (or key/value string), over rustls:
//!
//! | `sslmode` | TLS | server certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (default) | if the server offers it | not checked |
//! | `require` | always | not checked, unless `sslrootcert` is given (then as `verify-ca`) |
//! | `verify-ca` | always | signed by `sslrootcert` (or the system's roots) |
//! | `verify-full` | always | as `verify-ca`, and issued for the host connected to |
//!
//! tokio-postgres knows only `disable`, `prefer` and `require`: [`parse`] takes our two
//! parameters out of the string before it parses the rest. [`connect`] is the
//! tokio-postgres connection; [`negotiate`] upgrades a socket for the replication client,
//! which speaks the protocol itself.

mod verify;

use std::path::PathBuf;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::ClientConfig;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::config::SslMode as PgSslMode;

/// libpq's `sslmode` (`allow` is taken as `prefer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl std::str::FromStr for SslMode {
    type Err = PgTlsError;
    fn from_str(s: &str) -> Result<Self, PgTlsError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(PgTlsError::Config(format!(
                    "unknown sslmode {other:?} (expected disable, prefer, require, verify-ca or verify-full)"
                )))
            }
        })
    }
}

/// What a connection string asks of TLS.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert`: PEM file of the CA certificates to trust.
    pub root_cert: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum PgTlsError {
    #[error("connection string: {0}")]
    Config(String),
    #[error("sslrootcert {path:?}: {reason}")]
    RootCert { path: PathBuf, reason: String },
    #[error("the server does not accept TLS connections, and sslmode={0:?} requires TLS")]
    NotOffered(SslMode),
    #[error("TLS handshake with {host}: {source}")]
    Handshake {
        host: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Take `sslmode` and `sslrootcert` out of a URL (`postgres://…?sslmode=…`) or key/value
/// string, and parse the rest. The returned config asks tokio-postgres for TLS as the
/// mode needs (`disable`, `prefer`, or `require` for the three that insist on it).
pub fn parse(conn: &str) -> Result<(tokio_postgres::Config, TlsSettings), PgTlsError> {
    let (rest, params) = if conn.contains("://") {
        split_url(conn)
    } else {
        split_key_values(conn)
    };
    let mut settings = TlsSettings {
        mode: SslMode::Prefer,
        root_cert: None,
    };
    for (k, v) in params {
        match k.as_str() {
            "sslmode" => settings.mode = v.parse()?,
            _ => settings.root_cert = Some(PathBuf::from(v)),
        }
    }
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e| PgTlsError::Config(format!("invalid connection string: {e}")))?;
    config.ssl_mode(match settings.mode {
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        _ => PgSslMode::Require,
    });
    Ok((config, settings))
}

fn is_ours(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert"
}

fn split_url(url: &str) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), Vec::new());
    };
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if is_ours(k) {
            ours.push((k.to_string(), percent_decode(v)));
        } else {
            kept.push(pair);
        }
    }
    let rest = match kept.is_empty() {
        true => base.to_string(),
        false => format!("{base}?{}", kept.join("&")),
    };
    (rest, ours)
}

fn split_key_values(s: &str) -> (String, Vec<(String, String)>) {
    let mut kept = Vec::new();
    let mut ours = Vec::new();
    for token in s.split_whitespace() {
        match token.split_once('=') {
            Some((k, v)) if is_ours(k.trim()) => {
                ours.push((k.trim().to_string(), v.trim_matches('\'').to_string()))
            }
            _ => kept.push(token),
        }
    }
    (kept.join(" "), ours)
}

/// `%XX` escapes (a path in a URL query may carry them).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| {
            std::str::from_utf8(h)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        });
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The rustls configuration for these settings (`None`: no TLS at all).
pub fn client_config(s: &TlsSettings) -> Result<Option<Arc<ClientConfig>>, PgTlsError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgTlsError::Config(format!("TLS versions: {e}")))?;
    let verify = match (s.mode, &s.root_cert) {
        (SslMode::Disable, _) => return Ok(None),
        (SslMode::Prefer, _) | (SslMode::Require, None) => verify::Check::Nothing,
        (SslMode::Require | SslMode::VerifyCa, _) => verify::Check::Chain,
        (SslMode::VerifyFull, _) => verify::Check::ChainAndName,
    };
    let verifier = verify::verifier(verify, roots(s)?, provider)?;
    let config = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(Some(Arc::new(config)))
}

/// The CA certificates to trust: `sslrootcert`, else the system's.
fn roots(s: &TlsSettings) -> Result<rustls::RootCertStore, PgTlsError> {
    let mut store = rustls::RootCertStore::empty();
    let Some(path) = &s.root_cert else {
        let found = rustls_native_certs_fallback();
        store.add_parsable_certificates(found);
        return Ok(store);
    };
    let bad = |reason: String| PgTlsError::RootCert {
        path: path.clone(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no PEM certificate in it".into()));
    }
    let (added, _) = store.add_parsable_certificates(certs);
    if added == 0 {
        return Err(bad("no usable CA certificate in it".into()));
    }
    Ok(store)
}

/// The system's CA bundle (Debian's ca-certificates), when no `sslrootcert` is given.
fn rustls_native_certs_fallback() -> Vec<CertificateDer<'static>> {
    const BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
    CertificateDer::pem_file_iter(BUNDLE)
        .map(|it| it.filter_map(Result::ok).collect())
        .unwrap_or_default()
}

/// A tokio-postgres client for `conn`, TLS as its `sslmode` says; the connection task is
/// spawned and logs when it ends.
pub async fn connect(conn: &str) -> Result<tokio_postgres::Client, ConnectError> {
    let (config, settings) = parse(conn)?;
    let client = match client_config(&settings)? {
        None => {
            let (client, c) = config.connect(tokio_postgres::NoTls).await?;
            tokio::spawn(log_end(c));
            client
        }
        Some(tls) => {
            let make = tokio_postgres_rustls::MakeRustlsConnect::new((*tls).clone());
            let (client, c) = config.connect(make).await?;
            tokio::spawn(log_end(c));
            client
        }
    };
    Ok(client)
}

/// Ask the server to cancel what `token`'s session is running (a new connection to the
/// same server, TLS as `conn`'s `sslmode` says).
pub async fn cancel(conn: &str, token: &tokio_postgres::CancelToken) -> Result<(), ConnectError> {
    let (_, settings) = parse(conn)?;
    match client_config(&settings)? {
        None => token.cancel_query(tokio_postgres::NoTls).await?,
        Some(tls) => {
            let make = tokio_postgres_rustls::MakeRustlsConnect::new((*tls).clone());
            token.cancel_query(make).await?
        }
    }
    Ok(())
}

async fn log_end<F: std::future::Future<Output = Result<(), tokio_postgres::Error>>>(c: F) {
    if let Err(e) = c.await {
        tracing::warn!(error = %e, "postgres connection ended");
    }
}

/// Why [`connect`] failed: the connection string or TLS setup, or Postgres itself.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Tls(#[from] PgTlsError),
    #[error("{}", db_message(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

/// A socket after TLS negotiation: plain or encrypted.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// Negotiate TLS on a fresh socket to `host` as the settings say (the protocol's
/// `SSLRequest`): the stream to speak the startup message on.
pub async fn negotiate(
    mut sock: TcpStream,
    host: &str,
    settings: &TlsSettings,
) -> Result<Box<dyn Io>, PgTlsError> {
    let Some(config) = client_config(settings)? else {
        return Ok(Box::new(sock));
    };
    // SSLRequest: length 8, code 80877103.
    sock.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
        .await?;
    let mut answer = [0u8; 1];
    sock.read_exact(&mut answer).await?;
    match (answer[0], settings.mode) {
        (b'S', _) => {}
        (_, SslMode::Prefer) => return Ok(Box::new(sock)),
        (_, mode) => return Err(PgTlsError::NotOffered(mode)),
    }
    let name = ServerName::try_from(host.to_string())
        .map_err(|e| PgTlsError::Config(format!("host {host:?}: {e}")))?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, sock)
        .await
        .map_err(|source| PgTlsError::Handshake {
            host: host.to_string(),
            source,
        })?;
    Ok(Box::new(tls))
}

/// A database error with the server's message, severity and SQLSTATE (tokio-postgres'
/// own display says only "db error").
pub fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => format!("{}: {} ({})", d.severity(), d.message(), d.code().code()),
        None => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_parameters_are_taken_out_and_the_rest_parsed() {
        let (c, s) =
            parse("postgres://u:p@db:5433/app?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x")
                .unwrap();
        assert_eq!(s.mode, SslMode::VerifyFull);
        assert_eq!(s.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(c.get_ssl_mode(), PgSslMode::Require);
        assert_eq!(c.get_application_name(), Some("x"));
        assert_eq!(c.get_ports(), [5433]);

        let (c, s) = parse("host=db user=u sslmode=verify-ca sslrootcert=/ca.pem").unwrap();
        assert_eq!(s.mode, SslMode::VerifyCa);
        assert_eq!(c.get_user(), Some("u"));

        let (c, s) = parse("postgres://u@db/app").unwrap();
        assert_eq!(
            (s.mode, c.get_ssl_mode()),
            (SslMode::Prefer, PgSslMode::Prefer)
        );
        let (c, _) = parse("postgres://u@db/app?sslmode=disable").unwrap();
        assert_eq!(c.get_ssl_mode(), PgSslMode::Disable);
    }

    #[test]
    fn bad_settings_are_clear_errors() {
        let e = parse("postgres://u@db/app?sslmode=verify").unwrap_err();
        assert!(e.to_string().contains("unknown sslmode"), "{e}");
        let s = TlsSettings {
            mode: SslMode::VerifyFull,
            root_cert: Some("/nonexistent/ca.pem".into()),
        };
        let e = client_config(&s).unwrap_err();
        assert!(matches!(e, PgTlsError::RootCert { .. }), "{e}");
        assert!(client_config(&TlsSettings {
            mode: SslMode::Disable,
            root_cert: None
        })
        .unwrap()
        .is_none());
    }
}
