//! # walcast-control
//!
//! The control plane: what a deployment is made of and who may do what, all kept in the
//! control database. Realtime delivery, change streams and the worker read it; none of it
//! depends on them.
//!
//! - [`projects`]: the project directory (tenants: a schema, keys, limits);
//! - [`sources`]: the databases walcast reads, and [`source_projects`]: which projects a
//!   source serves (what its leader may speak for);
//! - [`secrets`]: the projects' secrets and the sources' URLs, encrypted at rest;
//! - [`roles`]: which roles a token may act as; [`check_login`]: the login tenant SQL
//!   runs on, checked at start;
//! - [`manage`]: the management operations on projects (the admin protocol's requests);
//! - [`tables`]: the realtime tables, per project (which tables are streamed);
//! - [`migrate`]: walcast's SQL schema (`sql/` in this crate), applied at start;
//! - [`error`], [`telemetry`].

#![forbid(unsafe_code)]

pub mod check_login;
pub mod error;
pub mod manage;
pub mod migrate;
pub mod projects;
pub mod roles;
pub mod secrets;
pub mod source_projects;
pub mod sources;
pub mod tables;
pub mod telemetry;

pub use error::{ControlError, MigrateError, RealtimeTablesError};
pub use walcast_core::DEFAULT_PROJECT;
