//! `walcast`: the all-in-one server and the operator's commands, one module each in
//! [`cmd`]. The commands (not `serve`) also take their settings from a `.env` file in
//! the working directory.

mod cmd;

use clap::{Parser, Subcommand};

/// walcast: streams Postgres changes in real time.
#[derive(Parser, Debug)]
#[command(name = "walcast", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// All-in-one server: the CDC pipeline and the realtime front (WebSocket, SSE) in one
    /// process.
    Serve(Box<cmd::serve::ServeConfig>),
    /// Apply walcast's SQL migrations and exit; with SECRETS_KEY, also encrypt the
    /// secrets still stored in plain text (without, refused while there are any).
    Migrate {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[command(flatten)]
        secrets: walcast_worker::config::SecretsArgs,
    },
    /// The secrets stored in the database (projects' JWT secrets, sources' URLs):
    /// rewrite them under SECRETS_KEY, or count them by key.
    Secrets(cmd::secrets::SecretsCmd),
    /// Manage which tables are streamed.
    Realtime(cmd::realtime::RealtimeArgs),
    /// Manage which tables store their changes in the JetStream change stream.
    Changes(cmd::changes::ChangesArgs),
    /// Publish a table's current rows on its change stream (READ events, consistent with
    /// its changes): start, status, cancel.
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Create and list projects (tenants with their own schema and keys).
    Project(cmd::project::ProjectArgs),
    /// Add, list and remove sources: other databases this deployment reads (projects on
    /// them have their schema there).
    Source(cmd::source::SourceArgs),
    /// Print change events from NATS as JSON lines.
    Tail(cmd::tail::TailArgs),
    /// Print a signed API key / access token (HS256 JWT) for a role.
    Key(cmd::key::KeyArgs),
    /// Inspect or drop the logical replication slot (to remove walcast cleanly).
    Slot(cmd::slot::SlotArgs),
    /// The transactional outbox: create and list outbox tables, redrive quarantined
    /// events, replay retained ones.
    Outbox(cmd::outbox::OutboxCmd),
    /// Ask a walcast process whether it is alive (`/livez`) or ready (`--ready`,
    /// `/readyz`): exit 0 if so, 1 with the reason (for health checks without curl).
    Probe(cmd::probe::ProbeArgs),
}

/// The file the operator's commands take settings from, in the working directory
/// (`./dev/up` writes one): a variable the environment sets wins.
pub const ENV_FILE: &str = ".env";

/// Read [`ENV_FILE`] unless the command is `serve` (a server's configuration is its
/// environment alone); a file that exists but cannot be read is an error naming it.
fn load_env_file() -> anyhow::Result<()> {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return Ok(());
    }
    match dotenvy::from_filename(ENV_FILE) {
        Ok(_) => Ok(()),
        Err(e) if e.not_found() => Ok(()),
        Err(e) => Err(anyhow::anyhow!(
            "reading {ENV_FILE} in the working directory: {e}"
        )),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    load_env_file()?;
    match Cli::parse().command {
        Command::Serve(cfg) => cmd::serve::serve(*cfg).await,
        Command::Migrate {
            database_url,
            secrets,
        } => {
            let keys = secrets.keys_if_set()?;
            cmd::migrate::migrate_command(&database_url, keys.as_deref()).await
        }
        Command::Secrets(cmd) => cmd::secrets::secrets(cmd).await,
        Command::Realtime(args) => cmd::realtime::realtime(args).await,
        Command::Changes(args) => cmd::changes::changes(args).await,
        Command::Snapshot(args) => cmd::snapshot::snapshot(args).await,
        Command::Project(args) => cmd::project::project(args).await,
        Command::Source(args) => cmd::source::source(args).await,
        Command::Tail(args) => cmd::tail::tail(args).await,
        Command::Key(args) => cmd::key::key(args),
        Command::Slot(args) => cmd::slot::slot(args).await,
        Command::Outbox(cmd) => cmd::outbox::outbox(cmd).await,
        Command::Probe(args) => cmd::probe::probe(args).await,
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }

    #[test]
    fn connection_options_go_before_or_after_the_subcommand() {
        use clap::Parser;
        for args in [
            &[
                "walcast",
                "realtime",
                "--database-url",
                "postgres://x",
                "list",
            ][..],
            &[
                "walcast",
                "realtime",
                "list",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "changes",
                "enable",
                "t",
                "--project",
                "p",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "project",
                "list",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "source",
                "add",
                "shop",
                "--source-database-url",
                "postgres://shop",
                "--check-url",
                "postgres://check@shop",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "source",
                "--database-url",
                "postgres://x",
                "list",
            ],
            &[
                "walcast",
                "outbox",
                "list",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "outbox",
                "--database-url",
                "postgres://x",
                "list",
            ],
            &[
                "walcast",
                "slot",
                "status",
                "--database-url",
                "postgres://x",
            ],
            &["walcast", "slot", "drop", "--slot-name", "s", "--force"],
            &[
                "walcast",
                "snapshot",
                "status",
                "--project",
                "p",
                "--database-url",
                "postgres://x",
            ],
            &[
                "walcast",
                "secrets",
                "status",
                "--database-url",
                "postgres://x",
            ],
        ] {
            if let Err(e) = super::Cli::try_parse_from(args) {
                panic!("{args:?}: {e}");
            }
        }
    }

    /// Every `walcast …` command the product prints as a hint (in an error, a warning, a
    /// reply) is one this command line takes as printed, its placeholders filled in.
    #[test]
    fn every_printed_hint_parses() {
        let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the crates directory");
        let names: Vec<String> = super::Cli::command()
            .get_subcommands()
            .map(|c| format!("walcast {} ", c.get_name()))
            .collect();
        let mut hints = Vec::new();
        for file in hint_sources(crates) {
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for line in text.lines().filter(|l| !is_comment(l)) {
                hints.extend(hints_in(line, &names).map(|h| (file.clone(), h)));
            }
        }
        assert!(hints.len() >= 8, "hints found: {hints:?}");
        // Where the hints are run: the connections are configured (./dev/up's .env).
        let configured = configured(super::Cli::command());
        for (file, hint) in hints {
            let args = std::iter::once("walcast").chain(hint.split_whitespace().skip(1));
            if let Err(e) = configured.clone().try_get_matches_from(args) {
                panic!("{}: `{hint}` does not parse: {e}", file.display());
            }
        }
    }

    /// The product's Rust sources: every crate's `src` (not the benchmarks' or the test
    /// kit's). The SQL's messages are printed once, when a migration runs, and migrations
    /// are never edited.
    fn hint_sources(crates: &std::path::Path) -> Vec<std::path::PathBuf> {
        let mut dirs: Vec<_> = std::fs::read_dir(crates)
            .expect("list the crates")
            .map(|e| e.expect("a crate").path())
            .filter(|p| !p.ends_with("walcast-bench") && !p.ends_with("walcast-testkit"))
            .map(|p| p.join("src"))
            .collect();
        let mut files = Vec::new();
        while let Some(dir) = dirs.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for path in entries.map(|e| e.expect("an entry").path()) {
                match path.extension().and_then(|e| e.to_str()) {
                    _ if path.is_dir() => dirs.push(path),
                    Some("rs") => files.push(path),
                    _ => {}
                }
            }
        }
        files
    }

    /// `cmd` as where DATABASE_URL and NATS_URL are set: their options have a value.
    fn configured(cmd: clap::Command) -> clap::Command {
        cmd.mut_args(|arg| match arg.get_env().and_then(|e| e.to_str()) {
            Some("DATABASE_URL") => arg.default_value("postgres://configured").required(false),
            Some("NATS_URL") => arg.default_value("nats://configured").required(false),
            _ => arg,
        })
        .mut_subcommands(configured)
    }

    fn is_comment(line: &str) -> bool {
        let code = line.trim_start();
        code.starts_with("//") || code.starts_with('*')
    }

    /// The commands in a line of code — set off as the messages set them off, in
    /// backticks or parentheses —, each up to the punctuation that ends it, with
    /// `{placeholder}` and `<placeholder>` filled in and `[optional parts]` left out.
    fn hints_in<'a>(line: &'a str, names: &'a [String]) -> impl Iterator<Item = String> + 'a {
        names.iter().flat_map(move |name| {
            let set_off = move |&(at, _): &(usize, &str)| line[..at].ends_with(['`', '(']);
            line.match_indices(name.as_str())
                .filter(set_off)
                .map(move |(at, _)| {
                    let rest = &line[at..];
                    let end = rest
                        .find([')', '`', '"', '\'', ',', ';', '\\'])
                        .unwrap_or(rest.len());
                    fill(&rest[..end])
                })
        })
    }

    fn fill(hint: &str) -> String {
        let mut out = String::new();
        let mut skip_to = None;
        for c in hint.chars() {
            match (skip_to, c) {
                (Some(end), _) if c == end => skip_to = None,
                (Some(_), _) => {}
                (None, '{') => (skip_to, out) = (Some('}'), out + "x"),
                (None, '<') => (skip_to, out) = (Some('>'), out + "x"),
                (None, '[') => skip_to = Some(']'),
                (None, _) => out.push(c),
            }
        }
        out
    }

    #[test]
    fn help_shows_no_secret_environment_value() {
        let shown = walcast_worker::config::secret_envs_shown(&super::Cli::command());
        assert_eq!(shown, Vec::<String>::new());
    }
}
