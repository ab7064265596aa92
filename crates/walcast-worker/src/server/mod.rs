//! Serving a router on a TCP listener: HTTP/1.1, one task per connection, with upgrades,
//! and bounded for clients that never authenticate.
//!
//! Our own accept loop rather than `axum::serve`, for two reasons. axum serves each
//! connection through hyper-util's protocol sniffer, which wraps the socket in a private
//! type, so a WebSocket upgrade hands the front an opaque stream. Served here with
//! hyper's HTTP/1 connection directly, the upgrade gives the front the `TcpStream`
//! itself (see `walcast_front::connection::socket::open`): its writer then writes each frame with one
//! `send` on its own half of the socket, not through a lock shared with the reader and
//! three layers of boxed IO (measured in docs/benchmarks.md). And axum's loop bounds
//! nothing a client does before it sends a key: here, per [`Limits`],
//!
//! - a request head is at most `HTTP_MAX_HEADER_BYTES` and `HTTP_MAX_HEADERS` headers
//!   (past either: 431 and closed);
//! - it must arrive within `HTTP_HEADER_TIMEOUT_MS` of the connection, the next one
//!   within `HTTP_IDLE_TIMEOUT_MS` of the previous response (`conn.rs`);
//! - connections not yet upgraded (nor streaming an admitted response) are at most
//!   `HTTP_MAX_PENDING`, `HTTP_MAX_PENDING_PER_PEER` from one address; past a cap the
//!   oldest is closed, not the newest (`pending.rs`), and so is the oldest when the
//!   process runs out of file descriptors, whose soft limit is raised to the hard one at
//!   start.
//!
//! So `/health` and `/readyz` are answered whatever unauthenticated clients hold. Upgraded
//! sockets and SSE streams are the front's, bounded by `MAX_CONNECTIONS`. At shutdown, no
//! new connection is accepted, each open one finishes the request in flight and closes,
//! and `serve` returns once all have.

mod conn;
mod pending;

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use pending::Pending;

/// Default of [`Limits::header_timeout`], in milliseconds.
pub const DEFAULT_HEADER_TIMEOUT_MS: u64 = 10_000;
/// Default of [`Limits::idle_timeout`], in milliseconds.
pub const DEFAULT_IDLE_TIMEOUT_MS: u64 = 30_000;
/// Default of [`Limits::max_header_bytes`] (the least hyper allows is 8,192).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 16 * 1024;
/// The smallest [`Limits::max_header_bytes`] hyper takes.
pub const MIN_MAX_HEADER_BYTES: usize = 8192;
/// Default of [`Limits::max_headers`].
pub const DEFAULT_MAX_HEADERS: usize = 64;
/// Default of [`Limits::max_pending`].
pub const DEFAULT_MAX_PENDING: usize = 4096;
/// Default of [`Limits::max_pending_per_peer`].
pub const DEFAULT_MAX_PENDING_PER_PEER: usize = 1024;

/// What a client may hold before its connection is upgraded (see the module's doc).
#[derive(Clone, Debug)]
pub struct Limits {
    /// From accept to a whole first request head.
    pub header_timeout: Duration,
    /// From the end of a response to the whole next request head.
    pub idle_timeout: Duration,
    /// A request head's bytes, at most (hyper's read buffer; at least 8,192).
    pub max_header_bytes: usize,
    /// A request's headers, at most.
    pub max_headers: usize,
    /// Connections not yet upgraded nor streaming, at most.
    pub max_pending: usize,
    /// Of those, from one address (IPv4, or IPv6 /64), at most; 0: no such cap.
    pub max_pending_per_peer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_millis(DEFAULT_HEADER_TIMEOUT_MS),
            idle_timeout: Duration::from_millis(DEFAULT_IDLE_TIMEOUT_MS),
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
            max_headers: DEFAULT_MAX_HEADERS,
            max_pending: DEFAULT_MAX_PENDING,
            max_pending_per_peer: DEFAULT_MAX_PENDING_PER_PEER,
        }
    }
}

/// A bound listener and the limits its connections are served with.
pub struct Listening {
    listener: TcpListener,
    limits: Limits,
}

impl Listening {
    /// Bind `host:port` (the file descriptor limit raised first, see [`raise_fd_limit`]),
    /// with a listen backlog of [`LISTEN_BACKLOG`].
    pub async fn bind(host: &str, port: u16, limits: Limits) -> io::Result<Listening> {
        raise_fd_limit();
        let mut last = io::Error::new(io::ErrorKind::AddrNotAvailable, "no address");
        for addr in tokio::net::lookup_host((host, port)).await? {
            match listen(addr) {
                Ok(listener) => return Ok(Listening { listener, limits }),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    /// Serve on an already bound listener.
    pub fn on(listener: TcpListener, limits: Limits) -> Listening {
        Listening { listener, limits }
    }

    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }
}

/// Connections the kernel completes and holds for the accept loop (capped by the system's
/// `somaxconn`): a burst of clients, or of stalled connections, beyond it has its
/// handshakes dropped and retried a second later.
pub const LISTEN_BACKLOG: u32 = 4096;

fn listen(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    let socket = match addr {
        std::net::SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Raise this process's soft limit of open files to its hard limit: the stalled
/// connections [`Limits`] allows, the sockets and streams the front admits and the
/// process's own connections all need one.
pub fn raise_fd_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => tracing::debug!(limit = n, "open files limit"),
        Err(e) => tracing::warn!(error = %e, "cannot raise the open files limit"),
    }
}

/// What every connection of one listener shares.
struct Shared {
    limits: Limits,
    pending: Arc<Pending>,
}

/// How long to wait before accepting again after an error that is not the peer's and
/// that closing a waiting connection cannot cure.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// Serve `router` until `shutdown` completes, then let the open connections finish their
/// requests.
pub async fn serve(
    listening: Listening,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let Listening { listener, limits } = listening;
    let shared = Arc::new(Shared {
        pending: Pending::new(limits.max_pending, limits.max_pending_per_peer),
        limits,
    });
    let conns = TaskTracker::new();
    let closing = CancellationToken::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            _ = &mut shutdown => break,
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    accept_failed(e, &shared.pending).await;
                    continue;
                }
            },
        };
        let (router, closing) = (router.clone(), closing.clone());
        conns.spawn(conn::connection(
            stream,
            peer,
            router,
            closing,
            shared.clone(),
        ));
    }
    drop(listener);
    closing.cancel();
    conns.close();
    conns.wait().await;
    Ok(())
}

/// An accept error: a peer's reset is ignored; out of file descriptors, the oldest waiting
/// connection is closed to free one; anything else is logged and retried after a second.
async fn accept_failed(e: io::Error, pending: &Pending) {
    use io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    ) {
        return;
    }
    // EMFILE (the process's limit) or ENFILE (the system's).
    let out_of_fds = matches!(e.raw_os_error(), Some(24 | 23));
    if out_of_fds && pending.evict_for_fds() {
        // Let the closed connection's task drop its socket before accepting again.
        tokio::time::sleep(Duration::from_millis(1)).await;
        return;
    }
    tracing::error!(error = %e, "accept failed; accepting again in a second");
    tokio::time::sleep(ACCEPT_BACKOFF).await;
}

#[cfg(test)]
mod tests;
