//! [`TcpProxy`]: a TCP relay on a free 127.0.0.1 port to a local service, whose link can
//! be cut and restored, to test what a process does when its connection (to NATS, say)
//! drops for a moment while the service itself keeps running.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::KitError;

/// A relay from `127.0.0.1:<port>` to `127.0.0.1:<upstream>`. Dropping it stops it and
/// closes every relayed connection.
pub struct TcpProxy {
    port: u16,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

struct Shared {
    upstream: u16,
    cut: AtomicBool,
    stop: AtomicBool,
    /// Both ends of every relayed connection (to close them on a cut).
    open: Mutex<Vec<TcpStream>>,
}

impl TcpProxy {
    /// Listen on a free loopback port and relay every connection to `upstream`.
    pub fn start(upstream: u16) -> Result<TcpProxy, KitError> {
        let listener = TcpListener::bind(("127.0.0.1", 0))
            .map_err(|e| KitError::io("binding the proxy's port", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| KitError::io("reading the proxy's port", e))?
            .port();
        listener
            .set_nonblocking(true)
            .map_err(|e| KitError::io("setting the proxy's listener non-blocking", e))?;
        let shared = Arc::new(Shared {
            upstream,
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            open: Mutex::new(Vec::new()),
        });
        let s = shared.clone();
        let accept = std::thread::spawn(move || accept_loop(&listener, &s));
        Ok(TcpProxy {
            port,
            shared,
            accept: Some(accept),
        })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Close every relayed connection, and refuse new ones until [`TcpProxy::restore`].
    pub fn cut(&self) {
        self.shared.cut.store(true, Ordering::SeqCst);
        self.shared.close_all();
    }

    /// Accept and relay connections again.
    pub fn restore(&self) {
        self.shared.cut.store(false, Ordering::SeqCst);
    }
}

impl Shared {
    fn close_all(&self) {
        let open = std::mem::take(&mut *self.open.lock().unwrap_or_else(|p| p.into_inner()));
        for s in open {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.close_all();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((client, _)) if !shared.cut.load(Ordering::SeqCst) => relay(client, shared),
            // Cut: refused (closed at once).
            Ok((client, _)) => drop(client),
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

/// Relay one connection, a thread per direction.
fn relay(client: TcpStream, shared: &Arc<Shared>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", shared.upstream)) else {
        return;
    };
    let _ = client.set_nonblocking(false);
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let ends = [client.try_clone(), server.try_clone()];
    let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    {
        let mut open = shared.open.lock().unwrap_or_else(|p| p.into_inner());
        open.extend(ends.into_iter().flatten());
    }
    std::thread::spawn(move || pipe(client, server));
    std::thread::spawn(move || pipe(s2, c2));
}

/// Copy `from` to `to` until either ends; then close both.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
