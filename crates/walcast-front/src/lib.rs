//! # walcast-front
//!
//! The realtime front: serves the Supabase Realtime protocol over WebSocket (so the
//! unmodified `@supabase/realtime-js` works), `postgres_changes` over SSE, and the
//! broadcast REST API.
//!
//! * Join means subscribed: a join's bindings are registered with the cdc-worker (through
//!   [`walcast_bus::subs::SubsClient`]) before the join reply is sent.
//! * Fan-out: the worker puts the ids of the subscriptions a change matched into the
//!   event; the front encodes the change once and sends one frame per channel into each
//!   connection's bounded queue. A connection that cannot keep up is closed (1013).
//! * Broadcast is relayed between fronts over the bus; presence is behind
//!   [`PresenceStore`]: per front ([`MemoryPresence`]) or shared through JetStream KV
//!   ([`KvPresence`]).
//!
//! ## Layout: one module per idea
//!
//! There is no state shared by everything: [`Front::start`] makes the parts and hands
//! each task and route the handles it uses. Modules depend downward only (in the order
//! below, roughly): no module imports one that imports it back.
//!
//! | module | the idea |
//! |---|---|
//! | [`config`], [`telemetry`] | configuration (every limit and timeout, each default once); every metric name |
//! | [`cors`] | which origins' pages may read the browser routes' answers, parsed and as a layer |
//! | `reply` | the HTTP error answers every route shares |
//! | [`cluster`] | the walcast processes this front hears from (their health beacons); reading a bus subscription until the front stops |
//! | [`auth`] | who may do what: tokens and the keys that verify them, where a request's credentials are, private channels, the operator's keys |
//! | [`projects`] | the project directory: each project's schema, source, keys and status, learnt from the cdc-worker |
//! | [`limits`] | per-project usage and limits across the fronts, their rates, a socket's token buckets |
//! | `connection` | a WebSocket connection beneath its channels: the socket and its writer, its bounded queue, each channel's gate, the channels by topic, the open connections and their slots |
//! | `subscription` | `postgres_changes`: a transport subscribes, the registry (subscription → sink), the registration with the cdc-worker, the fan-out of the delivery subject (in the leader's order, gaps recovered or reported), a source that stops streaming |
//! | [`presence`] | presence stores (per front, or shared through JetStream KV), their limits and diffs |
//! | `broadcast` | local delivery, the relay between fronts, the REST API, the NATS link's losses |
//! | `channel` | the WebSocket route and a connection's channels: one module per Phoenix command (`join`, `leave`, `access_token`, `send`, `track`) |
//! | `sse` | `postgres_changes` over server-sent events, resumable, with snapshots |
//! | [`management`] | the management API (operator key): projects created, updated, suspended, rotated, deleted, their snapshots; what a project change ends on this front |
//! | `http` | the routes (one sub-router per part), `/health`'s counts, the realtime REST API, the inspector, the operator's figures |
//! | `front` | [`Front`]: the parts made, their tasks spawned |
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
mod channel;
pub mod cluster;
pub mod config;
mod connection;
pub mod cors;
pub use cors::{CorsConfig, CorsError, CorsOrigins};
mod front;
mod http;
pub mod limits;
pub mod management;
pub mod presence;
pub mod projects;
mod reply;
mod sse;
mod subscription;
pub mod telemetry;

pub use auth::{AuthError, Verified, DEFAULT_PROJECT, DEFAULT_SCHEMA};
pub use broadcast::{BROADCAST_ALL, BROADCAST_PREFIX};
pub use channel::SUBSCRIBED;
pub use config::FrontConfig;
pub use connection::{
    TopicKey, CLOSE_GOING_AWAY, CLOSE_SLOW_CONSUMER, CLOSE_TOO_BIG, REASON_SLOW_CONSUMER,
    SOCKET_READ_BUFFER,
};
pub use front::Front;
pub use http::health::Health;
pub use presence::{
    KvPresence, MemoryPresence, PresenceDiff, PresenceMeta, PresenceStore, RemoteDiffs,
    DEFAULT_PRESENCE_TTL, PRESENCE_BUCKET,
};
pub use projects::{DirectoryConfig, Projects};
pub use telemetry::API_ERRORS;

/// The paths the binaries name: the keys of a project (`walcast project`) and the
/// operator's keys (`/metrics`, `/health`).
pub use auth::{keys, operator, remote_jwks};
