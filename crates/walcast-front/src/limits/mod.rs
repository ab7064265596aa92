//! What a project and a socket may do, and how much of it they did.
//!
//! * [`usage`]: per-project counters on this front (users, channels, joins, messages and
//!   bytes in and out, refusals) and the per-project limits, summed across the fronts
//!   from their beacons.
//! * [`rates`]: a project's per-second rates, by a sliding window.
//! * `bucket`: a socket's token buckets (joins, presence events) and the rate of new SSE
//!   streams per project.
//!
//! How many connections a front accepts at once is counted with the connections
//! (`connection::open`).

pub(crate) mod bucket;
pub mod rates;
pub mod usage;

pub(crate) use bucket::{OpenRate, TokenBucket};
