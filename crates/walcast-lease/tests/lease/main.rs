//! The integration tests of walcast-lease, in one test binary: the Kubernetes Lease
//! elector against a fake API server, the Postgres lease-row elector against a real
//! Postgres.

mod kubernetes;
mod postgres;
