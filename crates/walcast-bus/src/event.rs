//! The change event: one JSON message per row change, as published by the cdc-worker.
//!
//! ```json
//! {"project":"default","schema":"public","table":"todos","type":"UPDATE",
//!  "commit_timestamp":"2026-11-30T05:26:07.323Z","commit_lsn":"0/1530AD8","seq":0,"xid":730,
//!  "columns":[{"name":"id","type":"int4"},{"name":"title","type":"text"}],
//!  "record":{"id":1,"title":"new"},"old_record":{"id":1,"title":"old"},"pk":["id"]}
//! ```
//!
//! `(commit_lsn, seq)` identifies a change uniquely and orders changes in commit order: a
//! consumer that sees a pair not greater than the last one it kept drops it as a replay.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use walcast_core::Lsn;

#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "UPPERCASE")]
pub enum ChangeKind {
    Insert,
    Update,
    Delete,
    /// The table was emptied (`TRUNCATE`): no `record`, no `old_record`, no columns.
    /// Published on the table subject and the change stream, never to realtime clients
    /// (README "Change streams").
    Truncate,
    /// A row as a snapshot read it (`walcast snapshot`, README "Change streams"): its
    /// state at the event's `(commit_lsn, seq)`, `record` only. Published on the change
    /// stream only, never on the table subjects nor to realtime clients: a realtime client
    /// subscribed to changes, not to a table's rows (the SSE `?snapshot=true` reads rows
    /// as the subscriber, under row-level security; a leader-side snapshot has no
    /// subscriber to judge the rows for).
    Read,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Insert => "INSERT",
            ChangeKind::Update => "UPDATE",
            ChangeKind::Delete => "DELETE",
            ChangeKind::Truncate => "TRUNCATE",
            ChangeKind::Read => "READ",
        }
    }
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct ColumnInfo {
    pub name: String,
    /// The Postgres `typname` (`int4`, `text`, `_int4`, `timestamptz`, an enum's name …).
    #[serde(rename = "type")]
    pub type_name: String,
}

#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct ChangeEvent {
    pub project: String,
    pub schema: String,
    pub table: String,
    #[serde(rename = "type")]
    pub kind: ChangeKind,
    /// Commit time, UTC, millisecond precision, `Z` suffix.
    pub commit_timestamp: String,
    /// End LSN of the commit record: the slot position that acknowledges this transaction.
    pub commit_lsn: Lsn,
    /// Position of this change inside its transaction, from 0.
    pub seq: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u32>,
    /// Columns of `record` (or of `old_record` for a DELETE), in table order.
    pub columns: Vec<ColumnInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_record: Option<Box<RawValue>>,
    /// Primary-key column names.
    #[serde(default)]
    pub pk: Vec<String>,
    /// UPDATE only: columns whose unchanged TOASTed value wal2json left out of the new row.
    /// They were filled from `old_record` when the table has `REPLICA IDENTITY FULL`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unchanged_toast: Vec<String>,
    /// On a front's delivery subject: who on that front gets the change. Each entry is a
    /// class key ([`crate::subs::class_key`]: every subscription of the front in that
    /// class that was in effect at the change) or a subscription id (`<front>:<n>`,
    /// judged one by one under row-level security). Empty on the table subject.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subs: Vec<String>,
    /// Subscribers of `subs` that may see only some columns (column privileges, or only
    /// the key of a deleted row under row-level security).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub restricted: Vec<Restriction>,
    /// Supabase's `errors` of a change: `["Error 413: Payload Too Large"]` when the row
    /// was too large to send whole (see [`ChangeEvent::shrink_to`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub errors: Vec<String>,
    /// When the audience of one change does not fit one message, the change is sent as
    /// several parts (0, 1, …), each with some of the subscribers; `(commit_lsn, seq,
    /// part)` then orders messages.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The error a change carries when its values were too large to send whole.
pub const PAYLOAD_TOO_LARGE: &str = "Error 413: Payload Too Large";

/// In a change reduced for size, values of at most this many bytes (as JSON) are kept,
/// as Supabase does; the primary key is always kept.
pub const SMALL_VALUE_BYTES: usize = 64;

/// What [`ChangeEvent::shrink_to`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shrink {
    /// The values fit: nothing changed.
    Fits,
    /// Values over [`SMALL_VALUE_BYTES`] were dropped (the key and small values kept).
    SmallValues,
    /// Only the primary key was kept.
    KeyOnly,
    /// Even the key alone is over the limit: the event must not be sent.
    TooLarge,
}

/// These subscribers get only these columns.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
pub struct Restriction {
    pub columns: Vec<String>,
    pub subs: Vec<String>,
}

impl ChangeEvent {
    /// The position used to drop replays: commit order, then order inside the transaction.
    pub fn position(&self) -> (Lsn, u32) {
        (self.commit_lsn, self.seq)
    }

    /// Bytes of the row values: `record` and `old_record` as JSON.
    pub fn record_bytes(&self) -> usize {
        self.record.as_ref().map_or(0, |r| r.get().len())
            + self.old_record.as_ref().map_or(0, |r| r.get().len())
    }

    /// Make the row values fit `limit` bytes the way Supabase does with a record over
    /// `max_record_bytes`: drop values over [`SMALL_VALUE_BYTES`] (keeping the primary
    /// key whatever its size) and add [`PAYLOAD_TOO_LARGE`] to `errors`; if that is still
    /// over, keep only the key. `columns` still lists every column.
    pub fn shrink_to(&mut self, limit: usize) -> Result<Shrink, serde_json::Error> {
        if self.record_bytes() <= limit {
            return Ok(Shrink::Fits);
        }
        let pk: std::collections::HashSet<&str> = self.pk.iter().map(String::as_str).collect();
        let small =
            |name: &str, v: &RawValue| pk.contains(name) || v.get().len() <= SMALL_VALUE_BYTES;
        let record = filter_record(self.record.as_deref(), &small)?;
        let old = filter_record(self.old_record.as_deref(), &small)?;
        let size = |r: &Option<Box<RawValue>>| r.as_ref().map_or(0, |r| r.get().len());
        let (record, old, outcome) = if size(&record) + size(&old) <= limit {
            (record, old, Shrink::SmallValues)
        } else {
            let key = |name: &str, _: &RawValue| pk.contains(name);
            let record = filter_record(self.record.as_deref(), &key)?;
            let old = filter_record(self.old_record.as_deref(), &key)?;
            if size(&record) + size(&old) > limit {
                return Ok(Shrink::TooLarge);
            }
            (record, old, Shrink::KeyOnly)
        };
        self.record = record;
        self.old_record = old;
        self.unchanged_toast.clear();
        if !self.errors.iter().any(|e| e == PAYLOAD_TOO_LARGE) {
            self.errors.push(PAYLOAD_TOO_LARGE.to_string());
        }
        Ok(outcome)
    }

    /// The messages to publish for this change, each at most `max_bytes` when
    /// serialised: the event itself when it fits, otherwise copies with the same change
    /// and disjoint parts of `subs` (and of `restricted`), the ids in the order their front
    /// handed them out ([`allocation_order`]), numbered by `part` from the event's own (a
    /// second copy of one change to the same front starts after the first's parts). `None`
    /// when even one subscriber does not fit (the change itself is too large).
    pub fn split(&self, max_bytes: usize) -> Result<Option<Vec<Vec<u8>>>, serde_json::Error> {
        let whole = serde_json::to_vec(self)?;
        if whole.len() <= max_bytes {
            return Ok(Some(vec![whole]));
        }
        let mut bare = self.clone();
        bare.subs.clear();
        bare.restricted.clear();
        let base = serde_json::to_vec(&bare)?.len() + 64;
        let restricted: std::collections::HashMap<&str, usize> = self
            .restricted
            .iter()
            .enumerate()
            .flat_map(|(i, r)| r.subs.iter().map(move |s| (s.as_str(), i)))
            .collect();
        let mut parts: Vec<ChangeEvent> = Vec::new();
        let mut size = usize::MAX;
        let mut ids: Vec<&String> = self.subs.iter().collect();
        ids.sort_by(|a, b| allocation_order(a, b));
        for id in ids {
            let group = restricted.get(id.as_str()).copied();
            // An id restricted to some columns is listed twice (`subs` and `restricted`).
            let cost = (id.len() + 4) * if group.is_some() { 2 } else { 1 };
            let columns_cost = group.map_or(0, |g| {
                self.restricted[g]
                    .columns
                    .iter()
                    .map(|c| c.len() + 4)
                    .sum::<usize>()
                    + 32
            });
            let part = match parts.last_mut() {
                Some(p) if size + cost + columns_cost <= max_bytes => p,
                _ => {
                    if base + cost + columns_cost > max_bytes {
                        return Ok(None);
                    }
                    let mut p = bare.clone();
                    p.part = self.part + parts.len() as u32;
                    parts.push(p);
                    size = base;
                    parts.last_mut().expect("just pushed")
                }
            };
            part.subs.push(id.clone());
            size += cost;
            if let Some(g) = group {
                let r = &self.restricted[g];
                match part.restricted.iter_mut().find(|x| x.columns == r.columns) {
                    Some(x) => x.subs.push(id.clone()),
                    None => {
                        size += columns_cost;
                        part.restricted.push(Restriction {
                            columns: r.columns.clone(),
                            subs: vec![id.clone()],
                        });
                    }
                }
            }
        }
        let out = parts
            .iter()
            .map(serde_json::to_vec)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(out.iter().all(|m| m.len() <= max_bytes).then_some(out))
    }

    /// What each subscriber may receive: the full event for the unrestricted ones, and a
    /// reduced copy per [`Restriction`], each with exactly its subscribers in `subs`.
    pub fn variants(&self) -> Result<Vec<ChangeEvent>, serde_json::Error> {
        if self.restricted.is_empty() {
            return Ok(vec![self.clone()]);
        }
        let limited: std::collections::HashSet<&str> = self
            .restricted
            .iter()
            .flat_map(|r| r.subs.iter().map(String::as_str))
            .collect();
        let mut full = self.clone();
        full.restricted.clear();
        full.subs.retain(|s| !limited.contains(s.as_str()));
        let mut out = vec![full];
        for r in &self.restricted {
            let mut e = self.restrict(&r.columns)?;
            e.subs = r.subs.clone();
            out.push(e);
        }
        Ok(out)
    }

    /// A copy with only `keep` columns, in the event's column order.
    pub fn restrict(&self, keep: &[String]) -> Result<ChangeEvent, serde_json::Error> {
        let keep: std::collections::HashSet<&str> = keep.iter().map(String::as_str).collect();
        let mut e = self.clone();
        e.restricted.clear();
        e.columns.retain(|c| keep.contains(c.name.as_str()));
        e.record = restrict_record(self.record.as_deref(), &e.columns)?;
        e.old_record = restrict_record(self.old_record.as_deref(), &e.columns)?;
        e.pk.retain(|k| keep.contains(k.as_str()));
        e.unchanged_toast.retain(|k| keep.contains(k.as_str()));
        Ok(e)
    }
}

/// The fields of a JSON object that `keep` accepts, in order.
fn filter_record(
    rec: Option<&RawValue>,
    keep: &dyn Fn(&str, &RawValue) -> bool,
) -> Result<Option<Box<RawValue>>, serde_json::Error> {
    let Some(rec) = rec else { return Ok(None) };
    let map: OrderedFields = serde_json::from_str(rec.get())?;
    let mut out = String::from("{");
    for (k, v) in map.0 {
        if keep(&k, &v) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(&k)?);
            out.push(':');
            out.push_str(v.get());
        }
    }
    out.push('}');
    Ok(Some(RawValue::from_string(out)?))
}

/// A JSON object's fields in document order, values kept raw.
struct OrderedFields(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for OrderedFields {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = OrderedFields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<OrderedFields, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<String, Box<RawValue>>()? {
                    out.push(entry);
                }
                Ok(OrderedFields(out))
            }
        }
        d.deserialize_map(V)
    }
}

fn restrict_record(
    rec: Option<&RawValue>,
    columns: &[ColumnInfo],
) -> Result<Option<Box<RawValue>>, serde_json::Error> {
    let Some(rec) = rec else { return Ok(None) };
    let map: std::collections::HashMap<String, Box<RawValue>> = serde_json::from_str(rec.get())?;
    let mut out = String::from("{");
    for c in columns {
        if let Some(v) = map.get(&c.name) {
            if out.len() > 1 {
                out.push(',');
            }
            out.push_str(&serde_json::to_string(&c.name)?);
            out.push(':');
            out.push_str(v.get());
        }
    }
    out.push('}');
    Ok(Some(RawValue::from_string(out)?))
}

/// The order a front hands out its subscription ids in: `<front>:<n>`, `n` counting up
/// (anything else, such as a class key, by its text). A channel's bindings are
/// subscribed together, so they have neighbouring numbers: split in this order, each
/// part of a change names whole channels, and a channel gets the change in one frame
/// (two where a part ends) instead of once per part. In the order the audience was
/// gathered (by class), every part named some of every channel's bindings, and a
/// socket of 100 channels got each change of a large audience hundreds of times, which
/// filled its queue.
pub fn allocation_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn key(id: &str) -> (&str, Option<u64>, &str) {
        match id.rsplit_once(':') {
            Some((front, n)) => (front, n.parse().ok(), id),
            None => (id, None, id),
        }
    }
    key(a).cmp(&key(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_json() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"INSERT","commit_timestamp":"2026-11-30T05:26:07.323Z","commit_lsn":"0/1530AD8","seq":2,"columns":[{"name":"id","type":"int4"}],"record":{"id":1},"pk":["id"]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        assert_eq!(ev.kind, ChangeKind::Insert);
        assert_eq!(ev.commit_lsn.to_string(), "0/1530AD8");
        assert_eq!(ev.record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert!(ev.old_record.is_none());
        assert_eq!(serde_json::to_string(&ev).unwrap(), text);
    }

    #[test]
    fn restricted_subscribers_get_reduced_copies() {
        let text = r#"{"project":"default","schema":"public","table":"t","type":"UPDATE","commit_timestamp":"x","commit_lsn":"0/1","seq":0,"columns":[{"name":"id","type":"int4"},{"name":"secret","type":"text"}],"record":{"id":1,"secret":"s"},"old_record":{"id":1,"secret":"o"},"pk":["id"],"subs":["a","b"],"restricted":[{"columns":["id"],"subs":["b"]}]}"#;
        let ev: ChangeEvent = serde_json::from_str(text).unwrap();
        let v = ev.variants().unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].subs, ["a"]);
        assert_eq!(
            v[0].record.as_ref().unwrap().get(),
            r#"{"id":1,"secret":"s"}"#
        );
        assert_eq!(v[1].subs, ["b"]);
        assert_eq!(v[1].record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert_eq!(v[1].old_record.as_ref().unwrap().get(), r#"{"id":1}"#);
        assert_eq!(v[1].columns.len(), 1);
    }

    fn big_update() -> ChangeEvent {
        let big = "x".repeat(5000);
        let text = format!(
            r#"{{"project":"default","schema":"public","table":"t","type":"UPDATE","commit_timestamp":"x","commit_lsn":"0/1","seq":3,"columns":[{{"name":"id","type":"text"}},{{"name":"small","type":"int4"}},{{"name":"body","type":"text"}}],"record":{{"id":"k1","small":7,"body":"{big}"}},"old_record":{{"id":"k1","small":6,"body":"{big}"}},"pk":["id"],"unchanged_toast":["body"]}}"#
        );
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn an_event_that_fits_is_not_touched() {
        let mut ev = big_update();
        assert_eq!(ev.shrink_to(20_000).unwrap(), Shrink::Fits);
        assert!(ev.errors.is_empty());
        assert!(ev.record.unwrap().get().contains("xxxx"));
    }

    #[test]
    fn oversized_values_are_dropped_with_the_413_error() {
        let mut ev = big_update();
        assert_eq!(ev.shrink_to(1000).unwrap(), Shrink::SmallValues);
        assert_eq!(
            ev.record.as_ref().unwrap().get(),
            r#"{"id":"k1","small":7}"#
        );
        assert_eq!(
            ev.old_record.as_ref().unwrap().get(),
            r#"{"id":"k1","small":6}"#
        );
        assert_eq!(ev.errors, [PAYLOAD_TOO_LARGE]);
        assert!(ev.unchanged_toast.is_empty());
        assert_eq!(ev.columns.len(), 3, "columns still describe the table");
        // Idempotent: a second pass neither changes the values nor repeats the error.
        assert_eq!(ev.shrink_to(1000).unwrap(), Shrink::Fits);
        assert_eq!(ev.errors.len(), 1);
        let json = serde_json::to_string(&ev).unwrap();
        assert!(json.contains(r#""errors":["Error 413: Payload Too Large"]"#));
    }

    #[test]
    fn a_tighter_limit_keeps_only_the_key_and_a_huge_key_is_refused() {
        let mut ev = big_update();
        assert_eq!(ev.shrink_to(30).unwrap(), Shrink::KeyOnly);
        assert_eq!(ev.record.as_ref().unwrap().get(), r#"{"id":"k1"}"#);
        assert_eq!(ev.old_record.as_ref().unwrap().get(), r#"{"id":"k1"}"#);
        let mut ev = big_update();
        ev.pk = vec!["body".into()];
        assert_eq!(ev.shrink_to(1000).unwrap(), Shrink::TooLarge);
        assert!(ev.errors.is_empty(), "a refused event is left as it was");
    }

    #[test]
    fn a_large_audience_is_split_into_bounded_disjoint_parts() {
        let mut ev = big_update();
        ev.shrink_to(1000).unwrap();
        ev.subs = (0..5000).map(|i| format!("front-{}:{i}", i % 3)).collect();
        ev.restricted = vec![Restriction {
            columns: vec!["id".into()],
            subs: (0..5000)
                .step_by(7)
                .map(|i| format!("front-{}:{i}", i % 3))
                .collect(),
        }];
        let one = ev.split(usize::MAX).unwrap().unwrap();
        assert_eq!(one.len(), 1);
        let parts = ev.split(16 * 1024).unwrap().unwrap();
        assert!(parts.len() > 5, "{} parts", parts.len());
        let mut seen = Vec::new();
        let mut limited = Vec::new();
        for (i, bytes) in parts.iter().enumerate() {
            assert!(
                bytes.len() <= 16 * 1024,
                "part {i} has {} bytes",
                bytes.len()
            );
            let p: ChangeEvent = serde_json::from_slice(bytes).unwrap();
            assert_eq!(p.part, i as u32);
            assert_eq!(p.position(), ev.position());
            assert_eq!(
                p.record.as_ref().unwrap().get(),
                ev.record.as_ref().unwrap().get()
            );
            for r in &p.restricted {
                assert_eq!(r.columns, ["id"]);
                assert!(r.subs.iter().all(|s| p.subs.contains(s)));
                limited.extend(r.subs.clone());
            }
            seen.extend(p.subs);
        }
        let ordered = |ids: &[String]| {
            let mut v = ids.to_vec();
            v.sort_by(|a, b| allocation_order(a, b));
            v
        };
        assert_eq!(seen, ordered(&ev.subs), "every subscriber once, in order");
        assert_eq!(limited, ordered(&ev.restricted[0].subs));
        assert!(ev.split(100).unwrap().is_none());
        // A second copy of the change to the same front numbers on from its own part.
        ev.part = 40;
        let later = ev.split(16 * 1024).unwrap().unwrap();
        let numbers: Vec<u32> = later
            .iter()
            .map(|b| serde_json::from_slice::<ChangeEvent>(b).unwrap().part)
            .collect();
        assert_eq!(numbers, (40..40 + parts.len() as u32).collect::<Vec<_>>());
    }

    #[test]
    fn a_split_audience_names_whole_channels_in_each_part() {
        // 100 channels of 100 bindings each (ids handed out channel after channel), listed
        // by binding (class) as the worker gathers them.
        let mut ev = big_update();
        ev.shrink_to(1000).unwrap();
        ev.subs = (0..100)
            .flat_map(|binding| (0..100).map(move |channel| channel * 100 + binding))
            .map(|n| format!("front-0123456789abcdef:{n}"))
            .collect();
        let parts = ev.split(16 * 1024).unwrap().unwrap();
        assert!(parts.len() > 5, "{} parts", parts.len());
        let frames: usize = parts
            .iter()
            .map(|bytes| {
                let p: ChangeEvent = serde_json::from_slice(bytes).unwrap();
                let channels: std::collections::HashSet<u64> = p
                    .subs
                    .iter()
                    .map(|id| id.rsplit_once(':').unwrap().1.parse::<u64>().unwrap() / 100)
                    .collect();
                channels.len()
            })
            .sum();
        assert!(
            frames < 100 + parts.len(),
            "{frames} (channel, part) pairs over {} parts",
            parts.len()
        );
    }

    #[test]
    fn ids_sort_by_front_then_number_then_text() {
        let mut ids = vec!["f:10", "c0123", "f:9", "g:1", "f:x", "f:100"];
        ids.sort_by(|a, b| allocation_order(a, b));
        assert_eq!(ids, ["c0123", "f:x", "f:9", "f:10", "f:100", "g:1"]);
    }
}
