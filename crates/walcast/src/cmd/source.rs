//! `walcast source add|list|set-check-url|remove`: the sources registry (the databases walcast reads
//! besides its own, README "Sources"), rows of the control database's `walcast.sources`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tokio_postgres::error::SqlState;
use walcast_control::sources::{self, redact_url, NewSource, Source};

use walcast_worker::config::DEFAULT_SLOT_NAME;

#[derive(Args, Debug, Clone)]
pub struct SourceArgs {
    /// The control database (the deployment's own DATABASE_URL, as for every command):
    /// its `walcast.sources` lists the sources. Before or after the subcommand.
    #[arg(
        long = "database-url",
        alias = "control-database-url",
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true
    )]
    pub control_url: Option<String>,
    #[command(flatten)]
    pub secrets: walcast_worker::config::SecretsArgs,
    #[command(subcommand)]
    pub action: SourceAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum SourceAction {
    /// Add a source: check its database (preflight, wal2json), apply walcast's migrations
    /// to it, and store it. A worker leads it within seconds.
    Add {
        /// Its name: a lower-case letter, then lower-case letters, digits, '-' or '_'
        /// (at most 30).
        name: String,
        /// Its database (tables, catalog, RLS checks, the realtime registry). From the
        /// environment rather than the command line, where other users of the machine
        /// can read it.
        #[arg(
            long = "source-database-url",
            value_name = "URL",
            env = "SOURCE_DATABASE_URL",
            hide_env_values = true
        )]
        database_url: String,
        /// The URL its replication slot is read with (a role with REPLICATION);
        /// default: --database-url.
        #[arg(long, env = "SOURCE_REPLICATION_URL", hide_env_values = true)]
        replication_url: Option<String>,
        /// Its check login: a login of that database with no privileges of its own,
        /// which runs the tenants' SQL (row-level security and private-channel
        /// policies, SSE snapshots); see docs/security.md.
        #[arg(long, env = "SOURCE_CHECK_URL", hide_env_values = true)]
        check_url: String,
        /// Its replication slot; default: `walcast_src_<name>` ('-' as '_'). Two sources
        /// on one server need different ones.
        #[arg(long)]
        slot_name: Option<String>,
        /// Store it without connecting to it (no preflight, no migrations).
        #[arg(long)]
        skip_check: bool,
        /// Succeed without a change when a source of that name exists with the same
        /// URLs and slot (a deployment that declares its sources runs `add` on every
        /// upgrade); one that differs is still an error.
        #[arg(long)]
        if_missing: bool,
        /// Accept a server whose max_slot_wal_keep_size is -1 (a stalled slot can then
        /// fill its disk).
        #[arg(long, env = "CDC_ALLOW_UNBOUNDED_WAL", default_value_t = false)]
        allow_unbounded_wal: bool,
        /// The default source's slot (refused as this source's slot name).
        #[arg(long, env = "CDC_SLOT_NAME", default_value = DEFAULT_SLOT_NAME)]
        cdc_slot_name: String,
    },
    /// Print the sources as a JSON array (passwords hidden).
    List,
    /// Set a source's check login (SOURCE_CHECK_URL), checked first (a source added
    /// before there were check logins is not read until it has one).
    SetCheckUrl {
        name: String,
        #[arg(long, env = "SOURCE_CHECK_URL", hide_env_values = true)]
        check_url: String,
        /// Store it without connecting (no check of the login).
        #[arg(long)]
        skip_check: bool,
    },
    /// Remove a source (refused while projects are on it). Its worker stops reading it
    /// within seconds; its slot stays unless --drop-slot.
    Remove {
        name: String,
        /// Then drop its replication slot (waiting up to 30 s for its worker to let go),
        /// so that its server no longer retains WAL for walcast.
        #[arg(long)]
        drop_slot: bool,
    },
}

pub async fn source(args: SourceArgs) -> anyhow::Result<()> {
    let keys = args.secrets.keys()?;
    let control_url = super::database_url(&args.control_url)?;
    super::secrets::prepare_cli(control_url, &keys).await?;
    let mut control = walcast_pipeline::connect(control_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(control_url)))?;
    match args.action {
        SourceAction::Add {
            name,
            database_url,
            replication_url,
            check_url,
            slot_name,
            skip_check,
            if_missing,
            allow_unbounded_wal,
            cdc_slot_name,
        } => {
            let new = NewSource {
                name,
                database_url,
                replication_url,
                slot_name,
                check_url: Some(check_url),
            }
            .checked()?;
            if if_missing && already_there(&control, &keys, &new).await? {
                return Ok(());
            }
            let slot = new.slot_name.clone().unwrap_or_default();
            if slot == cdc_slot_name {
                bail!("slot name {slot:?} is the default source's (CDC_SLOT_NAME): pass another --slot-name");
            }
            if !skip_check {
                not_the_control_database(&control, &new).await?;
                check(&new, allow_unbounded_wal).await?;
            }
            let added = sources::add(&control, &keys, &new).await?;
            println!("{}", serde_json::to_string_pretty(&added.view())?);
        }
        SourceAction::List => {
            let list: Vec<serde_json::Value> = sources::list(&control, &keys)
                .await?
                .iter()
                .map(Source::view)
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
        SourceAction::SetCheckUrl {
            name,
            check_url,
            skip_check,
        } => {
            let Some(old) = sources::get(&control, &keys, &name).await? else {
                bail!("no source named {name:?}");
            };
            if let (false, Some(db)) = (skip_check, old.database_url.as_deref()) {
                let roles = walcast_control::roles::RolePolicy::default();
                walcast_worker::database::check_login(db, Some(&check_url), &roles)
                    .await
                    .with_context(|| format!("source {name:?}: its check login"))?;
            }
            let set = sources::set_check_url(&control, &keys, &name, &check_url).await?;
            eprintln!("source {name:?}: check login set; its worker uses it from its next start of the source");
            println!("{}", serde_json::to_string_pretty(&set.view())?);
        }
        SourceAction::Remove { name, drop_slot } => {
            let removed = sources::remove(&mut control, &keys, &name).await?;
            eprintln!("removed source {name:?}: its worker stops reading it within seconds");
            if drop_slot {
                drop_its_slot(&removed).await?;
            }
        }
    }
    Ok(())
}

/// Whether `new` is stored already, as it is (`add --if-missing`); an error if a source
/// of that name differs.
async fn already_there(
    control: &tokio_postgres::Client,
    keys: &walcast_control::secrets::SecretKeys,
    new: &NewSource,
) -> anyhow::Result<bool> {
    let Some(old) = sources::get(control, keys, &new.name).await? else {
        return Ok(false);
    };
    let same = old.database_url.as_deref() == Some(new.database_url.as_str())
        && old.replication_url == new.replication_url
        && old.slot_name == new.slot_name
        && old.check_url == new.check_url;
    if !same {
        bail!(
            "source {:?} exists with other URLs or slot: remove it first (walcast source remove {})",
            new.name,
            new.name
        );
    }
    eprintln!("source {:?} is there already", new.name);
    println!("{}", serde_json::to_string_pretty(&old.view())?);
    Ok(true)
}

/// What `add` checks before storing a source: the preflight of its replication URL
/// (role, wal_level, max_slot_wal_keep_size, its slot), that wal2json loads there (a
/// temporary slot), then walcast's migrations applied to its database. Every refusal
/// says what to change.
async fn check(new: &NewSource, allow_unbounded_wal: bool) -> anyhow::Result<()> {
    let name = &new.name;
    let repl_url = new.replication_url.as_deref().unwrap_or(&new.database_url);
    let slot = new.slot_name.as_deref().unwrap_or_default();
    let client = walcast_pipeline::connect(repl_url)
        .await
        .with_context(|| format!("source {name:?}: connecting to {}", redact_url(repl_url)))?;
    let report = walcast_pipeline::preflight::preflight(&client, slot, allow_unbounded_wal)
        .await
        .map_err(|e| anyhow::anyhow!("source {name:?} is not usable: {e}"))?;
    let probe = format!("walcast_check_{:016x}", rand::random::<u64>());
    client
        .query_one(
            "SELECT 1 FROM pg_create_logical_replication_slot($1, 'wal2json', true)",
            &[&probe],
        )
        .await
        .map_err(|e| walcast_pipeline::preflight::classify_plugin_error(e, report.major))
        .map_err(|e| anyhow::anyhow!("source {name:?} is not usable: {e}"))?;
    // Temporary: it would go with the session anyway.
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&probe])
        .await
        .context("dropping the check's temporary slot")?;
    let mut db = walcast_pipeline::connect(&new.database_url)
        .await
        .with_context(|| {
            format!(
                "source {name:?}: connecting to {}",
                redact_url(&new.database_url)
            )
        })?;
    walcast_control::migrate::migrate(&mut db)
        .await
        .with_context(|| format!("source {name:?}: applying walcast's migrations"))?;
    let roles = walcast_control::roles::RolePolicy::default();
    let login =
        walcast_worker::database::check_login(&new.database_url, new.check_url.as_deref(), &roles)
            .await
            .with_context(|| format!("source {name:?}: its check login"))?;
    eprintln!(
        "source {name:?} checked: Postgres {}, role {}, check login {login}, migrations applied",
        report.server_version, report.role
    );
    Ok(())
}

/// Which database a session is on: its server's start time (to the microsecond), the
/// database's oid and name. Two sessions with the same are on the same database.
async fn database_identity(client: &tokio_postgres::Client) -> anyhow::Result<String> {
    let row = client
        .query_one(
            "SELECT pg_postmaster_start_time()::text || ' ' || d.oid::text || ' ' || d.datname::text
               FROM pg_database d WHERE d.datname = current_database()",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

/// A source is another database than the control one (whose projects are the default
/// source's already): the same database read twice would deliver its changes twice.
async fn not_the_control_database(
    control: &tokio_postgres::Client,
    new: &NewSource,
) -> anyhow::Result<()> {
    let db = walcast_pipeline::connect(&new.database_url)
        .await
        .with_context(|| {
            format!(
                "source {:?}: connecting to {}",
                new.name,
                redact_url(&new.database_url)
            )
        })?;
    if database_identity(&db).await? == database_identity(control).await? {
        bail!(
            "source {:?} is the control database itself (DATABASE_URL): its projects are on the default source already",
            new.name
        );
    }
    Ok(())
}

/// How long `remove --drop-slot` waits for the worker that led the source to let go of
/// its slot (it stops within its sources poll and a lease duration).
const SLOT_RELEASE: Duration = Duration::from_secs(30);

/// Drop a removed source's slot once no session reads it.
async fn drop_its_slot(removed: &Source) -> anyhow::Result<()> {
    let Some(slot) = removed.slot_name.as_deref() else {
        return Ok(());
    };
    let Some(db) = removed.database_url.as_deref() else {
        return Ok(());
    };
    let url = removed.replication_url.as_deref().unwrap_or(db);
    let client = walcast_pipeline::connect(url)
        .await
        .with_context(|| format!("connecting to {} to drop slot {slot:?}", redact_url(url)))?;
    let deadline = Instant::now() + SLOT_RELEASE;
    loop {
        let row = client
            .query_opt(
                "SELECT active, active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await?;
        let Some(row) = row else {
            eprintln!("no replication slot {slot:?}: nothing to drop");
            return Ok(());
        };
        let (active, pid): (bool, Option<i32>) = (row.get(0), row.get(1));
        if !active {
            match client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await
            {
                Ok(_) => {
                    eprintln!("dropped replication slot {slot:?}: its server no longer retains WAL for it");
                    return Ok(());
                }
                // Taken again between the look and the drop: look again.
                Err(e) if e.code() == Some(&SqlState::OBJECT_IN_USE) => {}
                Err(e) => bail!("dropping slot {slot:?}: {}", walcast_pgtls::db_message(&e)),
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the source is removed, but its slot {slot:?} is still read by process {} after {} s, so it was not dropped: \
                 its server keeps retaining WAL for it. Once no cdc-worker reads it, drop it with \
                 `walcast slot drop --slot-name {slot}` (POSTGRES_REPLICATION_URL={})",
                pid.unwrap_or_default(),
                SLOT_RELEASE.as_secs(),
                redact_url(url)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SourceArgs,
    }

    #[test]
    fn add_takes_the_source_url_and_the_control_url_apart() {
        let cli = Cli::try_parse_from([
            "walcast",
            "--database-url",
            "postgres://control",
            "add",
            "shop",
            "--source-database-url",
            "postgres://shop",
            "--check-url",
            "postgres://check@shop",
            "--skip-check",
        ])
        .unwrap();
        assert_eq!(cli.args.control_url.as_deref(), Some("postgres://control"));
        let SourceAction::Add {
            name,
            database_url,
            replication_url,
            slot_name,
            skip_check,
            ..
        } = cli.args.action
        else {
            panic!("not add")
        };
        assert_eq!(
            (name.as_str(), database_url.as_str(), skip_check),
            ("shop", "postgres://shop", true)
        );
        assert_eq!((replication_url, slot_name), (None, None));
        // A source's URL is never taken from the environment (DATABASE_URL is the
        // control database's).
        let missing = Cli::try_parse_from([
            "walcast",
            "--control-database-url",
            "postgres://control",
            "add",
            "shop",
        ]);
        assert!(missing.is_err());
    }
}
