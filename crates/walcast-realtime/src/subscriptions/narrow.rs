//! A change's candidates narrowed to the classes it matches: each class's event and
//! filter evaluated on the row. The work of a project's filters runs on that project's
//! delivery lane (off the task that decodes every project's changes, and without the
//! matcher's lock), and stops at a deadline: a project's costly filters make its own
//! changes late, nobody else's.

use std::time::Instant;

use walcast_bus::ChangeKind;
use walcast_protocol::filter::RecordView;
use walcast_wal2json::Lsn;

use super::matcher::{MatchedClass, Matcher};

/// What a change's candidates came to.
#[derive(Debug, Default)]
pub struct Narrowed {
    /// The classes it matches.
    pub matched: Vec<MatchedClass>,
    /// Those whose filter was not evaluated by the deadline (nothing said about the row:
    /// their subscribers are told the change could not be judged).
    pub unevaluated: Vec<MatchedClass>,
}

/// Narrow `candidates` (see [`Matcher::candidates`]) for a change of `kind` whose row, as
/// filters see it, is `row` (the new row for INSERT and UPDATE, the old for DELETE). A
/// filter that cannot be evaluated on the row denies that class only (counted). Past
/// `deadline`, the filters left are not evaluated (classes without one still match).
pub fn narrow(
    candidates: Vec<MatchedClass>,
    kind: ChangeKind,
    row: &impl RecordView,
    deadline: Option<Instant>,
) -> Narrowed {
    let mut out = Narrowed::default();
    for m in candidates {
        if !m.class.wants(kind) {
            continue;
        }
        let Some(filter) = &m.class.filter else {
            out.matched.push(m);
            continue;
        };
        if deadline.is_some_and(|d| Instant::now() >= d) {
            out.unevaluated.push(m);
            continue;
        }
        match filter.matches(row) {
            Ok(true) => out.matched.push(m),
            Ok(false) => {}
            Err(e) => {
                metrics::counter!(crate::telemetry::FILTER_ERRORS).increment(1);
                tracing::debug!(class = %m.class.key, error = %e, "filter could not be evaluated; not delivered");
            }
        }
    }
    out
}

impl Matcher {
    /// The classes a change matches (its candidates narrowed at once, without a
    /// deadline), each with the fronts that have a subscription in effect at `commit_lsn`.
    /// `row` is the new row for INSERT and UPDATE, the old row (replica identity) for
    /// DELETE. The work is per class, not per subscription.
    pub fn matches(
        &self,
        project: &str,
        schema: &str,
        table: &str,
        kind: ChangeKind,
        commit_lsn: Lsn,
        row: &impl RecordView,
    ) -> Vec<MatchedClass> {
        let candidates = self.candidates(project, schema, table, commit_lsn);
        narrow(candidates, kind, row, None).matched
    }
}
