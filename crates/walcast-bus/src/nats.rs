//! Core NATS transport.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, HeaderMap};
use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::{BusError, BusMessage, Subscription};

const BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
pub struct NatsBus {
    client: Client,
    barrier: Arc<Barrier>,
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
}

impl NatsAuth {
    async fn options(&self, url: &str) -> Result<ConnectOptions, BusError> {
        let fail = |message: String| BusError::Connect {
            url: url.to_string(),
            message,
        };
        let mut o = ConnectOptions::new();
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

impl NatsBus {
    pub async fn connect(url: &str, name: &str, auth: &NatsAuth) -> Result<NatsBus, BusError> {
        let client = auth
            .options(url)
            .await?
            .name(name)
            .retry_on_initial_connect()
            .max_reconnects(None)
            .connection_timeout(Duration::from_secs(5))
            .event_callback(|ev| async move {
                tracing::info!(event = %ev, "nats connection event");
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
            .map_err(|e| BusError::Subscribe(e.to_string()))?;
        Ok(NatsBus {
            client,
            barrier: Arc::new(Barrier {
                subject,
                next: AtomicU64::new(0),
                sub: Mutex::new(sub),
            }),
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
            .map_err(|e| BusError::Publish(e.to_string()))
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
            .map_err(|e| BusError::Barrier(e.to_string()))?;
        self.client
            .flush()
            .await
            .map_err(|e| BusError::Barrier(e.to_string()))?;
        let wait = async {
            while let Some(msg) = sub.next().await {
                if msg.payload.as_ref() == token.as_bytes() {
                    return Ok(());
                }
                // An older token whose waiter timed out: skip it.
            }
            Err(BusError::Barrier("barrier subscription closed".into()))
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
            .map_err(|e| BusError::Subscribe(e.to_string()))?;
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
}
