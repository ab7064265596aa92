//! Phoenix event names of the Realtime protocol.

/// Client heartbeat (topic `phoenix`).
pub const HEARTBEAT: &str = "heartbeat";
/// Channel join.
pub const JOIN: &str = "phx_join";
/// Channel leave.
pub const LEAVE: &str = "phx_leave";
/// Reply to a push.
pub const REPLY: &str = "phx_reply";
/// Channel closed normally.
pub const CLOSE: &str = "phx_close";
/// Channel crashed.
pub const ERROR: &str = "phx_error";
/// Token refresh.
pub const ACCESS_TOKEN: &str = "access_token";
/// User broadcast.
pub const BROADCAST: &str = "broadcast";
/// Presence track/untrack.
pub const PRESENCE: &str = "presence";
/// Full presence state.
pub const PRESENCE_STATE: &str = "presence_state";
/// Presence joins/leaves.
pub const PRESENCE_DIFF: &str = "presence_diff";
/// Database change delivery.
pub const POSTGRES_CHANGES: &str = "postgres_changes";
/// Server notices.
pub const SYSTEM: &str = "system";
