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
//! - [`catalog`]: the catalog facts at a WAL position (the realtime tables themselves
//!   are the control plane's, `walcast_control::tables`);
//! - [`admin`]: the worker's side of the fronts' admin requests;
//! - [`config`], [`error`], [`telemetry`].

#![forbid(unsafe_code)]

pub mod admin;
pub mod authorize;
pub mod catalog;
pub mod config;
pub mod delivery;
pub mod error;
pub mod session;
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
