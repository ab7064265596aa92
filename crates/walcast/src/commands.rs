//! Operator commands: `walcast realtime enable|disable|list`, `walcast migrate`, `walcast tail`,
//! `walcast key` (projects: the `project` module, which signs its keys with [`sign_key`]).

use anyhow::Context;
use clap::{Args, Subcommand};
use futures_util::StreamExt;
use walcast_bus::Bus;
use walcast_control::tables as realtime_tables;
use walcast_core::sql::parse_qualified_name;

use crate::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct RealtimeArgs {
    /// Postgres connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Project the table belongs to.
    #[arg(long, env = "WALCAST_PROJECT", default_value = realtime_tables::DEFAULT_PROJECT)]
    pub project: String,
    #[command(subcommand)]
    pub action: RealtimeAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum RealtimeAction {
    /// Stream a table's changes (also sets REPLICA IDENTITY FULL). Name: `table`,
    /// `schema.table`, SQL quoting allowed: `'"My Schema"."My Table"'`.
    Enable { table: String },
    /// Stop streaming a table.
    Disable { table: String },
    /// List the streamed tables.
    List,
}

pub async fn realtime(args: RealtimeArgs) -> anyhow::Result<()> {
    crate::cdc_worker::migrate(&args.database_url).await?;
    let client = walcast_pipeline::connect(&args.database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(&args.database_url)))?;
    match args.action {
        RealtimeAction::Enable { table } => {
            let (schema, name) =
                parse_qualified_name(&table).with_context(|| format!("table name {table:?}"))?;
            realtime_tables::enable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            println!("realtime enabled for {q}");
            // Subscribers read as their JWT role: say so when the usual roles cannot.
            let blind = client
                .query(
                    "SELECT r.rolname::text FROM pg_roles r
                      WHERE r.rolname IN ('anon', 'authenticated')
                        AND NOT has_table_privilege(r.oid, to_regclass($1), 'SELECT')",
                    &[&q],
                )
                .await?;
            let roles: Vec<String> = blind.iter().map(|r| r.get(0)).collect();
            if !roles.is_empty() {
                println!(
                    "note: {} cannot SELECT {q}, so subscribers with that role receive nothing \
                     from it; if they should: GRANT SELECT ON {q} TO {};",
                    roles.join(" and "),
                    roles.join(", ")
                );
            }
        }
        RealtimeAction::Disable { table } => {
            let (schema, name) =
                parse_qualified_name(&table).with_context(|| format!("table name {table:?}"))?;
            let was = realtime_tables::disable(&client, &args.project, &schema, &name).await?;
            let q = walcast_core::sql::qualified(&schema, &name);
            if was {
                println!("realtime disabled for {q}");
            } else {
                println!("realtime was not enabled for {q}");
            }
        }
        RealtimeAction::List => {
            for t in realtime_tables::list(&client, Some(&args.project)).await? {
                println!("{t}");
            }
        }
    }
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct TailArgs {
    /// NATS server the cdc-worker publishes to.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: crate::config::NatsAuthArgs,
    /// Subject pattern to follow.
    #[arg(long, default_value = walcast_bus::subject::REALTIME_ALL)]
    pub subject: String,
    /// Stop after this many messages.
    #[arg(long)]
    pub count: Option<usize>,
}

/// Print change events as JSON lines.
pub async fn tail(args: TailArgs) -> anyhow::Result<()> {
    let bus = Bus::nats_with(
        &args.nats_url,
        "walcast-tail",
        &args.nats_auth.auth().inbox_for("tail"),
    )
    .await
    .with_context(|| format!("connecting to {}", redact_url(&args.nats_url)))?;
    let mut sub = bus.subscribe(&args.subject).await?;
    let mut seen = 0usize;
    while let Some(msg) = sub.next().await {
        println!("{}", String::from_utf8_lossy(&msg.payload));
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            break;
        }
    }
    Ok(())
}

#[derive(Args, Debug, Clone)]
pub struct KeyArgs {
    /// HS256 secret of the project (the default project's is JWT_SECRET).
    #[arg(long, env = "JWT_SECRET", hide_env_values = true)]
    pub jwt_secret: String,
    /// The `role` claim: `anon`, `service_role`, `authenticated` or any Postgres role.
    #[arg(long, default_value = "anon")]
    pub role: String,
    /// Lifetime in seconds (the `exp` claim).
    #[arg(long, default_value_t = KEY_LIFETIME_SECS)]
    pub expires_in: u64,
    /// The `sub` claim (a user id), if any.
    #[arg(long)]
    pub sub: Option<String>,
    /// The `ref` claim: the project id (none = the default project).
    #[arg(long = "project")]
    pub project_ref: Option<String>,
}

/// Lifetime of the keys `walcast project create` prints (and `walcast key`'s default).
pub const KEY_LIFETIME_SECS: u64 = 10 * 365 * 24 * 3600;

/// Sign an HS256 API key: `claims` plus `iss` = `walcast`, `iat` = now and
/// `exp` = now + `expires_in` seconds.
pub fn sign_key(
    secret: &str,
    mut claims: serde_json::Map<String, serde_json::Value>,
    expires_in: u64,
) -> anyhow::Result<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("system clock before 1970")?
        .as_secs();
    claims.insert("iss".into(), "walcast".into());
    claims.insert("iat".into(), now.into());
    claims.insert("exp".into(), now.saturating_add(expires_in).into());
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).context("the JWT secret")?,
    )
    .context("signing the key")
}

/// Print a signed HS256 JWT (an API key like Supabase's anon / service_role keys).
pub fn key(args: KeyArgs) -> anyhow::Result<()> {
    let mut claims = serde_json::Map::new();
    claims.insert("role".into(), args.role.into());
    if let Some(sub) = args.sub {
        claims.insert("sub".into(), sub.into());
    }
    if let Some(r) = args.project_ref {
        claims.insert("ref".into(), r.into());
    }
    println!("{}", sign_key(&args.jwt_secret, claims, args.expires_in)?);
    Ok(())
}
