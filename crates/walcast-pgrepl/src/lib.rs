//! A small async client for the Postgres logical streaming replication protocol.
//!
//! It reads a logical slot (made for the wal2json output plugin) over a
//! `replication=database` connection with `START_REPLICATION SLOT ... LOGICAL`. Unlike
//! the SQL interface (`pg_logical_slot_peek_changes`), which decodes again from the
//! slot's `restart_lsn` on every call, the walsender decodes each change once and pushes
//! it as it commits. Progress is reported with standby status updates, which move the
//! slot's `confirmed_flush_lsn`.
//!
//! ```no_run
//! # async fn demo() -> Result<(), walcast_pgrepl::ReplError> {
//! use walcast_pgrepl::{ReplEvent, ReplicationClient};
//! use walcast_core::Lsn;
//!
//! let client = ReplicationClient::connect("postgres://walcast:secret@db:5432/app").await?;
//! let mut stream = client
//!     .start_logical("walcast", Lsn::ZERO, &[("format-version", "2")])
//!     .await?;
//! while let Some(event) = stream.next_event().await? {
//!     match event {
//!         ReplEvent::XLogData { wal_start, data, .. } => {
//!             // one wal2json v2 JSON document; handle it, then at some point:
//!             stream.send_status(wal_start, false).await?;
//!         }
//!         ReplEvent::Keepalive { .. } => {}
//!     }
//! }
//! stream.stop().await
//! # }
//! ```
//!
//! # Scope
//!
//! * TCP, with TLS as libpq's `sslmode` (`disable`, `prefer` — the default —, `require`,
//!   `verify-ca`, `verify-full`) and `sslrootcert` say, through [`walcast_pgtls`] (rustls).
//!   `channel_binding=require` is rejected with [`ReplError::Config`]; so are Unix-socket
//!   hosts.
//! * Authentication: trust, cleartext `password`, `md5`, and `scram-sha-256` (without
//!   channel binding). Message framing, MD5 hashing and SCRAM are done by
//!   `postgres-protocol` from the rust-postgres project.
//! * The URL is parsed by [`tokio_postgres::Config`]: `user`, `password`, `dbname`,
//!   `host`/`hostaddr`/`port` (several hosts are tried in order), `application_name`
//!   (default `walcast`), `options` and `connect_timeout` are used.

mod auth;
mod conn;
mod error;
mod messages;
mod stream;

use std::collections::HashMap;
use std::time::Duration;

use tokio_postgres::config::{ChannelBinding, Host};
use walcast_core::Lsn;

pub use error::ReplError;
pub use messages::{
    encode_standby_status, parse_copy_data, pg_now_micros, ReplEvent, PG_EPOCH_UNIX_SECS,
};
pub use stream::ReplicationStream;

use conn::{Backend, Conn};

/// Added to every replication session's `options`: logical decoding writes `bytea`
/// values through the session's `bytea_output`, and wal2json expects `hex`.
pub const BYTEA_HEX: &str = "-c bytea_output=hex";

/// The answer to `IDENTIFY_SYSTEM`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemInfo {
    /// The cluster's system identifier (a 64-bit number, as text).
    pub systemid: String,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database connected to.
    pub dbname: Option<String>,
}

/// A `replication=database` connection, ready for replication commands.
pub struct ReplicationClient {
    conn: Conn,
    backend_pid: Option<i32>,
    parameters: HashMap<String, String>,
}

impl ReplicationClient {
    /// Connect with `replication=database` and authenticate. `url` is a libpq-style URL
    /// or key/value string, parsed by [`tokio_postgres::Config`].
    /// TLS as its `sslmode` and `sslrootcert` say (see [`walcast_pgtls`]).
    pub async fn connect(url: &str) -> Result<ReplicationClient, ReplError> {
        let (config, tls) = walcast_pgtls::parse(url)?;
        Self::connect_with(&config, &tls).await
    }

    /// Like [`connect`](Self::connect), from an already parsed configuration. The
    /// session's `bytea_output` is always `hex` (see [`BYTEA_HEX`]).
    pub async fn connect_with(
        config: &tokio_postgres::Config,
        tls: &walcast_pgtls::TlsSettings,
    ) -> Result<ReplicationClient, ReplError> {
        if config.get_channel_binding() == ChannelBinding::Require {
            return Err(ReplError::Config(
                "channel_binding=require is not supported by walcast-pgrepl (SCRAM without \
                 channel binding is; use channel_binding=prefer or disable)"
                    .into(),
            ));
        }
        let user = config
            .get_user()
            .ok_or_else(|| ReplError::Config("no user in the connection string".into()))?;
        let mut conn = open_first(config, tls).await?;

        let mut params = vec![("user", user), ("replication", "database")];
        if let Some(db) = config.get_dbname() {
            params.push(("database", db));
        }
        params.push((
            "application_name",
            config.get_application_name().unwrap_or("walcast"),
        ));
        // wal2json writes a bytea as its text output less the first two characters,
        // which are `\x` only under `bytea_output = hex`: pinned here, so a database or
        // role set to `escape` cannot make it cut real data.
        let options = match config.get_options() {
            Some(o) => format!("{o} {BYTEA_HEX}"),
            None => BYTEA_HEX.to_string(),
        };
        params.push(("options", &options));
        let session = auth::startup(&mut conn, &params, user, config.get_password()).await?;
        Ok(ReplicationClient {
            conn,
            backend_pid: session.backend_pid,
            parameters: session.parameters,
        })
    }

    /// The walsender's process id (from `BackendKeyData`).
    pub fn backend_pid(&self) -> Option<i32> {
        self.backend_pid
    }

    /// A run-time parameter the server reported at startup (e.g. `server_version`).
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.parameters.get(name).map(String::as_str)
    }

    /// `IDENTIFY_SYSTEM`: system id, timeline, current WAL flush position, database.
    pub async fn identify_system(&mut self) -> Result<SystemInfo, ReplError> {
        let rows = self.conn.simple_query("IDENTIFY_SYSTEM").await?;
        let [row] = rows.as_slice() else {
            return Err(ReplError::Protocol(format!(
                "IDENTIFY_SYSTEM returned {} rows",
                rows.len()
            )));
        };
        let col = |i: usize| row.get(i).cloned().flatten();
        let bad = |what: &str| ReplError::Protocol(format!("IDENTIFY_SYSTEM: bad {what}"));
        Ok(SystemInfo {
            systemid: col(0).ok_or_else(|| bad("systemid"))?,
            timeline: col(1)
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| bad("timeline"))?,
            xlogpos: col(2)
                .and_then(|p| p.parse().ok())
                .ok_or_else(|| bad("xlogpos"))?,
            dbname: col(3),
        })
    }

    /// Run a replication command or SQL query with the simple query protocol; rows come
    /// back as text, `None` for NULL. E.g. `CREATE_REPLICATION_SLOT "s" LOGICAL wal2json`.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, ReplError> {
        self.conn.simple_query(sql).await
    }

    /// `START_REPLICATION SLOT "<slot>" LOGICAL <start> ("name" 'value', ...)`.
    ///
    /// `start` `0/0` means "from the slot's `confirmed_flush_lsn`"; an earlier position
    /// than that is also served from `confirmed_flush_lsn`. The slot name and option names
    /// are quoted as identifiers, option values as string literals (see
    /// [`start_replication_command`] for what cannot be quoted). On an error (e.g. SQLSTATE
    /// `55006`, slot active for another process) the connection is closed.
    pub async fn start_logical(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream, ReplError> {
        let command = match start_replication_command(slot, start, options) {
            Ok(c) => c,
            Err(e) => {
                self.conn.close().await;
                return Err(e);
            }
        };
        tracing::debug!(%command, "starting logical replication");
        self.conn.send_query(&command).await?;
        let mut error = None;
        loop {
            match self.conn.read().await? {
                Backend::CopyBoth => {
                    if let Some(e) = error {
                        return Err(e);
                    }
                    return Ok(ReplicationStream::new(self.conn));
                }
                Backend::Msg(postgres_protocol::message::backend::Message::ErrorResponse(body)) => {
                    error = Some(conn::server_error(&body));
                }
                Backend::Msg(postgres_protocol::message::backend::Message::ReadyForQuery(_)) => {
                    self.conn.close().await;
                    return Err(error.unwrap_or_else(|| {
                        ReplError::Protocol("START_REPLICATION ended without streaming".into())
                    }));
                }
                other => self.conn.ignore_or_reject(other, "START_REPLICATION")?,
            }
        }
    }

    /// Send Terminate and close the connection.
    pub async fn close(self) {
        self.conn.close().await
    }
}

/// Build the `START_REPLICATION` command text.
///
/// The replication command grammar has no escape for `"` inside a quoted identifier
/// (`"a""b"` is a syntax error, unlike SQL), so a slot or option name containing `"` is
/// rejected here with [`ReplError::Config`], as is a slot name that Postgres would not
/// accept anyway (only `a-z`, `0-9`, `_`, at most 63 bytes). Values are string literals
/// with `'` doubled; the grammar has no backslash escapes, so backslashes pass through.
pub fn start_replication_command(
    slot: &str,
    start: Lsn,
    options: &[(&str, &str)],
) -> Result<String, ReplError> {
    if slot.is_empty()
        || slot.len() > 63
        || !slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    {
        return Err(ReplError::Config(format!(
            "invalid replication slot name {slot:?}: Postgres allows only lower-case \
             letters, digits and underscores, at most 63 bytes"
        )));
    }
    let mut cmd = format!("START_REPLICATION SLOT \"{slot}\" LOGICAL {start}");
    for (i, (name, value)) in options.iter().enumerate() {
        if name.is_empty() || name.contains('"') || name.contains('\0') {
            return Err(ReplError::Config(format!(
                "invalid option name {name:?}: the replication grammar cannot quote an \
                 empty name or one with a double quote or NUL"
            )));
        }
        if value.contains('\0') {
            return Err(ReplError::Config(format!(
                "option {name:?}: a value cannot contain NUL"
            )));
        }
        cmd.push_str(if i == 0 { " (" } else { ", " });
        cmd.push('"');
        cmd.push_str(name);
        cmd.push_str("\" '");
        cmd.push_str(&value.replace('\'', "''"));
        cmd.push('\'');
    }
    if !options.is_empty() {
        cmd.push(')');
    }
    Ok(cmd)
}

/// Connect to the first reachable host of the configuration.
async fn open_first(
    config: &tokio_postgres::Config,
    tls: &walcast_pgtls::TlsSettings,
) -> Result<Conn, ReplError> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let timeout: Option<Duration> = config.get_connect_timeout().copied();
    let count = hosts.len().max(addrs.len()).max(1);
    let mut last_error = None;
    for i in 0..count {
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        // The name the server's certificate must carry (`verify-full`): the host name,
        // even when `hostaddr` says where to connect.
        let name = match hosts.get(i) {
            Some(Host::Tcp(h)) => Some(h.clone()),
            _ => None,
        };
        let host = match (addrs.get(i), hosts.get(i)) {
            (Some(ip), _) => ip.to_string(),
            (None, Some(Host::Tcp(h))) => h.clone(),
            (None, Some(other)) => {
                last_error = Some(ReplError::Config(format!(
                    "{other:?}: only TCP hosts are supported"
                )));
                continue;
            }
            (None, None) => "localhost".to_string(),
        };
        let name = name.unwrap_or_else(|| host.clone());
        match Conn::open(&host, port, timeout, &name, tls).await {
            Ok(conn) => return Ok(conn),
            Err(e) => {
                tracing::debug!(%host, port, error = %e, "connect failed");
                last_error = Some(e);
            }
        }
    }
    Err(last_error.unwrap_or(ReplError::Config("no host to connect to".into())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_quoting() {
        assert_eq!(
            start_replication_command("s", Lsn(0x1_0000_0A00), &[]).unwrap(),
            "START_REPLICATION SLOT \"s\" LOGICAL 1/A00"
        );
        assert_eq!(
            start_replication_command(
                "slot_1",
                Lsn::ZERO,
                &[
                    ("format-version", "2"),
                    ("add-tables", "public.it\\'s"),
                    ("x y", "")
                ]
            )
            .unwrap(),
            "START_REPLICATION SLOT \"slot_1\" LOGICAL 0/0 \
             (\"format-version\" '2', \"add-tables\" 'public.it\\''s', \"x y\" '')"
        );
    }

    #[test]
    fn unquotable_names_are_config_errors() {
        for slot in ["we\"ird", "", "Upper", "a-b", &"x".repeat(64)] {
            let err = start_replication_command(slot, Lsn::ZERO, &[]).unwrap_err();
            assert!(matches!(err, ReplError::Config(_)), "{slot:?}: {err}");
        }
        assert!(start_replication_command(&"x".repeat(63), Lsn::ZERO, &[]).is_ok());
        for (name, value) in [("a\"b", "v"), ("", "v"), ("a", "nul\0")] {
            let err = start_replication_command("s", Lsn::ZERO, &[(name, value)]).unwrap_err();
            assert!(matches!(err, ReplError::Config(_)), "{name:?}: {err}");
        }
    }

    #[tokio::test]
    async fn an_unknown_sslmode_is_a_tls_settings_error() {
        let err = ReplicationClient::connect("postgres://u@127.0.0.1:1/db?sslmode=always")
            .await
            .err()
            .unwrap();
        assert!(
            matches!(err, ReplError::Tls(ref e) if e.to_string().contains("unknown sslmode")),
            "{err}"
        );
    }

    #[tokio::test]
    async fn unreachable_host_is_io_error() {
        // Port 1 on loopback: nothing listens there.
        let err = ReplicationClient::connect("postgres://u@127.0.0.1:1/db")
            .await
            .err()
            .unwrap();
        assert!(matches!(err, ReplError::Io(_)), "{err}");
    }
}
