//! The property tests of walcast-protocol, in one test binary.

mod prop_filter;
mod prop_frame;
mod prop_timestamp;
