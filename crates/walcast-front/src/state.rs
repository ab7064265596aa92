//! State shared by every connection and task of a front.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subs::SubsClient;
use walcast_bus::Bus;

use crate::cluster::Cluster;
use crate::config::FrontConfig;
use crate::outbound::ConnHandle;
use crate::presence::PresenceStore;
use crate::projects::Projects;
use crate::registry::Registry;
use crate::sse::SseHub;
use crate::topics::Topics;

pub(crate) struct Shared {
    pub cfg: FrontConfig,
    pub front_id: String,
    pub bus: Bus,
    pub subs: SubsClient,
    pub projects: Projects,
    pub registry: Registry,
    pub topics: Topics,
    pub presence: Arc<dyn PresenceStore>,
    pub sse: SseHub,
    pub cancel: CancellationToken,
    pub tracker: TaskTracker,
    pub connections: AtomicUsize,
    pub channels: AtomicUsize,
    pub sse_streams: AtomicUsize,
    /// Shutting down: new sockets and streams are refused, open ones are being closed.
    pub draining: AtomicBool,
    /// Open WebSocket connections, to close them one by one when draining.
    pub conns: Mutex<HashMap<u64, Arc<ConnHandle>>>,
    /// Joined subscriptions to register with the worker in the background (see
    /// [`crate::registration::background_loop`]).
    pub background: tokio::sync::mpsc::Sender<crate::registration::Background>,
    /// The other walcast processes' health beacons (the inspector's health panel).
    cluster: Mutex<Cluster>,
    next_id: AtomicU64,
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        cfg: FrontConfig,
        front_id: String,
        bus: Bus,
        subs: SubsClient,
        projects: Projects,
        presence: Arc<dyn PresenceStore>,
        cancel: CancellationToken,
        tracker: TaskTracker,
    ) -> (
        Shared,
        tokio::sync::mpsc::Receiver<crate::registration::Background>,
    ) {
        let (background, queue) = tokio::sync::mpsc::channel(crate::registration::BACKGROUND_QUEUE);
        let sse = SseHub::new(cfg.join_burst, cfg.joins_per_second);
        let shared = Shared {
            background,
            registry: Registry::new(&front_id),
            cfg,
            front_id,
            bus,
            subs,
            projects,
            topics: Topics::default(),
            presence,
            sse,
            cancel,
            tracker,
            connections: AtomicUsize::new(0),
            channels: AtomicUsize::new(0),
            sse_streams: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            conns: Mutex::default(),
            cluster: Mutex::default(),
            next_id: AtomicU64::new(1),
        };
        (shared, queue)
    }

    pub(crate) fn health(&self) -> crate::Health {
        crate::Health {
            front_id: self.front_id.clone(),
            connections: self.connections.load(Ordering::Relaxed),
            channels: self.channels.load(Ordering::Relaxed),
            sse_streams: self.sse_streams.load(Ordering::Relaxed),
            subscriptions: self.registry.len(),
            bus: self.bus.kind(),
            bus_connected: self.bus.is_connected(),
            draining: self.is_draining(),
        }
    }

    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub(crate) fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnHandle>>> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn cluster(&self) -> std::sync::MutexGuard<'_, Cluster> {
        self.cluster.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A front-unique id for a connection or channel.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

/// `{}` as a raw JSON value.
pub(crate) fn empty_object() -> Box<RawValue> {
    serde_json::value::to_raw_value(&serde_json::Map::new())
        .unwrap_or_else(|_| RawValue::NULL.to_owned())
}
