//! The control plane's errors that other crates carry as a source (each keeps its cause):
//! the database of a control read, the realtime-tables registry, the migrations. The
//! errors of one operation (projects, sources, secrets) live beside it.

use walcast_pgtls::db_message;

/// A read of the control database (the projects of a source, a check-login session).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("database: {}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
}

impl From<walcast_pgtls::ConnectError> for ControlError {
    fn from(e: walcast_pgtls::ConnectError) -> ControlError {
        match e {
            walcast_pgtls::ConnectError::Tls(e) => ControlError::Tls(e),
            walcast_pgtls::ConnectError::Postgres(e) => ControlError::Db(e),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RealtimeTablesError {
    #[error("table {0} does not exist (or is not a plain or partitioned table)")]
    UnknownTable(String),
    #[error("table {0} has no primary key; realtime needs one to identify rows")]
    NoPrimaryKey(String),
    #[error("table {0} is partitioned: wal2json names each change by the partition that holds the row, so walcast cannot stream it under its own name; enable its partitions instead")]
    Partitioned(String),
    #[error("table {table} is already enabled for project {project:?}; a table streams for one project only (disable it there first)")]
    OtherProject { table: String, project: String },
    #[error("{}", db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("migration {version} ({name}) failed: {source}")]
    Failed {
        version: i32,
        name: &'static str,
        #[source]
        source: tokio_postgres::Error,
    },
    #[error("migration bookkeeping failed: {0}")]
    Db(#[from] tokio_postgres::Error),
}
