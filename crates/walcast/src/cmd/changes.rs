//! Change streams (README "Change streams"): the operator's `walcast changes
//! enable|disable|list` (the worker's settings: `walcast_worker::config::changes`).

use anyhow::Context;
use clap::{Args, Subcommand};
use walcast_changes::tables as change_streams;
use walcast_core::sql::parse_qualified_name;

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct ChangesArgs {
    /// Postgres connection URL (walcast's own role: nobody else may change the list).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    /// Project the table belongs to (its realtime project, when it has one).
    #[arg(long, env = "WALCAST_PROJECT", default_value = walcast_core::DEFAULT_PROJECT, global = true)]
    pub project: String,
    #[command(subcommand)]
    pub action: ChangesAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum ChangesAction {
    /// Store a table's changes in the JetStream change stream (also sets REPLICA
    /// IDENTITY FULL). Name: `table`, `schema.table`, SQL quoting allowed.
    Enable { table: String },
    /// Stop storing a table's changes.
    Disable { table: String },
    /// List the tables whose change stream is on.
    List,
}

/// `walcast changes …`.
pub async fn changes(args: ChangesArgs) -> anyhow::Result<()> {
    let database_url = super::database_url(&args.database_url)?;
    walcast_worker::database::migrate(database_url).await?;
    let client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let table = match &args.action {
        ChangesAction::Enable { table } | ChangesAction::Disable { table } => {
            let (schema, name) =
                parse_qualified_name(table).with_context(|| format!("table name {table:?}"))?;
            Some((schema, name))
        }
        ChangesAction::List => None,
    };
    match (&args.action, table) {
        (ChangesAction::Enable { .. }, Some((schema, name))) => {
            let new = change_streams::enable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            match new {
                true => println!("change stream enabled for {q}"),
                false => println!("change stream was already enabled for {q}"),
            }
        }
        (ChangesAction::Disable { .. }, Some((schema, name))) => {
            let was = change_streams::disable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            match was {
                true => println!("change stream disabled for {q}"),
                false => println!("change stream was not enabled for {q}"),
            }
        }
        _ => {
            for t in change_streams::list(&client, Some(&args.project)).await? {
                println!("{t}");
            }
        }
    }
    Ok(())
}
