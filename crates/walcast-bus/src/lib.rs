//! The bus between the cdc-worker and the fronts.
//!
//! * [`subject`]: the NATS subject of a change. Every identifier (project, schema, table),
//!   whatever it contains, maps to a valid subject token and back. The worker sends each
//!   front the changes for its subscribers on [`subject::delivery_subject`] (with the
//!   audience: class keys and subscription ids, see [`ChangeEvent::subs`]), and every
//!   change without an audience on [`subject::change_subject`]. Messages are bounded:
//!   a large audience is split into parts ([`ChangeEvent::split`]), a large row loses its
//!   large values with Supabase's `Error 413` ([`ChangeEvent::shrink_to`]).
//! * [`event`]: the JSON change event published for every row change.
//! * [`Bus`]: publish, barrier and subscribe over core NATS or in process.
//! * [`subs`] and [`admin`]: request/reply between the fronts and the cdc-worker;
//!   [`resync`]: how a new leader learns every front's subscriptions.
//! * [`links`]: what keeps the delivery subjects whole: a per-front sequence number on
//!   every message ([`HEADER_FRONT_SEQ`]), heartbeats, and a front's resend requests.

pub mod admin;
pub mod beacon;
pub mod broadcast;
mod bus;
pub mod class;
mod error;
pub mod event;
pub mod links;
mod local;
mod nats;
pub mod resync;
pub mod source;
mod spec;
pub mod subject;
pub mod subs;

pub use bus::{Bus, BusMessage, Headers, Subscription};
pub use error::{BarrierError, BusError, Retry};
pub use event::{ChangeEvent, ChangeKind, ColumnInfo, Restriction};
pub use nats::{LinkEvents, NatsAuth, INBOX_PREFIX};

/// Header naming the instance that published a message (a replica ignores its own).
pub const HEADER_ORIGIN: &str = "Walcast-Origin";
/// Header with the publishing leader's term (its lease's fencing number, `0` without
/// election): fronts drop a message of a lower term than one they already received, so a
/// leader that wakes up after losing its lease reaches no client even with a message it
/// had already handed to its NATS connection.
pub const HEADER_TERM: &str = "Walcast-Term";
/// Header on a broadcast (value `1`) that a client sent as a binary push (kind 3): fronts
/// frame it as binary kind 4 for their 2.0.0 sockets, as Supabase does; a broadcast without
/// it came as JSON (a JSON push, the REST API, the database) and goes to them as a text
/// frame unless its body is raw bytes.
pub const HEADER_PUSHED: &str = "Walcast-Pushed";
/// Header with the commit LSN of the transaction a change belongs to.
pub const HEADER_LSN: &str = "Walcast-Lsn";
/// Header with the position of the change inside its transaction (0-based).
pub const HEADER_SEQ: &str = "Walcast-Seq";
/// Header marking a delivery-subject message that is not a change: its value names what
/// it is (see [`subs::NOTICE_SUBS_ENDED`]). A message without it is a change.
pub const HEADER_NOTICE: &str = "Walcast-Notice";
/// Header with a delivery-subject message's number in its front's stream (1, 2, 3 … per
/// front, per leader term and process, see [`links`]): a front that sees a number jump
/// knows what it missed and asks for it again. On a heartbeat it is the last number sent.
pub const HEADER_FRONT_SEQ: &str = "Walcast-Front-Seq";
/// Header marking a delivery-subject message sent again at a front's request (its
/// [`HEADER_FRONT_SEQ`] is the original number).
pub const HEADER_RESENT: &str = "Walcast-Resent";
