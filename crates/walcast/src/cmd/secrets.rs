//! `walcast secrets rotate|status`: the secrets stored in the control database (the
//! projects' JWT secrets, the sources' URLs), encrypted with SECRETS_KEY (see
//! `walcast_control::secrets`).

use anyhow::Context;
use clap::{Args, Subcommand};
use walcast_control::secrets::at_rest;
use walcast_control::secrets::SecretKeys;

use walcast_worker::config::{redact_url, SecretsArgs};

#[derive(Args, Debug, Clone)]
pub struct SecretsCmd {
    /// The control database (the deployment's own DATABASE_URL). Before or after the
    /// subcommand.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    #[command(flatten)]
    pub keys: SecretsArgs,
    #[command(subcommand)]
    pub action: SecretsAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SecretsAction {
    /// Rewrite every stored secret under SECRETS_KEY: plain text encrypted, values of
    /// SECRETS_KEY_PREVIOUS re-encrypted (a cdc-worker does the same at each start).
    /// Prints what it did (JSON); once no value is under the previous key, that key can
    /// be dropped.
    Rotate,
    /// Count the stored secrets by the key that made them (JSON; nothing written).
    Status,
}

pub async fn secrets(cmd: SecretsCmd) -> anyhow::Result<()> {
    let keys = cmd.keys.keys()?;
    let database_url = super::database_url(&cmd.database_url)?;
    walcast_worker::database::migrate(database_url).await?;
    let report = match cmd.action {
        SecretsAction::Rotate => {
            walcast_worker::database::seal_secrets(database_url, &keys).await?
        }
        SecretsAction::Status => {
            let client = walcast_pipeline::connect(database_url)
                .await
                .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
            at_rest::status(&client, &keys).await?
        }
    };
    println!("{}", serde_json::to_string_pretty(&report)?);
    anyhow::ensure!(
        report.unreadable.is_empty(),
        "{} stored secret(s) cannot be read ({}): set them again (`walcast project rotate <id>`, \
         `walcast project keys <id> --previous-secret <secret>`, \
         `walcast source set-check-url <name> --check-url <URL>`, or remove and add the source)",
        report.unreadable.len(),
        report.unreadable.join("; ")
    );
    Ok(())
}

/// What the commands on projects and sources do first: the migrations, then the stored
/// secrets encrypted (see `walcast_worker::database::seal_secrets`); a value that cannot be read
/// is said on stderr (its row is left out of what the command reads).
pub async fn prepare_cli(database_url: &str, keys: &SecretKeys) -> anyhow::Result<()> {
    walcast_worker::database::migrate(database_url).await?;
    let report = walcast_worker::database::seal_secrets(database_url, keys).await?;
    for why in &report.unreadable {
        eprintln!("warning: {why}; its row is left out");
    }
    Ok(())
}
