//! The `walcast` subcommands, one module each (the processes' runtime is
//! `walcast-worker`; the commands on the control database call `walcast-control`).

pub mod changes;
pub mod key;
pub mod migrate;
pub mod outbox;
pub mod project;
pub mod realtime;
pub mod secrets;
pub mod serve;
pub mod slot;
pub mod snapshot;
pub mod source;
pub mod tail;
