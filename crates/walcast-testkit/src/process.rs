//! Child processes under a watchdog shell, optionally as another user.

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use crate::KitError;

/// The watchdog: start the service in the background, then block reading stdin. When our
/// end of the pipe closes (drop, or the test process died), stop the service with the
/// given signal and wait for it.
const WATCHDOG: &str = r#"
sig="$1"; shift
"$@" &
pid=$!
read -r _ignored || true
kill "-$sig" "$pid" 2>/dev/null
wait "$pid"
"#;

/// A uid/gid to run services as. Postgres refuses to run as root.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

/// When we are root, the `postgres` user from /etc/passwd; otherwise ourselves.
pub(crate) fn run_as_for_postgres() -> Result<Option<RunAs>, KitError> {
    if !is_root() {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")
        .map_err(|e| KitError::io("reading /etc/passwd", e))?;
    for line in passwd.lines() {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.len() >= 4 && fields[0] == "postgres" {
            if let (Ok(uid), Ok(gid)) = (fields[2].parse(), fields[3].parse()) {
                return Ok(Some(RunAs { uid, gid }));
            }
        }
    }
    Err(KitError::Missing {
        what: "the `postgres` system user (Postgres cannot run as root)".into(),
        install: "apt-get install -y postgresql-15 postgresql-15-wal2json".into(),
    })
}

fn is_root() -> bool {
    // /proc/self/status has "Uid: real effective saved fs".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|e| e == "0"))
        })
        .unwrap_or(false)
}

pub(crate) fn chown_tree(path: &Path, run_as: Option<RunAs>) -> Result<(), KitError> {
    let Some(ids) = run_as else { return Ok(()) };
    std::os::unix::fs::chown(path, Some(ids.uid), Some(ids.gid))
        .map_err(|e| KitError::io(format!("chown {}", path.display()), e))
}

/// Run a command to completion (as `run_as` when set), failing with its output.
pub(crate) fn run(mut cmd: Command, run_as: Option<RunAs>) -> Result<String, KitError> {
    if let Some(ids) = run_as {
        cmd.uid(ids.uid).gid(ids.gid);
    }
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(|e| KitError::io(format!("running {shown}"), e))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if !out.status.success() {
        return Err(KitError::Command {
            command: shown,
            status: out.status.to_string(),
            output: text,
        });
    }
    Ok(text)
}

/// A service process under the watchdog. Dropping it stops the service.
pub(crate) struct Supervised {
    child: Option<Child>,
    stdin: Option<ChildStdin>,
    pub log: PathBuf,
}

impl Supervised {
    /// The watchdog's process id (the program runs under it).
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Spawn `program args…` under the watchdog, stdout+stderr appended to `log`.
    pub(crate) fn spawn(
        program: &Path,
        args: &[String],
        log: PathBuf,
        stop_signal: &str,
        run_as: Option<RunAs>,
        cwd: &Path,
    ) -> Result<Self, KitError> {
        let out = File::create(&log).map_err(|e| KitError::io("creating log file", e))?;
        chown_tree(&log, run_as)?;
        let err = out
            .try_clone()
            .map_err(|e| KitError::io("cloning log handle", e))?;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(WATCHDOG)
            .arg("walcast-testkit-watchdog")
            .arg(stop_signal)
            .arg(program)
            .args(args)
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(out)
            .stderr(err);
        if let Some(ids) = run_as {
            cmd.uid(ids.uid).gid(ids.gid);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| KitError::io(format!("spawning {}", program.display()), e))?;
        let stdin = child.stdin.take();
        Ok(Supervised {
            child: Some(child),
            stdin,
            log,
        })
    }

    /// True while the watchdog (and so normally the service) is running.
    pub(crate) fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub(crate) fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// Stop the service and wait (bounded) for it to exit.
    pub(crate) fn stop(&mut self) {
        drop(self.stdin.take());
        if let Some(mut child) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() > deadline => {
                        let _ = child.kill();
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        }
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}

pub(crate) fn log_tail(path: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.read_to_string(&mut s);
    }
    let lines: Vec<&str> = s.lines().collect();
    let start = lines.len().saturating_sub(40);
    lines[start..].join("\n")
}
