//! Binaries of walcast: `walcast` (all-in-one server and admin commands) and `cdc-worker`.

pub mod beacon;
pub mod cdc_worker;
pub mod changes;
pub mod changes_args;
pub mod commands;
pub mod config;
mod database;
mod election;
pub mod front;
pub mod http;
mod leader;
pub mod operator;
pub mod outbox;
pub mod project;
pub mod secrets;
pub mod serve;
pub mod server;
mod share;
pub mod shutdown;
pub mod slot;
pub mod snapshot;
pub mod source;
mod supervisor;
pub mod telemetry;
pub mod ws_front;
