//! Throwaway services for tests and benchmarks.
//!
//! * [`Postgres`]: a fresh cluster made with the machine's `initdb`, `wal_level=logical`,
//!   replication slots enabled, `max_slot_wal_keep_size` bounded, listening on a free
//!   127.0.0.1 port. Run as the `postgres` user when we are root.
//! * [`Nats`]: `nats-server -js` on a free 127.0.0.1 port with its own store directory.
//! * [`NatsCluster`]: N such servers routed into one JetStream cluster; one node can be
//!   killed (SIGKILL) and started again on its ports and store.
//! * [`fake_kube::FakeApi`]: an honest fake of the Kubernetes API server for Leases
//!   (the only fake: Kubernetes is not something a test can start).
//! * [`phoenix::PhoenixClient`]: a raw Phoenix (Supabase Realtime) WebSocket client, vsn
//!   1.0.0 and 2.0.0, for tests against a front.
//! * [`proxy::TcpProxy`]: a TCP relay to a local service whose link a test can cut and
//!   restore (a process's NATS connection dropping while NATS keeps running).
//! * [`tokens`]: test JWTs (HS256 by default) with given claims, role, project and expiry.
//!
//! Each service is owned by its handle: dropping it (also while unwinding from a panic)
//! stops the process and removes its directory. Each process is started under a small
//! shell watchdog whose stdin is a pipe from us, so even if the test process is killed
//! with SIGKILL the pipe closes and the watchdog stops the service.
//!
//! A missing binary is an error that names the command to install it: tests never skip.

mod error;
pub mod fake_kube;
mod nats;
mod nats_cluster;
pub mod phoenix;
mod ports;
mod postgres;
mod process;
pub mod proxy;
pub mod tls;
pub mod tokens;

pub use error::KitError;
pub use nats::Nats;
pub use nats_cluster::NatsCluster;
pub use ports::free_port;
pub use postgres::{as_check_login, Postgres, PostgresBuilder, CHECK_LOGIN};

/// The `SECRETS_KEY` tests and benchmarks give walcast's processes: the key the secrets
/// they store in `walcast.projects` and `walcast.sources` are encrypted with.
pub const SECRETS_KEY: &str = "walcast-tests-secrets-key-never-for-production-0123456789";
pub use proxy::TcpProxy;
