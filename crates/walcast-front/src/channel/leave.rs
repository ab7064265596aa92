//! `phx_leave`: answer, then close the channel (`phx_close`); a leave of a topic not
//! joined is answered all the same.

use walcast_protocol::{server, Frame};

use super::Channels;
use crate::connection::Out;

pub(super) async fn apply(s: &mut Channels, f: &Frame) {
    let reply = server::reply_ok(f.join_ref.as_deref(), f.ref_.as_deref(), &f.topic, None);
    match s.channels.remove(&f.topic) {
        None => s.push(&reply),
        Some(ch) => {
            let mut last: Vec<Out> = s.out(&reply).into_iter().collect();
            last.extend(s.out(&server::phx_close(ch.join_ref.as_deref(), &f.topic)));
            s.close_channel(ch, last).await;
        }
    }
}
