//! Evaluating the filters of a lane's batch, by its lag bound: what each change matched,
//! and the subscribers of the classes not evaluated in time (told, never silently left).

use std::time::Instant;

use super::Batch;
use crate::authorize::{PendingChange, Unjudged, Withheld};
use crate::subscriptions::narrow::{narrow, Narrowed};
use crate::telemetry;

/// Narrow each change of `batch` to the classes it matches (see
/// [`crate::subscriptions::narrow`]) by `deadline`; returns, per change, the subscribers
/// of the classes whose filters were not evaluated by then. Patterns run on a blocking
/// thread, not on the runtime every lane and the decoder share.
pub(super) async fn narrow_batch(batch: &mut Batch, deadline: Instant) -> Vec<Vec<Withheld>> {
    let costly = batch
        .changes
        .iter()
        .any(|c| c.candidates.iter().any(|m| m.class.has_patterns()));
    let changes = std::mem::take(&mut batch.changes);
    let (changes, unevaluated) = match costly {
        false => narrow_all(changes, deadline),
        true => match tokio::task::spawn_blocking(move || narrow_all(changes, deadline)).await {
            Ok(done) => done,
            // `narrow_all` catches a panic of one change's filters itself.
            Err(e) => {
                tracing::error!(error = %e, "narrowing a batch failed");
                (Vec::new(), Vec::new())
            }
        },
    };
    batch.changes = changes;
    unevaluated
}

fn narrow_all(
    mut changes: Vec<PendingChange>,
    deadline: Instant,
) -> (Vec<PendingChange>, Vec<Vec<Withheld>>) {
    let mut unevaluated = Vec::with_capacity(changes.len());
    for c in &mut changes {
        let run = std::panic::AssertUnwindSafe(|| {
            let kind = c.event.kind;
            narrow(c.candidates.clone(), kind, &c.filter_row, Some(deadline))
        });
        let n = match std::panic::catch_unwind(run) {
            Ok(n) => n,
            Err(_) => {
                metrics::counter!(telemetry::FILTER_ERRORS).increment(1);
                tracing::error!(table = %c.event.table, "a filter's evaluation panicked: the change's candidates are told");
                Narrowed {
                    matched: Vec::new(),
                    unevaluated: c.candidates.clone(),
                }
            }
        };
        if !n.unevaluated.is_empty() {
            metrics::counter!(telemetry::FILTERS_UNEVALUATED).increment(n.unevaluated.len() as u64);
        }
        let told = n.unevaluated.iter().flat_map(|m| {
            m.subs()
                .map(|s| (s.spec.front.clone(), s.spec.id.clone(), Unjudged::Filters))
        });
        unevaluated.push(told.collect());
        c.matched = n.matched;
    }
    (changes, unevaluated)
}
