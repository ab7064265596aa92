//! The front's integration tests, one binary: a front on a loopback port with an
//! in-process bus and a stand-in worker ([`support`]), driven through its WebSocket, SSE
//! and REST endpoints (`sources`: over a real NATS, with stand-in leaders of two sources).

mod support;

mod auth;
mod broadcast_presence;
mod channels;
mod failing_source;
mod hostile;
mod sources;
mod sse;
