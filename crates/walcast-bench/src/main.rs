//! `cargo run --release -p walcast-bench -- <benchmark>`: each benchmark starts its own
//! throwaway Postgres and nats-server, measures a baseline and walcast in the same run,
//! and prints both with their ratio.

mod cdc;
mod changes;
mod cpu;
mod env;
mod isolation;
mod latency;
mod outbox;
mod outbox_poll;
mod rls;
mod scale;
mod snapshot;
mod snapshot_check;
mod sources;
mod ws;
mod ws_server;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "walcast-bench", about)]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// CDC drain rate: raw `pg_logical_slot_get_changes` vs the poller end to end to NATS.
    Cdc(cdc::CdcBench),
    /// Commit-to-NATS latency at a steady rate, stream vs poll, with and without an idle
    /// transaction pinning restart_lsn.
    Latency(latency::LatencyBench),
    /// WebSocket fan-out: N raw Phoenix clients on `walcast serve` (a child process),
    /// deliveries/s, commit-to-client latency, memory per idle connection, against a
    /// minimal WebSocket fan-out server.
    Ws(ws::WsBench),
    /// Row-level security: N subscribers with distinct claims on one RLS table, batched
    /// checks vs one check per subscriber per change: deliveries/s and p99 latency.
    Rls(rls::RlsBench),
    /// Scale: one cdc-worker and K ws-front processes over NATS, clients growing in steps:
    /// the leader's CPU and published bytes per change, against the smallest step.
    Scale(scale::ScaleBench),
    /// Outbox relay: walcast's (from the WAL) against an `xid8`-offset polling relay, on
    /// the same events: backlog events/s relayed with JetStream acks and commit-to-ack
    /// latency at a steady rate, with and without an idle transaction open.
    Outbox(outbox::OutboxBench),
    /// Change streams: the same backlog drained to core NATS (realtime, table subjects)
    /// and to JetStream (the change stream, each change PubAck'd before the slot moves):
    /// changes/s of each and the ratio.
    Changes(changes::ChangesBench),
    /// Snapshots: a table's rows published on its change stream while a writer inserts
    /// at a steady rate: snapshot rows/s, and the writer's p99 insert latency without and
    /// with the snapshot, and the ratio.
    Snapshot(snapshot::SnapshotBench),
    /// Fault isolation between tenants: the default project's INSERT→client latency alone
    /// and beside projects with a slow RLS policy, and another table's latency during a
    /// burst of table enables through the REST API.
    Isolation(isolation::IsolationBench),
    /// Many sources: the cdc-workers' memory and CPU per idle source, commit-to-NATS
    /// latency per source under steady load, and how long a killed worker's sources take
    /// to be led again, against the default source alone.
    Sources(sources::SourcesBench),
    /// (internal) `walcast serve` with the in-process bus, run as the `ws` child.
    #[command(hide = true)]
    WsServer(Box<ws_server::ServerArgs>),
    /// (internal) the `ws` baseline server.
    #[command(hide = true)]
    WsBaselineServer(ws_server::BaselineArgs),
    /// (internal) the `cdc-worker` entry point, run as the `scale` leader and the
    /// `outbox` relay.
    #[command(hide = true)]
    ScaleWorker(Box<walcast_worker::cdc_worker::CdcWorkerConfig>),
    /// (internal) the `ws-front` entry point, run as a `scale` front.
    #[command(hide = true)]
    ScaleFront(Box<walcast_worker::ws_front::WsFrontConfig>),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse().bench {
        Bench::Cdc(args) => cdc::run(args).await,
        Bench::Latency(args) => latency::run(args).await,
        Bench::Ws(args) => ws::run(args).await,
        Bench::Rls(args) => rls::run(args).await,
        Bench::Outbox(args) => outbox::run(args).await,
        Bench::Isolation(args) => isolation::run(args).await,
        Bench::Changes(args) => changes::run(args).await,
        Bench::Snapshot(args) => snapshot::run(args).await,
        Bench::WsServer(args) => ws_server::serve_walcast(*args).await,
        Bench::WsBaselineServer(args) => ws_server::serve_baseline(args).await,
        Bench::Scale(args) => scale::run(args).await,
        Bench::Sources(args) => sources::run(args).await,
        Bench::ScaleWorker(cfg) => walcast_worker::cdc_worker::main(*cfg).await,
        Bench::ScaleFront(cfg) => walcast_worker::ws_front::main(*cfg).await,
    }
}
