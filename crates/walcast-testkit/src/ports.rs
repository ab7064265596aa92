use std::net::TcpListener;
use std::sync::atomic::{AtomicU32, Ordering};

/// The first port handed out; below it are well-known and registered services.
const LOWEST: u32 = 20_000;
/// Where the kernel's ephemeral range starts when `/proc` does not say.
const EPHEMERAL_DEFAULT: u32 = 32_768;

/// Ports handed out by this process so far (the next candidate is derived from it).
static HANDED: AtomicU32 = AtomicU32::new(0);

/// A loopback TCP port that was free a moment ago, for a server a test starts. The
/// caller retries on a bind race.
///
/// Chosen below the kernel's ephemeral range: a port the kernel picks for `bind(0)` is
/// from the range it also gives outgoing connections, and under load (thousands of client
/// sockets) one of them took a port between this answer and the server's bind. Candidates
/// walk the range from an offset of this process's id, so two test processes rarely meet,
/// and one process never hands out the same port twice before wrapping.
pub fn free_port() -> std::io::Result<u16> {
    let high = ephemeral_start().max(LOWEST + 1_000);
    let span = high - LOWEST;
    let offset = std::process::id().wrapping_mul(7_919) % span;
    let mut last_err = None;
    for _ in 0..span.min(4_096) {
        let n = HANDED.fetch_add(1, Ordering::Relaxed);
        let port = LOWEST + (offset + n) % span;
        match TcpListener::bind(("127.0.0.1", port as u16)) {
            Ok(listener) => return Ok(listener.local_addr()?.port()),
            Err(e) => last_err = Some(e),
        }
    }
    // Nothing free below the ephemeral range: let the kernel choose.
    let listener = TcpListener::bind(("127.0.0.1", 0)).map_err(|e| last_err.unwrap_or(e))?;
    Ok(listener.local_addr()?.port())
}

/// The first port of the kernel's ephemeral range.
fn ephemeral_start() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(EPHEMERAL_DEFAULT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_distinct_and_below_the_ephemeral_range() {
        let ports: Vec<u16> = (0..50).map(|_| free_port().unwrap()).collect();
        let mut unique = ports.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), ports.len());
        assert!(ports.iter().all(|&p| (p as u32) < ephemeral_start()));
    }
}
