//! A throwaway Postgres cluster with logical decoding and wal2json.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::process::{chown_tree, run, run_as_for_postgres, RunAs, Supervised};
use crate::{free_port, KitError};

const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// The login every cluster of the kit has for walcast's `CHECK_DATABASE_URL`: the session
/// user of the connections that run tenant SQL (row-level security policies and the
/// like), with no privileges of its own. walcast grants it the API roles at start.
pub const CHECK_LOGIN: &str = "walcast_check";
const BIND_RETRIES: usize = 5;

/// Settings for a throwaway cluster. Start with [`Postgres::builder`].
#[derive(Clone, Debug)]
pub struct PostgresBuilder {
    settings: Vec<(String, String)>,
    require_wal2json: bool,
    password_auth: Option<(String, String)>,
    /// Server certificate and key: TLS on, and TCP connections without it refused.
    tls_only: Option<(PathBuf, PathBuf)>,
}

impl Default for PostgresBuilder {
    fn default() -> Self {
        let base: &[(&str, &str)] = &[
            ("wal_level", "logical"),
            ("max_replication_slots", "16"),
            ("max_wal_senders", "16"),
            ("max_slot_wal_keep_size", "256MB"),
            ("max_connections", "200"),
            ("shared_buffers", "64MB"),
            // Throwaway data: durability only costs time here. Commit order and WAL
            // contents are unaffected.
            ("fsync", "off"),
            ("full_page_writes", "off"),
            ("log_min_messages", "warning"),
            ("timezone", "UTC"),
            ("log_line_prefix", "%m [%p] "),
        ];
        PostgresBuilder {
            settings: base
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            require_wal2json: true,
            password_auth: None,
            tls_only: None,
        }
    }
}

impl PostgresBuilder {
    /// Set (or override) a server setting passed as `-c name=value`.
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.retain(|(k, _)| k != name);
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    /// Do not fail when wal2json is missing (for testing our own "missing wal2json" error).
    pub fn without_wal2json_check(mut self) -> Self {
        self.require_wal2json = false;
        self
    }

    /// Require a password on TCP connections: `initdb --auth-host=<method>` (e.g.
    /// `scram-sha-256`, `md5`, `password`), with `password` set for the `postgres`
    /// superuser. [`Postgres::url`] then carries the password; Unix-socket connections
    /// stay `trust`.
    pub fn password_auth(mut self, method: &str, password: &str) -> Self {
        self.password_auth = Some((method.to_string(), password.to_string()));
        self
    }

    /// Serve TLS with this certificate and key (PEM), and refuse TCP connections without
    /// TLS (`hostnossl … reject`), replication ones included. Unix-socket connections
    /// (the kit's own `psql`) stay `trust`.
    pub fn tls_only(mut self, cert: &Path, key: &Path) -> Self {
        self.tls_only = Some((cert.to_path_buf(), key.to_path_buf()));
        self
    }

    pub fn start(self) -> Result<Postgres, KitError> {
        Postgres::start_with(self)
    }
}

/// A running throwaway cluster; stopped and deleted on drop.
pub struct Postgres {
    bindir: PathBuf,
    run_as: Option<RunAs>,
    port: u16,
    settings: Vec<(String, String)>,
    password: Option<String>,
    process: Option<Supervised>,
    // Declared last so the directory outlives the process.
    dir: TempDir,
}

impl Postgres {
    pub fn builder() -> PostgresBuilder {
        PostgresBuilder::default()
    }

    /// A cluster with the default settings.
    pub fn start() -> Result<Postgres, KitError> {
        PostgresBuilder::default().start()
    }

    /// `n` independent clusters (each its own data directory, port and slots) with the
    /// default settings: the databases of several sources.
    pub fn start_many(n: usize) -> Result<Vec<Postgres>, KitError> {
        (0..n).map(|_| Postgres::start()).collect()
    }

    fn start_with(builder: PostgresBuilder) -> Result<Postgres, KitError> {
        let bindir = find_bindir()?;
        if builder.require_wal2json {
            check_wal2json(&bindir)?;
        }
        let run_as = run_as_for_postgres()?;
        let dir = tempfile::Builder::new()
            .prefix("walcast-pg-")
            .tempdir()
            .map_err(|e| KitError::io("creating temp dir", e))?;
        chown_tree(dir.path(), run_as)?;
        let data = dir.path().join("data");
        let mut initdb = Command::new(bindir.join("initdb"));
        initdb
            .arg("-D")
            .arg(&data)
            .args(["--auth=trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
            .args(["--locale=C.UTF-8", "--wal-segsize=1"]);
        let pwfile = dir.path().join("pwfile");
        if let Some((method, password)) = &builder.password_auth {
            std::fs::write(&pwfile, format!("{password}\n"))
                .map_err(|e| KitError::io("writing the password file", e))?;
            chown_tree(&pwfile, run_as)?;
            // Later options win: host connections use `method`, local ones stay trust.
            initdb
                .arg(format!("--auth-host={method}"))
                .arg("--pwfile")
                .arg(&pwfile);
        }
        let initdb_result = run(initdb, run_as);
        if builder.password_auth.is_some() {
            let _ = std::fs::remove_file(&pwfile);
        }
        initdb_result?;
        let mut settings = builder.settings;
        if let Some((cert, key)) = &builder.tls_only {
            settings.extend(tls_only(dir.path(), &data, cert, key, run_as)?);
        }
        let mut pg = Postgres {
            bindir,
            run_as,
            port: 0,
            settings,
            password: builder.password_auth.map(|(_, password)| password),
            process: None,
            dir,
        };
        pg.boot(true)?;
        pg.create_check_login()?;
        Ok(pg)
    }

    /// Create [`CHECK_LOGIN`] (with the superuser's password when there is one).
    fn create_check_login(&self) -> Result<(), KitError> {
        let password = match &self.password {
            Some(p) => format!(" PASSWORD '{}'", p.replace('\'', "''")),
            None => String::new(),
        };
        self.psql(&format!(
            "CREATE ROLE {CHECK_LOGIN} LOGIN NOINHERIT{password}"
        ))
        .map(|_| ())
    }

    /// Start the server process; with `new_port`, pick a fresh free port (retrying binds).
    fn boot(&mut self, new_port: bool) -> Result<(), KitError> {
        let mut last_err = None;
        for _ in 0..BIND_RETRIES {
            if new_port || self.port == 0 {
                self.port = free_port().map_err(|e| KitError::io("finding a free port", e))?;
            }
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(e) => {
                    let bind_race = matches!(&e, KitError::NotReady { tail, .. }
                        if tail.contains("could not bind") || tail.contains("could not create listen socket"));
                    last_err = Some(e);
                    if !(bind_race && new_port) {
                        break;
                    }
                }
            }
        }
        Err(last_err.unwrap_or(KitError::NotReady {
            service: "postgres",
            seconds: 0,
            log: PathBuf::new(),
            tail: String::new(),
        }))
    }

    fn spawn_and_wait(&mut self) -> Result<(), KitError> {
        let mut args = vec![
            "-D".to_string(),
            self.data_dir().display().to_string(),
            "-c".into(),
            format!("port={}", self.port),
            "-c".into(),
            "listen_addresses=127.0.0.1".into(),
            "-c".into(),
            format!("unix_socket_directories={}", self.dir.path().display()),
        ];
        for (k, v) in &self.settings {
            args.push("-c".into());
            args.push(format!("{k}={v}"));
        }
        let log = self.dir.path().join("postgres.log");
        let mut proc = Supervised::spawn(
            &self.bindir.join("postgres"),
            &args,
            log,
            "QUIT",
            self.run_as,
            self.dir.path(),
        )?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if self.is_ready() {
                self.process = Some(proc);
                return Ok(());
            }
            if !proc.is_running() || Instant::now() > deadline {
                return Err(KitError::NotReady {
                    service: "postgres",
                    seconds: READY_TIMEOUT.as_secs(),
                    log: proc.log.clone(),
                    tail: proc.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_ready(&self) -> bool {
        Command::new(self.bindir.join("pg_isready"))
            .args(["-q", "-h", "127.0.0.1", "-p", &self.port.to_string()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn bindir(&self) -> &Path {
        &self.bindir
    }

    /// Superuser connection URL for the `postgres` database (with the password when the
    /// cluster was built with [`PostgresBuilder::password_auth`]).
    pub fn url(&self) -> String {
        match &self.password {
            None => self.url_for("postgres", "postgres"),
            Some(password) => format!(
                "postgres://postgres:{}@127.0.0.1:{}/postgres",
                percent_encode(password),
                self.port
            ),
        }
    }

    /// Connection URL of [`CHECK_LOGIN`] for the `postgres` database: walcast's
    /// `CHECK_DATABASE_URL`.
    pub fn check_url(&self) -> String {
        self.check_url_for("postgres")
    }

    /// [`Postgres::check_url`] for `database`.
    pub fn check_url_for(&self, database: &str) -> String {
        match &self.password {
            None => self.url_for(CHECK_LOGIN, database),
            Some(password) => format!(
                "postgres://{CHECK_LOGIN}:{}@127.0.0.1:{}/{database}",
                percent_encode(password),
                self.port
            ),
        }
    }

    /// Connection URL for `user` (trust auth) and `database`.
    pub fn url_for(&self, user: &str, database: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{database}", self.port)
    }

    /// Connect as superuser; the connection task runs on the current tokio runtime.
    pub async fn connect(&self) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        connect(&self.url()).await
    }

    /// Run SQL with `psql` (blocking), returning its unaligned, tuples-only output.
    pub fn psql(&self, sql: &str) -> Result<String, KitError> {
        let mut cmd = Command::new(self.bindir.join("psql"));
        cmd.args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(self.url())
            .arg("-c")
            .arg(sql);
        run(cmd, None).map(|s| s.trim_end().to_string())
    }

    /// Stop the server (immediate shutdown), keeping the data directory.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.stop();
        }
    }

    /// Start the server again on the same port and data directory.
    pub fn restart(&mut self) -> Result<(), KitError> {
        self.stop();
        self.boot(false)
    }

    /// The server log so far (the last lines).
    pub fn log_tail(&self) -> String {
        crate::process::log_tail(&self.dir.path().join("postgres.log"))
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `url` (a kit cluster's URL, any user) with the user [`CHECK_LOGIN`] instead, its
/// password kept: the check login's URL for the same server and database.
pub fn as_check_login(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((_, password)) => format!("{scheme}://{CHECK_LOGIN}:{password}@{host}"),
            None => format!("{scheme}://{CHECK_LOGIN}@{host}"),
        },
        None => format!("{scheme}://{CHECK_LOGIN}@{rest}"),
    }
}

/// Percent-encode everything but RFC 3986 unreserved characters (for URL userinfo).
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Connect to `url`, spawning the connection task on the current runtime.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

const INSTALL_PG: &str =
    "apt-get update && apt-get install -y postgresql-15 postgresql-15-wal2json \
     (or set WALCAST_PG_BINDIR to a directory holding initdb, postgres and pg_isready)";

/// `WALCAST_PG_BINDIR`, else the newest `/usr/lib/postgresql/<major>/bin` with a server.
fn find_bindir() -> Result<PathBuf, KitError> {
    if let Some(dir) = std::env::var_os("WALCAST_PG_BINDIR") {
        let dir = PathBuf::from(dir);
        if dir.join("initdb").exists() && dir.join("postgres").exists() {
            return Ok(dir);
        }
        return Err(KitError::Missing {
            what: format!("initdb/postgres in WALCAST_PG_BINDIR={}", dir.display()),
            install: INSTALL_PG.into(),
        });
    }
    let mut best: Option<(u32, PathBuf)> = None;
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        for entry in entries.flatten() {
            let major = entry.file_name().to_string_lossy().parse::<u32>().ok();
            let bin = entry.path().join("bin");
            if let Some(major) = major {
                if bin.join("initdb").exists() && best.as_ref().is_none_or(|(m, _)| major > *m) {
                    best = Some((major, bin));
                }
            }
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| KitError::Missing {
        what: "PostgreSQL server binaries (initdb, postgres)".into(),
        install: INSTALL_PG.into(),
    })
}

fn check_wal2json(bindir: &Path) -> Result<(), KitError> {
    let lib = bindir.join("../lib/wal2json.so");
    if lib.exists() {
        return Ok(());
    }
    let major = bindir
        .parent()
        .and_then(|p| p.file_name())
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "15".into());
    Err(KitError::Missing {
        what: format!("the wal2json output plugin ({})", lib.display()),
        install: format!("apt-get update && apt-get install -y postgresql-{major}-wal2json"),
    })
}

/// Copy the certificate and key where the server may read them (the key private to its
/// user), allow TCP only over TLS; returns the settings that turn TLS on.
fn tls_only(
    dir: &Path,
    data: &Path,
    cert: &Path,
    key: &Path,
    run_as: Option<RunAs>,
) -> Result<Vec<(String, String)>, KitError> {
    use std::os::unix::fs::PermissionsExt;
    let (c, k) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::copy(cert, &c).map_err(|e| KitError::io("copying the server certificate", e))?;
    std::fs::copy(key, &k).map_err(|e| KitError::io("copying the server key", e))?;
    std::fs::set_permissions(&k, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| KitError::io("chmod the server key", e))?;
    chown_tree(&c, run_as)?;
    chown_tree(&k, run_as)?;
    let hba = "local all all trust\n\
               local replication all trust\n\
               hostssl all all 127.0.0.1/32 trust\n\
               hostssl replication all 127.0.0.1/32 trust\n\
               hostnossl all all 0.0.0.0/0 reject\n\
               hostnossl replication all 0.0.0.0/0 reject\n";
    let hba_path = data.join("pg_hba.conf");
    std::fs::write(&hba_path, hba).map_err(|e| KitError::io("writing pg_hba.conf", e))?;
    chown_tree(&hba_path, run_as)?;
    Ok(vec![
        ("ssl".into(), "on".into()),
        ("ssl_cert_file".into(), c.display().to_string()),
        ("ssl_key_file".into(), k.display().to_string()),
    ])
}
