//! The HTTP listener's options: where, and the bounds on connections not yet upgraded.

use std::time::Duration;

use clap::Args;

use crate::server;

/// The HTTP port unless PORT says otherwise (`walcast probe` asks it too).
pub const DEFAULT_PORT: u16 = 4000;

#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// HTTP port (health, metrics; WebSocket in the front).
    #[arg(long, env = "PORT", default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Address to bind.
    #[arg(long, env = "HOST", default_value = "0.0.0.0")]
    pub host: String,
    /// A new connection must send its whole first request head within this, in ms
    /// (else it is closed).
    #[arg(long, env = "HTTP_HEADER_TIMEOUT_MS", default_value_t = server::DEFAULT_HEADER_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub header_timeout_ms: u64,
    /// A kept-alive connection must send its whole next request head within this of its
    /// last response, in ms (else it is closed).
    #[arg(long, env = "HTTP_IDLE_TIMEOUT_MS", default_value_t = server::DEFAULT_IDLE_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    pub idle_timeout_ms: u64,
    /// Largest request head (request line and headers), in bytes, at least 8192 (larger:
    /// 431 and closed).
    #[arg(long, env = "HTTP_MAX_HEADER_BYTES", default_value_t = server::DEFAULT_MAX_HEADER_BYTES, value_parser = max_header_bytes)]
    pub max_header_bytes: usize,
    /// Most headers in a request (more: 431 and closed).
    #[arg(long, env = "HTTP_MAX_HEADERS", default_value_t = server::DEFAULT_MAX_HEADERS)]
    pub max_headers: usize,
    /// Connections not yet upgraded to a WebSocket (nor streaming SSE) at once; past it
    /// the one waiting longest is closed.
    #[arg(long, env = "HTTP_MAX_PENDING", default_value_t = server::DEFAULT_MAX_PENDING)]
    pub max_pending: usize,
    /// Of those, from one address (IPv4, or IPv6 /64); past it that address's connection
    /// waiting longest is closed; 0: no per-address cap (behind a proxy every client has
    /// the proxy's address).
    #[arg(long, env = "HTTP_MAX_PENDING_PER_PEER", default_value_t = server::DEFAULT_MAX_PENDING_PER_PEER)]
    pub max_pending_per_peer: usize,
}

fn max_header_bytes(s: &str) -> Result<usize, String> {
    let n: usize = s.parse().map_err(|e| format!("{e}"))?;
    if n < server::MIN_MAX_HEADER_BYTES {
        return Err(format!("at least {}", server::MIN_MAX_HEADER_BYTES));
    }
    Ok(n)
}

impl HttpArgs {
    /// The limits of the connections served.
    pub fn limits(&self) -> server::Limits {
        server::Limits {
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            idle_timeout: Duration::from_millis(self.idle_timeout_ms),
            max_header_bytes: self.max_header_bytes,
            max_headers: self.max_headers,
            max_pending: self.max_pending,
            max_pending_per_peer: self.max_pending_per_peer,
        }
    }

    /// Bind `HOST:PORT`, to serve with these limits.
    pub async fn bind(&self) -> anyhow::Result<server::Listening> {
        use anyhow::Context;
        server::Listening::bind(&self.host, self.port, self.limits())
            .await
            .with_context(|| format!("binding {}:{}", self.host, self.port))
    }

    /// For the effective configuration.
    pub fn describe(&self) -> serde_json::Value {
        serde_json::json!({
            "listen": format!("{}:{}", self.host, self.port),
            "header_timeout_ms": self.header_timeout_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "max_header_bytes": self.max_header_bytes,
            "max_headers": self.max_headers,
            "max_pending": self.max_pending,
            "max_pending_per_peer": self.max_pending_per_peer,
        })
    }
}
