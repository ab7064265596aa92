//! `walcast realtime enable|disable|list`: which tables are streamed.

use anyhow::Context;
use clap::{Args, Subcommand};
use walcast_control::tables as realtime_tables;
use walcast_core::sql::parse_qualified_name;

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct RealtimeArgs {
    /// Postgres connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    /// Project the table belongs to.
    #[arg(long, env = "WALCAST_PROJECT", default_value = realtime_tables::DEFAULT_PROJECT, global = true)]
    pub project: String,
    #[command(subcommand)]
    pub action: RealtimeAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum RealtimeAction {
    /// Stream a table's changes (also sets REPLICA IDENTITY FULL). Name: `table`,
    /// `schema.table`, SQL quoting allowed: `'"My Schema"."My Table"'`.
    Enable { table: String },
    /// Stop streaming a table.
    Disable { table: String },
    /// List the streamed tables.
    List,
}

pub async fn realtime(args: RealtimeArgs) -> anyhow::Result<()> {
    let database_url = super::database_url(&args.database_url)?;
    walcast_worker::database::migrate(database_url).await?;
    let client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    match args.action {
        RealtimeAction::Enable { table } => {
            let (schema, name) =
                parse_qualified_name(&table).with_context(|| format!("table name {table:?}"))?;
            realtime_tables::enable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            println!("realtime enabled for {q}");
            // Subscribers read as their JWT role: say so when the usual roles cannot.
            let blind =
                realtime_tables::unreadable_by(&client, &schema, &name, realtime_tables::API_ROLES)
                    .await?;
            if let Some(note) = realtime_tables::unreadable_note(&schema, &name, &blind) {
                println!("note: {note}");
            }
        }
        RealtimeAction::Disable { table } => {
            let (schema, name) =
                parse_qualified_name(&table).with_context(|| format!("table name {table:?}"))?;
            let was = realtime_tables::disable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            if was {
                println!("realtime disabled for {q}");
            } else {
                println!("realtime was not enabled for {q}");
            }
        }
        RealtimeAction::List => {
            for t in realtime_tables::list(&client, Some(&args.project)).await? {
                println!("{t}");
            }
        }
    }
    Ok(())
}
