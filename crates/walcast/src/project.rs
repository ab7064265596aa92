//! `walcast project create|list`: projects with their own schema, JWT secret and keys.

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use walcast_realtime::projects;

use crate::commands::{sign_key, KEY_LIFETIME_SECS};
use crate::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct ProjectArgs {
    /// Postgres connection URL.
    #[arg(long, env = "DATABASE_URL")]
    pub database_url: String,
    #[command(subcommand)]
    pub action: ProjectAction,
}

#[derive(Subcommand, Debug, Clone)]
pub enum ProjectAction {
    /// Create a project: its schema `project_<uuid hex>`, a JWT secret, and print them
    /// with an anon and a service_role key (JSON).
    Create {
        /// A name for people (not unique).
        #[arg(long)]
        name: String,
    },
    /// Print the projects as a JSON array (no secrets).
    List,
    /// Set a project's other verification keys: the previous secret (accepted during a
    /// rotation) and a JWKS for its users' RS/PS/ES/EdDSA tokens. Omitted ones are cleared.
    Keys {
        /// The project id.
        id: String,
        /// The previous JWT secret.
        #[arg(long, env = "JWT_SECRET_PREVIOUS", hide_env_values = true)]
        previous_secret: Option<String>,
        /// A JWKS, as JSON or the path of a file holding one.
        #[arg(long)]
        jwks: Option<String>,
    },
}

/// The two keys of a project: `(anon, service_role)`, valid ten years.
pub fn project_keys(id: &str, secret: &str) -> anyhow::Result<(String, String)> {
    let key = |role: &str| {
        let mut claims = serde_json::Map::new();
        claims.insert("role".into(), role.into());
        claims.insert("ref".into(), id.into());
        sign_key(secret, claims, KEY_LIFETIME_SECS)
    };
    Ok((key("anon")?, key("service_role")?))
}

pub async fn project(args: ProjectArgs) -> anyhow::Result<()> {
    crate::cdc_worker::migrate(&args.database_url).await?;
    let mut client = walcast_pipeline::connect(&args.database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(&args.database_url)))?;
    match args.action {
        ProjectAction::Create { name } => {
            let p = projects::create(&mut client, &name)
                .await
                .context("creating the project")?;
            let (anon, service) = project_keys(&p.id, &p.jwt_secret)?;
            let out = json!({
                "id": p.id,
                "name": p.name,
                "schema": p.schema,
                "jwt_secret": p.jwt_secret,
                "anon_key": anon,
                "service_role_key": service,
            });
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        ProjectAction::Keys {
            id,
            previous_secret,
            jwks,
        } => set_keys(&client, &id, previous_secret.as_deref(), jwks.as_deref()).await?,
        ProjectAction::List => {
            let list: Vec<serde_json::Value> = projects::list(&client)
                .await
                .context("listing the projects")?
                .into_iter()
                .map(|p| {
                    json!({"id": p.id, "name": p.name, "schema": p.schema, "created_at": p.created_at})
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
    }
    Ok(())
}

/// `walcast project keys`: the JWKS checked here (every key usable) before it is stored.
async fn set_keys(
    client: &tokio_postgres::Client,
    id: &str,
    previous: Option<&str>,
    jwks: Option<&str>,
) -> anyhow::Result<()> {
    let jwks = match jwks.map(str::trim) {
        None | Some("") => None,
        Some(v) if v.starts_with('{') => Some(v.to_string()),
        Some(path) => {
            Some(std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?)
        }
    };
    if let Some(j) = &jwks {
        let keys = walcast_front::keys::parse_jwks(j).context("the JWKS")?;
        eprintln!("JWKS: {} key(s)", keys.len());
    }
    let found = projects::set_keys(client, id, previous, jwks.as_deref())
        .await
        .context("storing the keys")?;
    anyhow::ensure!(found, "no project {id:?}");
    println!("keys of project {id} updated; fronts use them within their refresh (30 s)");
    Ok(())
}
