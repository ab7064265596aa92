//! CPU time of whole process trees, from `/proc`: a server's watchdog and the server
//! under it, a postmaster and its backends (those that already exited included, through
//! their parent's `cutime`/`cstime`).

use std::collections::HashMap;

/// One process: its parent, its own CPU seconds and its reaped children's.
struct Stat {
    ppid: u32,
    own: f64,
    reaped: f64,
}

fn stat(pid: &str) -> Option<Stat> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = s.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the comm field: fields 3.. of proc(5) (1-based): ppid 4, utime 14, stime 15,
    // cutime 16, cstime 17, all in clock ticks (100 per second on Linux).
    let n = |i: usize| f.get(i - 3).and_then(|v| v.parse::<f64>().ok());
    Some(Stat {
        ppid: n(4)? as u32,
        own: (n(14)? + n(15)?) / 100.0,
        reaped: (n(16)? + n(17)?) / 100.0,
    })
}

/// User + system CPU seconds of `root` and every process under it, living or reaped.
pub(crate) fn tree_secs(root: u32) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let all: HashMap<u32, Stat> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, stat(&pid.to_string())?)))
        .collect();
    let mut total = 0.0;
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        let Some(s) = all.get(&pid) else { continue };
        total += s.own + s.reaped;
        todo.extend(all.iter().filter(|(_, c)| c.ppid == pid).map(|(p, _)| *p));
    }
    total
}

/// User + system CPU seconds of process `pid` (or `self`) alone: its threads, not its
/// children.
pub(crate) fn secs(pid: &str) -> f64 {
    stat(pid).map_or(0.0, |s| s.own)
}

/// The postmaster of the cluster in `data_dir` (the first line of `postmaster.pid`).
pub(crate) fn postmaster(data_dir: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(data_dir.join("postmaster.pid")).ok()?;
    text.lines().next()?.trim().parse().ok()
}
