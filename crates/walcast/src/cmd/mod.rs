//! The `walcast` subcommands, one module each (the processes' runtime is
//! `walcast-worker`; the commands on the control database call `walcast-control`).

pub mod changes;
pub mod key;
pub mod migrate;
pub mod outbox;
pub mod probe;
pub mod project;
pub mod realtime;
pub mod secrets;
pub mod serve;
pub mod slot;
pub mod snapshot;
pub mod source;
pub mod tail;

/// `--database-url` (`DATABASE_URL`, walcast's own database), which every command takes
/// before or after its subcommand (a global option cannot be required by clap): its value,
/// or an error saying where to give it.
pub fn database_url(value: &Option<String>) -> anyhow::Result<&str> {
    value
        .as_deref()
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "DATABASE_URL is not set: give --database-url, or set it in the environment or in .env"
            )
        })
}
