use anyhow::Context;
use clap::{Parser, Subcommand};
use walcast::commands::{RealtimeArgs, TailArgs};
use walcast::config::{CdcArgs, DbArgs, HttpArgs, LogArgs};
use walcast_bus::Bus;

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
    Serve(Box<ServeConfig>),
    /// Apply walcast's SQL migrations and exit; with SECRETS_KEY, also encrypt the
    /// secrets still stored in plain text (without, refused while there are any).
    Migrate {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[command(flatten)]
        secrets: walcast::config::SecretsArgs,
    },
    /// The secrets stored in the database (projects' JWT secrets, sources' URLs):
    /// rewrite them under SECRETS_KEY, or count them by key.
    Secrets(walcast::secrets::SecretsCmd),
    /// Manage which tables are streamed.
    Realtime(RealtimeArgs),
    /// Manage which tables store their changes in the JetStream change stream.
    Changes(walcast::changes::ChangesArgs),
    /// Publish a table's current rows on its change stream (READ events, consistent with
    /// its changes): start, status, cancel.
    Snapshot(walcast::snapshot::SnapshotArgs),
    /// Create and list projects (tenants with their own schema and keys).
    Project(walcast::project::ProjectArgs),
    /// Add, list and remove sources: other databases this deployment reads (projects on
    /// them have their schema there).
    Source(walcast::source::SourceArgs),
    /// Print change events from NATS as JSON lines.
    Tail(TailArgs),
    /// Print a signed API key / access token (HS256 JWT) for a role.
    Key(walcast::commands::KeyArgs),
    /// Inspect or drop the logical replication slot (to remove walcast cleanly).
    Slot(walcast::slot::SlotArgs),
    /// The transactional outbox: create and list outbox tables, redrive quarantined
    /// events, replay retained ones.
    Outbox(walcast::outbox::OutboxCmd),
}

#[derive(clap::Args, Debug, Clone)]
struct ServeConfig {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    cdc: CdcArgs,
    #[command(flatten)]
    secrets: walcast::config::SecretsArgs,
    /// NATS server; unset = in-process bus (single process, no scale-out).
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    nats_url: Option<String>,
    #[command(flatten)]
    nats_auth: walcast::config::NatsAuthArgs,
    /// In-process bus queue size per subscriber (when NATS_URL is unset).
    #[arg(long, env = "BUS_CAPACITY", default_value_t = 65_536)]
    bus_capacity: usize,
    #[command(flatten)]
    front: walcast::front::FrontArgs,
    #[command(flatten)]
    http: HttpArgs,
    #[command(flatten)]
    log: LogArgs,
}

async fn serve(cfg: ServeConfig) -> anyhow::Result<()> {
    walcast::telemetry::init_logs(&cfg.log);
    cfg.front.validate()?;
    let keys = cfg.secrets.keys()?;
    cfg.front.operator.warn_if_none();
    let mut described =
        walcast::cdc_worker::describe(&cfg.db, &cfg.cdc, cfg.nats_url.as_deref(), &cfg.http);
    described["front"] = cfg.front.describe();
    described["secrets"] = walcast::config::SecretsArgs::describe(&keys);
    described["nats_auth"] = cfg.nats_auth.describe();
    tracing::info!(config = %described, "walcast serve starting");
    let metrics = walcast::telemetry::init_metrics()?;
    let origin = walcast::cdc_worker::instance_id();
    let bus = match &cfg.nats_url {
        Some(url) => Bus::nats_with(
            url,
            &format!("walcast-{origin}"),
            &cfg.nats_auth.auth().inbox_for("worker"),
        )
        .await
        .with_context(|| format!("connecting to NATS at {}", walcast::config::redact_url(url)))?,
        None => Bus::local(cfg.bus_capacity),
    };
    let ops = walcast::http::OpsHttp {
        listener: cfg.http.bind().await?,
        metrics,
        key: cfg.front.operator.key(),
    };
    let cancel = walcast::shutdown::on_signal();
    walcast::serve::run(&cfg.db, &cfg.cdc, keys, &cfg.front, bus, ops, cancel).await
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Serve(cfg) => serve(*cfg).await,
        Command::Migrate {
            database_url,
            secrets,
        } => {
            let keys = secrets.keys_if_set()?;
            walcast::secrets::migrate_command(&database_url, keys.as_deref()).await
        }
        Command::Secrets(cmd) => walcast::secrets::secrets(cmd).await,
        Command::Realtime(args) => walcast::commands::realtime(args).await,
        Command::Changes(args) => walcast::changes::changes(args).await,
        Command::Snapshot(args) => walcast::snapshot::snapshot(args).await,
        Command::Project(args) => walcast::project::project(args).await,
        Command::Source(args) => walcast::source::source(args).await,
        Command::Tail(args) => walcast::commands::tail(args).await,
        Command::Key(args) => walcast::commands::key(args),
        Command::Slot(args) => walcast::slot::slot(args).await,
        Command::Outbox(cmd) => walcast::outbox::outbox(cmd).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn help_shows_no_secret_environment_value() {
        let shown = walcast::config::secret_envs_shown(&super::Cli::command());
        assert_eq!(shown, Vec::<String>::new());
    }
}
