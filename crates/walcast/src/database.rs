//! Getting a database ready for a pipeline: its preflight (with the fix for what the
//! operator must change) and walcast's migrations.

use anyhow::Context;

use crate::config::{redact_url, CdcArgs, DbArgs};

/// Apply our migrations (idempotent, serialised by an advisory lock).
pub async fn migrate(database_url: &str) -> anyhow::Result<()> {
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    walcast_realtime::migrate::migrate(&mut client)
        .await
        .context("applying migrations")?;
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
/// (see `walcast_realtime::check_login`): refuse a missing or over-privileged one, grant
/// it the allowed roles checks run as, record it. Returns its name.
pub async fn check_login(
    database_url: &str,
    check_url: Option<&str>,
    roles: &walcast_realtime::roles::RolePolicy,
) -> anyhow::Result<String> {
    let own = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let login = walcast_realtime::check_login::prepare(&own, check_url, roles).await?;
    tracing::info!(login = %login, "check login ready: tenant SQL runs as it");
    Ok(login)
}
