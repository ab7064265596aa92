//! Where authorized changes leave: the bus, through the session's fenced [`Publisher`].
//! An [`Outlet`] fits a change to what a message can carry (the Supabase way for
//! oversized values), splits its audience over messages, and publishes it once per front
//! with subscribers plus once, audience-free, on its table's subject. Shared by the
//! consumer (which fits changes as it decodes them) and every lane (which publishes).

use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use bytes::Bytes;
use serde_json::value::RawValue;
use walcast_bus::{subject::change_subject, BusError, ChangeEvent, Restriction};
use walcast_pipeline::change_event::{budget, fit};
use walcast_pipeline::health::PipelineHealth;
use walcast_pipeline::{Position, PublishError, Publisher};
use walcast_wal2json::Lsn;

use crate::authorize::Audience;
use crate::delivery::links::FrontLinks;
use crate::error::RealtimeError;
use crate::telemetry;

/// Where a message goes: a front's delivery subject (through [`FrontLinks`]) or a subject.
enum To {
    Front(String),
    Subject(String),
}

/// A message to publish: where, and its payload.
type Message = (To, Vec<u8>);

pub struct Outlet {
    pub publisher: Publisher,
    /// Values larger than this are dropped from a change (`Error 413`).
    pub max_record_bytes: usize,
    /// Where skipped and reduced changes are reported.
    pub health: Arc<PipelineHealth>,
    /// Every message to a front goes through them (numbered, kept to resend).
    pub links: Arc<FrontLinks>,
    /// The largest message published so far (for the gauge).
    largest: AtomicUsize,
}

impl Outlet {
    pub fn new(
        publisher: Publisher,
        max_record_bytes: usize,
        health: Arc<PipelineHealth>,
        links: Arc<FrontLinks>,
    ) -> Outlet {
        Outlet {
            publisher,
            max_record_bytes,
            health,
            links,
            largest: AtomicUsize::new(0),
        }
    }

    /// The largest message the bus takes, less room for subject and headers.
    pub fn message_budget(&self) -> usize {
        budget(self.publisher.max_payload())
    }

    /// Bring a change's values within `MAX_RECORD_BYTES` and what one bus message can
    /// carry, the Supabase way (see [`walcast_pipeline::change_event::fit`]). `false`: it cannot be sent at all
    /// (skipped, reported).
    pub fn fit_record(&self, event: &mut ChangeEvent) -> Result<bool, RealtimeError> {
        Ok(fit(
            event,
            self.max_record_bytes,
            self.message_budget(),
            &self.health,
        )?)
    }

    /// A change that no retry can deliver: log, count, report, move on.
    pub fn skip(&self, table: &str, commit_lsn: Option<Lsn>, reason: &'static str, error: &str) {
        self.health.report_skip(table, commit_lsn, reason, error);
    }

    /// Publish a change: once, without its audience, on its table's subject (for `walcast
    /// tail` and other services), and to each front with subscribers that may see it, on
    /// that front's delivery subject, naming them (in several parts when they do not fit
    /// one message). A change the server refuses as too large (its `max_payload` can
    /// shrink on a reconnect) is fitted again to the new size once; if that fails too it
    /// is skipped.
    pub async fn publish(
        &self,
        event: &mut ChangeEvent,
        audience: &Audience,
    ) -> Result<(), RealtimeError> {
        let table = format!("{}.{}", event.schema, event.table);
        for attempt in 0..2 {
            if attempt > 0 && !self.fit_record(event)? {
                return Ok(());
            }
            let Some(messages) = self.messages(event, audience)? else {
                self.skip(
                    &table,
                    Some(event.commit_lsn),
                    "payload_too_large",
                    "one subscriber's share does not fit a message",
                );
                return Ok(());
            };
            match self.send(event, messages).await {
                Err(RealtimeError::Publish(PublishError::Bus(BusError::PayloadTooLarge {
                    ..
                }))) => continue,
                other => return other,
            }
        }
        self.skip(
            &table,
            Some(event.commit_lsn),
            "payload_too_large",
            "the bus refused it twice",
        );
        Ok(())
    }

    /// (where, payload) of every message of a change; `None` if one cannot fit.
    fn messages(
        &self,
        event: &ChangeEvent,
        audience: &Audience,
    ) -> Result<Option<Vec<Message>>, RealtimeError> {
        let budget = self.message_budget();
        let json = |e: serde_json::Error| {
            RealtimeError::Event(walcast_pipeline::change_event::EventError::Json(e))
        };
        let mut out = Vec::with_capacity(1 + audience.len());
        for front in audience {
            // Those who may not see the old version get a copy without it, numbered
            // after the first copy's parts: its values never reach their front for them.
            let mut next = event.part;
            for (groups, hide) in [(&front.groups, false), (&front.hidden_old, true)] {
                if groups.is_empty() {
                    continue;
                }
                let mut e = event.clone();
                e.part = next;
                if hide && e.old_record.is_some() {
                    e.old_record = Some(RawValue::from_string("{}".into()).map_err(json)?);
                }
                for (columns, ids) in groups {
                    if let Some(cols) = columns {
                        e.restricted.push(Restriction {
                            columns: cols.iter().cloned().collect(),
                            subs: ids.clone(),
                        });
                    }
                    e.subs.extend(ids.iter().cloned());
                }
                let Some(parts) = e.split(budget).map_err(json)? else {
                    return Ok(None);
                };
                if parts.len() > 1 {
                    metrics::counter!(telemetry::CHANGES_SPLIT).increment(1);
                }
                next += parts.len() as u32;
                let to = || To::Front(front.front.clone());
                out.extend(parts.into_iter().map(|m| (to(), m)));
            }
        }
        // The audience-free copy last: a consumer of both knows a change's deliveries
        // are complete when it arrives.
        let subject = change_subject(&event.project, &event.schema, &event.table);
        let Some(bare) = event.split(budget).map_err(json)? else {
            return Ok(None);
        };
        out.extend(bare.into_iter().map(|m| (To::Subject(subject.clone()), m)));
        Ok(Some(out))
    }

    async fn send(&self, event: &ChangeEvent, messages: Vec<Message>) -> Result<(), RealtimeError> {
        let at = Position::change(event.commit_lsn, event.seq);
        for (to, payload) in messages {
            metrics::counter!(telemetry::PUBLISHED_BYTES).increment(payload.len() as u64);
            metrics::counter!(telemetry::PUBLISHED_MESSAGES).increment(1);
            let size = payload.len();
            let before = self
                .largest
                .fetch_max(size, std::sync::atomic::Ordering::Relaxed);
            if size > before {
                metrics::gauge!(telemetry::LARGEST_MESSAGE).set(size as f64);
            }
            // The publisher checks the fence right before the hand-over: a leader that
            // lost its lease sends nothing.
            let payload = Bytes::from(payload);
            match to {
                To::Front(f) => {
                    self.links
                        .send(&self.publisher, &f, at, None, payload)
                        .await?
                }
                To::Subject(s) => self.publisher.publish(s, at, &[], payload).await?,
            }
        }
        metrics::counter!(crate::telemetry::CHANGES_PUBLISHED).increment(1);
        Ok(())
    }
}
