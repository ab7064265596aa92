//! The versions of a batch's changes that wait for row checks, who waits for each, and
//! what the checks decided (see [`crate::authorize`]).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use walcast_bus::ChangeKind;

use crate::subscriptions::matcher::Sub;
use crate::telemetry;

/// One allowed entry: front, columns, class key or subscription id.
pub(super) type Allowed = (String, BTreeSet<String>, String);

pub(super) fn deny(sub: &Sub, why: &str) {
    metrics::counter!(telemetry::RLS_DENIED).increment(1);
    tracing::debug!(sub = %sub.spec.id, why, "change not delivered to subscriber");
}

/// Which version of a change a row check judges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Which {
    /// The row an INSERT or UPDATE wrote.
    New,
    /// The row a DELETE removed, or the one an UPDATE replaced (its `old_record`).
    Old,
}

/// A subscriber waiting for the row check of one version of a change.
#[derive(Debug, Clone)]
pub(super) struct Waiting {
    pub(super) change: usize,
    pub(super) which: Which,
    pub(super) sub: Arc<Sub>,
    /// The columns it may see.
    pub(super) cols: BTreeSet<String>,
    /// The verdict decides whether it gets the change (else only whether the change's
    /// `old_record` is shown to it).
    pub(super) delivers: bool,
}

/// Each version's position among its table's versions.
pub(super) type Positions = HashMap<(usize, Which), usize>;

/// The checks of one table being gathered.
#[derive(Default)]
pub(super) struct Gather {
    /// The versions to judge (change index, which version), in batch order.
    pub(super) versions: Vec<(usize, Which)>,
    pub(super) position: Positions,
    /// Group key (role, claims) → subscribers waiting.
    pub(super) groups: HashMap<(String, String), Vec<Waiting>>,
}

impl Gather {
    pub(super) fn row_of(&mut self, change: usize, which: Which) -> usize {
        *self.position.entry((change, which)).or_insert_with(|| {
            self.versions.push((change, which));
            self.versions.len() - 1
        })
    }
}

/// Per change: who may see it, and who may not see its old version.
#[derive(Debug, Default)]
pub(super) struct Verdicts {
    pub(super) allowed: Vec<Vec<Allowed>>,
    /// Subscription ids whose `old_record` is withheld: every subscriber of an UPDATE
    /// judged under RLS, until the old version's own check shows it to them.
    pub(super) hidden_old: Vec<HashSet<String>>,
}

impl Verdicts {
    pub(super) fn new(changes: usize) -> Verdicts {
        Verdicts {
            allowed: vec![Vec::new(); changes],
            hidden_old: vec![HashSet::new(); changes],
        }
    }

    /// The version `w` waited for is visible to it.
    pub(super) fn grant(&mut self, w: Waiting) {
        if !w.delivers {
            if let Some(hidden) = self.hidden_old.get_mut(w.change) {
                hidden.remove(&w.sub.spec.id);
            }
        } else if let Some(a) = self.allowed.get_mut(w.change) {
            a.push((w.sub.spec.front.clone(), w.cols, w.sub.spec.id.clone()));
        }
    }
}

/// The version `w` waited for is not visible to it: no delivery (or, for an old
/// version, no `old_record`, which needs nothing done).
pub(super) fn refuse(w: &Waiting, why: &str) {
    if w.delivers {
        deny(&w.sub, why);
    }
}

/// The versions of a change judged under RLS, and whether each decides delivery: an
/// INSERT's new row; an UPDATE's new row, and its old one for `old_record` (when it has
/// one); a DELETE's row, judged like an INSERT's (a subscriber gets a DELETE only if it
/// could have SELECTed the row deleted).
pub(super) fn judged_versions(kind: ChangeKind, has_old: bool) -> &'static [(Which, bool)] {
    match kind {
        ChangeKind::Insert => &[(Which::New, true)],
        ChangeKind::Update if has_old => &[(Which::New, true), (Which::Old, false)],
        ChangeKind::Update => &[(Which::New, true)],
        ChangeKind::Delete => &[(Which::Old, true)],
        ChangeKind::Truncate | ChangeKind::Read => &[],
    }
}
