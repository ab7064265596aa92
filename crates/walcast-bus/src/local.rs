//! In-process transport for the all-in-one binary.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::StreamExt;
use tokio::sync::broadcast;

use crate::subject::matches;
use crate::{BusMessage, Subscription};

#[derive(Clone)]
pub struct LocalBus {
    tx: broadcast::Sender<Arc<BusMessage>>,
}

impl LocalBus {
    pub fn new(capacity: usize) -> LocalBus {
        let (tx, _) = broadcast::channel(capacity.max(1));
        LocalBus { tx }
    }

    pub fn publish(&self, subject: String, headers: &[(&str, &str)], payload: Bytes) {
        let msg = BusMessage {
            subject,
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            payload,
        };
        // No subscriber is not an error: nobody is listening yet.
        let _ = self.tx.send(Arc::new(msg));
    }

    pub fn subscribe(&self, pattern: &str) -> Subscription {
        let pattern = pattern.to_string();
        let rx = self.tx.subscribe();
        let stream = futures_util::stream::unfold(rx, |mut rx| async move {
            loop {
                match rx.recv().await {
                    Ok(m) => return Some((m, rx)),
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        metrics::counter!("walcast_bus_local_lagged_total").increment(n);
                        tracing::warn!(dropped = n, "in-process bus subscriber fell behind");
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                }
            }
        })
        .filter(move |m| std::future::ready(matches(&pattern, &m.subject)))
        .map(|m| (*m).clone());
        Subscription {
            inner: Box::pin(stream),
        }
    }
}
