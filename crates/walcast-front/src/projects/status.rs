//! What the management API sets on a project besides its keys — suspended, private-only,
//! the end of a rotated secret's window, its own limits — and the events a directory
//! refresh emits when it sees one change: the project deleted, suspended, or made
//! private-only, so the front ends the sockets (or public channels) that may no longer
//! stay; or its keys changed (a rotation, its window's end), so the front checks every
//! session's token again and ends those no key accepts any more.

use walcast_bus::admin::ProjectLimits;

use crate::auth::keys::ProjectKeys;

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
    /// Its own limits (each `None`: this front's default, e.g. `PROJECT_MAX_USERS`).
    /// Lowering one ends no socket: only what comes after is refused.
    pub limits: ProjectLimits,
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
    /// Its keys changed (a secret rotated, a rotation's window ended, its JWKS replaced):
    /// each session's token is verified again, and the sessions it fails end.
    KeysChanged(String),
}

impl ProjectEvent {
    /// The project.
    pub fn project(&self) -> &str {
        match self {
            ProjectEvent::Deleted(p)
            | ProjectEvent::Suspended(p)
            | ProjectEvent::PrivateOnly(p)
            | ProjectEvent::KeysChanged(p) => p,
        }
    }

    /// The `system` message's text (`<Code>: <text>`, Supabase's codes).
    pub fn message(&self) -> &'static str {
        match self {
            ProjectEvent::Deleted(_) => "TenantNotFound: this project was deleted",
            ProjectEvent::Suspended(_) => SUSPENDED_MESSAGE,
            ProjectEvent::PrivateOnly(_) => PRIVATE_ONLY_MESSAGE,
            // Each session ending is told why its own token failed.
            ProjectEvent::KeysChanged(_) => "the project's keys changed",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refresh_reports_what_ends_sockets_and_nothing_else() {
        let plain = Status::default();
        let suspended = Status {
            suspended: true,
            ..Status::default()
        };
        let private = Status {
            private_only: true,
            ..Status::default()
        };
        let ev = |old: &Status, new: Option<&Status>| events("p", old, new);
        assert_eq!(ev(&plain, None), Some(ProjectEvent::Deleted("p".into())));
        assert_eq!(
            ev(&plain, Some(&suspended)),
            Some(ProjectEvent::Suspended("p".into()))
        );
        assert_eq!(
            ev(&plain, Some(&private)),
            Some(ProjectEvent::PrivateOnly("p".into()))
        );
        // Already so, or undone: nothing ends.
        assert_eq!(ev(&suspended, Some(&suspended)), None);
        assert_eq!(ev(&private, Some(&private)), None);
        assert_eq!(ev(&suspended, Some(&plain)), None);
        assert_eq!(ev(&plain, Some(&plain)), None);
        let e = ProjectEvent::PrivateOnly("p".into());
        assert!(e.public_only());
        assert_eq!(e.message(), PRIVATE_ONLY_MESSAGE);
        assert!(!ProjectEvent::Suspended("p".into()).public_only());
        // Close reasons must fit a WebSocket close frame (123 bytes).
        for e in [
            ProjectEvent::Deleted("p".into()),
            ProjectEvent::Suspended("p".into()),
            e,
        ] {
            assert!(e.message().len() <= 123, "{e:?}");
        }
    }
}
