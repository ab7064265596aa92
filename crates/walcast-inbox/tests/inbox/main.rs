//! The integration tests of walcast-inbox, in one test binary.

mod exactly_once;
mod lifecycle;
mod support;
