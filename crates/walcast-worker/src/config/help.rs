//! `--help` must never show a secret read from the environment.

/// Whether an option read from the environment variable `env` may carry a secret (a
/// password in a URL, a key, a token): `--help` must not show its value. One that names
/// a file (`…_FILE`) or a duration (`…_SECS`, `…_MS`) holds none.
pub fn is_secret_env(env: &str) -> bool {
    let words: Vec<&str> = env.split('_').collect();
    let secret = ["URL", "SECRET", "PASSWORD", "KEY", "TOKEN", "JWKS", "CREDS"];
    !matches!(words.last(), Some(&("FILE" | "SECS" | "MS")))
        && words.iter().any(|w| secret.contains(w))
}

/// The options of `cmd` and its subcommands whose secret-bearing environment value
/// `--help` would show (see [`is_secret_env`]): `command env` pairs; empty when none.
pub fn secret_envs_shown(cmd: &clap::Command) -> Vec<String> {
    let mut shown: Vec<String> = cmd
        .get_arguments()
        .filter(|a| !a.is_hide_env_values_set())
        .filter_map(|a| a.get_env())
        .map(|e| e.to_string_lossy().into_owned())
        .filter(|e| is_secret_env(e))
        .map(|e| format!("{} {e}", cmd.get_name()))
        .collect();
    for sub in cmd.get_subcommands() {
        shown.extend(secret_envs_shown(sub));
    }
    shown
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn secret_names_are_recognised() {
        for e in [
            "DATABASE_URL",
            "NATS_PASSWORD",
            "MANAGEMENT_API_KEY",
            "JWT_JWKS",
        ] {
            assert!(is_secret_env(e), "{e}");
        }
        for e in [
            "NATS_CREDS_FILE",
            "NATS_NKEY_FILE",
            "SECRET_ROTATION_WINDOW_SECS",
            "PORT",
            "NATS_USER",
        ] {
            assert!(!is_secret_env(e), "{e}");
        }
    }

    #[test]
    fn help_shows_no_secret_environment_value() {
        for cmd in [
            crate::cdc_worker::CdcWorkerConfig::command(),
            crate::ws_front::WsFrontConfig::command(),
        ] {
            assert_eq!(secret_envs_shown(&cmd), Vec::<String>::new());
        }
    }
}
