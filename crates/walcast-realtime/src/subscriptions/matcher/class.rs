//! A subscription ([`Sub`]), its class ([`Class`]: what subscriptions matched together
//! have in common) and what a change matched ([`MatchedClass`]).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Instant;

use walcast_bus::subs::{ClassFields, SubscriptionSpec};
use walcast_bus::ChangeKind;
use walcast_protocol::filter::CompiledFilter;
use walcast_wal2json::Lsn;

/// A validated subscription.
#[derive(Debug)]
pub struct Sub {
    pub spec: SubscriptionSpec,
    /// Its filter, patterns compiled once.
    pub filter: Option<CompiledFilter>,
    pub effective_from: Lsn,
    /// The claims as JSON text, as bound for `request.jwt.claims` (subscribers with the
    /// same text share RLS checks).
    pub claims_json: String,
    /// Its class's fields, and their key ([`ClassFields::key`]).
    pub fields: ClassFields,
    pub class: String,
    /// When the worker registered it (a sync list older than that may lack it).
    pub(super) registered: Instant,
}

impl Sub {
    pub fn new(spec: SubscriptionSpec, filter: Option<CompiledFilter>, effective_from: Lsn) -> Sub {
        let fields = ClassFields::of(&spec);
        Sub {
            claims_json: serde_json::to_string(&spec.claims).unwrap_or_default(),
            class: fields.key(),
            fields,
            spec,
            filter,
            effective_from,
            registered: Instant::now(),
        }
    }

    pub fn role(&self) -> Option<&str> {
        self.spec.claims.get("role").and_then(|r| r.as_str())
    }
}

/// What the subscriptions of one class have in common.
#[derive(Debug)]
pub struct Class {
    pub key: String,
    /// What its subscriptions have in common (every member's fields equal these).
    pub fields: ClassFields,
    /// The JWT `role` claim (empty when there is none).
    pub role: String,
    pub(in crate::subscriptions) filter: Option<CompiledFilter>,
    /// What its filter's compiled patterns hold in memory.
    pub(super) heap: usize,
    kinds: [bool; 3],
    /// The binding's `select`: only these columns (and the key) are sent.
    pub select: Option<BTreeSet<String>>,
}

impl Class {
    pub(super) fn of(sub: &Sub) -> Class {
        let f = &sub.fields;
        let e = f.event.as_str();
        let all = e == "*";
        Class {
            key: sub.class.clone(),
            fields: f.clone(),
            role: f.role.clone(),
            filter: sub.filter.clone(),
            heap: sub.filter.as_ref().map_or(0, CompiledFilter::heap_bytes),
            select: f.select.as_ref().map(|c| c.iter().cloned().collect()),
            kinds: [
                all || e == "INSERT",
                all || e == "UPDATE",
                all || e == "DELETE",
            ],
        }
    }

    /// Whether its filter has patterns (`like`, `match`, …): the filters whose evaluation
    /// may cost more than a comparison.
    pub fn has_patterns(&self) -> bool {
        self.heap > 0
    }

    /// The columns its filter reads (none without a filter).
    pub fn filter_columns(&self) -> impl Iterator<Item = &str> {
        self.filter.iter().flat_map(|f| f.filter().columns())
    }

    pub(in crate::subscriptions) fn wants(&self, kind: ChangeKind) -> bool {
        match kind {
            ChangeKind::Insert => self.kinds[0],
            ChangeKind::Update => self.kinds[1],
            ChangeKind::Delete => self.kinds[2],
            // Supabase does not deliver TRUNCATE to clients (README "Change streams").
            ChangeKind::Truncate => false,
            // Snapshot rows go to the change stream only (README "Change streams").
            ChangeKind::Read => false,
        }
    }
}

/// The subscriptions of one class on one front.
pub type Bucket = Arc<Vec<Arc<Sub>>>;

/// A class a change matched, with the fronts that have a subscription effective at it.
#[derive(Debug, Clone)]
pub struct MatchedClass {
    pub class: Arc<Class>,
    pub fronts: Vec<(String, Bucket)>,
    /// The change's commit LSN.
    pub at: Lsn,
}

impl MatchedClass {
    /// The subscriptions in effect for the change.
    pub fn subs(&self) -> impl Iterator<Item = &Arc<Sub>> {
        let at = self.at;
        self.fronts
            .iter()
            .flat_map(|(_, b)| b.iter())
            .filter(move |s| at > s.effective_from)
    }
}
