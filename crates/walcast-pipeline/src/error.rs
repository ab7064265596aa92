//! The pipeline's errors, each keeping its cause as a source, and the one question the
//! retry loop asks of them: can a retry help ([`Retry`])?

use walcast_lease::Fenced;
use walcast_pgtls::db_message;

use crate::preflight::PreflightError;

/// What retrying can do about a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// A transient fault (a connection lost, a slot still held, a server restarting):
    /// the session is retried with backoff.
    Backoff,
    /// Configuration the operator must change: the pipeline stops and says what to fix.
    Never,
    /// The leadership term ended (its fence closed): this term stops quietly, having
    /// published and acknowledged nothing more.
    Fenced,
}

/// Any error a consumer may return, boxed.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A consumer's failure: its own error, kept whole as the source, and the consumer's
/// judgement of whether a retry can help.
#[derive(Debug)]
pub struct ConsumerError {
    retry: Retry,
    source: BoxError,
}

impl ConsumerError {
    pub fn new(retry: Retry, source: impl Into<BoxError>) -> ConsumerError {
        ConsumerError {
            retry,
            source: source.into(),
        }
    }

    /// A transient failure: retried with backoff.
    pub fn transient(source: impl Into<BoxError>) -> ConsumerError {
        ConsumerError::new(Retry::Backoff, source)
    }

    pub fn retry(&self) -> Retry {
        self.retry
    }

    /// The consumer's own error, to downcast.
    pub fn inner(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.source.as_ref()
    }
}

impl std::fmt::Display for ConsumerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.source.fmt(f)
    }
}

impl std::error::Error for ConsumerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}

impl From<Fenced> for ConsumerError {
    fn from(e: Fenced) -> ConsumerError {
        ConsumerError::new(Retry::Fenced, e)
    }
}

/// Why a wal2json line could not be read as a step of a transaction.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not UTF-8")]
    Utf8(#[from] std::str::Utf8Error),
    #[error(transparent)]
    Wal2json(#[from] walcast_wal2json::DecodeError),
    #[error("not a position: {0:?}")]
    Lsn(String),
    /// The line decodes but breaks the framing wal2json was asked for.
    #[error("{0}")]
    Framing(&'static str),
}

#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("cannot decode wal2json output ({source}): {line}")]
    Decode {
        #[source]
        source: DecodeError,
        line: String,
    },
    #[error("replication slot {0:?} was lost (WAL removed past max_slot_wal_keep_size)")]
    SlotLost(String),
    #[error("replication slot {0:?} disappeared")]
    SlotMissing(String),
    #[error("replication stream: {0}")]
    Repl(#[from] walcast_pgrepl::ReplError),
    #[error("the server ended the replication stream")]
    StreamEnded,
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    /// A consumer failed; it said whether a retry can help.
    #[error("{consumer}: {source}")]
    Consumer {
        consumer: &'static str,
        #[source]
        source: ConsumerError,
    },
    /// Our leadership term's fence closed: stop, publish and acknowledge nothing more.
    #[error(transparent)]
    Fenced(#[from] Fenced),
}

impl PipelineError {
    /// Whether retrying the session can help.
    pub fn retry(&self) -> Retry {
        match self {
            PipelineError::Preflight(e) if e.is_fatal() => Retry::Never,
            PipelineError::Consumer { source, .. } => source.retry(),
            PipelineError::Fenced(_) => Retry::Fenced,
            _ => Retry::Backoff,
        }
    }

    pub(crate) fn decode(source: impl Into<DecodeError>, line: &str) -> PipelineError {
        PipelineError::Decode {
            source: source.into(),
            line: excerpt(line),
        }
    }
}

/// The start of a line, for errors and logs.
pub(crate) fn excerpt(line: &str) -> String {
    line.chars().take(300).collect()
}

impl From<walcast_pgtls::ConnectError> for PipelineError {
    fn from(e: walcast_pgtls::ConnectError) -> PipelineError {
        match e {
            walcast_pgtls::ConnectError::Tls(e) => PipelineError::Tls(e),
            walcast_pgtls::ConnectError::Postgres(e) => PipelineError::Db(e),
        }
    }
}
