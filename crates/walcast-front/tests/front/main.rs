//! The front's integration tests, one binary: a front on a loopback port with an
//! in-process bus and a stand-in worker ([`support`]), driven through its WebSocket, SSE
//! and REST endpoints.

mod support;

mod auth;
mod broadcast_presence;
mod channels;
mod hostile;
mod sse;
