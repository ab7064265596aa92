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

/// A connection URL option that may come after the subcommand (a global option cannot be
/// required by clap): its value, or an error saying where to give it.
pub fn required_url<'a>(
    value: &'a Option<String>,
    env: &str,
    flag: &str,
) -> anyhow::Result<&'a str> {
    value
        .as_deref()
        .filter(|v| !v.trim().is_empty())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{env} is not set: give {flag}, or set it in the environment or in .env"
            )
        })
}
