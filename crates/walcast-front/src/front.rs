//! A running front ([`Front`]): its parts, made from its configuration, their tasks
//! spawned, and the routes that serve them.
//!
//! There is no state shared by everything: [`Front::start`] makes the parts and hands
//! each task and route the handles it uses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subject::delivery_subject;
use walcast_bus::subs::{SubsClient, SUBJECT_RESYNC, SUBJECT_ROLL_CALL};
use walcast_bus::{Bus, BusError, Subscription};

use crate::auth::operator::OperatorKey;
use crate::auth::private::{Policies, SourceOf};
use crate::broadcast::{self, Broadcasts, BROADCAST_ALL};
use crate::channel::websocket::Sockets;
use crate::channel::Services;
use crate::cluster::{self, Heard};
use crate::config::FrontConfig;
use crate::connection::{Connections, Topics};
use crate::http::figures::Figures;
use crate::http::health::{Health, Probe};
use crate::http::inspector::Inspector;
use crate::limits::usage::{self, ProjectUsage, Usage};
use crate::presence::{self, MemoryPresence, PresenceStore};
use crate::projects::Projects;
use crate::sse::{self, SseHub};
use crate::subscription::registration::{self, Registration};
use crate::subscription::registry::Registry;
use crate::subscription::{fanout, source_watch};
use crate::{http, management};

/// A running front. Cheap to clone.
#[derive(Clone)]
pub struct Front {
    inner: Arc<Inner>,
}

struct Inner {
    front_id: String,
    projects: Projects,
    connections: Arc<Connections>,
    probe: Arc<Probe>,
    routes: http::Routes,
    drain_window: Duration,
    tracker: TaskTracker,
}

/// The bus subscriptions of a front, taken before it starts.
struct Feeds {
    /// Only what the worker sends this front: its subscribers' changes.
    changes: Subscription,
    broadcasts: Subscription,
    resync: Subscription,
    /// The resync requests of the other sources' leaders.
    resync_others: Subscription,
    roll_call: Subscription,
    beacons: Subscription,
    /// Management notices: a project changed.
    project_notices: Subscription,
}

impl Feeds {
    async fn subscribe(bus: &Bus, front_id: &str) -> Result<Feeds, BusError> {
        Ok(Feeds {
            changes: bus.subscribe(&delivery_subject(front_id)).await?,
            broadcasts: bus.subscribe(BROADCAST_ALL).await?,
            resync: bus.subscribe(SUBJECT_RESYNC).await?,
            resync_others: bus
                .subscribe(&walcast_bus::source::every_other(SUBJECT_RESYNC))
                .await?,
            roll_call: bus.subscribe(SUBJECT_ROLL_CALL).await?,
            beacons: bus.subscribe(walcast_bus::beacon::BEACON_ALL).await?,
            project_notices: bus.subscribe(management::SUBJECT_PROJECTS_CHANGED).await?,
        })
    }
}

/// The queue of background registrations (see [`registration::background_loop`]).
type Background = tokio::sync::mpsc::Receiver<registration::Background>;

/// The parts of a front, made from its configuration; [`Parts::spawn`] starts their tasks.
struct Parts {
    cfg: FrontConfig,
    front_id: String,
    projects: Projects,
    registry: Arc<Registry>,
    topics: Arc<Topics>,
    connections: Arc<Connections>,
    registration: Arc<Registration>,
    broadcasts: Arc<Broadcasts>,
    heard: Arc<Heard>,
    usage: Arc<Usage>,
    sse: Arc<SseHub>,
    probe: Arc<Probe>,
    services: Arc<Services>,
    tracker: TaskTracker,
    cancel: CancellationToken,
}

/// Each project's own limits, as the directory knows them.
fn own_limits(projects: &Projects) -> usage::Limits {
    let projects = projects.clone();
    Arc::new(move |p: &str| projects.limits(p))
}

/// Each project's source, as the directory knows it.
fn sources_of(projects: &Projects) -> SourceOf {
    let projects = projects.clone();
    Arc::new(move |p: &str| projects.source_of(p))
}

/// The policies of private channels, and broadcast (which asks them about private
/// topics).
fn broadcasts(
    cfg: &FrontConfig,
    (front_id, bus): (&str, &Bus),
    (topics, usage): (&Arc<Topics>, &Arc<Usage>),
    projects: &Projects,
) -> (Policies, Arc<Broadcasts>) {
    let source_of = sources_of(projects);
    let policies = Policies::new(projects.admin().cloned(), source_of, cfg.register_timeout);
    let broadcasts = Broadcasts::new(
        front_id.to_string(),
        bus.clone(),
        topics.clone(),
        (policies.clone(), projects.clone()),
        cfg.max_frame_bytes,
        usage.clone(),
    );
    (policies, Arc::new(broadcasts))
}

impl Parts {
    fn new(
        cfg: FrontConfig,
        (front_id, bus, subs): (String, Bus, SubsClient),
        projects: Projects,
        presence: Arc<dyn PresenceStore>,
        cancel: CancellationToken,
    ) -> (Parts, Background) {
        let tracker = TaskTracker::new();
        let registry = Arc::new(Registry::new(&front_id));
        let topics = Arc::new(Topics::default());
        let connections = Arc::new(Connections::new(cfg.max_connections));
        let heard = Arc::new(Heard::default());
        let usage = Arc::new(Usage::new(
            front_id.clone(),
            cfg.project_defaults(),
            own_limits(&projects),
            heard.clone(),
        ));
        let (registration, background) = Registration::new(
            (front_id.clone(), subs),
            (registry.clone(), projects.clone()),
            tracker.clone(),
            &cfg,
        );
        let registration = Arc::new(registration);
        let (policies, broadcasts) =
            broadcasts(&cfg, (&front_id, &bus), (&topics, &usage), &projects);
        let sse = Arc::new(SseHub::new(
            cfg.clone(),
            projects.clone(),
            registration.clone(),
            connections.clone(),
            (usage.clone(), heard.clone()),
            cancel.clone(),
        ));
        let probe = Arc::new(Probe {
            front_id: front_id.clone(),
            bus,
            connections: connections.clone(),
            registry: registry.clone(),
            usage: usage.clone(),
        });
        let services = Arc::new(Services {
            cfg: cfg.clone(),
            front_id: front_id.clone(),
            projects: projects.clone(),
            policies,
            topics: topics.clone(),
            registration: registration.clone(),
            presence,
            broadcasts: broadcasts.clone(),
            connections: connections.clone(),
            usage: usage.clone(),
            heard: heard.clone(),
        });
        let parts = Parts {
            cfg,
            front_id,
            projects,
            registry,
            topics,
            connections,
            registration,
            broadcasts,
            heard,
            usage,
            sse,
            probe,
            services,
            tracker,
            cancel,
        };
        (parts, background)
    }

    /// Spawn the fan-out, relay, registration, presence, beacon, directory and SSE
    /// reaper tasks; the front they make.
    fn spawn(self, feeds: Feeds, background: Background) -> Front {
        let (t, cancel) = (&self.tracker, &self.cancel);
        let reg = &self.registration;
        t.spawn(registration::background_loop(
            reg.clone(),
            background,
            cancel.clone(),
        ));
        let feed = fanout::Feed {
            registry: self.registry.clone(),
            registration: reg.clone(),
            projects: self.projects.clone(),
            resend: walcast_bus::links::ResendClient::new(&self.probe.bus),
            front_id: self.front_id.clone(),
            window: self.cfg.gap_recovery,
            max_held: self.cfg.gap_max_held,
        };
        t.spawn(fanout::run(feed, feeds.changes, cancel.clone()));
        t.spawn(broadcast::link::watch(
            self.topics.clone(),
            self.probe.bus.clone(),
            cancel.clone(),
        ));
        t.spawn(broadcast::relay::run(
            self.broadcasts.clone(),
            feeds.broadcasts,
            cancel.clone(),
        ));
        t.spawn(registration::sync_loop(reg.clone(), cancel.clone()));
        for resync in [feeds.resync, feeds.resync_others] {
            t.spawn(registration::resync_loop(
                reg.clone(),
                resync,
                cancel.clone(),
            ));
        }
        t.spawn(registration::roll_call_loop(
            reg.clone(),
            feeds.roll_call,
            cancel.clone(),
        ));
        if let Some(rx) = self.services.presence.remote_diffs() {
            t.spawn(presence::remote_loop(
                (self.topics.clone(), self.usage.clone()),
                rx,
                cancel.clone(),
            ));
        }
        t.spawn(cluster::listen(
            self.heard.clone(),
            feeds.beacons,
            cancel.clone(),
        ));
        t.spawn(self.projects.clone().refresh_loop(cancel.clone()));
        t.spawn(self.projects.clone().jwks_loop(cancel.clone()));
        t.spawn(management::notice_loop(
            self.projects.clone(),
            feeds.project_notices,
            cancel.clone(),
        ));
        t.spawn(management::events_loop(
            self.projects.clone(),
            (
                self.topics.clone(),
                self.connections.clone(),
                self.sse.clone(),
            ),
            cancel.clone(),
        ));
        t.spawn(sse::reaper(self.sse.clone(), cancel.clone()));
        t.spawn(source_watch::run(
            self.registry.clone(),
            self.heard.clone(),
            cancel.clone(),
        ));
        self.into_front()
    }

    /// The front of these parts (their tasks spawned): its routes and handles.
    fn into_front(self) -> Front {
        let inspector = self.cfg.inspector.then(|| {
            Arc::new(Inspector {
                projects: self.projects.clone(),
                heard: self.heard.clone(),
                probe: self.probe.clone(),
                usage: self.usage.clone(),
            })
        });
        let management = self.cfg.management_api_key.as_deref().map(|key| {
            Arc::new(management::Management::new(
                self.projects.clone(),
                self.probe.bus.clone(),
                key,
                (self.cfg.rotation_window, self.cfg.project_defaults()),
            ))
        });
        let routes = http::Routes {
            sockets: Arc::new(Sockets {
                services: self.services,
                cancel: self.cancel.clone(),
                tracker: self.tracker.clone(),
            }),
            sse: self.sse,
            broadcasts: self.broadcasts,
            projects: self.projects.clone(),
            inspector,
            management,
            figures: Arc::new(Figures {
                key: OperatorKey::new(self.cfg.management_api_key.as_deref())
                    .with_reader(self.cfg.metrics_api_key.as_deref()),
                usage: self.usage.clone(),
            }),
            cors: self.cfg.cors.clone(),
        };
        let inner = Inner {
            front_id: self.front_id,
            projects: self.projects,
            connections: self.connections,
            probe: self.probe,
            routes,
            drain_window: self.cfg.drain_window,
            tracker: self.tracker,
        };
        Front {
            inner: Arc::new(inner),
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
        let feeds = Feeds::subscribe(&bus, &front_id).await?;
        let kind = bus.kind();
        let (parts, background) =
            Parts::new(cfg, (front_id, bus, subs), projects, presence, cancel);
        let front = parts.spawn(feeds, background);
        tracing::info!(front = %front.inner.front_id, bus = kind, "realtime front started");
        Ok(front)
    }

    /// The routes: `GET /realtime/v1/websocket` (also `/socket/websocket`),
    /// `GET /realtime/v1/sse`, `POST /realtime/v1/api/broadcast` and
    /// `POST /realtime/v1/api/broadcast/{topic}/events/{event}`.
    pub fn router(&self) -> axum::Router {
        http::router(&self.inner.routes)
    }

    /// Counts for `/health`.
    pub fn health(&self) -> Health {
        self.inner.probe.health()
    }

    /// Every project's counters on this front (served to the operator on
    /// `GET /metrics/projects`).
    pub fn usage(&self) -> BTreeMap<String, ProjectUsage> {
        self.inner.probe.usage.snapshot()
    }

    /// Shut down gently: refuse new sockets and SSE streams (503, and `/readyz` says so),
    /// then close the open sockets one by one (1001, "server draining"), spread evenly over
    /// the first four fifths of the drain window ([`FrontConfig::drain_window`]), so their
    /// clients reconnect to other replicas a few at a time rather than all in the same
    /// second. Returns when the last is closed; cancel the front then.
    pub async fn drain(&self) {
        self.inner.connections.drain(self.inner.drain_window).await;
    }

    /// This front's id (subscription id prefix and `Walcast-Origin`).
    pub fn id(&self) -> &str {
        &self.inner.front_id
    }

    /// The projects (add or remove them at run time).
    pub fn projects(&self) -> &Projects {
        &self.inner.projects
    }

    /// Wait until every task and socket of this front has ended (after `cancel`).
    pub async fn closed(&self) {
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }
}
