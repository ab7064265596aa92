//! Fitting a change to what one message can carry, the Supabase way: values over
//! `max_record_bytes` (or the bus's `max_payload`) are left out and the change is marked
//! `Error 413`; a change whose key alone is too large is skipped and reported.

use walcast_bus::event::Shrink;
use walcast_bus::ChangeEvent;

use super::EventError;
use crate::health::{PipelineHealth, SkippedChange};
use crate::telemetry;

/// Room left in a bus message for the subject, headers and framing.
const MESSAGE_OVERHEAD: usize = 1024;

/// Bring a change's values within `max_record_bytes` and `budget` (what one message can
/// carry, less room for subject and headers), the Supabase way (see
/// [`ChangeEvent::shrink_to`]): a reduced change is counted and reported; `false`: it
/// cannot be sent at all (skipped, reported). Shared by every publisher of changes.
pub fn fit(
    event: &mut ChangeEvent,
    max_record_bytes: usize,
    budget: usize,
    health: &PipelineHealth,
) -> Result<bool, EventError> {
    let columns: usize = event
        .columns
        .iter()
        .map(|c| c.name.len() + c.type_name.len() + 24)
        .sum();
    let limit = max_record_bytes.min(budget.saturating_sub(columns + MESSAGE_OVERHEAD));
    let size = event.record_bytes();
    let outcome = event.shrink_to(limit)?;
    let table = format!("{}.{}", event.schema, event.table);
    match outcome {
        Shrink::Fits => Ok(true),
        Shrink::SmallValues | Shrink::KeyOnly => {
            metrics::counter!(telemetry::CHANGES_OVERSIZED).increment(1);
            tracing::warn!(%table, commit_lsn = %event.commit_lsn, bytes = size, limit, "change too large: delivered without its large values (Error 413)");
            health.record_skip(
                SkippedChange {
                    table,
                    commit_lsn: Some(event.commit_lsn),
                    reason: "payload_too_large".into(),
                },
                true,
            );
            Ok(true)
        }
        Shrink::TooLarge => {
            health.report_skip(
                &table,
                Some(event.commit_lsn),
                "payload_too_large",
                &format!("even its primary key is over {limit} bytes"),
            );
            Ok(false)
        }
    }
}

/// The largest message a bus with `max_payload` takes, less room for subject and headers.
pub fn budget(max_payload: Option<usize>) -> usize {
    max_payload.map_or(usize::MAX, |m| m.saturating_sub(MESSAGE_OVERHEAD))
}
