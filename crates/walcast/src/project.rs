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
    /// The fronts' default connected-users limit of a project (shown as the limit in
    /// force of a project without its own).
    #[arg(long, env = "PROJECT_MAX_USERS", default_value_t = walcast_front::config::DEFAULT_PROJECT_MAX_USERS)]
    pub project_max_users: u64,
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
        /// Its connected-users limit (omitted: the fronts' PROJECT_MAX_USERS).
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=i64::from(i32::MAX)))]
        max_concurrent_users: Option<u32>,
    },
    /// Print the projects as a JSON array (no secrets).
    List,
    /// Print one project (no secrets).
    Get {
        /// The project id.
        id: String,
    },
    /// Rename a project, switch private-only, suspend or resume it, set its
    /// connected-users limit.
    Update {
        /// The project id.
        id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        private_only: Option<bool>,
        #[arg(long)]
        suspended: Option<bool>,
        /// Its connected-users limit, or `default` for the fronts' PROJECT_MAX_USERS.
        /// Lowering it ends no socket: only new users are refused.
        #[arg(long, value_name = "N|default", value_parser = parse_limit)]
        max_concurrent_users: Option<Limit>,
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

/// `--max-concurrent-users`: a number, or the fronts' default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit(Option<u32>);

/// `default`, or a whole number from 0 to 2147483647.
fn parse_limit(s: &str) -> Result<Limit, String> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("default") {
        return Ok(Limit(None));
    }
    s.parse::<u32>()
        .ok()
        .filter(|n| u64::from(*n) <= walcast_bus::admin::MAX_USERS_LIMIT)
        .map(|n| Limit(Some(n)))
        .ok_or_else(|| {
            format!(
                "expected `default` or a whole number from 0 to {}",
                walcast_bus::admin::MAX_USERS_LIMIT
            )
        })
}

/// The management request of an action (`None`: list and keys, answered apart).
fn request(action: &ProjectAction) -> Option<AdminRequest> {
    Some(match action.clone() {
        ProjectAction::Create {
            name,
            private_only,
            max_concurrent_users,
        } => AdminRequest::ProjectCreate {
            name,
            private_only,
            max_concurrent_users,
        },
        ProjectAction::Get { id } => AdminRequest::ProjectGet { id },
        ProjectAction::Update {
            id,
            name,
            private_only,
            suspended,
            max_concurrent_users,
        } => AdminRequest::ProjectUpdate {
            id,
            name,
            private_only,
            suspended,
            max_concurrent_users: max_concurrent_users.map(|l| l.0),
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
        let default = args.project_max_users;
        let out = match manage::run(&mut client, req).await? {
            AdminReply::Project { project } if with_secret => {
                let v = management::created_view(&project)?;
                management::with_effective_limit(v, &project, default)
            }
            AdminReply::Project { project } => {
                let v = management::project_view(&project);
                management::with_effective_limit(v, &project, default)
            }
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
                .map(|p| {
                    let p = manage::record(p);
                    let v = management::project_view(&p);
                    management::with_effective_limit(v, &p, args.project_max_users)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_is_a_number_or_default() {
        assert_eq!(parse_limit("default"), Ok(Limit(None)));
        assert_eq!(parse_limit(" Default "), Ok(Limit(None)));
        assert_eq!(parse_limit("0"), Ok(Limit(Some(0))));
        assert_eq!(parse_limit("2147483647"), Ok(Limit(Some(i32::MAX as u32))));
        for bad in ["-1", "2147483648", "1.5", "", "none", "1e3", "0x10"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
        let req = request(&ProjectAction::Update {
            id: "p".into(),
            name: None,
            private_only: None,
            suspended: None,
            max_concurrent_users: Some(Limit(None)),
        });
        let Some(AdminRequest::ProjectUpdate {
            max_concurrent_users,
            ..
        }) = req
        else {
            panic!("{req:?}")
        };
        assert_eq!(max_concurrent_users, Some(None), "default: back to null");
    }
}
