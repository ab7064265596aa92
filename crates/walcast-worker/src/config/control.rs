//! What the control plane's readers are given: the key of the secrets stored in the
//! database, and the roles a token may act as.

use clap::Args;
use walcast_control::secrets::SecretKeys;

/// The key the projects' secrets and the sources' URLs are stored encrypted with (see
/// `walcast_control::secrets`), and during a rotation the previous one.
#[derive(Args, Clone, Default)]
pub struct SecretsArgs {
    /// Key of the secrets stored in the database (the projects' JWT secrets, the sources'
    /// URLs): at least 32 bytes, e.g. `openssl rand -hex 32`. Required by the processes
    /// that read or write them (cdc-worker, `walcast serve`, `walcast project`,
    /// `walcast source`, `walcast secrets`); keep it apart from the database's backups.
    #[arg(long, env = "SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<String>,
    /// During a rotation of SECRETS_KEY, the previous key: still read, while every value
    /// is rewritten under SECRETS_KEY (at each start, or `walcast secrets rotate`).
    #[arg(long, env = "SECRETS_KEY_PREVIOUS", hide_env_values = true)]
    pub secrets_key_previous: Option<String>,
}

impl std::fmt::Debug for SecretsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretsArgs { .. }")
    }
}

impl SecretsArgs {
    /// The keys; an error naming the option when the key is missing or too short.
    pub fn keys(&self) -> anyhow::Result<std::sync::Arc<SecretKeys>> {
        let key = self
            .secrets_key
            .as_deref()
            .filter(|k| !k.is_empty())
            .ok_or(walcast_control::secrets::SecretError::NoKey)?;
        let keys = SecretKeys::new(key, self.secrets_key_previous.as_deref())?;
        Ok(std::sync::Arc::new(keys))
    }

    /// The keys if SECRETS_KEY is set.
    pub fn keys_if_set(&self) -> anyhow::Result<Option<std::sync::Arc<SecretKeys>>> {
        match self.secrets_key.as_deref() {
            None | Some("") => Ok(None),
            Some(_) => self.keys().map(Some),
        }
    }

    /// For the effective configuration: the keys' ids, never the keys.
    pub fn describe(keys: &SecretKeys) -> serde_json::Value {
        serde_json::json!({
            "secrets_key": "***",
            "secrets_key_id": keys.key_id(),
            "secrets_key_previous": keys.previous_key_id().map(|_| "***"),
            "secrets_key_previous_id": keys.previous_key_id(),
        })
    }
}

/// `ALLOWED_ROLES`: the roles a token may act as (its `role` claim). Checked by the
/// front (every token it verifies) and by the worker (every check that switches to a
/// token's role), which also refuses superusers and its own role whatever the list says.
#[derive(Args, Clone, Debug)]
pub struct RolesArgs {
    /// Roles a token may act as, comma-separated (`none`, superusers and walcast's own
    /// role are always refused by the worker).
    #[arg(
        long = "allowed-roles",
        env = "ALLOWED_ROLES",
        value_delimiter = ',',
        default_value = "anon,authenticated,service_role"
    )]
    pub allowed_roles: Vec<String>,
}

impl RolesArgs {
    /// The worker's policy.
    pub fn policy(&self) -> walcast_control::roles::RolePolicy {
        walcast_control::roles::RolePolicy::new(self.allowed_roles.iter().cloned())
    }
}
