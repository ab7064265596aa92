//! # walcast-front
//!
//! The realtime front: serves the Supabase Realtime protocol over WebSocket (so the
//! unmodified `@supabase/realtime-js` works), `postgres_changes` over SSE, and the
//! broadcast REST API.
//!
//! * Join means subscribed: a join's bindings are registered with the cdc-worker (through
//!   [`SubsClient`]) before the join reply is sent.
//! * Fan-out: the worker puts the ids of the subscriptions a change matched into the
//!   event; the front encodes the change once and sends one frame per channel into each
//!   connection's bounded queue. A connection that cannot keep up is closed (1013).
//! * Broadcast is relayed between fronts over the bus; presence is behind
//!   [`PresenceStore`]: per front ([`MemoryPresence`]) or shared through JetStream KV
//!   ([`KvPresence`]).
//!
//! ```no_run
//! # async fn demo(bus: walcast_bus::Bus, subs: walcast_bus::subs::SubsClient) -> Result<(), Box<dyn std::error::Error>> {
//! use tokio_util::sync::CancellationToken;
//! use walcast_front::{Front, FrontConfig, Projects};
//!
//! let cancel = CancellationToken::new();
//! let front = Front::start(FrontConfig::default(), bus, subs, Projects::new("secret"), cancel.clone()).await?;
//! let listener = tokio::net::TcpListener::bind("0.0.0.0:4000").await?;
//! let c = cancel.clone();
//! axum::serve(listener, front.router())
//!     .with_graceful_shutdown(async move { c.cancelled().await })
//!     .await?;
//! front.closed().await; // every socket closed with 1001
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod auth;
mod broadcast;
mod channel;
pub mod cluster;
pub mod config;
mod conn;
mod credentials;
mod fanout;
mod http;
mod inspector;
pub mod keys;
pub mod kv_presence;
mod limits;
mod outbound;
pub mod presence;
mod private;
pub mod projects;
mod realtime_api;
mod registration;
mod registry;
mod sink;
mod sse;
mod state;
mod subscribe;
pub mod telemetry;
mod topics;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::Serialize;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subject::delivery_subject;
use walcast_bus::subs::{SubsClient, SUBJECT_RESYNC, SUBJECT_ROLL_CALL};
use walcast_bus::{Bus, BusError};

pub use auth::{AuthError, Verified, DEFAULT_PROJECT, DEFAULT_SCHEMA};
pub use broadcast::{BROADCAST_ALL, BROADCAST_PREFIX};
pub use channel::SUBSCRIBED;
pub use config::FrontConfig;
pub use conn::{CLOSE_GOING_AWAY, CLOSE_TOO_BIG};
pub use kv_presence::{KvPresence, DEFAULT_PRESENCE_TTL, PRESENCE_BUCKET};
pub use outbound::{CLOSE_SLOW_CONSUMER, REASON_SLOW_CONSUMER};
pub use presence::{MemoryPresence, PresenceDiff, PresenceMeta, PresenceStore, RemoteDiffs};
pub use projects::{DirectoryConfig, Projects};
pub use realtime_api::API_ERRORS;
pub use topics::TopicKey;

use state::Shared;

/// A running front. Cheap to clone.
#[derive(Clone)]
pub struct Front {
    shared: Arc<Shared>,
}

/// `GET /health` material.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// This front's id.
    pub front_id: String,
    /// Open WebSocket connections.
    pub connections: usize,
    /// Joined WebSocket channels.
    pub channels: usize,
    /// Open SSE streams.
    pub sse_streams: usize,
    /// Registered subscriptions (WebSocket bindings and SSE streams).
    pub subscriptions: usize,
    /// Bus kind (`nats` / `in-process`).
    pub bus: &'static str,
    /// Whether the bus is connected.
    pub bus_connected: bool,
    /// Shutting down (see [`Front::drain`]): not ready for new clients.
    pub draining: bool,
}

impl Health {
    /// The front part of this process's health beacon ([`walcast_bus::beacon`]).
    pub fn beacon(&self) -> walcast_bus::beacon::FrontBeacon {
        walcast_bus::beacon::FrontBeacon {
            connections: self.connections,
            channels: self.channels,
            sse_streams: self.sse_streams,
            subscriptions: self.subscriptions,
            draining: self.draining,
        }
    }
}

impl Front {
    /// Start with in-memory presence. See [`Front::start_with_presence`].
    pub async fn start(
        cfg: FrontConfig,
        bus: Bus,
        subs: SubsClient,
        projects: Projects,
        cancel: CancellationToken,
    ) -> Result<Front, BusError> {
        Front::start_with_presence(
            cfg,
            bus,
            subs,
            projects,
            Arc::new(MemoryPresence::default()),
            cancel,
        )
        .await
    }

    /// Subscribe to changes, broadcasts and resync requests (before returning, so no join
    /// can be answered before the front receives changes), and spawn the fan-out, relay,
    /// sync, resync and SSE reaper tasks. Everything stops when `cancel` fires; sockets
    /// are then closed with 1001.
    pub async fn start_with_presence(
        cfg: FrontConfig,
        bus: Bus,
        subs: SubsClient,
        projects: Projects,
        presence: Arc<dyn PresenceStore>,
        cancel: CancellationToken,
    ) -> Result<Front, BusError> {
        let front_id = cfg
            .front_id
            .clone()
            .unwrap_or_else(|| format!("front-{:08x}", rand::random::<u32>()));
        // Only what the worker sends this front: its subscribers' changes.
        let changes = bus.subscribe(&delivery_subject(&front_id)).await?;
        let broadcasts = bus.subscribe(BROADCAST_ALL).await?;
        let resync = bus.subscribe(SUBJECT_RESYNC).await?;
        let roll_call = bus.subscribe(SUBJECT_ROLL_CALL).await?;
        let beacons = bus.subscribe(walcast_bus::beacon::BEACON_ALL).await?;
        let tracker = TaskTracker::new();
        let remote_diffs = presence.remote_diffs();
        let (shared, background) = Shared::new(
            cfg,
            front_id,
            bus,
            subs,
            projects,
            presence,
            cancel.clone(),
            tracker.clone(),
        );
        let shared = Arc::new(shared);
        tracker.spawn(registration::background_loop(
            shared.clone(),
            background,
            cancel.clone(),
        ));
        tracker.spawn(fanout::run(shared.clone(), changes, cancel.clone()));
        tracker.spawn(broadcast::relay_loop(
            shared.clone(),
            broadcasts,
            cancel.clone(),
        ));
        tracker.spawn(registration::sync_loop(shared.clone(), cancel.clone()));
        tracker.spawn(registration::resync_loop(
            shared.clone(),
            resync,
            cancel.clone(),
        ));
        tracker.spawn(registration::roll_call_loop(
            shared.clone(),
            roll_call,
            cancel.clone(),
        ));
        if let Some(rx) = remote_diffs {
            tracker.spawn(presence::remote_loop(shared.clone(), rx, cancel.clone()));
        }
        tracker.spawn(cluster::listen(shared.clone(), beacons, cancel.clone()));
        tracker.spawn(shared.projects.clone().refresh_loop(cancel.clone()));
        tracker.spawn(sse::reaper(shared.clone(), cancel));
        tracing::info!(front = %shared.front_id, bus = shared.bus.kind(), "realtime front started");
        Ok(Front { shared })
    }

    /// The routes: `GET /realtime/v1/websocket` (also `/socket/websocket`),
    /// `GET /realtime/v1/sse`, `POST /realtime/v1/api/broadcast` and
    /// `POST /realtime/v1/api/broadcast/{topic}/events/{event}`.
    pub fn router(&self) -> axum::Router {
        http::router(self.shared.clone())
    }

    /// Counts for `/health`.
    pub fn health(&self) -> Health {
        self.shared.health()
    }

    /// Shut down gently: refuse new sockets and SSE streams (503, and `/readyz` says so),
    /// then close the open sockets one by one (1001, "server draining"), spread evenly over
    /// the first four fifths of the drain window ([`FrontConfig::drain_window`]), so their
    /// clients reconnect to other replicas a few at a time rather than all in the same
    /// second. Returns when the last is closed; cancel the front then.
    pub async fn drain(&self) {
        let s = &self.shared;
        let window = s.cfg.drain_window;
        s.draining.store(true, Ordering::Relaxed);
        let conns: Vec<Arc<outbound::ConnHandle>> = s.conns().values().cloned().collect();
        tracing::info!(
            connections = conns.len(),
            window_secs = window.as_secs_f64(),
            "draining: closing sockets over the window"
        );
        let spread = window.mul_f64(0.8);
        let start = tokio::time::Instant::now();
        let n = conns.len().max(1) as f64;
        for (i, c) in conns.iter().enumerate() {
            tokio::time::sleep_until(start + spread.mul_f64(i as f64 / n)).await;
            c.close_with(CLOSE_GOING_AWAY, "server draining");
        }
    }

    /// This front's id (subscription id prefix and `Walcast-Origin`).
    pub fn id(&self) -> &str {
        &self.shared.front_id
    }

    /// The projects (add or remove them at run time).
    pub fn projects(&self) -> &Projects {
        &self.shared.projects
    }

    /// Wait until every task and socket of this front has ended (after `cancel`).
    pub async fn closed(&self) {
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
    }
}

/// The next message of a bus subscription, or `None` once `cancel` fires or the
/// subscription ends (which is logged: `what` names it).
pub(crate) async fn next_message(
    sub: &mut walcast_bus::Subscription,
    cancel: &CancellationToken,
    what: &str,
) -> Option<walcast_bus::BusMessage> {
    use futures_util::StreamExt;
    tokio::select! {
        _ = cancel.cancelled() => None,
        m = sub.next() => {
            if m.is_none() {
                tracing::warn!("{what} subscription ended");
            }
            m
        }
    }
}
