//! The subscription registry protocol between fronts and the cdc-worker.
//!
//! A front registers every `postgres_changes` binding of a joining channel with the
//! worker and answers the join only after the worker replied: the worker matches
//! subscriptions while decoding, so "join ok" means every change committed after the
//! reply's `effective_from` position is matched against it.
//!
//! * `register` (request/reply): add or replace subscriptions; the reply says, per
//!   subscription, whether it was accepted (unknown table, bad filter … are refused with a
//!   readable error), and from which WAL position it is effective.
//! * `unregister`: drop subscriptions (channel left or socket closed).
//! * `sync` (every [`SYNC_INTERVAL`]): a front's complete list of subscription ids. The
//!   worker drops that front's subscriptions missing from it, and drops every
//!   subscription of a front not heard from for [`FRONT_EXPIRY`] (a dead front).
//! * `resync` (worker → fronts): a worker that starts leading asks every front to
//!   register all its subscriptions again (each keeping its `from` position). The
//!   request's payload is a subject on which each front reports [`ResyncProgress`]:
//!   `started` at once, `done` when all its subscriptions are registered again. The new
//!   leader reads the slot only once every front that started is done, and every front
//!   it knows to be alive answered (bounded: see [`crate::resync`]), so the backlog it
//!   replays is matched against everything.
//! * `roll-call` (worker → fronts): who is there; each front answers with its id.
//!
//! Over NATS these are the subjects below; in one process the front calls the worker's
//! [`SubsHandler`] directly (same types, no serialisation).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use walcast_core::Lsn;

pub use crate::class::{is_class_key, ClassFields};
use crate::resync::request_resync;
pub use crate::resync::{
    FrontHello, KnownFronts, ResyncProgress, ResyncSummary, ResyncWait, FRONT_ALIVE, RESYNC_GRACE,
    RESYNC_KNOWN_WAIT, RESYNC_MAX_WAIT, SUBJECT_RESYNC, SUBJECT_ROLL_CALL, SUBJECT_SYNC,
    SYNC_INTERVAL,
};
pub use crate::spec::{selected, SubscriptionSpec};
use crate::{Bus, BusError};

pub const SUBJECT_REGISTER: &str = "walcast.cdc.subs.register";
pub const SUBJECT_UNREGISTER: &str = "walcast.cdc.subs.unregister";
/// A front silent this long is considered dead and its subscriptions dropped.
pub const FRONT_EXPIRY: Duration = Duration::from_secs(20);

/// The class of a subscription: its [`ClassFields`] named by [`ClassFields::key`]
/// (`c` and 32 hex digits of a SHA-256; a subscription id always has a `:`). Subscriptions
/// with the same project, schema, table, event, filter, selected columns and role see the
/// same changes of tables they can read without row-level security, so the worker
/// matches and names them once per class. Fronts and worker compute it the same way, and
/// both compare the full fields whenever a subscription joins a class by key.
pub fn class_key(spec: &SubscriptionSpec) -> String {
    ClassFields::of(spec).key()
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct RegisterRequest {
    pub subs: Vec<SubscriptionSpec>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RegisterResult {
    pub id: String,
    pub ok: bool,
    /// Why the worker refused it (sent to the client in a `system` error).
    pub error: Option<String>,
    /// Every change it matches is named by its [`class_key`], never by its id: its table
    /// has no row-level security for its role. A front may then let a new subscription
    /// of the same class join without asking the worker first (see the front's registry).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub by_class: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct RegisterReply {
    /// One per requested subscription, same order.
    pub results: Vec<RegisterResult>,
    /// Changes committed after this WAL position are matched against the accepted ones.
    pub effective_from: Option<Lsn>,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default)]
pub struct UnregisterRequest {
    pub ids: Vec<String>,
}

/// [`crate::HEADER_NOTICE`] value of a [`SubsEnded`] message.
pub const NOTICE_SUBS_ENDED: &str = "subs-ended";

/// [`crate::HEADER_NOTICE`] value of a notice that changes were skipped for these
/// subscriptions (their project lagged past its bound): same body as [`SubsEnded`]; the
/// front tells each channel with a `system` error carrying `message`, and the
/// subscriptions go on.
pub const NOTICE_SUBS_LAGGED: &str = "subs-lagged";

/// [`crate::HEADER_NOTICE`] value of a notice that changes are withheld from these
/// subscriptions for a reason their client must know (say, their filter reads a column
/// their role may no longer `SELECT`): same body as [`SubsEnded`]; the front tells each
/// channel with a `system` error carrying `message`, and the subscriptions go on.
pub const NOTICE_SUBS_WITHHELD: &str = "subs-withheld";

/// Worker → front, on the front's delivery subject (so in order with its changes):
/// these subscriptions ended on the worker's side (their table was dropped). The front
/// tells each channel with a `system` error carrying `message` and removes them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SubsEnded {
    pub ids: Vec<String>,
    pub message: String,
}

/// A front's full list of subscription ids, possibly in several parts.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct SyncMessage {
    pub front: String,
    pub ids: Vec<String>,
    /// Parts of one list share a round (any number, fresh for each list).
    #[serde(default)]
    pub round: u64,
    /// The list's last part: the worker applies the list once it has it.
    #[serde(default = "yes")]
    pub last: bool,
}

fn yes() -> bool {
    true
}

impl SyncMessage {
    /// A whole list in one message.
    pub fn whole(front: String, ids: Vec<String>) -> SyncMessage {
        SyncMessage {
            front,
            ids,
            round: 0,
            last: true,
        }
    }
}

/// Registrations a worker handles at once over NATS (the rest wait in NATS).
pub const MAX_REGISTRATIONS_IN_FLIGHT: usize = 1024;

/// The largest message a front sends the worker (registrations, unregistrations and syncs
/// are split to stay under it): well within nats-server's smallest usual `max_payload`.
pub const MESSAGE_BUDGET: usize = 48 * 1024;

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// The worker side of the registry.
pub trait SubsHandler: Send + Sync + 'static {
    fn register(&self, req: RegisterRequest) -> BoxFuture<RegisterReply>;
    fn unregister(&self, req: UnregisterRequest);
    fn sync(&self, msg: SyncMessage);
}

/// The front side: talks to the worker over NATS, or calls it in process.
#[derive(Clone)]
pub enum SubsClient {
    Nats(async_nats::Client),
    Local(Arc<dyn SubsHandler>),
}

impl SubsClient {
    /// Over the given bus: NATS request/reply, or the in-process handler.
    pub fn new(bus: &Bus, local: Option<Arc<dyn SubsHandler>>) -> Result<SubsClient, BusError> {
        match (bus, local) {
            (Bus::Nats(b), _) => Ok(SubsClient::Nats(b.client().clone())),
            (Bus::Local(_), Some(h)) => Ok(SubsClient::Local(h)),
            (Bus::Local(_), None) => Err(BusError::NoSubsHandler),
        }
    }

    /// Register subscriptions. Over NATS a large request goes as several requests of at
    /// most [`MESSAGE_BUDGET`] bytes, one after another; the replies are merged (the
    /// latest `effective_from` stands for all).
    pub async fn register(
        &self,
        source: &str,
        req: RegisterRequest,
        timeout: Duration,
    ) -> Result<RegisterReply, BusError> {
        match self {
            SubsClient::Local(_) if !crate::source::is_default(source) => {
                Err(BusError::NoSubsHandler)
            }
            SubsClient::Local(h) => tokio::time::timeout(timeout, h.register(req))
                .await
                .map_err(|_| BusError::RegisterTimeout),
            SubsClient::Nats(c) => {
                let mut merged = RegisterReply::default();
                let mut chunks = chunks_by_size(req.subs, MESSAGE_BUDGET);
                if chunks.is_empty() {
                    // Still one round trip: callers use it to know earlier messages were
                    // handled (the worker serves them in order).
                    chunks.push(Vec::new());
                }
                for subs in chunks {
                    let reply =
                        register_once(c, source, &RegisterRequest { subs }, timeout).await?;
                    merged.results.extend(reply.results);
                    merged.effective_from = merged.effective_from.max(reply.effective_from);
                }
                Ok(merged)
            }
        }
    }

    /// Unregister, with the leader of `source`.
    pub async fn unregister(&self, source: &str, req: UnregisterRequest) -> Result<(), BusError> {
        match self {
            SubsClient::Local(_) if !crate::source::is_default(source) => {
                Err(BusError::NoSubsHandler)
            }
            SubsClient::Local(h) => {
                h.unregister(req);
                Ok(())
            }
            SubsClient::Nats(c) => {
                for ids in chunks_by_size(req.ids, MESSAGE_BUDGET) {
                    let subject = crate::source::subject(source, SUBJECT_UNREGISTER);
                    publish_json(c, subject, &UnregisterRequest { ids }).await?;
                }
                Ok(())
            }
        }
    }

    /// Answer a resync request or a roll call (its payload is where to).
    pub async fn answer<T: Serialize>(&self, to: &str, p: &T) -> Result<(), BusError> {
        match self {
            SubsClient::Local(_) => Ok(()),
            SubsClient::Nats(c) => {
                let body = serde_json::to_vec(p).map_err(BusError::Encode)?;
                c.publish(to.to_string(), Bytes::from(body))
                    .await
                    .map_err(BusError::Publish)
            }
        }
    }

    /// A front's full list. Over NATS a long list goes as several messages of at most
    /// [`MESSAGE_BUDGET`] bytes, numbered by a fresh `round`; the worker applies a round
    /// only once its `last` part arrived.
    ///
    /// Sent to the leader of `source`, with the subscriptions of that source's projects.
    pub async fn sync(&self, source: &str, msg: SyncMessage) -> Result<(), BusError> {
        match self {
            SubsClient::Local(_) if !crate::source::is_default(source) => {
                Err(BusError::NoSubsHandler)
            }
            SubsClient::Local(h) => {
                h.sync(msg);
                Ok(())
            }
            SubsClient::Nats(c) => {
                let round = rand::random::<u64>();
                let parts = chunks_by_size(msg.ids, MESSAGE_BUDGET);
                let n = parts.len().max(1);
                let mut parts = parts.into_iter();
                for i in 0..n {
                    let part = SyncMessage {
                        front: msg.front.clone(),
                        ids: parts.next().unwrap_or_default(),
                        round,
                        last: i + 1 == n,
                    };
                    publish_json(c, crate::source::subject(source, SUBJECT_SYNC), &part).await?;
                }
                Ok(())
            }
        }
    }
}

async fn register_once(
    c: &async_nats::Client,
    source: &str,
    req: &RegisterRequest,
    timeout: Duration,
) -> Result<RegisterReply, BusError> {
    let body = serde_json::to_vec(req).map_err(BusError::Encode)?;
    let msg = tokio::time::timeout(
        timeout,
        c.request(
            crate::source::subject(source, SUBJECT_REGISTER),
            Bytes::from(body),
        ),
    )
    .await
    .map_err(|_| BusError::RequestTimeout)?
    .map_err(BusError::Request)?;
    serde_json::from_slice(&msg.payload).map_err(BusError::BadReply)
}

/// Split `items` into runs whose JSON array stays under `budget` bytes (an item larger
/// than that goes alone).
pub fn chunks_by_size<T: Serialize>(items: Vec<T>, budget: usize) -> Vec<Vec<T>> {
    let mut out: Vec<Vec<T>> = Vec::new();
    let mut size = 0;
    for item in items {
        let n = serde_json::to_vec(&item).map_or(0, |v| v.len()) + 1;
        match out.last_mut() {
            Some(run) if size + n <= budget => run.push(item),
            _ => {
                out.push(vec![item]);
                size = 0;
            }
        }
        size += n;
    }
    out
}

async fn publish_json<T: Serialize>(
    c: &async_nats::Client,
    subject: String,
    v: &T,
) -> Result<(), BusError> {
    let body = serde_json::to_vec(v).map_err(BusError::Encode)?;
    c.publish(subject, Bytes::from(body))
        .await
        .map_err(BusError::Publish)
}

/// Worker side over NATS: answer registrations and apply unregister and sync messages
/// until `shutdown` completes. Asks every front to register again first (a new leader
/// learns all current subscriptions). Registrations are answered concurrently (the
/// handler batches them); unregister and sync messages in arrival order. An unregister
/// that overtakes the registration it undoes leaves that subscription behind until the
/// front's next sync list drops it (its front no longer knows the id, so nothing is
/// delivered for it meanwhile). `expected`: the fronts known to be alive, waited for even
/// when they are slow to answer the resync request.
pub async fn serve_nats(
    bus: &Bus,
    source: &str,
    handler: Arc<dyn SubsHandler>,
    expected: std::collections::HashSet<String>,
    resynced: tokio::sync::oneshot::Sender<ResyncSummary>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), BusError> {
    use futures_util::StreamExt;
    let Bus::Nats(nats) = bus else {
        return Ok(());
    };
    let client = nats.client().clone();
    let sub = |s: &'static str| {
        let (c, s) = (client.clone(), crate::source::subject(source, s));
        async move { c.subscribe(s).await.map_err(BusError::Subscribe) }
    };
    let mut register = sub(SUBJECT_REGISTER).await?;
    let mut unregister = sub(SUBJECT_UNREGISTER).await?;
    let mut sync = sub(SUBJECT_SYNC).await?;
    // Listening for registrations now: ask the fronts for theirs (answered beside this
    // loop, which must keep serving the registrations it asks for).
    let inbox = client.new_inbox();
    let progress = client
        .subscribe(inbox.clone())
        .await
        .map_err(BusError::Subscribe)?;
    let asker = client.clone();
    let wait = ResyncWait::new(tokio::time::Instant::now(), expected);
    let resync = crate::source::subject(source, SUBJECT_RESYNC);
    walcast_core::source_scope::spawn(async move {
        let summary = request_resync(&asker, resync, inbox, progress, wait).await;
        let _ = resynced.send(summary);
    });
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_REGISTRATIONS_IN_FLIGHT));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            Some(msg) = register.next() => {
                let Some(reply_to) = msg.reply else { continue };
                // Answered beside this loop, so registrations arriving together are
                // handled together (the handler batches them); at most
                // MAX_REGISTRATIONS_IN_FLIGHT at once.
                let Ok(permit) = in_flight.clone().acquire_owned().await else { continue };
                let (handler, client) = (handler.clone(), client.clone());
                walcast_core::source_scope::spawn(async move {
                    let reply = match serde_json::from_slice::<RegisterRequest>(&msg.payload) {
                        Ok(req) => handler.register(req).await,
                        Err(e) => {
                            tracing::warn!(error = %e, "malformed subscription registration");
                            RegisterReply::default()
                        }
                    };
                    drop(permit);
                    match serde_json::to_vec(&reply) {
                        Ok(body) => {
                            if let Err(e) = client.publish(reply_to, Bytes::from(body)).await {
                                tracing::warn!(error = %e, "cannot answer a subscription registration");
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "cannot encode a registration reply"),
                    }
                });
            }
            Some(msg) = unregister.next() => match serde_json::from_slice::<UnregisterRequest>(&msg.payload) {
                Ok(req) => handler.unregister(req),
                Err(e) => tracing::warn!(error = %e, "malformed unregister message"),
            },
            Some(msg) = sync.next() => match serde_json::from_slice::<SyncMessage>(&msg.payload) {
                Ok(m) => handler.sync(m),
                Err(e) => tracing::warn!(error = %e, "malformed sync message"),
            },
            else => return Err(BusError::Closed("subscription registry subscriptions")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn todos_spec() -> SubscriptionSpec {
        SubscriptionSpec {
            id: "f1:7".into(),
            front: "f1".into(),
            project: "default".into(),
            schema: "public".into(),
            table: Some("todos".into()),
            event: "*".into(),
            filter: Some("id=eq.1".into()),
            select: None,
            claims: serde_json::json!({"role": "authenticated", "sub": "u1"}).into(),
            from: None,
        }
    }

    #[test]
    fn specs_round_trip() {
        let spec = todos_spec();
        let text = serde_json::to_string(&RegisterRequest {
            subs: vec![spec.clone()],
        })
        .unwrap();
        let back: RegisterRequest = serde_json::from_str(&text).unwrap();
        assert_eq!(back.subs, vec![spec.clone()]);
    }

    #[test]
    fn long_lists_are_cut_into_bounded_parts() {
        let ids: Vec<String> = (0..20_000).map(|i| format!("front-0123abcd:{i}")).collect();
        let parts = chunks_by_size(ids.clone(), MESSAGE_BUDGET);
        assert!(parts.len() > 1);
        for p in &parts {
            assert!(serde_json::to_vec(p).unwrap().len() <= MESSAGE_BUDGET);
        }
        assert_eq!(parts.concat(), ids);
        assert!(chunks_by_size(Vec::<String>::new(), 10).is_empty());
        let old: SyncMessage = serde_json::from_str(r#"{"front":"f","ids":["f:1"]}"#).unwrap();
        assert!(old.last, "a message without parts is whole");
    }

    #[test]
    fn a_select_makes_its_own_class_whatever_its_order() {
        let spec = todos_spec();
        let sel = |cols: &[&str]| SubscriptionSpec {
            select: Some(cols.iter().map(|c| c.to_string()).collect()),
            ..spec.clone()
        };
        assert_ne!(class_key(&sel(&["title"])), class_key(&spec));
        assert_eq!(
            class_key(&sel(&["a", "b"])),
            class_key(&sel(&["b", " a", "b"]))
        );
        assert_ne!(class_key(&sel(&["a", "b"])), class_key(&sel(&["ab"])));
    }

    #[test]
    fn class_keys_ignore_ids_fronts_and_claims_but_the_role() {
        let spec = todos_spec();
        let k = class_key(&spec);
        assert!(is_class_key(&k), "{k}");
        assert!(!is_class_key("f1:7"));
        let same = SubscriptionSpec {
            id: "f2:9".into(),
            front: "f2".into(),
            claims: serde_json::json!({"role": "authenticated", "sub": "u2"}).into(),
            filter: Some(" id=eq.1 ".into()),
            ..spec.clone()
        };
        assert_eq!(class_key(&same), k);
        for other in [
            SubscriptionSpec {
                claims: serde_json::json!({"role": "anon"}).into(),
                ..spec.clone()
            },
            SubscriptionSpec {
                filter: None,
                ..spec.clone()
            },
            SubscriptionSpec {
                table: None,
                ..spec.clone()
            },
            SubscriptionSpec {
                event: "INSERT".into(),
                ..spec.clone()
            },
            SubscriptionSpec {
                project: "p2".into(),
                ..spec.clone()
            },
        ] {
            assert_ne!(class_key(&other), k, "{other:?}");
        }
    }
}
