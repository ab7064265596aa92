//! `walcast key`: a signed API key (HS256 JWT) for a role, like Supabase's anon and
//! service_role keys.

use anyhow::Context;
use clap::Args;

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
