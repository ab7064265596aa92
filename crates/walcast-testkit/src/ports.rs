use std::net::TcpListener;

/// A loopback TCP port that was free a moment ago. The caller retries on a bind race.
pub fn free_port() -> std::io::Result<u16> {
    let listener = TcpListener::bind(("127.0.0.1", 0))?;
    Ok(listener.local_addr()?.port())
}
