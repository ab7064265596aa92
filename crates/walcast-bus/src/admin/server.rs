//! The worker's side of the admin requests over NATS: answered in order when they
//! change something, side by side when they only read; snapshot rows sent in parts.

use std::future::Future;
use std::sync::Arc;

use super::{
    parts, unexpected, AdminError, AdminErrorKind, AdminHandler, AdminReply, AdminRequest,
    Response, SnapshotRows, CONCURRENT_READS, SUBJECT_ADMIN,
};
use crate::Bus;

/// Worker side over NATS: answer admin requests until `shutdown` completes. Requests
/// that change something are answered one at a time in arrival order (an enable is never
/// overtaken by the disable sent after it); read-only ones (private-channel checks,
/// replays, lists) side by side, at most [`CONCURRENT_READS`] at once, so one slow check
/// or a burst of them does not hold every other front's request.
pub async fn serve_nats(
    bus: &Bus,
    source: &str,
    handler: Arc<dyn AdminHandler>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), crate::BusError> {
    use futures_util::StreamExt;
    let Bus::Nats(nats) = bus else {
        return Ok(());
    };
    let client = nats.client().clone();
    let mut requests = client
        .subscribe(crate::source::subject(source, SUBJECT_ADMIN))
        .await
        .map_err(crate::BusError::Subscribe)?;
    let reads = Arc::new(tokio::sync::Semaphore::new(CONCURRENT_READS));
    tokio::pin!(shutdown);
    loop {
        let msg = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            m = requests.next() => match m {
                Some(m) => m,
                None => return Err(crate::BusError::Closed("admin subscription")),
            },
        };
        let Some(reply_to) = msg.reply else { continue };
        let req = match serde_json::from_slice::<AdminRequest>(&msg.payload) {
            Ok(req) => req,
            Err(e) => {
                tracing::warn!(error = %e, "malformed admin request");
                let refusal = Response::Error(AdminError::new(
                    AdminErrorKind::Internal,
                    format!("malformed admin request: {e}"),
                ));
                answer(&client, reply_to, refusal).await;
                continue;
            }
        };
        if req.is_ordered() {
            let response = respond(handler.as_ref(), req).await;
            answer(&client, reply_to, response).await;
            continue;
        }
        let Ok(permit) = reads.clone().acquire_owned().await else {
            continue;
        };
        let (client, handler) = (client.clone(), handler.clone());
        walcast_core::source_scope::spawn(async move {
            match parts_nonce(&req) {
                Some(nonce) => {
                    let rows = match handler.handle(req).await {
                        Ok(AdminReply::SnapshotRows(rows)) => Ok(rows),
                        Ok(other) => Err(unexpected(&other)),
                        Err(e) => Err(e),
                    };
                    send_parts(&client, reply_to, &nonce, rows).await;
                }
                None => {
                    let response = respond(handler.as_ref(), req).await;
                    answer(&client, reply_to, response).await;
                }
            }
            drop(permit);
        });
    }
}

async fn respond(handler: &dyn AdminHandler, req: AdminRequest) -> Response {
    match handler.handle(req).await {
        Ok(r) => Response::Ok(r),
        Err(e) => Response::Error(e),
    }
}

/// The nonce of a snapshot request answered in parts (one that may be echoed; another is
/// answered in one reply, as from a front that predates parts).
fn parts_nonce(req: &AdminRequest) -> Option<String> {
    match req {
        AdminRequest::SnapshotRows { nonce: Some(n), .. } if parts::nonce_ok(n) => Some(n.clone()),
        _ => None,
    }
}

fn max_payload(client: &async_nats::Client) -> usize {
    match client.server_info().max_payload {
        0 => 1024 * 1024,
        n => n,
    }
}

/// Publish the parts of a snapshot answer (see [`parts`]) to the requester's inbox. A
/// part NATS refuses ends them: the front, missing the rest, refuses the snapshot.
async fn send_parts(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    nonce: &str,
    rows: Result<SnapshotRows, AdminError>,
) {
    let max = max_payload(client);
    for part in parts::Parts::new(nonce, rows, max) {
        if let Err(e) = client.publish(reply_to.clone(), part).await {
            tracing::warn!(error = %e, "cannot send a snapshot part");
            return;
        }
    }
    if let Err(e) = client.flush().await {
        tracing::warn!(error = %e, "cannot flush snapshot parts");
    }
}

async fn answer(
    client: &async_nats::Client,
    reply_to: async_nats::Subject,
    mut response: Response,
) {
    let max = max_payload(client);
    let room = max.saturating_sub(REPLY_OVERHEAD);
    fit_rows(&mut response, room);
    let left_out = fit_replay(&mut response, room);
    if left_out > 0 {
        tracing::warn!(
            left_out,
            max_payload = max,
            "a broadcast replay did not fit one NATS message: its newest messages were left out"
        );
    }
    crate::nats::reply_json(client, reply_to, &response, "admin").await
}

/// Room left in a reply for its subject and headers.
const REPLY_OVERHEAD: usize = 1024;

/// Rows asked for in one reply (by a front that predates parts) that do not fit one NATS
/// message are refused as too large (never cut short: the reader would take a part for
/// the whole).
pub(super) fn fit_rows(response: &mut Response, max: usize) {
    let Response::Ok(AdminReply::SnapshotRows(rows)) = response else {
        return;
    };
    let size: usize = 256
        + rows.snapshot.len()
        + serde_json::to_vec(&rows.columns).map_or(usize::MAX / 2, |v| v.len())
        + rows
            .rows
            .iter()
            .map(|r| serde_json::to_vec(r).map_or(usize::MAX / 2, |v| v.len()) + 1)
            .sum::<usize>();
    if size > max {
        let n = rows.rows.len();
        tracing::warn!(
            rows = n,
            size,
            max_payload = max,
            "snapshot rows do not fit one NATS message"
        );
        *response = Response::Error(AdminError::new(
            AdminErrorKind::TooLarge,
            format!("{n} rows of {size} bytes do not fit one NATS message ({max} bytes)"),
        ));
    }
}

/// Bring a replay's reply within `max` bytes of JSON: its oldest messages that fit, in
/// order, the newer ones left out (a reply NATS refuses would leave the join waiting for
/// nothing until its timeout). How many were left out.
pub(super) fn fit_replay(response: &mut Response, max: usize) -> usize {
    let Response::Ok(AdminReply::Replayed { messages }) = response else {
        return 0;
    };
    // `{"ok":{"reply":"replayed","messages":[…]}}` and a comma per message.
    let mut total = 64;
    let keep = messages
        .iter()
        .take_while(|m| {
            total += serde_json::to_vec(m).map_or(usize::MAX / 2, |v| v.len()) + 1;
            total <= max
        })
        .count();
    let left_out = messages.len() - keep;
    messages.truncate(keep);
    left_out
}
