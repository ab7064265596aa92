//! Fan-out of change events from the bus to channels.
//!
//! One task reads `walcast.realtime.>`. Per event: parse once, keep only this front's
//! subscription ids, group them by channel, encode the change once, and produce each
//! channel's frame text once (cached by version, topic and ids, so identical channels
//! share the bytes). Frames go into each connection's bounded queue without waiting.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use tokio_util::sync::CancellationToken;
use walcast_bus::subs::{SubsEnded, NOTICE_SUBS_ENDED};
use walcast_bus::HEADER_TERM;
use walcast_bus::{BusMessage, ChangeEvent, ChangeKind, Subscription, HEADER_NOTICE};
use walcast_protocol::{ChangeData, ChangeType, Column, ColumnValue, EncodedChange};

use crate::sink::Change;
use crate::state::Shared;
use crate::telemetry;

pub(crate) async fn run(shared: Arc<Shared>, mut sub: Subscription, cancel: CancellationToken) {
    let mut replays = ReplayGuard::default();
    let mut terms = TermGuard::default();
    while let Some(m) = crate::next_message(&mut sub, &cancel, "change").await {
        if !terms.admit(m.header(HEADER_TERM), std::time::Instant::now()) {
            continue;
        }
        match m.header(HEADER_NOTICE) {
            None => deliver(&shared, &m, &mut replays),
            Some(NOTICE_SUBS_ENDED) => subs_ended(&shared, &m).await,
            Some(other) => {
                telemetry::error("unknown_notice");
                tracing::warn!(notice = other, "unknown notice on the delivery subject");
            }
        }
    }
}

/// The worker ended some of our subscriptions (their table was dropped): each channel
/// gets a `system` error and the subscriptions are removed.
async fn subs_ended(shared: &Arc<Shared>, m: &BusMessage) {
    let notice: SubsEnded = match serde_json::from_slice(&m.payload) {
        Ok(n) => n,
        Err(e) => {
            telemetry::error("bad_notice");
            tracing::warn!(error = %e, "undecodable subs-ended notice");
            return;
        }
    };
    let ended: Vec<(u64, String)> = notice
        .ids
        .iter()
        .filter_map(|id| shared.registry.own(id))
        .map(|n| (n, notice.message.clone()))
        .collect();
    crate::registration::end_subscriptions(shared, ended, "table_dropped").await;
}

/// Drops messages of a leader term older than the newest one received: a leader frozen
/// past its lease may release, when it wakes, a message it had handed to its NATS
/// connection before its fence closed; by then its successor's messages (a higher term)
/// reached us, and the old leader's judgement (its subscriptions, privileges) is stale.
/// A lower term is adopted only after the newest has been silent for
/// [`STALE_TERM_WINDOW`] (the lease state was reset by hand, say), never within it.
#[derive(Default)]
pub(crate) struct TermGuard {
    newest: Option<(u64, std::time::Instant)>,
}

/// How long the newest term must have been silent before a lower one is accepted.
pub(crate) const STALE_TERM_WINDOW: std::time::Duration = std::time::Duration::from_secs(60);

impl TermGuard {
    /// True if a message of `term` (the header; absent from workers without it) may be
    /// delivered, seen at `now`.
    pub(crate) fn admit(&mut self, term: Option<&str>, now: std::time::Instant) -> bool {
        let Some(term) = term.and_then(|t| t.parse::<u64>().ok()) else {
            return true;
        };
        match self.newest {
            Some((newest, at)) if term < newest => {
                if now.saturating_duration_since(at) < STALE_TERM_WINDOW {
                    metrics::counter!(telemetry::STALE_TERM_DROPPED).increment(1);
                    tracing::warn!(term, newest, "dropped a message of an older leader term");
                    return false;
                }
                tracing::warn!(
                    term,
                    newest,
                    "the newest leader term went silent; accepting a lower one"
                );
            }
            _ => {}
        }
        self.newest = Some((term, now));
        true
    }
}

/// Drops what this front already delivered. Changes leave the leader in commit order, so
/// `(commit_lsn, seq, part)` only grows; a new leader (or a restarted one) replays from
/// the slot's last acknowledged position, and everything up to what we saw last is a
/// replay that each channel already got.
#[derive(Default)]
pub(crate) struct ReplayGuard {
    last: Option<(walcast_wal2json::Lsn, u32, u32)>,
}

impl ReplayGuard {
    /// True if the change is new (and remember it).
    pub(crate) fn admit(&mut self, ev: &ChangeEvent) -> bool {
        let at = (ev.commit_lsn, ev.seq, ev.part);
        if self.last.is_some_and(|last| at <= last) {
            metrics::counter!(telemetry::REPLAYS_DROPPED).increment(1);
            return false;
        }
        self.last = Some(at);
        true
    }
}

fn deliver(shared: &Shared, msg: &BusMessage, replays: &mut ReplayGuard) {
    let ev: ChangeEvent = match serde_json::from_slice(&msg.payload) {
        Ok(ev) => ev,
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "undecodable change event");
            return;
        }
    };
    shared.registry.saw(ev.commit_lsn);
    if !replays.admit(&ev) {
        return;
    }
    if ev.restricted.is_empty() {
        deliver_event(shared, &ev);
        return;
    }
    // Subscribers that may see only some columns get their own, reduced copy.
    match ev.variants() {
        Ok(variants) => variants.iter().for_each(|v| deliver_event(shared, v)),
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "cannot reduce a change event");
        }
    }
}

fn deliver_event(shared: &Shared, ev: &ChangeEvent) {
    let groups = shared.registry.groups(ev);
    if groups.is_empty() {
        return;
    }
    let Some(encoded) = encode(ev) else {
        return;
    };
    let mut change = Change::new(ev, &encoded);
    for (sink, ids) in groups {
        if sink.deliver(&mut change, ids) {
            metrics::counter!(telemetry::DELIVERIES).increment(1);
        }
    }
}

/// The `data` of a change, encoded once.
pub(crate) fn encode(ev: &ChangeEvent) -> Option<EncodedChange> {
    let change_type = match ev.kind {
        ChangeKind::Insert => ChangeType::Insert,
        ChangeKind::Update => ChangeType::Update,
        ChangeKind::Delete => ChangeType::Delete,
        ChangeKind::Truncate => return None,
    };
    let columns: Vec<Column<'_>> = ev
        .columns
        .iter()
        .map(|c| Column {
            name: &c.name,
            typname: &c.type_name,
        })
        .collect();
    let record = fields(ev.record.as_deref())?;
    let old = fields(ev.old_record.as_deref())?;
    let typname = |name: &str| {
        ev.columns
            .iter()
            .find(|c| c.name == name)
            .map_or("", |c| c.type_name.as_str())
    };
    let rec: Vec<ColumnValue<'_>> = record
        .iter()
        .map(|(k, v)| ColumnValue {
            name: k,
            typname: typname(k),
            value: v,
        })
        .collect();
    let errors: Vec<&str> = ev.errors.iter().map(String::as_str).collect();
    let old_rec: Vec<ColumnValue<'_>> = old
        .iter()
        .map(|(k, v)| ColumnValue {
            name: k,
            typname: typname(k),
            value: v,
        })
        .collect();
    Some(
        ChangeData {
            schema: &ev.schema,
            table: &ev.table,
            commit_timestamp: &ev.commit_timestamp,
            change_type,
            columns: Some(&columns),
            record: &rec,
            old_record: &old_rec,
            errors: (!errors.is_empty()).then_some(errors.as_slice()),
        }
        .encode(),
    )
}

type Fields<'a> = Vec<(Cow<'a, str>, &'a RawValue)>;

/// The fields of a raw JSON object, in order, values kept raw.
fn fields(raw: Option<&RawValue>) -> Option<Fields<'_>> {
    let Some(raw) = raw else {
        return Some(Vec::new());
    };
    let mut de = serde_json::Deserializer::from_str(raw.get());
    match (&mut de).deserialize_map(FieldsVisitor) {
        Ok(f) => Some(f),
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(error = %e, "change record is not a JSON object");
            None
        }
    }
}

struct FieldsVisitor;

#[derive(Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

impl<'de> Visitor<'de> for FieldsVisitor {
    type Value = Fields<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::new();
        while let Some((k, v)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
            out.push((k.0, v));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_an_event() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"UPDATE","commit_timestamp":"2026-01-01T00:00:00.000Z","commit_lsn":"0/10","seq":0,"columns":[{"name":"id","type":"int4"},{"name":"x\"y","type":"jsonb"}],"record":{"id":1,"x\"y":{"a":[1,2]}},"old_record":{"id":1},"pk":["id"],"subs":["f:1"]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        let enc = encode(&ev).unwrap();
        let v: serde_json::Value = serde_json::from_str(enc.data_json()).unwrap();
        assert_eq!(v["record"]["x\"y"]["a"][1], 2);
        assert_eq!(v["old_record"]["id"], 1);
        assert_eq!(v["type"], "UPDATE");
        assert_eq!(v["columns"][1]["type"], "jsonb");
    }

    #[test]
    fn an_older_term_is_dropped_unless_the_newest_went_silent() {
        let t0 = std::time::Instant::now();
        let mut g = TermGuard::default();
        assert!(g.admit(None, t0), "no header: no election");
        assert!(g.admit(Some("3"), t0));
        assert!(g.admit(Some("3"), t0));
        assert!(g.admit(Some("4"), t0), "a new leader");
        assert!(
            !g.admit(Some("3"), t0 + std::time::Duration::from_secs(1)),
            "the old one woke up"
        );
        assert!(g.admit(Some("4"), t0 + std::time::Duration::from_secs(2)));
        assert!(g.admit(Some("junk"), t0), "unparsable: not judged");
        let later = t0 + std::time::Duration::from_secs(2) + STALE_TERM_WINDOW;
        assert!(
            g.admit(Some("1"), later),
            "term 4 silent for the window: lease reset by hand"
        );
        assert!(!g.admit(Some("0"), later), "and 1 is now the newest");
    }
}
