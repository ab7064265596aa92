//! Publishing what the WAL says to the fronts: the realtime consumer ([`consumer`]:
//! realtime-tables edits, routing, matching, authorization, publishing, DDL notices), the
//! events it builds ([`event`]), and database broadcast ([`broadcast`]), a consumer of
//! its own. Each project's changes are authorized and published by a lane of its own
//! ([`lanes`]) through the [`outlet`].

pub mod broadcast;
pub mod consumer;
pub mod event;
pub mod lanes;
pub mod outlet;
