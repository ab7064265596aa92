//! # walcast-pipeline
//!
//! The path from a Postgres logical replication slot (wal2json) to whatever consumes the
//! changes, which never acknowledges a transaction before every consumer has put all of
//! it where it goes. It knows nothing of what the consumers do: realtime delivery
//! (`walcast-realtime`) and the outbox relay (`walcast-outbox`) are plug-ins, each a
//! [`Consumer`] made per session by a [`ConsumerFactory`].
//!
//! One session (see [`run`]):
//! - [`preflight`] checks the server, [`slot`] creates or recovers the slot;
//! - a [`source::Source`] ([`source::Poller`] or [`source::Streamer`]) only reads wal2json
//!   lines and "caught up to LSN", and acknowledges what it is told;
//! - the [`driver::Driver`] reads lines as steps of transactions ([`txn`]), verifies
//!   `walcast.*` logical messages ([`signed`]), hands every item to every consumer, and
//!   owns the control logic: the decoding filter (the union of the consumers' tables),
//!   timers, [`health`], fence checks, and "every consumer's barrier, then acknowledge";
//! - each consumer publishes only through its [`Publisher`], which checks the leadership
//!   term's fence before every message and stamps it with origin, term and position;
//! - beside the session, the [`heartbeat`] (when on) writes a logical message on the
//!   source database at each interval, for the term only.
//!
//! Consumers that publish changes share [`change_event`]: a decoded row as the bus's
//! `ChangeEvent`, fitted to what one message carries.
//!
//! Adding a consumer: implement [`Consumer`] (and [`ConsumerFactory`], or wrap a closure
//! with [`factory`]) and pass it to [`run`]; `tests/pipeline/main.rs` is a complete example.

#![forbid(unsafe_code)]

pub mod change_event;
pub mod config;
pub mod consumer;
pub mod driver;
pub mod error;
pub mod health;
pub mod heartbeat;
pub mod jetstream;
pub mod preflight;
pub mod publisher;
mod run;
pub mod signed;
pub mod slot;
pub mod source;
pub mod telemetry;
#[cfg(feature = "testing")]
pub mod testing;
pub mod txn;

pub use config::PipelineConfig;
pub use consumer::{Consumer, Handled, Item, Refresh};
pub use error::{BoxError, ConsumerError, DecodeError, PipelineError, Retry};
pub use health::{PipelineHealth, PipelineHealthReport, SkippedChange, SnapshotProgress};
pub use preflight::PreflightError;
pub use publisher::{JetStreamPublisher, Position, PublishError, Publisher};
pub use run::{connect, factory, run, ConsumerFactory, Session};
pub use source::{ReadConfig, SourceKind};
pub use txn::TxnContext;
