//! Core NATS transport.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, HeaderMap};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::{BarrierError, BusError, BusMessage, Subscription};

const BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct NatsBus {
    client: Client,
    barrier: Arc<Barrier>,
    events: Arc<LinkEvents>,
}

/// The connection's losses: how many, the last one, and a signal on every reconnection
/// after one (core NATS drops what was published to us meanwhile).
pub struct LinkEvents {
    disconnects: AtomicU64,
    /// Unix time of the last disconnect, in microseconds (`0`: none yet).
    last_disconnect: std::sync::atomic::AtomicI64,
    /// The count of reconnections so far, bumped on each.
    reconnected: tokio::sync::watch::Sender<u64>,
}

impl LinkEvents {
    fn new() -> LinkEvents {
        LinkEvents {
            disconnects: AtomicU64::new(0),
            last_disconnect: std::sync::atomic::AtomicI64::new(0),
            reconnected: tokio::sync::watch::channel(0).0,
        }
    }

    fn on(&self, event: &async_nats::Event) {
        match event {
            async_nats::Event::Disconnected => {
                self.disconnects.fetch_add(1, Ordering::Relaxed);
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as i64);
                self.last_disconnect.store(now, Ordering::Relaxed);
            }
            async_nats::Event::Connected if self.disconnects.load(Ordering::Relaxed) > 0 => {
                self.reconnected.send_modify(|n| *n += 1);
            }
            _ => {}
        }
    }

    /// Times the connection was lost since start.
    pub fn disconnects(&self) -> u64 {
        self.disconnects.load(Ordering::Relaxed)
    }

    /// When it was last lost (Unix microseconds).
    pub fn last_disconnect(&self) -> Option<i64> {
        Some(self.last_disconnect.load(Ordering::Relaxed)).filter(|t| *t > 0)
    }

    /// Changes on every reconnection after a loss.
    pub fn reconnections(&self) -> tokio::sync::watch::Receiver<u64> {
        self.reconnected.subscribe()
    }
}

/// A private inbox on our own connection: a message we publish to it comes back only
/// after the server has processed everything we published before it.
struct Barrier {
    subject: String,
    next: AtomicU64,
    sub: Mutex<async_nats::Subscriber>,
}

/// How to trust and authenticate to the NATS server, beyond its URL (which may carry a
/// user and password, and `tls://` to require TLS).
#[derive(Clone, Debug, Default)]
pub struct NatsAuth {
    /// PEM file of the CA that signed the server's certificate (TLS is then required).
    pub ca_file: Option<std::path::PathBuf>,
    /// A `.creds` file (user JWT and nkey seed), as `nsc` writes them.
    pub creds_file: Option<std::path::PathBuf>,
    /// A file holding a user nkey seed (`SU…`).
    pub nkey_file: Option<std::path::PathBuf>,
    /// A user and password (else those of the URL, if any).
    pub user: Option<(String, String)>,
    /// Which walcast role this process plays on NATS (`worker`, `front`, `tail`): its
    /// reply inboxes are `_WALCAST_INBOX.<role>.…`, so the NATS permissions walcast ships
    /// (`docker/nats/walcast-permissions.conf`) can let each user read only its own
    /// replies (a front's admin replies carry the projects' secrets). `None`: `any`.
    pub inbox_role: Option<&'static str>,
}

/// The prefix of every walcast process's reply inboxes (see [`NatsAuth::inbox_role`]);
/// services on NATS keep the usual `_INBOX`, which no walcast process uses.
pub const INBOX_PREFIX: &str = "_WALCAST_INBOX";

impl NatsAuth {
    /// The same, with reply inboxes under `_WALCAST_INBOX.<role>`.
    pub fn inbox_for(mut self, role: &'static str) -> NatsAuth {
        self.inbox_role = Some(role);
        self
    }

    async fn options(&self, url: &str) -> Result<ConnectOptions, BusError> {
        let fail = |message: String| BusError::Connect {
            url: url.to_string(),
            message,
        };
        let role = self.inbox_role.unwrap_or("any");
        let mut o = ConnectOptions::new().custom_inbox_prefix(format!("{INBOX_PREFIX}.{role}"));
        // async-nats parses a URL's user and password but does not send them: we do.
        if let Some((user, pass)) = self.user.clone().or_else(|| url_user(url)) {
            o = o.user_and_password(user, pass);
        }
        if let Some(path) = &self.creds_file {
            o = o
                .credentials_file(path)
                .await
                .map_err(|e| fail(format!("credentials file {}: {e}", path.display())))?;
        }
        if let Some(path) = &self.nkey_file {
            let seed = std::fs::read_to_string(path)
                .map_err(|e| fail(format!("nkey seed file {}: {e}", path.display())))?;
            o = o.nkey(seed.trim().to_string());
        }
        if let Some(path) = &self.ca_file {
            if !path.is_file() {
                return Err(fail(format!("CA file {} does not exist", path.display())));
            }
            o = o.add_root_certificates(path.clone()).require_tls(true);
        }
        Ok(o)
    }
}

/// The user and password of a `nats://user:password@host` URL (percent-decoded).
fn url_user(url: &str) -> Option<(String, String)> {
    let addr: async_nats::ServerAddr = url.split(',').next()?.trim().parse().ok()?;
    let user = addr.username()?;
    Some((decode(user), decode(addr.password().unwrap_or_default())))
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = b
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match (b[i], hex.and_then(|h| u8::from_str_radix(h, 16).ok())) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl NatsBus {
    pub async fn connect(url: &str, name: &str, auth: &NatsAuth) -> Result<NatsBus, BusError> {
        let events = Arc::new(LinkEvents::new());
        let seen = events.clone();
        let client = auth
            .options(url)
            .await?
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .event_callback(move |ev| {
                seen.on(&ev);
                async move {
                    tracing::info!(event = %ev, "nats connection event");
                }
            })
            .connect(url)
            .await
            .map_err(|e| BusError::Connect {
                url: url.to_string(),
                message: e.to_string(),
            })?;
        let subject = client.new_inbox();
        let sub = client
            .subscribe(subject.clone())
            .await
            .map_err(BusError::Subscribe)?;
        Ok(NatsBus {
            client,
            barrier: Arc::new(Barrier {
                subject,
                next: AtomicU64::new(0),
                sub: Mutex::new(sub),
            }),
            events,
        })
    }

    pub async fn publish(
        &self,
        subject: String,
        headers: &[(&str, &str)],
        payload: Bytes,
    ) -> Result<(), BusError> {
        let max = self.max_payload();
        if payload.len() > max {
            return Err(BusError::PayloadTooLarge {
                size: payload.len(),
                max,
            });
        }
        let mut map = HeaderMap::new();
        for (k, v) in headers {
            map.insert(*k, *v);
        }
        self.client
            .publish_with_headers(subject, map, payload)
            .await
            .map_err(BusError::Publish)
    }

    pub async fn barrier(&self) -> Result<(), BusError> {
        let mut sub = self.barrier.sub.lock().await;
        let token = self
            .barrier
            .next
            .fetch_add(1, Ordering::Relaxed)
            .to_string();
        self.client
            .publish(self.barrier.subject.clone(), Bytes::from(token.clone()))
            .await
            .map_err(|e| BusError::Barrier(BarrierError::Publish(e)))?;
        self.client
            .flush()
            .await
            .map_err(|e| BusError::Barrier(BarrierError::Flush(e)))?;
        let wait = async {
            while let Some(msg) = sub.next().await {
                if msg.payload.as_ref() == token.as_bytes() {
                    return Ok(());
                }
                // An older token whose waiter timed out: skip it.
            }
            Err(BusError::Barrier(BarrierError::Closed))
        };
        tokio::time::timeout(BARRIER_TIMEOUT, wait)
            .await
            .map_err(|_| BusError::BarrierTimeout(BARRIER_TIMEOUT))?
    }

    pub async fn subscribe(&self, pattern: &str) -> Result<Subscription, BusError> {
        let sub = self
            .client
            .subscribe(pattern.to_string())
            .await
            .map_err(BusError::Subscribe)?;
        let stream = sub.map(|m| BusMessage {
            subject: m.subject.to_string(),
            headers: m
                .headers
                .map(|h| {
                    h.iter()
                        .flat_map(|(k, vs)| {
                            let k = k.to_string();
                            vs.iter()
                                .map(move |v| (k.clone(), v.as_str().to_string()))
                                .collect::<Vec<_>>()
                        })
                        .collect()
                })
                .unwrap_or_default(),
            payload: m.payload,
        });
        Ok(Subscription {
            inner: Box::pin(stream),
        })
    }

    /// The server's `max_payload` (1 MiB when not yet known).
    pub fn max_payload(&self) -> usize {
        match self.client.server_info().max_payload {
            0 => 1024 * 1024,
            n => n,
        }
    }

    pub fn is_connected(&self) -> bool {
        matches!(
            self.client.connection_state(),
            async_nats::connection::State::Connected
        )
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The connection's losses and reconnections.
    pub fn link_events(&self) -> &Arc<LinkEvents> {
        &self.events
    }
}

/// Answer a request (`what` names it in logs) with `body` as JSON; failures are logged
/// (the asker times out and asks again).
pub(crate) async fn reply_json<T: serde::Serialize>(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    body: &T,
    what: &'static str,
) {
    match serde_json::to_vec(body) {
        Ok(body) => {
            if let Err(e) = client.publish(reply_to, Bytes::from(body)).await {
                tracing::warn!(error = %e, request = what, "cannot answer a request");
            }
        }
        Err(e) => tracing::error!(error = %e, request = what, "cannot encode a reply"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_urls_user_and_password_are_read_and_decoded() {
        assert_eq!(
            url_user("nats://walcast-front:p%40ss%2Fw@nats:4222"),
            Some(("walcast-front".into(), "p@ss/w".into()))
        );
        assert_eq!(url_user("nats://127.0.0.1:4222"), None);
        assert_eq!(url_user("nats://u@h:1"), Some(("u".into(), String::new())));
    }
}
