//! The bodies of a notice about subscriptions (`subs-ended`, `subs-lagged`) for one front.
//!
//! A notice names every subscription it is about, and a front may hold tens of
//! thousands of one project's: its ids go in as many messages as it takes to keep each
//! under [`MESSAGE_BUDGET`], well within the bus's `max_payload` (one body over it would
//! fail to publish, and stop the lane that sends it).

use bytes::Bytes;
use walcast_bus::subs::{chunks_by_size, SubsEnded, MESSAGE_BUDGET};

use crate::error::RealtimeError;
use walcast_pipeline::change_event::EventError;

/// `message` about `ids`, in bodies of at most about [`MESSAGE_BUDGET`] bytes each.
pub fn bodies(ids: Vec<String>, message: &str) -> Result<Vec<Bytes>, RealtimeError> {
    // The message and the JSON around the ids count too.
    let budget = MESSAGE_BUDGET.saturating_sub(message.len() + 64).max(1024);
    chunks_by_size(ids, budget)
        .into_iter()
        .map(|ids| {
            let body = SubsEnded {
                ids,
                message: message.to_string(),
            };
            serde_json::to_vec(&body)
                .map(Bytes::from)
                .map_err(|e| RealtimeError::Event(EventError::Json(e)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forty_thousand_ids_go_in_bodies_under_the_budget_and_none_is_lost() {
        let ids: Vec<String> = (0..40_000)
            .map(|n| format!("front-0123456789abcdef:{n}"))
            .collect();
        let message = "m".repeat(300);
        let bodies = bodies(ids.clone(), &message).unwrap();
        assert!(bodies.len() > 1);
        let mut back = Vec::new();
        for b in &bodies {
            assert!(b.len() <= MESSAGE_BUDGET, "{} bytes", b.len());
            let n: SubsEnded = serde_json::from_slice(b).unwrap();
            assert_eq!(n.message, message);
            back.extend(n.ids);
        }
        assert_eq!(back, ids);
    }
}
