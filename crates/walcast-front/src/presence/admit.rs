//! The limits of presence events: a payload's size, a socket's rate, its project's
//! presence, messages and bytes rates ([`admit`]).

use walcast_protocol::PresenceAction;

use crate::limits::rates::Rate;
use crate::limits::usage::Usage;
use crate::limits::TokenBucket;

/// Presence events (track, untrack) a socket may send per second, after a burst of
/// [`EVENTS_BURST`]: each one is a KV write shared by every front.
pub(crate) const EVENTS_PER_SECOND: u32 = 10;
pub(crate) const EVENTS_BURST: u32 = 20;
/// The largest presence payload (its JSON), stored per presence in the KV bucket and sent
/// to every member of the topic in each `presence_state` (a project's smaller
/// `max_payload_size_in_kb` holds too).
pub(crate) const MAX_PAYLOAD_BYTES: usize = 8 * 1024;
/// The largest tracked entry: its payload, topic and presence key, as JSON text (a KV
/// entry of the presence bucket holds the three, and the bucket's entries are bounded).
pub(crate) const MAX_TRACKED_BYTES: usize = MAX_PAYLOAD_BYTES + 12 * 1024;

/// The length of `s` as a JSON string (quotes and escapes included), without writing it.
pub(crate) fn json_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// Why a presence event is refused; each shuts the channel (a `system` error with
/// Supabase's text, then `phx_close`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PresenceRefused {
    /// The track payload is over [`MAX_PAYLOAD_BYTES`] or the project's payload limit,
    /// or with its topic and presence key over [`MAX_TRACKED_BYTES`].
    TooLarge,
    /// The socket is over its presence events/s.
    ClientRate,
    /// The project is over its presence events/s across the fronts.
    ProjectRate,
    /// The project is over its messages/s or bytes/s.
    Messages,
}

impl PresenceRefused {
    /// Supabase's `system` message text.
    pub(crate) fn message(self) -> &'static str {
        match self {
            PresenceRefused::TooLarge => "Track message size exceeded",
            PresenceRefused::ClientRate => "Client presence rate limit exceeded",
            PresenceRefused::ProjectRate => "Too many presence messages per second",
            PresenceRefused::Messages => crate::limits::usage::TOO_MANY_MESSAGES,
        }
    }
}

/// May this presence event of a socket of `project` go ahead? The payload's size (and
/// with the channel's `(topic, presence key)`, the entry's), the socket's rate, the
/// project's presence rate, its messages and bytes rates. Refusals are counted and
/// logged.
pub(crate) fn admit(
    usage: &Usage,
    (project, entry): (&str, (&str, &str)),
    events: &mut TokenBucket,
    action: &PresenceAction,
) -> Result<(), PresenceRefused> {
    let size = match action {
        PresenceAction::Track { payload } => payload.get().len(),
        PresenceAction::Untrack => 0,
    };
    if size > MAX_PAYLOAD_BYTES {
        let detail = format!("presence payload of {size} bytes, max {MAX_PAYLOAD_BYTES}");
        usage.refuse(project, "presence_payload", "PayloadSizeExceeded", &detail);
        return Err(PresenceRefused::TooLarge);
    }
    let tracked = size + json_len(entry.0) + json_len(entry.1);
    if size > 0 && tracked > MAX_TRACKED_BYTES {
        let detail = format!(
            "presence entry (payload, topic and key) of {tracked} bytes, max {MAX_TRACKED_BYTES}"
        );
        usage.refuse(project, "presence_payload", "PayloadSizeExceeded", &detail);
        return Err(PresenceRefused::TooLarge);
    }
    if usage.check_payload(project, size).is_err() {
        return Err(PresenceRefused::TooLarge);
    }
    if !events.take() {
        let detail = "a socket's presence events per second";
        usage.refuse(
            project,
            "presence_events",
            "ClientPresenceRateLimitReached",
            detail,
        );
        return Err(PresenceRefused::ClientRate);
    }
    if let Err(over) = usage.take(project, &[(Rate::Presence, 1)]) {
        let detail = format!("{} per second, limit {}", over.seen, over.limit);
        usage.refuse(
            project,
            "project_presence",
            "PresenceRateLimitReached",
            &detail,
        );
        return Err(PresenceRefused::ProjectRate);
    }
    usage
        .take_messages(project, 1, size as u64)
        .map_err(|_| PresenceRefused::Messages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_len_is_the_length_serde_writes() {
        for s in [
            "",
            "plain",
            "é🙂",
            "\"\\/",
            "\u{0}\u{1}\u{1f}\u{7f}",
            "\t\r\n\u{8}\u{c}",
        ] {
            assert_eq!(
                json_len(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
    }
}
