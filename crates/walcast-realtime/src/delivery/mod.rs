//! Publishing what the WAL says to the fronts: the realtime consumer ([`consumer`]:
//! realtime-tables edits, routing, matching, authorization, publishing, DDL notices), the
//! events it builds ([`event`]), and database broadcast ([`broadcast`]), a consumer of
//! its own.

pub mod broadcast;
pub mod consumer;
pub mod event;
