//! Snapshots (README "Change streams"): the operator's `walcast snapshot
//! start|status|cancel`. The source's leader reads a queued snapshot and publishes the
//! table's rows on its change stream as `READ` events (`walcast_changes::snapshot`).

use anyhow::Context;
use clap::{Args, Subcommand};
use walcast_changes::snapshot::store::{self, Snapshot};

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct SnapshotArgs {
    /// Postgres connection URL of the table's database (walcast's own role). Before or
    /// after the subcommand, as --project.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    /// The project whose change stream carries the table.
    #[arg(long, env = "WALCAST_PROJECT", default_value = walcast_core::DEFAULT_PROJECT, global = true)]
    pub project: String,
    #[command(subcommand)]
    pub action: SnapshotAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SnapshotAction {
    /// Queue a snapshot of a table whose change stream is on: its current rows are
    /// published on the stream as READ events, in order with its changes. Name: `table`,
    /// `schema.table`, SQL quoting allowed. Prints the snapshot's id.
    Start {
        table: String,
        /// Only rows matching a `postgres_changes` filter (`status=eq.open`,
        /// `id=in.(1,2)`, conditions separated by commas).
        #[arg(long = "where", default_value = "")]
        filter: String,
    },
    /// The project's snapshots, newest first, with their progress.
    Status {
        /// How many to show.
        #[arg(long, default_value_t = 20)]
        limit: i64,
        /// JSON lines instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Cancel a queued or running snapshot (what was published stays published).
    Cancel { id: i64 },
}

/// `walcast snapshot …`.
pub async fn snapshot(args: SnapshotArgs) -> anyhow::Result<()> {
    let database_url = super::database_url(&args.database_url)?;
    walcast_worker::database::migrate(database_url).await?;
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    match &args.action {
        SnapshotAction::Start { table, filter } => {
            let id = store::start_named(&mut client, &args.project, table, filter).await?;
            println!("{id}");
        }
        SnapshotAction::Status { limit, json } => {
            let all = store::list(&client, Some(&args.project), *limit).await?;
            for s in &all {
                match json {
                    true => println!("{}", serde_json::to_string(s)?),
                    false => println!("{}", status_line(s)),
                }
            }
        }
        SnapshotAction::Cancel { id } => match store::cancel(&client, &args.project, *id).await? {
            true => println!("snapshot {id} cancelled"),
            false => anyhow::bail!(
                "snapshot {id} of project {:?} is not queued nor running",
                args.project
            ),
        },
    }
    Ok(())
}

/// `12 running public.orders 4000/10000 rows (40%) 4 chunks`.
fn status_line(s: &Snapshot) -> String {
    let table = format!("{}.{}", s.schema, s.table);
    let pct = match s.rows_estimate {
        0 => String::new(),
        e => format!(" ({}%)", (s.rows_done * 100 / e).min(100)),
    };
    let mut line = format!(
        "{} {} {table} {}/{} rows{pct} {} chunks",
        s.id, s.state, s.rows_done, s.rows_estimate, s.chunks_done
    );
    if !s.filter.is_empty() {
        line.push_str(&format!(" where {}", s.filter));
    }
    if let Some(e) = &s.error {
        line.push_str(&format!(" error: {e}"));
    }
    line
}
