//! What the management API sets on a project besides its keys — suspended, private-only,
//! the end of a rotated secret's window — and the events a directory refresh emits when
//! it sees one change: the project deleted, suspended, or made private-only, so the
//! front ends the sockets (or public channels) that may no longer stay.

use crate::keys::ProjectKeys;

/// A stored project's switches.
#[derive(Clone, Default)]
pub(crate) struct Status {
    /// New sockets and joins refused (`RealtimeDisabledForTenant`).
    pub suspended: bool,
    /// Public channels refused (`PrivateOnly`).
    pub private_only: bool,
    /// After a rotation: the keys without the previous secret, used from this Unix
    /// time (ms) on.
    pub rotated: Option<(ProjectKeys, i64)>,
}

/// Why a project's sockets (or public channels) end on this front.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProjectEvent {
    /// Deleted: every socket ends.
    Deleted(String),
    /// Suspended: every socket ends.
    Suspended(String),
    /// Now private-only: the sockets with a public channel end.
    PrivateOnly(String),
}

impl ProjectEvent {
    /// The project.
    pub fn project(&self) -> &str {
        match self {
            ProjectEvent::Deleted(p)
            | ProjectEvent::Suspended(p)
            | ProjectEvent::PrivateOnly(p) => p,
        }
    }

    /// The `system` message's text (`<Code>: <text>`, Supabase's codes).
    pub fn message(&self) -> &'static str {
        match self {
            ProjectEvent::Deleted(_) => "TenantNotFound: this project was deleted",
            ProjectEvent::Suspended(_) => SUSPENDED_MESSAGE,
            ProjectEvent::PrivateOnly(_) => PRIVATE_ONLY_MESSAGE,
        }
    }

    /// Only the public channels end.
    pub fn public_only(&self) -> bool {
        matches!(self, ProjectEvent::PrivateOnly(_))
    }
}

/// Supabase's text for a suspended tenant.
pub const SUSPENDED_MESSAGE: &str = "RealtimeDisabledForTenant: Realtime disabled for this tenant";
/// Supabase's text for a public channel of a private-only tenant.
pub const PRIVATE_ONLY_MESSAGE: &str = "PrivateOnly: This project only allows private channels";

/// What changed between two views of one project (`new` `None`: gone).
pub(crate) fn events(id: &str, old: &Status, new: Option<&Status>) -> Option<ProjectEvent> {
    match new {
        None => Some(ProjectEvent::Deleted(id.to_string())),
        Some(n) if n.suspended && !old.suspended => Some(ProjectEvent::Suspended(id.to_string())),
        Some(n) if n.private_only && !old.private_only => {
            Some(ProjectEvent::PrivateOnly(id.to_string()))
        }
        Some(_) => None,
    }
}

/// Now, Unix ms.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
