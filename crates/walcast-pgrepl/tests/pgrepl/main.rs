//! The integration tests of walcast-pgrepl, in one test binary (the `throughput`
//! benchmark is ignored by default).

mod auth;
mod common;
mod stream;
mod throughput;
