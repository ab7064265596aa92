//! `walcast project create|list|get|update|rotate|delete|keys`: projects with their own
//! schema, JWT secret and keys.

use anyhow::Context;
use clap::{Args, Subcommand};
use serde_json::json;
use walcast_bus::admin::{AdminReply, AdminRequest, LimitChanges, ProjectLimits, MAX_LIMIT};
use walcast_control::{manage, projects};
use walcast_front::management;

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct ProjectArgs {
    /// Postgres connection URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,
    #[command(flatten)]
    pub secrets: walcast_worker::config::SecretsArgs,
    /// The fronts' default connected-users limit of a project (shown as the limit in
    /// force of a project without its own).
    #[arg(long, env = "PROJECT_MAX_USERS", default_value_t = walcast_front::config::DEFAULT_PROJECT_MAX_USERS)]
    pub project_max_users: u64,
    /// The fronts' channels per socket (shown as the channels-per-client limit in force
    /// of a project without its own).
    #[arg(long, env = "MAX_CHANNELS_PER_SOCKET", default_value_t = walcast_front::config::DEFAULT_MAX_CHANNELS_PER_SOCKET)]
    pub max_channels_per_socket: usize,
    /// The fronts' default rate limits of a project (shown as the limits in force of a
    /// project without its own).
    #[command(flatten)]
    pub project_rates: walcast_worker::front::ProjectRateArgs,
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
        /// The source (database) to put its schema in (`walcast source list`); default:
        /// the deployment's own database.
        #[arg(long)]
        source: Option<String>,
        #[command(flatten)]
        limits: CreateLimits,
    },
    /// Print the projects as a JSON array (no secrets).
    List,
    /// Print one project (no secrets).
    Get {
        /// The project id.
        id: String,
    },
    /// Rename a project, switch private-only, suspend or resume it, set its limits.
    Update {
        /// The project id.
        id: String,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        private_only: Option<bool>,
        #[arg(long)]
        suspended: Option<bool>,
        #[command(flatten)]
        limits: UpdateLimits,
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

/// A project's limits at its creation (each omitted: the fronts' default).
#[derive(Args, Debug, Clone, Default)]
pub struct CreateLimits {
    /// Its connected-users limit (omitted: the fronts' PROJECT_MAX_USERS).
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_concurrent_users: Option<u32>,
    /// Its channel joins per second, across the fronts.
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_joins_per_second: Option<u32>,
    /// The channels one of its sockets may have joined (omitted: MAX_CHANNELS_PER_SOCKET).
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_channels_per_client: Option<u32>,
    /// Its broadcast and presence messages per second, across the fronts.
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_events_per_second: Option<u32>,
    /// The bytes of those messages per second, across the fronts.
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_bytes_per_second: Option<u32>,
    /// Its presence track and untrack events per second, across the fronts.
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_presence_events_per_second: Option<u32>,
    /// Its largest broadcast or presence payload, in KiB.
    #[arg(long, value_name = "N", value_parser = limit_value())]
    max_payload_size_in_kb: Option<u32>,
}

/// A limit at creation: a whole number from 0 to 2147483647.
fn limit_value() -> clap::builder::RangedI64ValueParser<u32> {
    clap::value_parser!(u32).range(0..=MAX_LIMIT as i64)
}

impl CreateLimits {
    fn limits(&self) -> ProjectLimits {
        ProjectLimits::from_array([
            self.max_concurrent_users,
            self.max_joins_per_second,
            self.max_channels_per_client,
            self.max_events_per_second,
            self.max_bytes_per_second,
            self.max_presence_events_per_second,
            self.max_payload_size_in_kb,
        ])
    }
}

/// A project's limits changed (each omitted: unchanged; `default`: back to the fronts'
/// default). Lowering one ends no socket: only what comes after is refused.
#[derive(Args, Debug, Clone, Default)]
pub struct UpdateLimits {
    /// Its connected-users limit, or `default` for the fronts' PROJECT_MAX_USERS.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_concurrent_users: Option<Limit>,
    /// Its channel joins per second across the fronts, or `default`.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_joins_per_second: Option<Limit>,
    /// The channels one of its sockets may have joined, or `default` (MAX_CHANNELS_PER_SOCKET).
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_channels_per_client: Option<Limit>,
    /// Its broadcast and presence messages per second across the fronts, or `default`.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_events_per_second: Option<Limit>,
    /// The bytes of those messages per second across the fronts, or `default`.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_bytes_per_second: Option<Limit>,
    /// Its presence track and untrack events per second across the fronts, or `default`.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_presence_events_per_second: Option<Limit>,
    /// Its largest broadcast or presence payload in KiB, or `default`.
    #[arg(long, value_name = "N|default", value_parser = parse_limit)]
    max_payload_size_in_kb: Option<Limit>,
}

impl UpdateLimits {
    fn changes(&self) -> LimitChanges {
        LimitChanges::from_array(
            [
                self.max_concurrent_users,
                self.max_joins_per_second,
                self.max_channels_per_client,
                self.max_events_per_second,
                self.max_bytes_per_second,
                self.max_presence_events_per_second,
                self.max_payload_size_in_kb,
            ]
            .map(|l| l.map(|l| l.0)),
        )
    }
}

/// `--max-…` of an update: a number, or the fronts' default.
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
        .filter(|n| u64::from(*n) <= MAX_LIMIT)
        .map(|n| Limit(Some(n)))
        .ok_or_else(|| format!("expected `default` or a whole number from 0 to {MAX_LIMIT}"))
}

/// The management request of an action (`None`: list and keys, answered apart).
fn request(action: &ProjectAction) -> Option<AdminRequest> {
    Some(match action.clone() {
        ProjectAction::Create {
            name,
            private_only,
            source,
            limits,
        } => AdminRequest::ProjectCreate {
            name,
            private_only,
            source,
            limits: limits.limits(),
        },
        ProjectAction::Get { id } => AdminRequest::ProjectGet { id },
        ProjectAction::Update {
            id,
            name,
            private_only,
            suspended,
            limits,
        } => AdminRequest::ProjectUpdate {
            id,
            name,
            private_only,
            suspended,
            limits: limits.changes(),
        },
        ProjectAction::Rotate { id, window_secs } => {
            AdminRequest::ProjectRotate { id, window_secs }
        }
        ProjectAction::Delete { id } => AdminRequest::ProjectDelete { id },
        ProjectAction::List | ProjectAction::Keys { .. } => return None,
    })
}

/// `walcast project …`: the management API's operations, run by the same code
/// ([`walcast_control::manage`]) on this process's own database session; the fronts
/// see a change at their next directory refresh (30 s; the management API tells them
/// at once).
pub async fn project(args: ProjectArgs) -> anyhow::Result<()> {
    let keys = args.secrets.keys()?;
    let database_url = super::database_url(&args.database_url)?;
    super::secrets::prepare_cli(database_url, &keys).await?;
    let mut client = walcast_pipeline::connect(database_url)
        .await
        .with_context(|| format!("connecting to {}", redact_url(database_url)))?;
    let defaults = walcast_front::FrontConfig {
        project_max_users: args.project_max_users,
        max_channels_per_socket: args.max_channels_per_socket,
        project_rates: args.project_rates.config(),
        ..Default::default()
    }
    .project_defaults();
    if let Some(req) = request(&args.action) {
        let with_secret = matches!(
            req,
            AdminRequest::ProjectCreate { .. } | AdminRequest::ProjectRotate { .. }
        );
        let out = match manage::run(&mut client, &keys, req).await? {
            AdminReply::Project { project } if with_secret => {
                let v = management::created_view(&project)?;
                management::with_effective_limits(v, &project, &defaults)
            }
            AdminReply::Project { project } => {
                let v = management::project_view(&project);
                management::with_effective_limits(v, &project, &defaults)
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
        } => {
            let (previous, jwks) = (previous_secret.as_deref(), jwks.as_deref());
            set_keys(&client, &keys, &id, previous, jwks).await?
        }
        _ => {
            let list: Vec<serde_json::Value> = projects::list(&client, &keys)
                .await
                .context("listing the projects")?
                .into_iter()
                .map(|p| {
                    let p = manage::record(p);
                    let v = management::project_view(&p);
                    management::with_effective_limits(v, &p, &defaults)
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
    }
    Ok(())
}

/// `walcast project keys`: the JWKS checked here (every key usable, no private part)
/// before it is stored; the previous secret stored encrypted.
async fn set_keys(
    client: &tokio_postgres::Client,
    keys: &walcast_control::secrets::SecretKeys,
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
        let parsed = walcast_front::keys::parse_jwks(j).context("the JWKS")?;
        no_private_parts(j)?;
        eprintln!("JWKS: {} key(s)", parsed.len());
    }
    let found = projects::set_keys(client, keys, id, previous, jwks.as_deref())
        .await
        .context("storing the keys")?;
    anyhow::ensure!(found, "no project {id:?}");
    println!("keys of project {id} updated; fronts use them within their refresh (30 s)");
    Ok(())
}

/// The members of a JWK that are private (RFC 7518: RSA's and EC/OKP's `d` and the
/// RSA primes and exponents, a symmetric key's `k`).
const PRIVATE_MEMBERS: &[&str] = &["d", "p", "q", "dp", "dq", "qi", "oth", "k"];

/// A JWKS verifies tokens with public keys only: one that carries a private part is
/// refused (it would be stored, and a private key has no business there).
fn no_private_parts(jwks: &str) -> anyhow::Result<()> {
    let set: serde_json::Value = serde_json::from_str(jwks).context("the JWKS")?;
    let keys = set["keys"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, key) in keys.iter().enumerate() {
        if let Some(m) = PRIVATE_MEMBERS.iter().find(|m| key.get(**m).is_some()) {
            anyhow::bail!(
                "the JWKS: key {i} has the private member {m:?}: give the public keys only"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_jwks_with_a_private_part_is_refused() {
        let public = r#"{"keys":[{"kty":"EC","crv":"P-256","kid":"k1","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;
        assert!(no_private_parts(public).is_ok());
        let private = public.replace(
            "\"kid\"",
            "\"d\":\"jpsQnnGQmL-YBIffH1136cspYG6-0iY7X1fCE9-E9LI\",\"kid\"",
        );
        let e = no_private_parts(&private).unwrap_err().to_string();
        assert!(e.contains("key 0 has the private member \"d\""), "{e}");
        assert!(no_private_parts(r#"{"keys":[{"kty":"oct","k":"c2VjcmV0"}]}"#).is_err());
    }

    #[test]
    fn a_limit_is_a_number_or_default() {
        assert_eq!(parse_limit("default"), Ok(Limit(None)));
        assert_eq!(parse_limit(" Default "), Ok(Limit(None)));
        assert_eq!(parse_limit("0"), Ok(Limit(Some(0))));
        assert_eq!(parse_limit("2147483647"), Ok(Limit(Some(i32::MAX as u32))));
        for bad in ["-1", "2147483648", "1.5", "", "none", "1e3", "0x10"] {
            assert!(parse_limit(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn create_takes_a_source() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ProjectArgs,
        }
        let source = |extra: &[&str]| {
            let mut argv = vec!["walcast", "--database-url", "postgres://x", "create"];
            argv.extend(extra);
            match request(&Cli::try_parse_from(argv).unwrap().args.action) {
                Some(AdminRequest::ProjectCreate { source, .. }) => source,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(source(&["--name", "n"]), None);
        assert_eq!(
            source(&["--name", "n", "--source", "shop"]).as_deref(),
            Some("shop")
        );
    }

    /// Each `--max-…` option of update and create reaches its own field of the request;
    /// `default` is `null` (back to the default); bad values are refused by clap.
    #[test]
    fn every_limit_option_reaches_its_field() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ProjectArgs,
        }
        let parse = |extra: &[&str]| {
            let mut argv = vec!["walcast", "--database-url", "postgres://x"];
            argv.extend(extra);
            Cli::try_parse_from(argv).map(|c| request(&c.args.action))
        };
        for (i, field) in ProjectLimits::FIELDS.into_iter().enumerate() {
            let opt = format!("--{}", field.replace('_', "-"));
            for (value, want) in [("7", Some(Some(7))), ("default", Some(None))] {
                let req = parse(&["update", "p", &opt, value]).unwrap();
                let Some(AdminRequest::ProjectUpdate { limits, .. }) = req else {
                    panic!("{req:?}")
                };
                let mut a = [None; walcast_bus::admin::LIMITS];
                a[i] = want;
                assert_eq!(limits.to_array(), a, "{opt} {value}");
            }
            let req = parse(&["create", "--name", "n", &opt, "2147483647"]).unwrap();
            let Some(AdminRequest::ProjectCreate { limits, .. }) = req else {
                panic!("{req:?}")
            };
            let mut a = [None; walcast_bus::admin::LIMITS];
            a[i] = Some(i32::MAX as u32);
            assert_eq!(limits.to_array(), a, "{opt}");
            for bad in ["-1", "2147483648", "lots"] {
                assert!(parse(&["update", "p", &opt, bad]).is_err(), "{opt} {bad}");
                assert!(
                    parse(&["create", "--name", "n", &opt, bad]).is_err(),
                    "{opt} {bad}"
                );
            }
            assert!(
                parse(&["create", "--name", "n", &opt, "default"]).is_err(),
                "{opt}"
            );
        }
        let req = parse(&["update", "p", "--name", "x"]).unwrap();
        let Some(AdminRequest::ProjectUpdate { limits, .. }) = req else {
            panic!("{req:?}")
        };
        assert!(limits.is_empty());
    }
}
