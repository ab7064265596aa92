//! `walcast slot status|drop`: the logical replication slot walcast reads. A slot keeps
//! every WAL segment from its position on, so a walcast that is removed for good must
//! drop it, or the primary's disk fills up (up to `max_slot_wal_keep_size`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};

use walcast_worker::config::{redact_url, DEFAULT_SLOT_NAME};

/// The options go before or after the subcommand.
#[derive(Args, Debug, Clone)]
pub struct SlotArgs {
    /// Postgres connection URL (walcast's own login).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    /// Connection URL for the replication slot; defaults to DATABASE_URL.
    #[arg(
        long,
        env = "POSTGRES_REPLICATION_URL",
        hide_env_values = true,
        global = true
    )]
    pub replication_url: Option<String>,
    /// The slot's name.
    #[arg(long, env = "CDC_SLOT_NAME", default_value = DEFAULT_SLOT_NAME, global = true)]
    pub slot_name: String,
    #[command(subcommand)]
    pub action: SlotAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SlotAction {
    /// Print the slot as JSON: plugin, whether a worker reads it (and its pid), its
    /// confirmed position and the WAL it retains.
    Status,
    /// Drop the slot. Stop every cdc-worker first: a slot being read is refused, unless
    /// `--force`, which ends the session reading it (a worker still running would
    /// create a new slot and start from there, losing what was committed in between).
    Drop {
        #[arg(long)]
        force: bool,
    },
}

pub async fn slot(args: SlotArgs) -> anyhow::Result<()> {
    let url = match &args.replication_url {
        Some(url) if !url.trim().is_empty() => url.as_str(),
        _ => super::database_url(&args.database_url)?,
    };
    let client = walcast_pipeline::connect(url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(url)))?;
    let name = args.slot_name.as_str();
    let row = client
        .query_opt(
            "SELECT plugin::text, active, active_pid, confirmed_flush_lsn::text,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&name],
        )
        .await?;
    let Some(row) = row else {
        bail!("no replication slot named {name:?} (nothing to do)");
    };
    let active: bool = row.get(1);
    let pid: Option<i32> = row.get(2);
    match args.action {
        SlotAction::Status => {
            let status = serde_json::json!({
                "slot": name,
                "plugin": row.get::<_, Option<String>>(0),
                "active": active,
                "active_pid": pid,
                "confirmed_flush_lsn": row.get::<_, Option<String>>(3),
                "retained_wal_bytes": row.get::<_, Option<i64>>(4),
            });
            println!("{status}");
        }
        SlotAction::Drop { force } => {
            if active && !force {
                bail!(
                    "slot {name:?} is being read by process {} (a running cdc-worker): stop \
                     every cdc-worker first, or pass --force to end that session",
                    pid.unwrap_or_default()
                );
            }
            if let (true, Some(pid)) = (active, pid) {
                client
                    .execute("SELECT pg_terminate_backend($1)", &[&pid])
                    .await?;
                wait_inactive(&client, name).await?;
            }
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&name])
                .await
                .map_err(|e| anyhow::anyhow!(walcast_pgtls::db_message(&e)))
                .with_context(|| format!("dropping slot {name:?}"))?;
            println!("dropped replication slot {name:?}: Postgres no longer retains WAL for it");
        }
    }
    Ok(())
}

/// After its session was ended, a slot turns inactive within moments.
async fn wait_inactive(client: &tokio_postgres::Client, name: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let active: bool = client
            .query_opt(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&name],
            )
            .await?
            .is_some_and(|r| r.get(0));
        if !active {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("slot {name:?} still in use 10 s after ending its session");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
