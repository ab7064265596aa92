//! How to reach NATS beyond `NATS_URL`: its CA, credentials, user.

use clap::Args;

/// How to trust and authenticate to NATS beyond `NATS_URL` (which may carry a user and
/// password, and `tls://` to require TLS).
#[derive(Args, Clone, Debug, Default)]
pub struct NatsAuthArgs {
    /// PEM file of the CA that signed the NATS server's certificate (TLS is then required).
    #[arg(long, env = "NATS_CA_FILE")]
    pub nats_ca_file: Option<std::path::PathBuf>,
    /// NATS credentials file (user JWT and nkey seed, as `nsc` writes it).
    #[arg(long, env = "NATS_CREDS_FILE")]
    pub nats_creds_file: Option<std::path::PathBuf>,
    /// File holding a NATS user nkey seed (`SU…`).
    #[arg(long, env = "NATS_NKEY_FILE")]
    pub nats_nkey_file: Option<std::path::PathBuf>,
    /// NATS user (with `NATS_PASSWORD`; instead of a user in `NATS_URL`), e.g. one of
    /// docker/nats/walcast-permissions.conf.
    #[arg(long, env = "NATS_USER")]
    pub nats_user: Option<String>,
    /// That user's password.
    #[arg(long, env = "NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
}

impl NatsAuthArgs {
    pub fn auth(&self) -> walcast_bus::NatsAuth {
        walcast_bus::NatsAuth {
            ca_file: self.nats_ca_file.clone(),
            creds_file: self.nats_creds_file.clone(),
            nkey_file: self.nats_nkey_file.clone(),
            user: self
                .nats_user
                .clone()
                .map(|u| (u, self.nats_password.clone().unwrap_or_default())),
            inbox_role: None,
        }
    }

    /// For the effective configuration (file paths, not their contents).
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "nats_ca_file": self.nats_ca_file,
            "nats_creds_file": self.nats_creds_file,
            "nats_nkey_file": self.nats_nkey_file,
            "nats_user": self.nats_user,
            "nats_password": self.nats_password.as_ref().map(|_| "***"),
        })
    }
}
