//! Our SQL migrations (`sql/` in this crate), embedded in the binary, versioned,
//! idempotent, and applied under an advisory lock so two processes never race.

use tokio_postgres::Client;

pub use crate::error::MigrateError;

/// (version, name, sql). Append only; never edit an applied migration.
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "registry", include_str!("../sql/0001_registry.sql")),
    (
        2,
        "supabase_helpers",
        include_str!("../sql/0002_supabase_helpers.sql"),
    ),
    (3, "projects", include_str!("../sql/0003_projects.sql")),
    (
        4,
        "one_project_per_table",
        include_str!("../sql/0004_one_project_per_table.sql"),
    ),
    (5, "leases", include_str!("../sql/0005_leases.sql")),
    (6, "fronts", include_str!("../sql/0006_fronts.sql")),
    (
        7,
        "catalog_changes",
        include_str!("../sql/0007_catalog_changes.sql"),
    ),
    (8, "outbox", include_str!("../sql/0008_outbox.sql")),
    (
        9,
        "realtime_messages",
        include_str!("../sql/0009_realtime_messages.sql"),
    ),
    (
        10,
        "supabase_realtime_publication",
        include_str!("../sql/0010_supabase_realtime_publication.sql"),
    ),
    (
        11,
        "project_keys",
        include_str!("../sql/0011_project_keys.sql"),
    ),
    (12, "trust", include_str!("../sql/0012_trust.sql")),
    (
        13,
        "signed_messages",
        include_str!("../sql/0013_signed_messages.sql"),
    ),
    (
        14,
        "project_messages",
        include_str!("../sql/0014_project_messages.sql"),
    ),
    (
        15,
        "catalog_log",
        include_str!("../sql/0015_catalog_log.sql"),
    ),
    (
        16,
        "send_binary",
        include_str!("../sql/0016_send_binary.sql"),
    ),
    (
        17,
        "project_management",
        include_str!("../sql/0017_project_management.sql"),
    ),
    (
        18,
        "project_limits",
        include_str!("../sql/0018_project_limits.sql"),
    ),
    (
        19,
        "project_rate_limits",
        include_str!("../sql/0019_project_rate_limits.sql"),
    ),
    (20, "sources", include_str!("../sql/0020_sources.sql")),
    (
        21,
        "change_streams",
        include_str!("../sql/0021_change_streams.sql"),
    ),
    (22, "snapshots", include_str!("../sql/0022_snapshots.sql")),
    (
        23,
        "auth_claim_settings",
        include_str!("../sql/0023_auth_claim_settings.sql"),
    ),
    (
        24,
        "check_login",
        include_str!("../sql/0024_check_login.sql"),
    ),
];

/// Arbitrary, fixed key of the advisory lock that serialises migrations.
const LOCK_KEY: i64 = 0x7761_6c63_6173_7401; // "walcast\x01"

/// Apply every migration not yet applied. Returns the versions applied by this call.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>, MigrateError> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY])
        .await?;
    let result = apply_all(client).await;
    // Unlock even when a migration failed; a lost session releases it anyway.
    let unlock = client
        .execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY])
        .await;
    let applied = result?;
    unlock?;
    Ok(applied)
}

async fn apply_all(client: &mut Client) -> Result<Vec<i32>, MigrateError> {
    client
        .batch_execute(
            "CREATE SCHEMA IF NOT EXISTS walcast;
             CREATE TABLE IF NOT EXISTS walcast.schema_migrations (
                 version    integer     PRIMARY KEY,
                 name       text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             );",
        )
        .await?;
    let mut applied = Vec::new();
    for &(version, name, sql) in MIGRATIONS {
        let done = client
            .query_opt(
                "SELECT 1 FROM walcast.schema_migrations WHERE version = $1",
                &[&version],
            )
            .await?
            .is_some();
        if done {
            continue;
        }
        let tx = client.transaction().await?;
        let fail = |source| MigrateError::Failed {
            version,
            name,
            source,
        };
        tx.batch_execute(sql).await.map_err(fail)?;
        tx.execute(
            "INSERT INTO walcast.schema_migrations (version, name) VALUES ($1, $2)",
            &[&version, &name],
        )
        .await
        .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        tracing::info!(version, name, "applied migration");
        applied.push(version);
    }
    Ok(applied)
}
