//! # walcast-protocol
//!
//! Pure protocol logic for a server speaking the Supabase Realtime protocol to the
//! unmodified `@supabase/realtime-js` client. No IO, no async.
//!
//! - [`frame`] / [`binary`]: Phoenix frames, text serializers 1.0.0 (JSON object) and 2.0.0
//!   (JSON array), binary broadcast kinds 3 (client push) and 4 (server broadcast); [`Vsn`]
//!   from the `vsn` query parameter.
//! - [`message`] / [`join`]: typed client messages (heartbeat, join with its config and
//!   `postgres_changes` bindings, leave, access_token, broadcast, presence) and stable
//!   binding ids.
//! - [`events`]: the Phoenix event names (`phx_join`, `postgres_changes`, …).
//! - [`server`]: builders for server frames (`phx_reply`, `system`, `phx_close`,
//!   `phx_error`, presence, broadcast).
//! - [`payload`]: `postgres_changes` payloads encoded once and spliced per channel.
//! - [`filter`]: the `filter` grammar, validation against column types and evaluation.
//! - [`timestamp`]: Postgres timestamp text → RFC 3339 UTC milliseconds.
//!
//! Typical server flow:
//!
//! ```
//! use walcast_protocol::{ClientMessage, Frame, Vsn, server};
//!
//! let vsn = Vsn::from_query(Some("2.0.0")).unwrap();
//! let frame = Frame::decode_text(r#"[null,"7","phoenix","heartbeat",{}]"#, vsn).unwrap();
//! assert_eq!(ClientMessage::parse(&frame).unwrap(), ClientMessage::Heartbeat);
//! let reply = server::reply_ok(None, frame.ref_.as_deref(), &frame.topic, None);
//! assert_eq!(
//!     reply.encode_text(vsn).unwrap(),
//!     r#"[null,"7","phoenix","phx_reply",{"status":"ok","response":{}}]"#
//! );
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod events;
pub mod filter;
pub mod frame;
pub mod join;
mod json;
pub mod message;
pub mod payload;
pub mod server;
pub use walcast_core::timestamp;
pub mod values;
pub mod vsn;

pub use filter::{ColumnText, EvalError, Filter, FilterError, RecordView, SliceRecord};
pub use frame::binary::{self, BinaryError};
pub use frame::{
    BroadcastBody, DecodeError, EncodeError, Frame, Payload, UserBroadcast, WireMessage,
};
pub use join::{
    binding_id, BindingError, BroadcastConfig, EventFilter, JoinConfig, PgChangeBinding,
    PresenceConfig, Replay, REPLAY_MAX,
};
pub use message::{
    channel_name, BroadcastPush, ClientMessage, JoinRequest, MessageError, PresenceAction,
};
pub use payload::{ChangeData, ChangeType, Column, ColumnValue, EncodedChange};
pub use server::SystemStatus;
pub use timestamp::{pg_to_rfc3339_millis, TimestampError};
pub use vsn::{Vsn, VsnError};

/// Re-export of the raw JSON type used for payloads.
pub use serde_json::value::RawValue;
