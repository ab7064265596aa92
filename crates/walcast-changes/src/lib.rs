//! # walcast-changes
//!
//! Change streams, a consumer of the walcast pipeline beside realtime delivery and the
//! outbox: the changes of chosen tables stored in a JetStream stream, each with an id
//! stable across replays, the slot acknowledged only past what JetStream acknowledged;
//! and snapshots, a table's current rows published on its change stream consistently
//! with its changes.
//!
//! - [`consumer`]: the change-stream [`walcast_pipeline::Consumer`] and its JetStream
//!   sender ([`factory`] adds it to a pipeline);
//! - [`tables`]: which tables have a change stream (`walcast.change_stream_tables`);
//! - [`snapshot`]: the snapshot queue, the runner on the source's leader, and the admin
//!   requests about snapshots;
//! - [`config`], [`error`], [`telemetry`].

#![forbid(unsafe_code)]

pub mod config;
pub mod consumer;
pub mod error;
pub mod snapshot;
pub mod tables;
pub mod telemetry;

pub use config::ChangeStreamConfig;
pub use consumer::factory;
pub use error::ChangesError;
