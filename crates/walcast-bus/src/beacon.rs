//! Health beacons: every walcast process publishes a small summary of its state once a
//! second, so a front can show the whole cluster (the inspector's health panel) without
//! a privileged API or scraping Prometheus text.
//!
//! Subject: `walcast.health.<process id>` (the id encoded with [`encode_token`]).
//! Payload: one JSON [`Beacon`]. Plain NATS (not JetStream): a missed beacon is replaced by
//! the next one; a process that stops beaconing is forgotten by the receivers.

use serde::{Deserialize, Serialize};

use crate::subject::encode_token;

/// Prefix of beacon subjects.
pub const BEACON_PREFIX: &str = "walcast.health";
/// Subscription pattern for every beacon.
pub const BEACON_ALL: &str = "walcast.health.>";

/// One process's state at `at_ms`.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct Beacon {
    /// Unique per process start (a front's id, else `worker-<random>`).
    pub process: String,
    /// Sender's clock, Unix milliseconds.
    pub at_ms: u64,
    /// Whether the process's bus connection is up (it is, or this would not arrive; kept
    /// for symmetry with `/health`).
    pub bus_connected: bool,
    /// Present in a process that runs the CDC pipeline (a cdc-worker or `serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerBeacon>,
    /// Present in a process that serves clients (a ws-front or `serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front: Option<FrontBeacon>,
    /// The pipelines of the other sources (not the default) this worker leads or runs,
    /// each named by its `source`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<WorkerBeacon>,
}

impl Beacon {
    /// The state of `source`'s pipeline in this process, if it runs one.
    pub fn source(&self, source: &str) -> Option<&WorkerBeacon> {
        if crate::source::is_default(source) {
            return self.worker.as_ref();
        }
        self.sources.iter().find(|w| w.source == source)
    }
}

/// The pipeline part of a beacon.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
pub struct WorkerBeacon {
    /// The source this pipeline reads.
    #[serde(default = "default_source", skip_serializing_if = "is_default")]
    pub source: String,
    /// Holds the lease (or runs without election).
    pub leader: bool,
    /// Reading the slot and publishing.
    pub cdc_active: bool,
    pub slot: String,
    /// Bytes of WAL between the server's current position and the slot's confirmed one.
    pub lag_bytes: i64,
    /// Changes read from the WAL since the process started.
    pub changes_total: u64,
    /// Changes skipped (could not be delivered at all) since start.
    pub skipped_changes_total: u64,
    /// Why the pipeline is not active, if it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

fn default_source() -> String {
    crate::source::DEFAULT_SOURCE.to_string()
}

impl Default for WorkerBeacon {
    fn default() -> Self {
        WorkerBeacon {
            source: default_source(),
            leader: false,
            cdc_active: false,
            slot: String::new(),
            lag_bytes: 0,
            changes_total: 0,
            skipped_changes_total: 0,
            last_error: None,
        }
    }
}

fn is_default(source: &str) -> bool {
    crate::source::is_default(source)
}

/// The front part of a beacon.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Default)]
pub struct FrontBeacon {
    pub connections: usize,
    pub channels: usize,
    pub sse_streams: usize,
    pub subscriptions: usize,
    pub draining: bool,
    /// Connected users per project on this front (projects with none left out): the
    /// other fronts add them up to apply each project's limit across the cluster.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub project_users: std::collections::BTreeMap<String, u64>,
    /// Per-project rates on this front over the last second (projects with none left
    /// out): the other fronts add them up to apply each project's rate limits.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub project_rates: std::collections::BTreeMap<String, ProjectRates>,
}

/// One project's rates on one front, per second.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProjectRates {
    /// Channel joins.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub joins: u64,
    /// Broadcast and presence messages received from and sent to its clients.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub events: u64,
    /// Bytes of those messages.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub bytes: u64,
    /// Presence track and untrack events.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub presence: u64,
}

impl ProjectRates {
    /// Nothing counted.
    pub fn is_empty(&self) -> bool {
        *self == ProjectRates::default()
    }

    /// Both added, field by field.
    pub fn plus(self, o: ProjectRates) -> ProjectRates {
        ProjectRates {
            joins: self.joins.saturating_add(o.joins),
            events: self.events.saturating_add(o.events),
            bytes: self.bytes.saturating_add(o.bytes),
            presence: self.presence.saturating_add(o.presence),
        }
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Beacon {
    pub fn subject(&self) -> String {
        format!("{BEACON_PREFIX}.{}", encode_token(&self.process))
    }

    pub fn encode(&self) -> bytes::Bytes {
        // A struct of plain fields always serializes.
        bytes::Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    pub fn decode(payload: &[u8]) -> Option<Beacon> {
        serde_json::from_slice(payload).ok()
    }
}

/// Why a source's pipeline does not stream, as a class its projects' clients may be told:
/// never the error itself, which may name hosts, roles and other sources' details.
/// `last_error`: what a worker running the source reports (`None`: no worker reported
/// one, e.g. none runs it yet). Read from walcast's own messages (preflight, connection).
pub fn not_streaming_reason(last_error: Option<&str>) -> &'static str {
    let Some(e) = last_error.map(str::to_ascii_lowercase) else {
        return "no cdc-worker is reading it";
    };
    let has = |words: &[&str]| words.iter().any(|w| e.contains(w));
    if has(&["wal2json", "wal_level", "logical decoding"]) {
        "its database does not allow logical decoding (wal_level or wal2json)"
    } else if has(&["replication slot", "max_replication_slots"]) {
        "its replication slot cannot be used"
    } else if has(&[
        "replicat",
        "permission denied",
        "authentication",
        "password",
    ]) {
        "walcast is not allowed to read it"
    } else if has(&[
        "connect",
        "refused",
        "timed out",
        "timeout",
        "closed",
        "unreachable",
    ]) {
        "its database cannot be reached"
    } else {
        "its change stream failed"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beacons_round_trip_under_their_subject() {
        let b = Beacon {
            process: "front-a.b".into(),
            at_ms: 7,
            bus_connected: true,
            worker: Some(WorkerBeacon {
                leader: true,
                cdc_active: true,
                slot: "walcast".into(),
                lag_bytes: 42,
                changes_total: 9,
                ..Default::default()
            }),
            front: None,
            sources: vec![WorkerBeacon {
                source: "shop".into(),
                leader: true,
                ..Default::default()
            }],
        };
        assert_eq!(Beacon::decode(&b.encode()), Some(b.clone()));
        assert!(b.source("shop").is_some_and(|w| w.leader));
        assert_eq!(b.source("default"), b.worker.as_ref());
        assert!(b.source("other").is_none());
        let json: serde_json::Value = serde_json::from_slice(&b.encode()).unwrap();
        assert!(
            json["worker"].get("source").is_none(),
            "the default is implied"
        );
        let subject = b.subject();
        assert!(subject.starts_with("walcast.health."), "{subject}");
        assert_eq!(
            subject.matches('.').count(),
            2,
            "one token for the id: {subject}"
        );
        assert!(Beacon::decode(b"{}").is_none());
        let json: serde_json::Value = serde_json::from_slice(&b.encode()).unwrap();
        assert!(
            json.get("front").is_none(),
            "absent parts are left out: {json}"
        );
    }

    #[test]
    fn why_a_source_is_not_streaming_is_told_as_a_class() {
        let cases = [
            (None, "no cdc-worker is reading it"),
            (
                Some("error connecting to server: Connection refused (os error 111)"),
                "its database cannot be reached",
            ),
            (
                Some("wal_level is \"replica\", logical decoding needs \"logical\". Fix: …"),
                "its database does not allow logical decoding (wal_level or wal2json)",
            ),
            (
                Some("the wal2json output plugin is not installed on the Postgres server. Fix: …"),
                "its database does not allow logical decoding (wal_level or wal2json)",
            ),
            (
                Some("no free replication slot: all 10 of max_replication_slots are in use"),
                "its replication slot cannot be used",
            ),
            (
                Some("role \"w\" can neither replicate nor is superuser. Fix: …"),
                "walcast is not allowed to read it",
            ),
            (Some("something else"), "its change stream failed"),
        ];
        for (error, class) in cases {
            assert_eq!(not_streaming_reason(error), class, "{error:?}");
        }
    }
}
