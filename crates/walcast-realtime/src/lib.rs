//! # walcast-realtime
//!
//! Realtime delivery, a plug-in of the pipeline (`walcast-pipeline`): what turns decoded
//! transactions into the `postgres_changes` and broadcasts the fronts deliver, and the
//! worker's side of the fronts' requests.
//!
//! - [`session`]: the [`walcast_pipeline::ConsumerFactory`]s it adds to a pipeline;
//! - [`delivery`]: the realtime consumer (realtime-tables edits at their WAL position, routing
//!   to a project, events, matching, authorization, publishing, DDL notices) and
//!   database broadcast;
//! - [`subscriptions`]: what the fronts register, validated, matched per change;
//! - [`authorize`]: who may see which change and which of its columns (privileges and
//!   row-level security, checked as each subscriber), and private channels;
//! - [`catalog`]: the realtime tables, types, and the catalog facts at a WAL position;
//! - [`admin`], [`projects`], [`roles`]: the fronts' admin requests, the project
//!   directory, which roles a token may act as;
//! - [`check_login`]: the login tenant SQL runs on, checked at start;
//! - [`sources`]: the sources registry (the databases walcast reads);
//! - [`secrets`]: the projects' secrets and the sources' URLs, encrypted at rest;
//! - [`migrate`]: walcast's SQL schema; [`config`], [`error`], [`telemetry`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod authorize;
pub mod catalog;
pub mod check_login;
pub mod config;
pub mod delivery;
pub mod error;
pub mod manage;
pub mod migrate;
pub mod projects;
pub mod roles;
pub mod secrets;
pub mod session;
pub mod snapshot;
pub mod source_projects;
pub mod sources;
pub mod subscriptions;
pub mod telemetry;

pub use config::{
    LaneLimits, LinkOptions, RealtimeConfig, RlsMode, RlsOptions, DEFAULT_MAX_LAG_BYTES,
    DEFAULT_MAX_LAG_MS, DEFAULT_MAX_RECORD_BYTES, DEFAULT_RESEND_BYTES, DEFAULT_RESEND_MESSAGES,
    DEFAULT_RESEND_SECS, DEFAULT_RLS_BATCH, DEFAULT_RLS_CHECK_TIMEOUT_MS, DEFAULT_RLS_CONNECTIONS,
    DEFAULT_SHARDS,
};
pub use delivery::links::FrontLinks;
pub use error::RealtimeError;
pub use session::factories;
pub use subscriptions::matcher::Matcher;
