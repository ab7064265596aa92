//! The `broadcast` command: a client's message to the channel's topic, delivered on this front and
//! relayed to the others (see [`crate::broadcast`]); acknowledged if the join asked for
//! it. Over its project's payload limit it is refused (an error reply); while its project
//! is over its messages/s or bytes/s the channel is shut (`system` "Too many messages per
//! second", then `phx_close`), as Supabase shuts it.

use walcast_protocol::{server, BroadcastPush, Frame, UserBroadcast};

use super::Channels;
use crate::broadcast::Pushed;
use crate::limits::usage::{MessageRefused, TOO_MANY_MESSAGES};
use crate::telemetry;

pub(super) async fn apply(s: &mut Channels, f: &Frame, b: BroadcastPush) {
    if !s.may_write(&f.topic) {
        // Dropped, as Supabase drops a send its policies refuse.
        return;
    }
    if !s.channels.contains_key(&f.topic) {
        return;
    }
    match s.services.usage.admit_message(&s.project, b.payload.len()) {
        Ok(()) => {}
        Err(MessageRefused::TooLarge { size, max }) => {
            // Not sent: said to the sender, `ack` or not (Supabase answers only an `ack`
            // join; a refused message is never dropped silently here).
            let text = format!("Payload size exceeded: {size} bytes, at most {max}");
            return s.reply_error(f, &server::error_reason("PayloadSizeExceeded", &text));
        }
        Err(MessageRefused::OverRate(_)) => return s.shut(&f.topic, TOO_MANY_MESSAGES).await,
    }
    let Some(ch) = s.channels.get(&f.topic) else {
        return;
    };
    metrics::counter!(telemetry::BROADCASTS, "source" => "socket").increment(1);
    // A binary push (kind 3) fans out as binary, a JSON one as text (see `Pushed`).
    let how = if b.binary {
        Pushed::Binary
    } else {
        Pushed::Json
    };
    let ub = UserBroadcast {
        event: b.event,
        meta: b.meta,
        body: b.payload,
    };
    let except = (!ch.out.broadcast_self).then_some(ch.id);
    let (key, ack) = (ch.key.clone(), ch.ack);
    s.services.broadcasts.send(&key, &ub, how, except).await;
    if ack {
        s.reply_ok(f);
    }
}
