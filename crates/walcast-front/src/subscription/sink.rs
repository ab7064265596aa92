//! Where a subscription's changes go: one [`Sink`] per transport.
//!
//! The registry (`super::registry`) maps each subscription to a sink; fan-out
//! (`super::fanout`) hands every change to the sinks its subscriptions point to. A
//! WebSocket channel (its gate, [`ChanOut`], whose implementation is here) and an SSE
//! stream (`sse::SseChannel`) are the two today; a third transport implements this trait
//! in its own module and subscribes through `super::subscribe`.

use std::collections::HashMap;
use std::sync::Arc;

use walcast_bus::ChangeEvent;
use walcast_protocol::server::{self, SystemStatus};
use walcast_protocol::{EncodedChange, Vsn};

use crate::connection::{ChanOut, Out};

/// One change on its way to its sinks: the event, its `data` encoded once, and the
/// Phoenix frames made of it so far (shared by channels of the same topic, version and
/// bindings).
pub(crate) struct Change<'a> {
    pub event: &'a ChangeEvent,
    pub encoded: &'a EncodedChange,
    /// By topic (looked up by its text, so a delivery clones and allocates nothing):
    /// each version and binding ids with its frame.
    frames: HashMap<Arc<str>, Vec<Frame>, FastHash>,
}

/// A change's frame for one version and set of binding ids.
type Frame = (Vsn, Vec<u32>, Out);

impl<'a> Change<'a> {
    pub(crate) fn new(event: &'a ChangeEvent, encoded: &'a EncodedChange) -> Self {
        Change {
            event,
            encoded,
            frames: HashMap::default(),
        }
    }

    /// The `postgres_changes` frame for a channel, made once per distinct channel.
    pub(crate) fn phoenix_frame(&mut self, vsn: Vsn, topic: &Arc<str>, ids: &[u32]) -> Out {
        let made = self.frames.get(&**topic).and_then(|variants| {
            let same = |(v, i, _): &&Frame| *v == vsn && i == ids;
            variants.iter().find(same).map(|(_, _, text)| text.clone())
        });
        if let Some(text) = made {
            return text;
        }
        let text = Out::text(&self.encoded.frame_text(vsn, topic, ids));
        let variants = self.frames.entry(topic.clone()).or_default();
        variants.push((vsn, ids.to_vec(), text.clone()));
        text
    }
}

/// The hasher of the maps the fan-out looks up once per delivery (SipHash was a few
/// percent of its CPU). Seeded per map; their keys are our own ids, or here a change's
/// channels, which live only as long as that change's delivery.
pub(crate) type FastHash = foldhash::fast::RandomState;

/// A destination of changes.
pub(crate) trait Sink: Send + Sync {
    /// Unique among this front's sinks (changes are grouped by it).
    fn id(&self) -> u64;
    /// Queue `change` for the client's bindings `ids` without waiting; `true` when it
    /// was queued (it counts as a delivery).
    fn deliver(&self, change: &mut Change<'_>, ids: &[u32]) -> bool;
    /// The worker ended a subscription of this sink (`why` is its reason, for the client).
    fn end(&self, why: &str);
    /// Changes were lost for a subscription of this sink, which goes on: the client gets
    /// a `system` error saying `why`.
    fn warn(&self, why: &str);
    /// Changes for this sink may have been lost on their way from the worker (`why`, for
    /// the client); its subscriptions go on.
    fn missed(&self, why: &str);
    /// A notice that changes flow again after a [`Sink::warn`] (`why`, for the client): a
    /// `system` message with status `ok`.
    fn resumed(&self, why: &str);
}

/// A shared sink, as the registry keeps it.
pub(crate) type SinkRef = Arc<dyn Sink>;

impl Sink for ChanOut {
    fn id(&self) -> u64 {
        self.id
    }

    fn deliver(&self, change: &mut Change<'_>, ids: &[u32]) -> bool {
        let text = change.phoenix_frame(self.vsn, &self.topic, ids);
        ChanOut::deliver(self, text)
    }

    /// A `system` error; the channel goes on.
    fn missed(&self, why: &str) {
        self.end(why);
    }

    /// The channel stays open (as for a refused join) with a `system` error.
    fn end(&self, why: &str) {
        let status = SystemStatus::Error;
        let f = server::system(None, &self.topic, "postgres_changes", status, why);
        if let Some(out) = Out::frame(&f, self.vsn) {
            ChanOut::deliver(self, out);
        }
    }

    /// The same `system` error; the channel stays subscribed.
    fn warn(&self, why: &str) {
        Sink::end(self, why)
    }

    fn resumed(&self, why: &str) {
        let f = server::system(None, &self.topic, "postgres_changes", SystemStatus::Ok, why);
        if let Some(out) = Out::frame(&f, self.vsn) {
            ChanOut::deliver(self, out);
        }
    }
}
