//! The crate's error type.

use std::fmt;

/// Everything that can go wrong while connecting, authenticating or streaming.
#[derive(thiserror::Error, Debug)]
pub enum ReplError {
    /// The socket failed (connect, read or write).
    #[error("I/O error talking to Postgres: {0}")]
    Io(#[from] std::io::Error),
    /// The server sent something this client does not understand or did not expect
    /// (malformed, truncated or out-of-sequence messages).
    #[error("replication protocol error: {0}")]
    Protocol(String),
    /// An `ErrorResponse` from the server, with its SQLSTATE `code` (e.g. `55006` when the
    /// slot is active for another process, `42704` when it does not exist).
    #[error("server error {code}: {message}{}", DetailSuffix(detail))]
    Server {
        code: String,
        message: String,
        detail: Option<String>,
    },
    /// Authentication failed or needs a method this client does not support. Includes the
    /// server's rejection of a password (SQLSTATE class 28).
    #[error("authentication failed: {0}")]
    Auth(String),
    /// The connection string is invalid or asks for something unsupported.
    #[error("connection settings: {0}")]
    Config(String),
    /// TLS could not be set up as `sslmode` asks (bad root certificate, the server does
    /// not offer TLS, the certificate is not trusted …).
    #[error("TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    /// The server closed the connection, or the stream was already finished or failed.
    #[error("replication connection closed")]
    Closed,
}

impl ReplError {
    /// The SQLSTATE code of a [`ReplError::Server`] error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ReplError::Server { code, .. } => Some(code),
            _ => None,
        }
    }
}

struct DetailSuffix<'a>(&'a Option<String>);

impl fmt::Display for DetailSuffix<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(d) => write!(f, " ({d})"),
            None => Ok(()),
        }
    }
}
