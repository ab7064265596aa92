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

/// Why a change was withheld from a subscriber without a judgement: only a policy's
/// answer (its expression true, false or NULL for that subscriber and that version), the
/// role's privileges and the absence of a permissive policy withhold in silence; a
/// subscriber withheld for one of these is told (see `delivery::lanes`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Unjudged {
    /// Its check ran past `CDC_RLS_CHECK_TIMEOUT_MS`.
    Timeout,
    /// Its check was cancelled on the server.
    Cancelled,
    /// Its check failed: a policy that raised or read what the role may not read, a
    /// system column, a role dropped since the catalog read, the current-row comparison.
    /// One statement judges a group's versions together, so its error leaves every one
    /// of them unjudged.
    Failed,
    /// The catalog (privileges, policies, the table) could not be read as of the change.
    Catalog,
    /// Judged by its row, which had changed again by the check.
    Superseded,
    /// A deleted row lacking a value its policies read (a replica identity other than
    /// `FULL`): nothing holds it any more to judge it by.
    Incomplete,
    /// Its filter was not evaluated before the project's lag bound (the project's
    /// filters cost more than its lane could evaluate in time).
    Filters,
}

impl Unjudged {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Unjudged::Timeout => "timeout",
            Unjudged::Cancelled => "cancelled",
            Unjudged::Failed => "failed",
            Unjudged::Catalog => "catalog",
            Unjudged::Superseded => "superseded",
            Unjudged::Incomplete => "incomplete",
            Unjudged::Filters => "filters",
        }
    }

    /// What a failed check's error (as `walcast_pgtls::db_message` words it) means.
    pub(super) fn of_error(error: &str) -> Unjudged {
        match error.contains("(57014)") {
            true if error.contains("statement timeout") => Unjudged::Timeout,
            true => Unjudged::Cancelled,
            false => Unjudged::Failed,
        }
    }
}

/// A subscriber withheld a change unjudged: its front, its id, why.
pub type Withheld = (String, String, Unjudged);

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

/// Per change: who may see it, who may not see its old version, and who could not be
/// judged.
#[derive(Debug, Default)]
pub(super) struct Verdicts {
    pub(super) allowed: Vec<Vec<Allowed>>,
    /// Subscription ids whose `old_record` is withheld: every subscriber of an UPDATE
    /// judged under RLS, until the old version's own check shows it to them.
    pub(super) hidden_old: Vec<HashSet<String>>,
    pub(super) unjudged: Vec<Vec<Withheld>>,
}

impl Verdicts {
    pub(super) fn new(changes: usize) -> Verdicts {
        Verdicts {
            allowed: vec![Vec::new(); changes],
            hidden_old: vec![HashSet::new(); changes],
            unjudged: vec![Vec::new(); changes],
        }
    }

    /// Withhold change `i` from `sub` unjudged: denied, and noted to be told.
    pub(super) fn unjudged(&mut self, i: usize, sub: &Sub, why: Unjudged) {
        deny(sub, why.label());
        if let Some(list) = self.unjudged.get_mut(i) {
            list.push((sub.spec.front.clone(), sub.spec.id.clone(), why));
        }
    }

    /// The version `w` waited for could not be judged: a delivery withheld and told (an
    /// old version's `old_record` simply stays hidden).
    pub(super) fn unjudged_wait(&mut self, w: &Waiting, why: Unjudged) {
        if w.delivers {
            self.unjudged(w.change, &w.sub, why);
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
