//! The `presence` command: track or untrack this channel's presence on its topic (see
//! [`crate::presence`]); the diff goes to this front's channels of the topic. Over a
//! limit (payload size, the socket's or the project's presence rate, the project's
//! messages rate) the channel is shut with Supabase's `system` text.

use walcast_protocol::{Frame, PresenceAction};

use super::Channels;
use crate::presence::admit::admit;
use crate::presence::send_diff;

pub(super) async fn apply(s: &mut Channels, f: &Frame, action: PresenceAction) {
    let usage = s.services.usage.clone();
    let key = s.channels.get(&f.topic).map(|c| c.presence_key.as_str());
    let entry = (s.project.as_str(), (f.topic.as_str(), key.unwrap_or("")));
    if let Err(why) = admit(&usage, entry, &mut s.presence_events, &action) {
        return s.shut(&f.topic, why.message()).await;
    }
    if matches!(action, PresenceAction::Track { .. }) && !s.may_write(&f.topic) {
        // Tracking on a private channel needs the write policy, as sending does.
        return s.reply_error(
            f,
            "Unauthorized: You do not have permissions to write to this Channel topic",
        );
    }
    let sv = s.services.clone();
    let Some(ch) = s.channels.get_mut(&f.topic) else {
        return;
    };
    let owner = format!("{}:{}", sv.front_id, ch.id);
    let key = ch.key.clone();
    let diff = match action {
        PresenceAction::Track { payload } => {
            ch.tracked = true;
            ch.out
                .presence
                .store(true, std::sync::atomic::Ordering::Relaxed);
            let pkey = ch.presence_key.clone();
            sv.presence.track(key.clone(), owner, pkey, payload).await
        }
        PresenceAction::Untrack => {
            ch.tracked = false;
            sv.presence.untrack(key.clone(), owner).await
        }
    };
    s.reply_ok(f);
    if let Some(d) = diff {
        send_diff(&sv.topics, &sv.usage, &key, &d);
    }
}
