//! `walcast project create|list|get|update|rotate|delete|keys`: projects with their own
//! schema, JWT secret and keys.

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use walcast_bus::admin::{AdminReply, AdminRequest};
use walcast_front::management;
use walcast_realtime::{manage, projects};

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
        /// Refuse public channels.
        #[arg(long)]
        private_only: bool,
    },
    /// Print the projects as a JSON array (no secrets).
    List,
    /// Print one project (no secrets).
    Get {
        /// The project id.
        id: String,
    },
    /// Rename a project, switch private-only, suspend or resume it.
    Update {
        /// The project id.
        id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        private_only: Option<bool>,
        #[arg(long)]
        suspended: Option<bool>,
    },
    /// A new secret (printed with new keys); the current one stays valid for the window.
    Rotate {
        /// The project id.
        id: String,
        /// How long the current secret stays valid, in seconds (0: refused at once).
        #[arg(long, env = "SECRET_ROTATION_WINDOW_SECS", default_value_t = walcast_front::config::DEFAULT_ROTATION_WINDOW_SECS)]
        window_secs: u64,
    },
    /// Delete a project: realtime off on its tables, its keys refused (its schema and
    /// data are kept).
    Delete {
        /// The project id.
        id: String,
    },
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
    Ok(management::mint_keys(id, secret)?)
}

/// The management request of an action (`None`: list and keys, answered apart).
fn request(action: &ProjectAction) -> Option<AdminRequest> {
    Some(match action.clone() {
        ProjectAction::Create { name, private_only } => {
            AdminRequest::ProjectCreate { name, private_only }
        }
        ProjectAction::Get { id } => AdminRequest::ProjectGet { id },
        ProjectAction::Update {
            id,
            name,
            private_only,
            suspended,
        } => AdminRequest::ProjectUpdate {
            id,
            name,
            private_only,
            suspended,
        },
        ProjectAction::Rotate { id, window_secs } => {
            AdminRequest::ProjectRotate { id, window_secs }
        }
        ProjectAction::Delete { id } => AdminRequest::ProjectDelete { id },
        ProjectAction::List | ProjectAction::Keys { .. } => return None,
    })
}

/// `walcast project …`: the management API's operations, run by the same code
/// ([`walcast_realtime::manage`]) on this process's own database session; the fronts
/// see a change at their next directory refresh (30 s; the management API tells them
/// at once).
pub async fn project(args: ProjectArgs) -> anyhow::Result<()> {
    crate::cdc_worker::migrate(&args.database_url).await?;
    let mut client = walcast_pipeline::connect(&args.database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(&args.database_url)))?;
    if let Some(req) = request(&args.action) {
        let with_secret = matches!(
            req,
            AdminRequest::ProjectCreate { .. } | AdminRequest::ProjectRotate { .. }
        );
        let out = match manage::run(&mut client, req).await? {
            AdminReply::Project { project } if with_secret => management::created_view(&project)?,
            AdminReply::Project { project } => management::project_view(&project),
            AdminReply::ProjectDeleted { id, tables } => {
                json!({"id": id, "deleted": true, "tables": tables})
            }
            other => anyhow::bail!("unexpected answer {other:?}"),
        };
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    match args.action {
        ProjectAction::Keys {
            id,
            previous_secret,
            jwks,
        } => set_keys(&client, &id, previous_secret.as_deref(), jwks.as_deref()).await?,
        _ => {
            let list: Vec<serde_json::Value> = projects::list(&client)
                .await
                .context("listing the projects")?
                .into_iter()
                .map(|p| management::project_view(&manage::record(p)))
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
