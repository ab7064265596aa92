//! Which database roles a token may act as. Every check that switches to a token's
//! `role` (`set_config('role', …)`: subscriptions' RLS checks, private-channel checks)
//! goes through a [`RolePolicy`] first: the role must be in the allow-list
//! (`ALLOWED_ROLES`, default `anon,authenticated,service_role`), and even when listed it
//! may be neither a superuser, nor walcast's own login role (`current_user` /
//! `session_user`), nor a member of it — a token must never borrow walcast's powers.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::Value;
use tokio_postgres::Client;

/// The default allow-list: Supabase's API roles.
pub const DEFAULT_ALLOWED_ROLES: &[&str] = &["anon", "authenticated", "service_role"];

/// Why a token's role is refused. `Display` is the reason given to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoleRefused {
    #[error("the token has no `role` claim")]
    Missing,
    #[error("the token's role {0:?} is not allowed (ALLOWED_ROLES)")]
    NotListed(String),
    #[error("the token's role {0:?} is a superuser")]
    Superuser(String),
    #[error("the token's role {0:?} is walcast's own role or a member of it")]
    Walcast(String),
}

/// The roles tokens may act as. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RolePolicy {
    allowed: Arc<[String]>,
}

impl Default for RolePolicy {
    fn default() -> Self {
        RolePolicy::new(DEFAULT_ALLOWED_ROLES.iter().map(|r| r.to_string()))
    }
}

/// What a role is, as walcast's session sees it.
const ROLE_FACTS: &str = "SELECT r.rolsuper,
        r.rolname = current_user OR r.rolname = session_user
        OR pg_has_role(r.rolname, session_user, 'MEMBER')
        OR pg_has_role(r.rolname, current_user, 'MEMBER')
   FROM pg_roles r WHERE r.rolname = $1";

impl RolePolicy {
    /// Allow these roles (empty names are ignored).
    pub fn new(allowed: impl IntoIterator<Item = String>) -> RolePolicy {
        let allowed: Vec<String> = allowed
            .into_iter()
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty())
            .collect();
        RolePolicy {
            allowed: allowed.into(),
        }
    }

    /// The allowed roles.
    pub fn allowed(&self) -> &[String] {
        &self.allowed
    }

    /// The `role` of `claims`, if it is listed (no database needed).
    pub fn listed<'a>(&self, claims: &'a Value) -> Result<&'a str, RoleRefused> {
        let role = claims
            .get("role")
            .and_then(Value::as_str)
            .filter(|r| !r.is_empty())
            .ok_or(RoleRefused::Missing)?;
        if !self.allowed.iter().any(|a| a == role) {
            return Err(RoleRefused::NotListed(role.to_string()));
        }
        Ok(role)
    }

    /// The `role` of `claims` if a token may act as it: listed, and neither a superuser
    /// nor walcast's own role (a role that does not exist passes: switching to it fails).
    pub async fn check<'a>(
        &self,
        client: &Client,
        claims: &'a Value,
    ) -> Result<Result<&'a str, RoleRefused>, tokio_postgres::Error> {
        let role = match self.listed(claims) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        let Some(row) = client.query_opt(ROLE_FACTS, &[&role]).await? else {
            return Ok(Ok(role));
        };
        Ok(judge(role, row.get(0), row.get(1)))
    }

    /// [`RolePolicy::check`], remembering each role's answer in `memo` (one batch).
    pub async fn check_memo(
        &self,
        client: &Client,
        claims: &Value,
        memo: &mut HashMap<String, Result<(), RoleRefused>>,
    ) -> Result<Result<(), RoleRefused>, tokio_postgres::Error> {
        let key = claims
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        if let Some(known) = memo.get(&key) {
            return Ok(known.clone());
        }
        let answer = self.check(client, claims).await?.map(|_| ());
        memo.insert(key, answer.clone());
        Ok(answer)
    }
}

fn judge(role: &str, superuser: bool, walcast: bool) -> Result<&str, RoleRefused> {
    if superuser {
        return Err(RoleRefused::Superuser(role.to_string()));
    }
    if walcast {
        return Err(RoleRefused::Walcast(role.to_string()));
    }
    Ok(role)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn only_listed_roles_pass() {
        let p = RolePolicy::default();
        assert_eq!(p.listed(&json!({"role": "anon"})), Ok("anon"));
        assert_eq!(
            p.listed(&json!({"role": "service_role"})),
            Ok("service_role")
        );
        for bad in ["none", "postgres", "Anon", "anon ", ""] {
            assert!(p.listed(&json!({ "role": bad })).is_err(), "{bad}");
        }
        assert_eq!(p.listed(&json!({})), Err(RoleRefused::Missing));
        assert_eq!(p.listed(&json!({"role": 1})), Err(RoleRefused::Missing));
        let custom = RolePolicy::new(["a".to_string(), " ".to_string()]);
        assert_eq!(custom.allowed(), ["a".to_string()]);
    }

    #[test]
    fn superusers_and_walcast_are_refused_even_when_listed() {
        assert_eq!(judge("x", false, false), Ok("x"));
        assert_eq!(
            judge("x", true, false),
            Err(RoleRefused::Superuser("x".into()))
        );
        assert_eq!(
            judge("x", false, true),
            Err(RoleRefused::Walcast("x".into()))
        );
    }
}
