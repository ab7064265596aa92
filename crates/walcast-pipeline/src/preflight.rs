//! Checks run at start. Each failure says exactly what to change.

use tokio_postgres::Client;

#[derive(Debug, thiserror::Error)]
pub enum PreflightError {
    #[error("role {role:?} can neither replicate nor is superuser. Fix: run `ALTER ROLE {quoted} WITH REPLICATION;` as a superuser")]
    NoReplication { role: String, quoted: String },
    #[error("wal_level is {0:?}, logical decoding needs \"logical\". Fix: `ALTER SYSTEM SET wal_level = logical;` then restart Postgres")]
    WalLevel(String),
    #[error("max_slot_wal_keep_size is -1 (unbounded): a stalled or abandoned slot can fill the disk with WAL. Fix: `ALTER SYSTEM SET max_slot_wal_keep_size = '10GB'; SELECT pg_reload_conf();` or start with --allow-unbounded-wal (CDC_ALLOW_UNBOUNDED_WAL=true) to accept the risk")]
    UnboundedWal,
    #[error("no free replication slot: all {max} of max_replication_slots are in use. Fix: drop an unused slot (`SELECT pg_drop_replication_slot('name')`) or raise max_replication_slots and restart Postgres")]
    NoFreeSlot { max: i64 },
    #[error("replication slot {slot:?} exists but is a {kind} slot with plugin {plugin:?} in database {database:?}; walcast needs a logical wal2json slot in this database. Fix: drop it or set another CDC_SLOT_NAME")]
    ForeignSlot {
        slot: String,
        kind: String,
        plugin: String,
        database: String,
    },
    #[error("replication slot {slot:?} is in use by process {pid}: another cdc-worker is probably reading it. Stop it, or set another CDC_SLOT_NAME")]
    SlotInUse { slot: String, pid: i32 },
    #[error("the wal2json output plugin is not installed on the Postgres server. Fix: install postgresql-{major}-wal2json on the database host (apt-get install postgresql-{major}-wal2json). Server said: {detail}")]
    Wal2jsonMissing { major: i32, detail: String },
    #[error("preflight query failed: {0}")]
    Db(#[from] tokio_postgres::Error),
}

impl PreflightError {
    /// Errors that retrying cannot fix: configuration the operator must change. A missing
    /// wal2json is retried instead (with `/readyz` 503 saying what to install): installing
    /// the package on the database host needs no restart, so the worker then starts by
    /// itself.
    pub fn is_fatal(&self) -> bool {
        !matches!(
            self,
            PreflightError::SlotInUse { .. }
                | PreflightError::Db(_)
                | PreflightError::Wal2jsonMissing { .. }
        )
    }
}

/// What preflight found, for the start-up log.
#[derive(Debug, Clone)]
pub struct PreflightReport {
    pub server_version: String,
    pub major: i32,
    pub role: String,
    pub max_slot_wal_keep_size: String,
    pub slot_exists: bool,
}

/// Check role, `wal_level`, `max_slot_wal_keep_size` and slot availability. wal2json
/// itself is checked when the slot is created or first read (`slot.rs`).
pub async fn preflight(
    client: &Client,
    slot: &str,
    allow_unbounded_wal: bool,
) -> Result<PreflightReport, PreflightError> {
    let row = client
        .query_one(
            "SELECT current_user::text, r.rolsuper, r.rolreplication,
                    current_setting('wal_level'), current_setting('max_slot_wal_keep_size'),
                    current_setting('server_version'),
                    current_setting('server_version_num')::int / 10000,
                    current_setting('max_replication_slots')::int8
               FROM pg_roles r WHERE r.rolname = current_user",
            &[],
        )
        .await?;
    let role: String = row.get(0);
    let (superuser, replication): (bool, bool) = (row.get(1), row.get(2));
    if !superuser && !replication {
        return Err(PreflightError::NoReplication {
            quoted: walcast_core::sql::quote_ident(&role),
            role,
        });
    }
    let wal_level: String = row.get(3);
    if wal_level != "logical" {
        return Err(PreflightError::WalLevel(wal_level));
    }
    let keep: String = row.get(4);
    if keep == "-1" && !allow_unbounded_wal {
        return Err(PreflightError::UnboundedWal);
    }
    let max_slots: i64 = row.get(7);
    let existing = client
        .query_opt(
            "SELECT slot_type, coalesce(plugin, ''), coalesce(database, ''),
                    database = current_database(), active_pid
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let slot_exists = existing.is_some();
    match existing {
        Some(r) => {
            let (kind, plugin, database): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            let same_db: Option<bool> = r.get(3);
            if kind != "logical" || plugin != "wal2json" || same_db != Some(true) {
                return Err(PreflightError::ForeignSlot {
                    slot: slot.to_string(),
                    kind,
                    plugin,
                    database,
                });
            }
            if let Some(pid) = r.get::<_, Option<i32>>(4) {
                return Err(PreflightError::SlotInUse {
                    slot: slot.to_string(),
                    pid,
                });
            }
        }
        None => {
            let used: i64 = client
                .query_one("SELECT count(*) FROM pg_replication_slots", &[])
                .await?
                .get(0);
            if used >= max_slots {
                return Err(PreflightError::NoFreeSlot { max: max_slots });
            }
        }
    }
    Ok(PreflightReport {
        server_version: row.get(5),
        major: row.get(6),
        role,
        max_slot_wal_keep_size: keep,
        slot_exists,
    })
}

/// Turn the server's "could not access file" error for the plugin into our clear error.
pub fn classify_plugin_error(err: tokio_postgres::Error, major: i32) -> PreflightError {
    let detail = err
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_else(|| err.to_string());
    if detail.contains("wal2json")
        && (detail.contains("could not access file") || detail.contains("could not load library"))
    {
        PreflightError::Wal2jsonMissing { major, detail }
    } else {
        PreflightError::Db(err)
    }
}
