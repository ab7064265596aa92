//! Getting a database ready for a pipeline: its preflight (with the fix for what the
//! operator must change), walcast's migrations, and its stored secrets encrypted.

use anyhow::Context;
use walcast_control::secrets::at_rest::{self, Report};
use walcast_control::secrets::SecretKeys;

use crate::config::{redact_url, CdcArgs, DbArgs};

/// Apply our migrations (idempotent, serialised by an advisory lock).
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    walcast_control::migrate::migrate(&mut client)
        .await
        .context("applying migrations")?;
    Ok(())
}

/// The control database's secrets at rest: plain-text values encrypted, the previous
/// key's rewritten under the current one (see `walcast_control::secrets::at_rest`).
/// Refused, naming the key, when a value was made with a key not configured; values
/// that cannot be read are logged and left as they are.
pub async fn seal_secrets(database_url: &str, keys: &SecretKeys) -> anyhow::Result<Report> {
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let report = at_rest::seal_all(&mut client, keys)
        .await
        .context("the secrets stored in the database")?;
    for why in &report.unreadable {
        tracing::error!(error = %why, "a stored secret cannot be read: its row is left out until it is set again");
    }
    if report.encrypted + report.reencrypted > 0 {
        tracing::info!(
            key_id = %report.key_id,
            encrypted = report.encrypted,
            reencrypted = report.reencrypted,
            "stored secrets encrypted with the current key"
        );
    }
    Ok(report)
}

/// The control database made ready at start: walcast's migrations, its secrets at rest
/// (see [`seal_secrets`]), the check login (see [`check_login`]).
pub async fn prepare_control(
    db: &DbArgs,
    keys: &SecretKeys,
    roles: &walcast_control::roles::RolePolicy,
) -> anyhow::Result<()> {
    migrate(&db.database_url).await?;
    seal_secrets(&db.database_url, keys).await?;
    check_login(&db.database_url, db.check_database_url.as_deref(), roles).await?;
    Ok(())
}

/// Fail fast, with the fix, on configuration the operator must change. Transient states
/// (a slot still held by a dying session) are left to the pipeline's retries.
pub async fn preflight(db: &DbArgs, cdc: &CdcArgs) -> anyhow::Result<()> {
    let url = db.replication_url();
    let client = walcast_pipeline::connect(url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(url)))?;
    match walcast_pipeline::preflight::preflight(&client, &cdc.slot_name, cdc.allow_unbounded_wal)
        .await
    {
        Ok(report) => {
            tracing::info!(
                server = %report.server_version,
                role = %report.role,
                max_slot_wal_keep_size = %report.max_slot_wal_keep_size,
                slot_exists = report.slot_exists,
                "preflight passed"
            );
            Ok(())
        }
        Err(e) if e.is_fatal() => Err(anyhow::anyhow!("preflight failed: {e}")),
        Err(e) => {
            tracing::warn!(error = %e, "preflight: will retry");
            Ok(())
        }
    }
}

/// Check the check login of `check_url` against walcast's own login of `database_url`
/// (see `walcast_control::check_login`): refuse a missing or over-privileged one, grant
/// it the allowed roles checks run as, record it. Returns its name.
pub async fn check_login(
    database_url: &str,
    check_url: Option<&str>,
    roles: &walcast_control::roles::RolePolicy,
) -> anyhow::Result<String> {
    let own = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let login = walcast_control::check_login::prepare(&own, check_url, roles).await?;
    tracing::info!(login = %login, "check login ready: tenant SQL runs as it");
    Ok(login)
}
