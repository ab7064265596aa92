//! The leader's side of each front's numbered stream (see [`walcast_bus::links`]): every
//! message to a front's delivery subject goes through [`FrontLinks::send`], which gives
//! it the front's next number and hands it to the publisher under the front's lock (so
//! numbers reach NATS in order), and keeps it for a while (bounded in count, bytes and
//! age) to resend what the front says it missed. While leading, [`FrontLinks::lead`]
//! sends each front with subscriptions a heartbeat with its last number about once a
//! second, and answers resend requests with the term's publisher.
//!
//! A stream is one leadership term of one process (`Walcast-Term`, `Walcast-Origin`):
//! a new term numbers from 1 again and forgets what the last one kept. Within a term a
//! front's count is never reset (a front whose subscriptions come back later continues
//! where it was), so a number is never used twice for different messages.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use walcast_bus::links::NOTICE_HEARTBEAT;
use walcast_bus::links::{ResendHandler, ResendReply, ResendRequest, HEARTBEAT_INTERVAL};
use walcast_bus::subject::delivery_subject;
use walcast_bus::subs::BoxFuture;
use walcast_bus::{HEADER_FRONT_SEQ, HEADER_NOTICE, HEADER_RESENT};
use walcast_pipeline::{Position, PublishError, Publisher};
use walcast_wal2json::Lsn;

use crate::config::LinkOptions;
use crate::subscriptions::matcher::Matcher;
use crate::telemetry;

/// Every front's numbered stream (see the module docs). Shared (`Arc`) by everything
/// that publishes to fronts, side by side.
pub struct FrontLinks {
    opts: LinkOptions,
    links: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Link>>>>,
    /// The publisher of the term being led (heartbeats and resends go through it).
    leading: Mutex<Option<Publisher>>,
}

/// One front's stream.
#[derive(Default)]
struct Link {
    /// `(term, origin)` of the numbers below.
    stream: (u64, String),
    /// The last number sent (`0`: none yet).
    last: u64,
    /// What was sent, oldest first, numbered `last - kept.len() + 1 ..= last`.
    kept: VecDeque<Kept>,
    bytes: usize,
}

/// A message kept for resending.
struct Kept {
    at: Position,
    notice: Option<&'static str>,
    payload: Bytes,
    sent: Instant,
}

impl Link {
    /// Numbers restart with a new stream.
    fn follow(&mut self, publisher: &Publisher) {
        let stream = (publisher.term(), publisher.origin());
        if self.stream.0 != stream.0 || self.stream.1 != stream.1 {
            *self = Link {
                stream: (stream.0, stream.1.to_string()),
                ..Link::default()
            };
        }
    }

    /// The number of the oldest message kept.
    fn first(&self) -> u64 {
        self.last + 1 - self.kept.len() as u64
    }

    fn keep(&mut self, kept: Kept, opts: &LinkOptions) {
        self.bytes += kept.payload.len();
        self.kept.push_back(kept);
        self.trim(opts, Instant::now());
    }

    /// Drop the oldest messages past any bound.
    fn trim(&mut self, opts: &LinkOptions, now: Instant) {
        while let Some(old) = self.kept.front() {
            let over = self.kept.len() > opts.max_messages
                || self.bytes > opts.max_bytes
                || now.saturating_duration_since(old.sent) > opts.max_age;
            if !over {
                break;
            }
            self.bytes -= old.payload.len();
            self.kept.pop_front();
        }
    }
}

impl FrontLinks {
    pub fn new(opts: LinkOptions) -> Arc<FrontLinks> {
        Arc::new(FrontLinks {
            opts,
            links: Mutex::default(),
            leading: Mutex::default(),
        })
    }

    fn link(&self, front: &str) -> Arc<tokio::sync::Mutex<Link>> {
        let mut links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.entry(front.to_string()).or_default().clone()
    }

    fn existing(&self, front: &str) -> Option<Arc<tokio::sync::Mutex<Link>>> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.get(front).cloned()
    }

    /// Send one message to `front`'s delivery subject through `publisher`, with the
    /// front's next number (and `notice`, if it is one); kept for resending once handed
    /// over. On an error no number is used.
    pub async fn send(
        &self,
        publisher: &Publisher,
        front: &str,
        at: Position,
        notice: Option<&'static str>,
        payload: Bytes,
    ) -> Result<(), PublishError> {
        let link = self.link(front);
        let mut l = link.lock().await;
        l.follow(publisher);
        let seq = (l.last + 1).to_string();
        let mut extra = vec![(HEADER_FRONT_SEQ, seq.as_str())];
        if let Some(n) = notice {
            extra.push((HEADER_NOTICE, n));
        }
        publisher
            .publish(delivery_subject(front), at, &extra, payload.clone())
            .await?;
        l.last += 1;
        let kept = Kept {
            at,
            notice,
            payload,
            sent: Instant::now(),
        };
        l.keep(kept, &self.opts);
        Ok(())
    }

    /// A heartbeat to `front` with its last number; what is kept past its age goes.
    async fn heartbeat(&self, publisher: &Publisher, front: &str) -> Result<(), PublishError> {
        let link = self.link(front);
        let mut l = link.lock().await;
        l.follow(publisher);
        l.trim(&self.opts, Instant::now());
        let last = l.last.to_string();
        let extra = [
            (HEADER_NOTICE, NOTICE_HEARTBEAT),
            (HEADER_FRONT_SEQ, last.as_str()),
        ];
        let at = Position::commit(Lsn::default());
        publisher
            .publish(delivery_subject(front), at, &extra, Bytes::new())
            .await
    }

    /// While `publisher`'s term lasts (until `stop`, or it is fenced): heartbeats to
    /// every front with subscriptions about once a second, and resends through it.
    pub async fn lead(
        self: Arc<Self>,
        publisher: Publisher,
        matcher: Arc<Matcher>,
        stop: impl std::future::Future<Output = ()>,
    ) {
        self.set_leading(Some(publisher.clone()));
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(HEARTBEAT_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        'term: loop {
            tokio::select! {
                _ = &mut stop => break,
                _ = tick.tick() => {}
            }
            for front in matcher.subscribed_fronts() {
                match self.heartbeat(&publisher, &front).await {
                    Ok(()) => {}
                    Err(PublishError::Fenced(_)) => break 'term,
                    Err(e) => tracing::debug!(%front, error = %e, "heartbeat not sent"),
                }
            }
            self.trim_idle();
        }
        self.set_leading(None);
    }

    fn set_leading(&self, publisher: Option<Publisher>) {
        *self.leading.lock().unwrap_or_else(|p| p.into_inner()) = publisher;
    }

    /// Age out what fronts without subscriptions (no heartbeat) still keep, and report
    /// the bytes kept.
    fn trim_idle(&self) {
        let links: Vec<_> = {
            let g = self.links.lock().unwrap_or_else(|p| p.into_inner());
            g.values().cloned().collect()
        };
        let (now, mut bytes) = (Instant::now(), 0);
        for link in links {
            if let Ok(mut l) = link.try_lock() {
                l.trim(&self.opts, now);
                bytes += l.bytes;
            }
        }
        metrics::gauge!(telemetry::FRONT_KEPT_BYTES).set(bytes as f64);
    }

    /// Send `req.from..=req.to` of a front's stream again, as far as it is kept.
    pub async fn resend(&self, req: ResendRequest) -> ResendReply {
        let (from, to) = (req.from, req.to.max(req.from));
        let leading = self
            .leading
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(publisher) = leading else {
            return lost(from, to, "this worker no longer leads");
        };
        if publisher.term() != req.term || publisher.origin() != req.origin {
            return lost(from, to, "another leader term");
        }
        let Some(link) = self.existing(&req.front) else {
            return lost(from, to, "nothing was sent to this front");
        };
        let l = link.lock().await;
        if l.stream.0 != req.term || l.stream.1 != req.origin || from > l.last {
            return lost(from, to, "not sent in this leader term");
        }
        let (first, to) = (l.first(), to.min(l.last));
        let mut reply = ResendReply::default();
        if from < first {
            let end = to.min(first - 1);
            metrics::counter!(telemetry::FRONT_RESEND_LOST).increment(end - from + 1);
            reply = lost(
                from,
                end,
                "no longer kept by the leader (its resend buffer is full or too old)",
            );
        }
        let start = from.max(first);
        if start > to {
            return reply;
        }
        let subject = delivery_subject(&req.front);
        for seq in start..=to {
            let k = &l.kept[(seq - first) as usize];
            let n = seq.to_string();
            let mut extra = vec![(HEADER_FRONT_SEQ, n.as_str()), (HEADER_RESENT, "1")];
            if let Some(notice) = k.notice {
                extra.push((HEADER_NOTICE, notice));
            }
            let sent = publisher
                .publish(subject.clone(), k.at, &extra, k.payload.clone())
                .await;
            if let Err(e) = sent {
                tracing::warn!(front = %req.front, error = %e, "resend stopped");
                return ResendReply {
                    resent: (seq > start).then_some((start, seq - 1)),
                    ..lost(from.min(seq), to, format!("resending failed: {e}"))
                };
            }
        }
        metrics::counter!(telemetry::FRONT_RESENT).increment(to - start + 1);
        tracing::info!(front = %req.front, from = start, to, "resent what a front missed");
        reply.resent = Some((start, to));
        reply
    }

    /// The handler that answers resend requests on
    /// [`walcast_bus::links::SUBJECT_RESEND`].
    pub fn handler(self: &Arc<Self>) -> Arc<dyn ResendHandler> {
        Arc::new(Resender(self.clone()))
    }
}

fn lost(from: u64, to: u64, why: impl Into<String>) -> ResendReply {
    ResendReply::lost(from, to, why)
}

struct Resender(Arc<FrontLinks>);

impl ResendHandler for Resender {
    fn resend(&self, req: ResendRequest) -> BoxFuture<ResendReply> {
        let links = self.0.clone();
        Box::pin(async move { links.resend(req).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn kept(bytes: usize, sent: Instant) -> Kept {
        Kept {
            at: Position::commit(Lsn::default()),
            notice: None,
            payload: Bytes::from(vec![0u8; bytes]),
            sent,
        }
    }

    #[test]
    fn what_is_kept_stays_within_its_bounds() {
        let opts = LinkOptions {
            max_messages: 3,
            max_bytes: 100,
            max_age: Duration::from_secs(30),
        };
        let mut l = Link::default();
        let now = Instant::now();
        for _ in 0..5 {
            l.last += 1;
            l.keep(kept(10, now), &opts);
        }
        assert_eq!((l.first(), l.last, l.kept.len(), l.bytes), (3, 5, 3, 30));
        l.last += 1;
        l.keep(kept(95, now), &opts);
        assert_eq!((l.first(), l.bytes), (6, 95), "bytes bound");
        l.trim(&opts, now + Duration::from_secs(31));
        assert_eq!((l.first(), l.kept.len(), l.bytes), (7, 0, 0), "age bound");
    }
}
