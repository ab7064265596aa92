//! State shared by every connection and task of a front.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subs::SubsClient;
use walcast_bus::Bus;

use crate::config::FrontConfig;
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
    ) -> Shared {
        Shared {
            registry: Registry::new(&front_id),
            cfg,
            front_id,
            bus,
            subs,
            projects,
            topics: Topics::default(),
            presence,
            sse: SseHub::default(),
            cancel,
            tracker,
            connections: AtomicUsize::new(0),
            channels: AtomicUsize::new(0),
            sse_streams: AtomicUsize::new(0),
            next_id: AtomicU64::new(1),
        }
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
