//! `walcast outbox create|list|redrive|replay` (docs/outbox.md).

use anyhow::Context;
use clap::{Args, Subcommand};
use walcast_control::projects;
use walcast_core::DEFAULT_PROJECT;
use walcast_outbox::replay::{Position, Replay};

use walcast_worker::config::{redact_url, NatsAuthArgs, OutboxStreamArgs};

#[derive(Args, Debug, Clone)]
pub struct OutboxCmd {
    /// Postgres connection URL (the outbox tables and the quarantine; `replay` reads
    /// only NATS). Before or after the subcommand.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    #[command(subcommand)]
    pub action: OutboxAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum OutboxAction {
    /// Create an outbox table: insert-only, range-partitioned by UTC day of
    /// `occurred_at`, partitions older than the retention dropped. Idempotent.
    Create(CreateArgs),
    /// List the outbox tables: project, retention, partitions, rows (approximate) and
    /// the project's quarantined events.
    List,
    /// Send quarantined events (refused by JetStream for good: too large, no stream) to
    /// JetStream again, once the cause is fixed. Each acknowledged event leaves the
    /// quarantine; one refused again stays, and its error is printed.
    Redrive(RedriveArgs),
    /// Re-publish events the outbox stream still holds to `<prefix>.<project>.<topic>`,
    /// in stream order, at a limited rate, with progress on stderr.
    Replay(ReplayArgs),
}

#[derive(Args, Debug, Clone)]
pub struct CreateArgs {
    /// The table's name (in --schema).
    pub name: String,
    /// The project whose events the table holds (events go to
    /// `walcast.outbox.<project>.<aggregate_type>`).
    #[arg(long, env = "WALCAST_PROJECT", default_value = DEFAULT_PROJECT)]
    pub project: String,
    /// The table's schema; default: the project's (`public` for the default project).
    #[arg(long, env = "OUTBOX_SCHEMA")]
    pub schema: Option<String>,
    /// Partitions whose whole UTC day is older than this many days are dropped. Default:
    /// 7 for a new table; an existing table keeps its retention unless this is given.
    #[arg(long, env = "OUTBOX_RETENTION_DAYS", value_parser = clap::value_parser!(u32).range(1..=36_500))]
    pub retention_days: Option<u32>,
}

#[derive(Args, Debug, Clone)]
pub struct RedriveArgs {
    /// NATS server with JetStream.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
    /// The stream, and its settings should it be missing (an existing stream is left as
    /// it is).
    #[command(flatten)]
    pub stream: OutboxStreamArgs,
    /// Only this project's events (default: every project's).
    #[arg(long, env = "WALCAST_PROJECT")]
    pub project: Option<String>,
    /// Only these events (repeat the flag, or separate ids with commas).
    #[arg(long = "id", env = "OUTBOX_REDRIVE_IDS", value_delimiter = ',')]
    pub ids: Vec<String>,
}

#[derive(Args, Debug, Clone)]
pub struct ReplayArgs {
    /// NATS server with JetStream.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: NatsAuthArgs,
    /// The outbox stream to read.
    #[arg(long = "outbox-stream", env = "OUTBOX_STREAM", default_value = walcast_outbox::config::DEFAULT_STREAM)]
    pub stream: String,
    /// The project whose events are replayed.
    #[arg(long, env = "WALCAST_PROJECT")]
    pub project: String,
    /// Start: an RFC 3339 time (`2026-12-01T10:00:00Z`: events JetStream stored at or
    /// after it) or a commit LSN (`16/B374D848`: events committed at or after it).
    #[arg(long, env = "OUTBOX_REPLAY_FROM")]
    pub from: Position,
    /// End (inclusive), a time or an LSN as --from. The replay never goes past the
    /// stream's last event when it started.
    #[arg(long, env = "OUTBOX_REPLAY_TO")]
    pub to: Option<Position>,
    /// Replayed events go to `<prefix>.<project>.<topic>`, without the original's
    /// `Nats-Msg-Id`, with `Walcast-Replay-Of: <event id>`.
    #[arg(long, env = "OUTBOX_REPLAY_SUBJECT_PREFIX")]
    pub subject_prefix: String,
    /// Events per second, at most.
    #[arg(long, env = "OUTBOX_REPLAY_RATE", value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: u32,
    /// Allow a subject prefix that the outbox stream itself captures (the replayed
    /// events are then stored again in it, beside the originals).
    #[arg(long, env = "OUTBOX_REPLAY_ALLOW_SAME_STREAM")]
    pub allow_same_stream: bool,
}

pub async fn outbox(cmd: OutboxCmd) -> anyhow::Result<()> {
    match cmd.action {
        OutboxAction::Create(args) => create(super::database_url(&cmd.database_url)?, args).await,
        OutboxAction::List => list(super::database_url(&cmd.database_url)?).await,
        OutboxAction::Redrive(args) => redrive(super::database_url(&cmd.database_url)?, args).await,
        OutboxAction::Replay(args) => replay(args).await,
    }
}

/// Migrations applied, then a connection.
async fn database(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    walcast_worker::database::migrate(url).await?;
    walcast_pipeline::connect(url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(url)))
}

async fn create(database_url: &str, args: CreateArgs) -> anyhow::Result<()> {
    let client = database(database_url).await?;
    let schema = match args.schema {
        Some(s) => s,
        None => projects::schema_of(&client, &args.project)
            .await
            .context("reading the projects")?
            .with_context(|| {
                format!("no project {:?} (see `walcast project list`)", args.project)
            })?,
    };
    let kept: Option<String> = client
        .query_opt(
            "SELECT retention::text FROM walcast.outbox_tables
              WHERE schema_name = $1 AND table_name = $2",
            &[&schema, &args.name],
        )
        .await
        .context("reading walcast.outbox_tables")?
        .map(|r| r.get(0));
    let retention = match (args.retention_days, &kept) {
        (Some(days), _) => format!("{days} days"),
        (None, Some(kept)) => kept.clone(),
        (None, None) => format!("{} days", walcast_outbox::config::DEFAULT_RETENTION_DAYS),
    };
    let q: String = client
        .query_one(
            "SELECT format('%I.%I', $1::text, $2::text)",
            &[&schema, &args.name],
        )
        .await
        .context("quoting the name")?
        .get(0);
    // Creating the table's trigger and partitions locks it: never queue its writers long.
    let lock_timeout = walcast_outbox::config::MAINTAIN_LOCK_TIMEOUT.as_millis();
    client
        .batch_execute(&format!("SET lock_timeout = {lock_timeout}"))
        .await
        .context("setting lock_timeout")?;
    let row = client
        .query_one(
            "SELECT walcast.outbox_create($1, $2, $3, $4::text::interval)",
            &[&args.project, &schema, &args.name, &retention],
        )
        .await
        .with_context(|| format!("creating the outbox {q}"))?;
    let id: i32 = row.get(0);
    let parts = partitions(&client, id).await?;
    let verb = if kept.is_some() { "exists" } else { "created" };
    println!(
        "outbox {q} {verb}: id {id}, project {}, retention {retention}",
        args.project
    );
    println!(
        "partitions ({}, by UTC day of occurred_at): {}",
        parts.len(),
        parts.join(", ")
    );
    println!(
        "events go to {}.{}.<aggregate_type>",
        walcast_outbox::event::SUBJECT_PREFIX,
        args.project
    );
    Ok(())
}

/// The partitions of outbox `id`, oldest day first.
async fn partitions(client: &tokio_postgres::Client, id: i32) -> anyhow::Result<Vec<String>> {
    let rows = client
        .query(
            "SELECT n.nspname || '.' || c.relname
               FROM walcast.outbox_tables t
               JOIN pg_inherits i ON i.inhparent = format('%I.%I', t.schema_name, t.table_name)::regclass
               JOIN pg_class c ON c.oid = i.inhrelid
               JOIN pg_namespace n ON n.oid = c.relnamespace
              WHERE t.id = $1
              ORDER BY c.relname",
            &[&id],
        )
        .await
        .context("listing the partitions")?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

async fn list(database_url: &str) -> anyhow::Result<()> {
    let client = database(database_url).await?;
    let rows = client
        .query(
            "SELECT format('%I.%I', t.schema_name, t.table_name), t.project, t.retention::text,
                    count(c.oid), coalesce(min(right(c.relname, 8)), ''),
                    coalesce(max(right(c.relname, 8)), ''),
                    coalesce(sum(s.n_live_tup), 0)::int8,
                    (SELECT count(*) FROM walcast.outbox_quarantine q WHERE q.project = t.project)
               FROM walcast.outbox_tables t
               LEFT JOIN pg_inherits i
                      ON i.inhparent = to_regclass(format('%I.%I', t.schema_name, t.table_name))
               LEFT JOIN pg_class c ON c.oid = i.inhrelid
               LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
              GROUP BY t.id
              ORDER BY t.project, t.schema_name, t.table_name",
            &[],
        )
        .await
        .context("listing the outbox tables")?;
    let mut table = vec![[
        "TABLE",
        "PROJECT",
        "RETENTION",
        "PARTITIONS",
        "DAYS",
        "ROWS~",
        "QUARANTINED",
    ]
    .map(String::from)];
    for r in &rows {
        let (first, last): (String, String) = (r.get(4), r.get(5));
        let days = if first.is_empty() {
            "-".to_string()
        } else {
            format!("{first}..{last}")
        };
        let count = |i: usize| r.get::<_, i64>(i).to_string();
        table.push([
            r.get(0),
            r.get(1),
            r.get(2),
            count(3),
            days,
            count(6),
            count(7),
        ]);
    }
    print_table(&table);
    let total: i64 = client
        .query_one("SELECT count(*) FROM walcast.outbox_quarantine", &[])
        .await
        .context("counting the quarantine")?
        .get(0);
    println!("quarantine: {total} event(s) in all projects (`walcast outbox redrive` sends them again); QUARANTINED counts the table's project, walcast.emit events included");
    Ok(())
}

/// Columns padded to their widest cell.
fn print_table<const N: usize>(rows: &[[String; N]]) {
    let mut widths = [0usize; N];
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    for row in rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        println!("{}", cells.join("  ").trim_end());
    }
}

async fn nats(url: &str, auth: &NatsAuthArgs, name: &str) -> anyhow::Result<async_nats::Client> {
    let bus = walcast_bus::Bus::nats_with(url, name, &auth.auth().inbox_for("worker"))
        .await
        .with_context(|| format!("connecting to NATS at {}", redact_url(url)))?;
    match bus {
        walcast_bus::Bus::Nats(n) => Ok(n.client().clone()),
        _ => anyhow::bail!("not a NATS connection"),
    }
}

async fn redrive(database_url: &str, args: RedriveArgs) -> anyhow::Result<()> {
    let db = database(database_url).await?;
    let client = nats(&args.nats_url, &args.nats_auth, "walcast-outbox-redrive").await?;
    let cfg = args.stream.to_config(database_url);
    let mut publisher = walcast_outbox::publish::Publisher::new(client, cfg);
    let report =
        walcast_outbox::redrive::redrive(&db, &mut publisher, args.project.as_deref(), &args.ids)
            .await
            .context("redriving the quarantine")?;
    for o in &report.outcomes {
        match &o.error {
            None if o.duplicate => println!(
                "{} {}: already on the stream, removed from the quarantine",
                o.id, o.subject
            ),
            None => println!("{} {}: sent, removed from the quarantine", o.id, o.subject),
            Some(e) => println!("{} {}: refused again, kept: {e}", o.id, o.subject),
        }
    }
    for id in &report.missing {
        println!("{id}: not in the quarantine");
    }
    let failed = report.failed();
    println!(
        "redrive: {} sent, {failed} kept in the quarantine",
        report.outcomes.len() - failed
    );
    if failed > 0 || !report.missing.is_empty() {
        anyhow::bail!(
            "{failed} event(s) refused again, {} not found",
            report.missing.len()
        );
    }
    Ok(())
}

async fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    let client = nats(&args.nats_url, &args.nats_auth, "walcast-outbox-replay").await?;
    let replay = Replay {
        stream: args.stream,
        project: args.project,
        from: args.from,
        to: args.to,
        subject_prefix: args.subject_prefix,
        rate: args.rate,
        allow_same_stream: args.allow_same_stream,
    };
    let done = replay
        .run(&client, |p| {
            eprintln!(
                "replay: {}/{} read, {} sent, {} skipped, {:.1} events/s",
                p.read,
                p.total,
                p.sent,
                p.skipped,
                p.rate()
            )
        })
        .await
        .context("replaying")?;
    println!(
        "replayed {} event(s) of project {} to {} in {:.2} s ({:.1} events/s), {} skipped",
        done.sent,
        replay.project,
        replay.target(),
        done.elapsed.as_secs_f64(),
        done.rate(),
        done.skipped
    );
    Ok(())
}
