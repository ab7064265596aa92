//! `walcast migrate`: walcast's migrations, and the stored secrets encrypted.

use anyhow::Context;
use walcast_control::secrets::at_rest;
use walcast_control::secrets::SecretKeys;

use walcast_worker::config::redact_url;

/// `walcast migrate`: the migrations, then the secrets encrypted when a key is given; with
/// none, refused while any secret is stored in plain text (it says which key to give).
pub async fn migrate_command(database_url: &str, keys: Option<&SecretKeys>) -> anyhow::Result<()> {
    walcast_worker::database::migrate(database_url).await?;
    if let Some(keys) = keys {
        let r = walcast_worker::database::seal_secrets(database_url, keys).await?;
        eprintln!(
            "migrations applied; {} stored secret(s) under key {} ({} encrypted now, {} re-encrypted)",
            r.values, r.key_id, r.encrypted, r.reencrypted
        );
        return Ok(());
    }
    let client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let plain = at_rest::plain_text(&client).await?;
    anyhow::ensure!(
        plain == 0,
        "migrations applied, but {plain} secret(s) of walcast.projects and walcast.sources are stored in plain text: \
         run it again with SECRETS_KEY set (the key walcast's processes are given) to encrypt them"
    );
    Ok(())
}
