//! The integration tests of walcast-lease, in one test binary: the Kubernetes Lease
//! elector against a fake API server (over HTTP, and over HTTPS configured by a kubeconfig
//! or a pod's service account), the Postgres lease-row elector against a real Postgres.

mod kubeconfig;
mod kubernetes;
mod postgres;
