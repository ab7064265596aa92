//! What a subscription is, as fronts and the cdc-worker exchange it: one
//! `postgres_changes` binding ([`SubscriptionSpec`]). Its own module so that the class
//! identity (module `class`) and the registry protocol (module `subs`, which re-exports
//! it) both build on it.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use walcast_core::Lsn;

/// One `postgres_changes` binding of one channel of one socket.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct SubscriptionSpec {
    /// Unique across the deployment: `<front id>:<counter>`.
    pub id: String,
    /// The front that owns it.
    pub front: String,
    pub project: String,
    /// Schema name, or `*` for all schemas of the project.
    pub schema: String,
    /// Table name; `None` for every table of the schema.
    pub table: Option<String>,
    /// `*`, `INSERT`, `UPDATE` or `DELETE` (upper case).
    pub event: String,
    /// The binding's `filter` string, unparsed (the worker parses and validates it).
    pub filter: Option<String>,
    /// Selected columns, if the binding has `select`.
    pub select: Option<Vec<String>>,
    /// The subscriber's JWT claims (JSON object); its `role` is the Postgres role. Shared:
    /// the front's registry, its registrations and, in one process, the worker's matcher
    /// hold the same claims (a copy each was about 2 KB per idle joined connection).
    pub claims: Arc<serde_json::Value>,
    /// The position the subscription has been effective from since it was first
    /// registered (the first reply's `effective_from`), sent again when a front registers
    /// it anew (resync to a new leader, token refresh): the worker keeps matching from
    /// there, so a backlog it replays after a failover or a restart is matched as the
    /// first leader matched it. `None` on the first registration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<Lsn>,
}

/// The selected columns of a subscription, sorted and once each (`None`: every column).
pub fn selected(spec: &SubscriptionSpec) -> Option<Vec<String>> {
    spec.select.as_ref().map(|s| {
        let mut cols: Vec<String> = s.iter().map(|c| c.trim().to_string()).collect();
        cols.sort();
        cols.dedup();
        cols
    })
}
