//! A throwaway `nats-server -js`.

use std::io::Read;
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::process::Supervised;
use crate::{free_port, KitError};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const INSTALL_NATS: &str = "apt-get update && apt-get install -y nats-server \
     (or set WALCAST_NATS_SERVER to the nats-server binary)";

/// A running nats-server with JetStream; stopped and deleted on drop.
pub struct Nats {
    binary: PathBuf,
    /// A configuration file's text (`max_payload`, `tls`, `authorization` …), if any.
    conf: Option<String>,
    port: u16,
    process: Option<Supervised>,
    dir: TempDir,
}

impl Nats {
    pub fn start() -> Result<Nats, KitError> {
        Nats::start_with_max_payload(None)
    }

    /// A server whose `max_payload` (largest message) is `max_payload` bytes.
    pub fn start_with_max_payload(max_payload: Option<usize>) -> Result<Nats, KitError> {
        Nats::start_with_conf(max_payload.map(|max| format!("max_payload: {max}\n")))
    }

    /// A server with this configuration file text (the listen address, port and
    /// JetStream store are set by flags and still apply): e.g. a `tls { … }` block or an
    /// `authorization { … }` one.
    pub fn start_with_conf(conf: Option<String>) -> Result<Nats, KitError> {
        let binary = find_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("walcast-nats-")
            .tempdir()
            .map_err(|e| KitError::io("creating temp dir", e))?;
        let mut nats = Nats {
            binary,
            conf,
            port: 0,
            process: None,
            dir,
        };
        let mut last = None;
        for _ in 0..5 {
            nats.port = free_port().map_err(|e| KitError::io("finding a free port", e))?;
            match nats.boot() {
                Ok(()) => return Ok(nats),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            KitError::io("starting nats-server", std::io::ErrorKind::Other.into())
        }))
    }

    fn boot(&mut self) -> Result<(), KitError> {
        let mut args = vec![
            "-a".to_string(),
            "127.0.0.1".into(),
            "-p".into(),
            self.port.to_string(),
            "-js".into(),
            "-sd".into(),
            self.dir.path().join("store").display().to_string(),
        ];
        if let Some(text) = &self.conf {
            // Some settings only a configuration file sets; the flags above still apply.
            let conf = self.dir.path().join("nats.conf");
            std::fs::write(&conf, text).map_err(|e| KitError::io("writing nats.conf", e))?;
            args.push("-c".into());
            args.push(conf.display().to_string());
        }
        let log = self.dir.path().join("nats.log");
        let mut proc = Supervised::spawn(&self.binary, &args, log, "KILL", None, self.dir.path())?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if banner_ok(self.port) {
                self.process = Some(proc);
                return Ok(());
            }
            if !proc.is_running() || Instant::now() > deadline {
                return Err(KitError::NotReady {
                    service: "nats-server",
                    seconds: READY_TIMEOUT.as_secs(),
                    log: proc.log.clone(),
                    tail: proc.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kill the server (SIGKILL), keeping its store directory.
    /// The process the server runs under (a watchdog shell; nats-server is its child),
    /// for measuring the server's CPU time as that process tree's.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(Supervised::pid)
    }

    pub fn stop(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.stop();
        }
    }

    /// Start again on the same port and store.
    pub fn restart(&mut self) -> Result<(), KitError> {
        self.stop();
        self.boot()
    }

    /// Start again on the same port and store, with another `max_payload` (`None`: the
    /// server's default), e.g. to let a message through that the first server refused.
    pub fn restart_with_max_payload(&mut self, max_payload: Option<usize>) -> Result<(), KitError> {
        self.conf = max_payload.map(|max| format!("max_payload: {max}\n"));
        self.restart()
    }

    pub fn log_tail(&self) -> String {
        crate::process::log_tail(&self.dir.path().join("nats.log"))
    }

    /// The server's whole log (e.g. to find its permission violations).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("nats.log")).unwrap_or_default()
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The server greets every client with `INFO {...}`.
pub(crate) fn banner_ok(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 4];
    s.read_exact(&mut buf).is_ok() && &buf == b"INFO"
}

pub(crate) fn find_binary() -> Result<PathBuf, KitError> {
    find_binary_in(
        std::env::var_os("WALCAST_NATS_SERVER"),
        std::env::var_os("PATH").unwrap_or_default(),
    )
}

fn find_binary_in(
    explicit: Option<std::ffi::OsString>,
    path: std::ffi::OsString,
) -> Result<PathBuf, KitError> {
    if let Some(p) = explicit {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        return Err(KitError::Missing {
            what: format!("nats-server at WALCAST_NATS_SERVER={}", p.display()),
            install: INSTALL_NATS.into(),
        });
    }
    let dirs = std::env::split_paths(&path).chain(["/usr/sbin".into(), "/usr/local/bin".into()]);
    for dir in dirs {
        let candidate = dir.join("nats-server");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    Err(KitError::Missing {
        what: "nats-server".into(),
        install: INSTALL_NATS.into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_binary_is_an_error_naming_the_install_command() {
        let err = find_binary_in(Some("/nonexistent/nats-server".into()), "".into())
            .expect_err("must not find a missing binary");
        assert!(
            err.to_string().contains("apt-get install -y nats-server"),
            "{err}"
        );
    }
}
