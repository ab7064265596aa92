//! The database a process reads and the sources it may lead.

use clap::Args;
use walcast_pipeline::config as pipeline;

/// A database this worker may read (see [`walcast_bus::source`]): its name, its URLs and
/// its slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceSpec {
    pub name: String,
    pub database_url: String,
    pub replication_url: String,
    pub slot_name: String,
    /// The check login's URL on the source's database (`None`: not set, the source is
    /// refused until it is).
    pub check_url: Option<String>,
}

/// The logical replication slot's default name.
pub const DEFAULT_SLOT_NAME: &str = pipeline::DEFAULT_SLOT_NAME;

#[derive(Args, Clone, Debug)]
pub struct DbArgs {
    /// Postgres connection URL (tables, registry, RLS checks).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Connection URL for the replication slot; defaults to DATABASE_URL.
    #[arg(long, env = "POSTGRES_REPLICATION_URL", hide_env_values = true)]
    pub replication_url: Option<String>,
    /// Connection URL of the check login: the login, with no privileges of its own,
    /// that runs the SQL tenants write (row-level security and private-channel
    /// policies, SSE snapshots). Required by the processes that check (cdc-worker,
    /// `walcast serve`); refused at start if it is DATABASE_URL's login or may do more
    /// than act as the roles tokens act as (see docs/security.md).
    #[arg(long, env = "CHECK_DATABASE_URL", hide_env_values = true)]
    pub check_database_url: Option<String>,
}

impl DbArgs {
    pub fn replication_url(&self) -> &str {
        self.replication_url
            .as_deref()
            .unwrap_or(&self.database_url)
    }
}
