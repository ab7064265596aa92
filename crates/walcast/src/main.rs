//! `walcast`: the all-in-one server and the operator's commands, one module each in
//! [`cmd`]. The commands (not `serve`) also take their settings from a `.env` file in
//! the working directory.

mod cmd;

use clap::{Parser, Subcommand};

/// walcast: streams Postgres changes in real time.
#[derive(Parser, Debug)]
#[command(name = "walcast", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// All-in-one server: the CDC pipeline and the realtime front (WebSocket, SSE) in one
    /// process.
    Serve(Box<cmd::serve::ServeConfig>),
    /// Apply walcast's SQL migrations and exit; with SECRETS_KEY, also encrypt the
    /// secrets still stored in plain text (without, refused while there are any).
    Migrate {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[command(flatten)]
        secrets: walcast_worker::config::SecretsArgs,
    },
    /// The secrets stored in the database (projects' JWT secrets, sources' URLs):
    /// rewrite them under SECRETS_KEY, or count them by key.
    Secrets(cmd::secrets::SecretsCmd),
    /// Manage which tables are streamed.
    Realtime(cmd::realtime::RealtimeArgs),
    /// Manage which tables store their changes in the JetStream change stream.
    Changes(cmd::changes::ChangesArgs),
    /// Publish a table's current rows on its change stream (READ events, consistent with
    /// its changes): start, status, cancel.
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Create and list projects (tenants with their own schema and keys).
    Project(cmd::project::ProjectArgs),
    /// Add, list and remove sources: other databases this deployment reads (projects on
    /// them have their schema there).
    Source(cmd::source::SourceArgs),
    /// Print change events from NATS as JSON lines.
    Tail(cmd::tail::TailArgs),
    /// Print a signed API key / access token (HS256 JWT) for a role.
    Key(cmd::key::KeyArgs),
    /// Inspect or drop the logical replication slot (to remove walcast cleanly).
    Slot(cmd::slot::SlotArgs),
    /// The transactional outbox: create and list outbox tables, redrive quarantined
    /// events, replay retained ones.
    Outbox(cmd::outbox::OutboxCmd),
}

/// The file the operator's commands take settings from, in the working directory
/// (`./dev/up` writes one): a variable the environment sets wins.
pub const ENV_FILE: &str = ".env";

/// Read [`ENV_FILE`] unless the command is `serve` (a server's configuration is its
/// environment alone); a file that exists but cannot be read is an error naming it.
fn load_env_file() -> anyhow::Result<()> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return Ok(());
    }
    match dotenvy::from_filename(ENV_FILE) {
        Ok(_) => Ok(()),
        Err(e) if e.not_found() => Ok(()),
        Err(e) => Err(anyhow::anyhow!(
            "reading {ENV_FILE} in the working directory: {e}"
        )),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    load_env_file()?;
    match Cli::parse().command {
        Command::Serve(cfg) => cmd::serve::serve(*cfg).await,
        Command::Migrate {
            database_url,
            secrets,
        } => {
            let keys = secrets.keys_if_set()?;
            cmd::migrate::migrate_command(&database_url, keys.as_deref()).await
        }
        Command::Secrets(cmd) => cmd::secrets::secrets(cmd).await,
        Command::Realtime(args) => cmd::realtime::realtime(args).await,
        Command::Changes(args) => cmd::changes::changes(args).await,
        Command::Snapshot(args) => cmd::snapshot::snapshot(args).await,
        Command::Project(args) => cmd::project::project(args).await,
        Command::Source(args) => cmd::source::source(args).await,
        Command::Tail(args) => cmd::tail::tail(args).await,
        Command::Key(args) => cmd::key::key(args),
        Command::Slot(args) => cmd::slot::slot(args).await,
        Command::Outbox(cmd) => cmd::outbox::outbox(cmd).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn connection_options_go_before_or_after_the_subcommand() {
        use clap::Parser;
        for args in [
            &[
                "walcast",
                "realtime",
                "--database-url",
                "postgres://x",
                "list",
            ][..],
            &[
                "walcast",
                "realtime",
                "list",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "changes",
                "enable",
                "t",
                "--project",
                "p",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "project",
                "list",
                "--database-url",
                "postgres://x",
            ],
        ] {
            assert!(super::Cli::try_parse_from(args).is_ok(), "{args:?}");
        }
    }

    #[test]
    fn help_shows_no_secret_environment_value() {
        let shown = walcast_worker::config::secret_envs_shown(&super::Cli::command());
        assert_eq!(shown, Vec::<String>::new());
    }
}
