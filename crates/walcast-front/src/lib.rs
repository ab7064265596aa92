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
//! ## Layout: each part owns its state
//!
//! There is no state shared by everything: [`Front::start`] makes the parts below and
//! hands each task and route the handles it uses. Modules depend downward only: no
//! module imports one that imports it back.
//!
//! | module | owns / does |
//! |---|---|
//! | `delivery` | `Delivery`: the `registry` (subscription → sink) and the `topics` (topic → channels) |
//! | `connections` | `Connections`: the sockets' handles, the connection/channel/SSE counts, the `max_connections` slots, draining, the id counter |
//! | [`cluster`] | the processes heard from (their health beacons), for the inspector |
//! | `registration` | `Registrar`: the talk with the cdc-worker about subscriptions (register, unregister, background queue, sync, resync, roll call, subs-ended notices) |
//! | `subscribe` | a transport's subscription: verify the subscriber, register its bindings |
//! | `fanout`, `sequence` | the delivery subject's reader: changes to their sinks, in the leader's order, gaps recovered or reported |
//! | `bus_link` | after a NATS loss: every channel told broadcasts may have been missed |
//! | `guards`, `encode` | the term and replay guards of the change stream; a change's `data`, encoded once |
//! | `sink`, `outbound`, `topics`, `registry` | where changes go; a connection's bounded queue and a channel's gate; channels by topic; subscriptions by number and class |
//! | `channel` | a connection's `Session` (its channels) and the `Services` its commands use; one module per Phoenix command: `join`, `leave`, `access_token`, `broadcast`, `presence` |
//! | `conn`, `socket` | a WebSocket connection's read loop; the upgrade, the socket's two halves (tungstenite reads; our writer writes frames encoded once for every socket, `wire`) |
//! | `sse` | `SseHub`: the SSE streams (`stream`), their events (`events`), the route |
//! | `broadcast` | `Broadcasts`: local delivery, the relay between fronts, the REST API |
//! | [`presence`], [`kv_presence`] | presence stores (per front, or JetStream KV) and their diffs |
//! | `private` | `Policies`: the app's policies for private channels, asked of the worker |
//! | [`projects`], [`auth`], [`keys`], `credentials` | the project directory, token verification, keys, where a request's credentials are |
//! | [`usage`], `rates` | per-project counters (users, channels, joins, messages and bytes in and out, refusals, rates over the last second) and the per-project limits, summed across fronts from their beacons |
//! | `source_watch` | subscribed clients told when their project's source stops streaming, and when it streams again |
//! | `health`, `inspector`, `realtime_api` | the counts of `/health`; the inspector page and its health API; the per-table realtime REST API |
//! | [`management`] | the management API (operator key): projects created, updated, suspended, rotated, deleted; the notices that refresh every front's directory, and the ending of the sockets a project change no longer allows |
//! | `http`, `reply`, `listen`, `limits`, [`telemetry`], [`config`] | the routes (one sub-router per part); HTTP error answers; reading a bus subscription; rate limits; metric names; configuration |
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
//!
//! Any server works; the sockets write fastest when the upgrade yields the `TcpStream`
//! itself, as the `walcast` binaries' own accept loop (`walcast_worker::http::serve`) does and
//! `axum::serve` does not.

#![forbid(unsafe_code)]

pub mod auth;
mod broadcast;
mod bus_link;
mod channel;
pub mod cluster;
pub mod config;
mod conn;
mod connections;
mod credentials;
mod delivery;
mod encode;
mod fanout;
mod guards;
mod health;
mod http;
mod inspector;
pub mod keys;
pub mod kv_presence;
mod limits;
mod listen;
pub mod management;
pub mod operator;
mod outbound;
pub mod presence;
mod private;
pub mod projects;
pub mod rates;
mod realtime_api;
mod registration;
mod registry;
mod reply;
mod sequence;
mod sink;
mod socket;
mod source_watch;
mod sse;
mod subscribe;
pub mod telemetry;
mod topics;
pub mod usage;

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use walcast_bus::subject::delivery_subject;
use walcast_bus::subs::{SubsClient, SUBJECT_RESYNC, SUBJECT_ROLL_CALL};
use walcast_bus::{Bus, BusError, Subscription};

pub use auth::{AuthError, Verified, DEFAULT_PROJECT, DEFAULT_SCHEMA};
pub use broadcast::{BROADCAST_ALL, BROADCAST_PREFIX};
pub use channel::SUBSCRIBED;
pub use config::FrontConfig;
pub use health::Health;
pub use kv_presence::{KvPresence, DEFAULT_PRESENCE_TTL, PRESENCE_BUCKET};
pub use outbound::{CLOSE_GOING_AWAY, CLOSE_SLOW_CONSUMER, CLOSE_TOO_BIG, REASON_SLOW_CONSUMER};
pub use presence::{MemoryPresence, PresenceDiff, PresenceMeta, PresenceStore, RemoteDiffs};
pub use projects::{DirectoryConfig, Projects};
pub use socket::SOCKET_READ_BUFFER;
pub use telemetry::API_ERRORS;
pub use topics::TopicKey;

use broadcast::Broadcasts;
use channel::Services;
use cluster::Heard;
use conn::Sockets;
use connections::Connections;
use delivery::Delivery;
use health::Probe;
use inspector::Inspector;
use private::Policies;
use registration::Registrar;
use sse::SseHub;
use usage::Usage;

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
    delivery: Arc<Delivery>,
    connections: Arc<Connections>,
    registrar: Arc<Registrar>,
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

impl Parts {
    fn new(
        cfg: FrontConfig,
        (front_id, bus, subs): (String, Bus, SubsClient),
        projects: Projects,
        presence: Arc<dyn PresenceStore>,
        cancel: CancellationToken,
    ) -> (Parts, Background) {
        let tracker = TaskTracker::new();
        let delivery = Arc::new(Delivery::new(&front_id));
        let connections = Arc::new(Connections::new(cfg.max_connections));
        let heard = Arc::new(Heard::default());
        let usage = Arc::new(Usage::new(
            front_id.clone(),
            cfg.project_defaults(),
            own_limits(&projects),
            heard.clone(),
        ));
        let (registrar, background) = Registrar::new(
            (front_id.clone(), subs),
            (delivery.clone(), projects.clone()),
            tracker.clone(),
            &cfg,
        );
        let registrar = Arc::new(registrar);
        let policies = Policies::new(projects.clone(), cfg.register_timeout);
        let broadcasts = Arc::new(Broadcasts::new(
            front_id.clone(),
            bus.clone(),
            delivery.clone(),
            (policies.clone(), projects.clone()),
            cfg.max_frame_bytes,
            usage.clone(),
        ));
        let sse = Arc::new(SseHub::new(
            cfg.clone(),
            projects.clone(),
            registrar.clone(),
            connections.clone(),
            (usage.clone(), heard.clone()),
            cancel.clone(),
        ));
        let probe = Arc::new(Probe {
            front_id: front_id.clone(),
            bus,
            connections: connections.clone(),
            delivery: delivery.clone(),
            usage: usage.clone(),
        });
        let services = Arc::new(Services {
            cfg: cfg.clone(),
            front_id: front_id.clone(),
            projects: projects.clone(),
            policies,
            delivery: delivery.clone(),
            registrar: registrar.clone(),
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
            delivery,
            connections,
            registrar,
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
        let reg = &self.registrar;
        t.spawn(registration::background_loop(
            reg.clone(),
            background,
            cancel.clone(),
        ));
        let feed = fanout::Feed {
            delivery: self.delivery.clone(),
            registrar: reg.clone(),
            projects: self.projects.clone(),
            resend: walcast_bus::links::ResendClient::new(&self.probe.bus),
            front_id: self.front_id.clone(),
            window: self.cfg.gap_recovery,
            max_held: self.cfg.gap_max_held,
        };
        t.spawn(fanout::run(feed, feeds.changes, cancel.clone()));
        t.spawn(bus_link::watch(
            self.delivery.clone(),
            self.probe.bus.clone(),
            cancel.clone(),
        ));
        t.spawn(broadcast::relay_loop(
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
                (self.delivery.clone(), self.usage.clone()),
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
        t.spawn(management::notice_loop(
            self.projects.clone(),
            feeds.project_notices,
            cancel.clone(),
        ));
        t.spawn(management::events_loop(
            self.projects.clone(),
            (
                self.delivery.clone(),
                self.connections.clone(),
                self.sse.clone(),
            ),
            cancel.clone(),
        ));
        t.spawn(sse::reaper(self.sse.clone(), cancel.clone()));
        t.spawn(source_watch::run(
            self.delivery.clone(),
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
            figures: Arc::new(operator::Figures {
                key: operator::OperatorKey::new(self.cfg.management_api_key.as_deref())
                    .with_reader(self.cfg.metrics_api_key.as_deref()),
                usage: self.usage.clone(),
            }),
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
    pub fn usage(&self) -> std::collections::BTreeMap<String, usage::ProjectUsage> {
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
