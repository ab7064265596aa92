//! Publishing what the WAL says to the fronts: the realtime consumer ([`consumer`]:
//! realtime-tables edits, routing, matching, authorization, publishing, DDL notices), the
//! events it builds (`walcast_pipeline::change_event`), database broadcast ([`broadcast`]), a consumer of
//! its own, and the numbered, resendable stream of each front ([`links`]). Each
//! project's changes are authorized and published by a lane of its own ([`lanes`])
//! through the [`outlet`]. Subscriptions whose role may not read their table, or a column
//! their filter reads, are told so by the [`privilege_watch`].

pub mod broadcast;
pub mod consumer;
pub mod lanes;
pub mod links;
pub mod notice;
pub mod outlet;
pub mod privilege_watch;
