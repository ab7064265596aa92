use std::path::PathBuf;

/// Why a throwaway service could not be provided.
#[derive(Debug, thiserror::Error)]
pub enum KitError {
    #[error("{what} not found. Install it with: {install}")]
    Missing { what: String, install: String },
    #[error("io error while {context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`{command}` failed with {status}: {output}")]
    Command {
        command: String,
        status: String,
        output: String,
    },
    #[error("{service} did not become ready within {seconds} s; log {log}:\n{tail}")]
    NotReady {
        service: &'static str,
        seconds: u64,
        log: PathBuf,
        tail: String,
    },
}

impl KitError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        KitError::Io {
            context: context.into(),
            source,
        }
    }
}
