//! `broadcast`: a client's message to the channel's topic, delivered on this front and
//! relayed to the others (see [`crate::broadcast`]); acknowledged if the join asked for
//! it.

use walcast_protocol::{BroadcastPush, Frame, UserBroadcast};

use super::Session;
use crate::broadcast::Pushed;
use crate::telemetry;

pub(super) async fn apply(s: &mut Session, f: &Frame, b: BroadcastPush) {
    if !s.may_write(&f.topic).await {
        // Dropped, as Supabase drops a send its policies refuse.
        return;
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
