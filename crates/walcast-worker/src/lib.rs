//! # walcast-worker
//!
//! The runtime of walcast's processes, which the binaries (`crates/walcast`: `walcast`,
//! `cdc-worker`, `ws-front`) and the benchmarks call:
//!
//! - [`cdc_worker`]: the cdc-worker — migrations, the default source, the other
//!   sources' [`supervisor`] and their fair [`share`] among the workers, the ops HTTP
//!   endpoints; every source, the default one included, is elected ([`election`]) and
//!   led ([`lead`], [`leader`]) by the same code; [`database`]: a source's database made
//!   ready (preflight, migrations, secrets sealed, the check login);
//! - [`ws_front`]: the ws-front process (the realtime front, `walcast-front`, on NATS),
//!   with its options ([`front`]);
//! - [`serve`]: both in one process (`walcast serve`);
//! - [`server`]: the HTTP accept loop every process serves with (bounded for clients that
//!   never authenticate), [`http`]: `/health`, `/livez`, `/readyz`, `/metrics`;
//!   [`beacon`]: this process's health, published for the inspector;
//! - [`config`], [`operator`]: every option (`--flag` and environment variable), each
//!   default defined once ([`token_rules`]: the JWKS URL, `iss` and `aud`);
//!   [`telemetry`]: logs and the metrics recorder;
//!   [`shutdown`]: SIGINT/SIGTERM and the front's drain.

#![forbid(unsafe_code)]

pub mod beacon;
pub mod cdc_worker;
pub mod config;
pub mod database;
pub mod election;
pub mod front;
pub mod http;
pub mod lead;
pub mod leader;
pub mod operator;
pub mod serve;
pub mod server;
pub mod share;
pub mod shutdown;
pub mod supervisor;
pub mod telemetry;
pub mod token_rules;
pub mod ws_front;
