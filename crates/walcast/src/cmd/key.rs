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
    /// Another claim, `NAME=VALUE` (VALUE as JSON when it parses, else a string), e.g.
    /// `--claim aud=authenticated --claim iss=https://auth.example.com/` for a front with
    /// JWT_AUDIENCE / JWT_ISSUER. Repeatable.
    #[arg(long = "claim", value_name = "NAME=VALUE", value_parser = parse_claim)]
    pub claims: Vec<(String, serde_json::Value)>,
}

/// Claims with their own option (or set by the signing) that `--claim` may not set.
const OWN_OPTIONS: &[(&str, &str)] = &[
    ("role", "--role"),
    ("sub", "--sub"),
    ("ref", "--project"),
    ("exp", "--expires-in"),
    ("iat", "the signing time"),
];

/// `NAME=VALUE` of `--claim`.
fn parse_claim(s: &str) -> Result<(String, serde_json::Value), String> {
    let (name, value) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("{s:?} has no claim name"));
    }
    if let Some((_, by)) = OWN_OPTIONS.iter().find(|(n, _)| *n == name) {
        return Err(format!("the `{name}` claim is set by {by}"));
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| value.into());
    Ok((name.to_string(), value))
}

/// Lifetime of the keys `walcast project create` prints (and `walcast key`'s default).
pub const KEY_LIFETIME_SECS: u64 = 10 * 365 * 24 * 3600;

/// Sign an HS256 API key: `claims` plus `iss` = `walcast` (unless `claims` has one),
/// `iat` = now and `exp` = now + `expires_in` seconds.
pub fn sign_key(
    secret: &str,
    mut claims: serde_json::Map<String, serde_json::Value>,
    expires_in: u64,
) -> anyhow::Result<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .context("system clock before 1970")?
        .as_secs();
    claims.entry("iss").or_insert_with(|| "walcast".into());
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
    claims.extend(args.claims);
    println!("{}", sign_key(&args.jwt_secret, claims, args.expires_in)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_json_or_strings_and_not_the_ones_with_their_own_option() {
        assert_eq!(
            parse_claim("aud=authenticated").unwrap(),
            ("aud".into(), "authenticated".into())
        );
        assert_eq!(
            parse_claim(r#"aud=["a","b"]"#).unwrap().1,
            serde_json::json!(["a", "b"])
        );
        assert_eq!(parse_claim("n=3").unwrap().1, serde_json::json!(3));
        assert_eq!(
            parse_claim("iss=https://a.example/x=y").unwrap().1,
            "https://a.example/x=y"
        );
        assert!(parse_claim("aud").is_err());
        assert!(parse_claim("=x").is_err());
        assert!(parse_claim("role=service_role")
            .unwrap_err()
            .contains("--role"));
    }
}
