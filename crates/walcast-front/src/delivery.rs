//! Where this front delivers: its subscriptions (the [`Registry`]: subscription → the
//! sink of a WebSocket channel or SSE stream, for `postgres_changes`) and its channels by
//! topic ([`Topics`], for broadcast and presence).
//!
//! Fan-out, broadcast and presence read it; joins, leaves, SSE streams and the worker's
//! answers change it.

use crate::registry::Registry;
use crate::topics::Topics;

pub(crate) struct Delivery {
    pub registry: Registry,
    pub topics: Topics,
}

impl Delivery {
    /// Subscription ids are `<front_id>:<n>`.
    pub(crate) fn new(front_id: &str) -> Delivery {
        Delivery {
            registry: Registry::new(front_id),
            topics: Topics::default(),
        }
    }
}
