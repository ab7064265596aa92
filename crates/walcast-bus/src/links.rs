//! What keeps each front's delivery subject whole, whatever core NATS drops.
//!
//! Core NATS delivers at most once: what the leader publishes on
//! `walcast.deliver.<front>` while that front is disconnected is gone. So the leader
//! numbers every message it sends a front ([`crate::HEADER_FRONT_SEQ`]: 1, 2, 3 … per
//! front, for one leader term of one process, i.e. one `(Walcast-Term, Walcast-Origin)`
//! stream), keeps what it sent for a while, and sends each front with subscriptions a
//! heartbeat ([`NOTICE_HEARTBEAT`], carrying the last number) about once a second, so a
//! front notices a gap even when nothing else comes. A front that sees a gap asks for the
//! missing numbers on [`SUBJECT_RESEND`] ([`ResendRequest`]); the leader publishes them
//! again on the delivery subject (marked [`crate::HEADER_RESENT`]) and answers what it
//! resent and what it no longer has ([`ResendReply`]); the front then tells the affected
//! channels what was lost.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::subs::BoxFuture;
use crate::{Bus, BusError};

/// Request/reply subject on which the leading cdc-worker resends what a front missed.
pub const SUBJECT_RESEND: &str = "walcast.cdc.resend";

/// [`crate::HEADER_NOTICE`] of a heartbeat: no payload; its [`crate::HEADER_FRONT_SEQ`]
/// is the last number sent to that front in this stream (`0`: none yet).
pub const NOTICE_HEARTBEAT: &str = "heartbeat";

/// How often the leader sends each front with subscriptions a heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);

/// A front asks for the numbers `from..=to` of its stream in `term` again.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ResendRequest {
    pub front: String,
    /// The stream's `Walcast-Term` and `Walcast-Origin`.
    pub term: u64,
    pub origin: String,
    pub from: u64,
    pub to: u64,
}

/// What the leader did about a [`ResendRequest`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct ResendReply {
    /// Numbers published again on the delivery subject (inclusive), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resent: Option<(u64, u64)>,
    /// Numbers it cannot send (inclusive): no longer kept, another stream, or never sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<(u64, u64)>,
    /// Why `lost`, for logs and the clients' `system` message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ResendReply {
    /// Nothing of `from..=to` can be sent, because `reason`.
    pub fn lost(from: u64, to: u64, reason: impl Into<String>) -> ResendReply {
        ResendReply {
            resent: None,
            lost: Some((from, to)),
            reason: Some(reason.into()),
        }
    }
}

/// Why a resend request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum ResendError {
    #[error("no cdc-worker answered the resend request within {0:?}")]
    Timeout(Duration),
    #[error("the resend request failed: {0}")]
    Request(#[source] async_nats::RequestError),
    #[error("bad resend reply: {0}")]
    Reply(#[source] serde_json::Error),
    #[error("the resend request could not be encoded: {0}")]
    Encode(#[source] serde_json::Error),
    /// The in-process bus drops nothing a resend could bring back.
    #[error("no resend on this bus")]
    Unsupported,
}

/// The worker side.
pub trait ResendHandler: Send + Sync + 'static {
    fn resend(&self, req: ResendRequest) -> BoxFuture<ResendReply>;
}

/// The front side: over NATS, or nothing (in process).
#[derive(Clone)]
pub enum ResendClient {
    Nats(async_nats::Client),
    None,
}

impl ResendClient {
    pub fn new(bus: &Bus) -> ResendClient {
        match bus {
            Bus::Nats(b) => ResendClient::Nats(b.client().clone()),
            Bus::Local(_) => ResendClient::None,
        }
    }

    /// Ask the leader of `source`; the answer within `timeout`.
    pub async fn request(
        &self,
        source: &str,
        req: &ResendRequest,
        timeout: Duration,
    ) -> Result<ResendReply, ResendError> {
        let ResendClient::Nats(c) = self else {
            return Err(ResendError::Unsupported);
        };
        let body = serde_json::to_vec(req).map_err(ResendError::Encode)?;
        let msg = tokio::time::timeout(
            timeout,
            c.request(
                crate::source::subject(source, SUBJECT_RESEND),
                Bytes::from(body),
            ),
        )
        .await
        .map_err(|_| ResendError::Timeout(timeout))?
        .map_err(ResendError::Request)?;
        serde_json::from_slice(&msg.payload).map_err(ResendError::Reply)
    }
}

/// Worker side over NATS: answer the resend requests of `source` until `shutdown`
/// completes, each on a task of its own.
pub async fn serve_nats(
    bus: &Bus,
    source: &str,
    handler: Arc<dyn ResendHandler>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), BusError> {
    use futures_util::StreamExt;
    let Bus::Nats(nats) = bus else {
        return Ok(());
    };
    let client = nats.client().clone();
    let mut requests = client
        .subscribe(crate::source::subject(source, SUBJECT_RESEND))
        .await
        .map_err(BusError::Subscribe)?;
    tokio::pin!(shutdown);
    loop {
        let msg = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            m = requests.next() => match m {
                Some(m) => m,
                None => return Err(BusError::Closed("resend subscription")),
            },
        };
        let Some(reply_to) = msg.reply else { continue };
        let req = match serde_json::from_slice::<ResendRequest>(&msg.payload) {
            Ok(req) => req,
            Err(e) => {
                tracing::warn!(error = %e, "malformed resend request");
                continue;
            }
        };
        let (client, handler) = (client.clone(), handler.clone());
        walcast_core::source_scope::spawn(async move {
            let reply = handler.resend(req).await;
            crate::nats::reply_json(&client, reply_to, &reply, "resend").await
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_forms_are_stable() {
        let req = ResendRequest {
            front: "f".into(),
            term: 3,
            origin: "o".into(),
            from: 5,
            to: 9,
        };
        let text = serde_json::to_string(&req).unwrap();
        assert_eq!(
            text,
            r#"{"front":"f","term":3,"origin":"o","from":5,"to":9}"#
        );
        let reply = ResendReply {
            resent: Some((7, 9)),
            lost: Some((5, 6)),
            reason: Some("gone".into()),
        };
        let text = serde_json::to_string(&reply).unwrap();
        assert_eq!(text, r#"{"resent":[7,9],"lost":[5,6],"reason":"gone"}"#);
        assert_eq!(serde_json::from_str::<ResendReply>(&text).unwrap(), reply);
        assert_eq!(
            serde_json::from_str::<ResendReply>("{}").unwrap(),
            ResendReply::default()
        );
    }
}
