//! Outbox relay: walcast's relay (the real `cdc-worker`, reading `walcast.emit` from the
//! WAL) against an `xid8`-offset polling relay implemented here ([`crate::outbox_poll`]),
//! on the same events, with and without a session idle in a transaction.
//!
//! Every event is one transaction that writes it both ways (`bench_emit`: a row of the
//! polling relay's table and `walcast.emit`, the same payload), so the database does the
//! same work whichever relay runs; each scenario runs one relay on fresh servers:
//! 1. **Drain**: `--events` are written while the relay is not running (walcast's slot
//!    already exists), then the relay starts; events/s = events / (last − first stored in
//!    JetStream), JetStream's store time being taken just before its PubAck.
//! 2. **Steady**: `--rate` events/s for `--secs` with the relay running; commit → ack =
//!    JetStream's store time − `clock_timestamp()` taken in the event's transaction just
//!    before its commit (same machine clock), read from the stored messages.
//!
//! With an idle transaction: a session runs `BEGIN; SELECT pg_current_xact_id()` and sits
//! idle. During the drain it is opened before the backlog is written and ended
//! `--idle-hold-secs` after the relay started; during the steady phase it is open from
//! the first write to the last.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context};
use async_nats::jetstream;
use clap::Args;
use futures_util::StreamExt;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::outbox_poll::{self, PollRelay};
use crate::scale::Proc;

#[derive(Args)]
pub struct OutboxBench {
    /// Events in the backlog each relay drains (one transaction each).
    #[arg(long, default_value_t = 100_000)]
    events: i64,
    /// Events per second written while the relay runs (commit-to-ack latency).
    #[arg(long, default_value_t = 2000)]
    rate: u32,
    /// Seconds of that steady load.
    #[arg(long, default_value_t = 10)]
    secs: u64,
    /// With an idle transaction: seconds it stays open once the relay started draining.
    #[arg(long, default_value_t = 5)]
    idle_hold_secs: u64,
    /// Bytes of padding in each payload.
    #[arg(long, default_value_t = 100)]
    pad: usize,
    /// The polling relay: rows per poll.
    #[arg(long, default_value_t = 1000)]
    poll_batch: i64,
    /// The polling relay: wait after a poll that found less than a batch, in ms.
    #[arg(long, default_value_t = 10)]
    poll_interval_ms: u64,
    /// walcast's CDC source (`stream` or `poll`).
    #[arg(long, default_value = "stream")]
    source: String,
    /// Fail when a phase's events are not all in JetStream this many seconds after its
    /// last write (or after the idle transaction ended, whichever is later).
    #[arg(long, default_value_t = 60)]
    max_wait: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Relay {
    Walcast,
    Poll,
}

/// Written by both relays' scenarios: one transaction per event, the event both ways.
const SETUP_SQL: &str = "
    CREATE FUNCTION bench_emit(seq int8, pad text) RETURNS void LANGUAGE plpgsql AS $$
    DECLARE
        k text := 'k' || (seq % 20);
        p jsonb := jsonb_build_object('seq', seq, 'pad', pad,
            'at', (extract(epoch FROM clock_timestamp()) * 1000000)::int8);
    BEGIN
        INSERT INTO bench_outbox (key, payload) VALUES (k, p);
        PERFORM walcast.emit('bench', k, p);
    END $$;
    CREATE PROCEDURE bench_load(first int8, n int8, pad text) LANGUAGE plpgsql AS $$
    BEGIN
        FOR i IN first..first + n - 1 LOOP
            PERFORM bench_emit(i, pad);
            COMMIT;
        END LOOP;
    END $$;";

/// One scenario's numbers.
struct Outcome {
    drained: usize,
    drain_rate: f64,
    /// From the relay's start to its first event in JetStream.
    first_after: Duration,
    steady_sent: usize,
    steady_received: usize,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    achieved_rate: f64,
    duplicates: usize,
    /// CPU seconds over the drain (relay start → every backlog event stored).
    cpu: DrainCpu,
}

/// CPU seconds spent over the drain by the relay (walcast: the cdc-worker process, its
/// start included; the poller: this process, which runs it), nats-server and Postgres
/// (every backend: the walsender, the poller's queries).
#[derive(Clone, Copy, Default)]
struct DrainCpu {
    relay: f64,
    nats: f64,
    postgres: f64,
}

/// The counters at the drain's start.
struct CpuMeter {
    nats: Option<u32>,
    postmaster: Option<u32>,
    at_start: DrainCpu,
}

impl CpuMeter {
    fn start(env: &crate::env::BenchEnv) -> CpuMeter {
        let nats = env.nats.pid();
        let postmaster = crate::cpu::postmaster(&env.pg.data_dir());
        let tree = |pid: Option<u32>| pid.map_or(0.0, crate::cpu::tree_secs);
        CpuMeter {
            nats,
            postmaster,
            at_start: DrainCpu {
                relay: crate::cpu::secs("self"),
                nats: tree(nats),
                postgres: tree(postmaster),
            },
        }
    }

    fn stop(&self, running: &Running) -> DrainCpu {
        let tree = |pid: Option<u32>| pid.map_or(0.0, crate::cpu::tree_secs);
        let relay = match running {
            Running::Walcast(p) => crate::cpu::tree_secs(p.child.id()),
            Running::Poll(..) => crate::cpu::secs("self") - self.at_start.relay,
        };
        DrainCpu {
            relay,
            nats: tree(self.nats) - self.at_start.nats,
            postgres: tree(self.postmaster) - self.at_start.postgres,
        }
    }
}

pub async fn run(args: OutboxBench) -> anyhow::Result<()> {
    anyhow::ensure!(args.events >= 2, "--events must be at least 2");
    println!(
        "outbox relay: {} events drained from a backlog, then {} events/s for {} s; one \
         transaction per event, written both ways; walcast source {}; the polling relay \
         reads {} rows per poll, waits {} ms after a short poll; idle transaction held {} s \
         into the drain",
        args.events,
        args.rate,
        args.secs,
        args.source,
        args.poll_batch,
        args.poll_interval_ms,
        args.idle_hold_secs
    );
    println!(
        "{:<16} {:<9} {:>13} {:>10} {:>11} {:>13} {:>9} {:>9} {:>9} {:>8}  drain CPU s: relay/nats/pg",
        "relay",
        "idle txn",
        "drained",
        "events/s",
        "1st after s",
        "steady recv",
        "p50 ms",
        "p99 ms",
        "max ms",
        "tx/s"
    );
    for idle in [false, true] {
        let mut pair = Vec::new();
        for relay in [Relay::Walcast, Relay::Poll] {
            let o = scenario(&args, relay, idle).await?;
            print_row(&args, relay, idle, &o);
            check_complete(&args, relay, idle, &o)?;
            pair.push(o);
        }
        print_ratios(idle, &pair[0], &pair[1]);
    }
    Ok(())
}

fn name(args: &OutboxBench, relay: Relay) -> String {
    match relay {
        Relay::Walcast => format!("walcast ({})", args.source),
        Relay::Poll => "xid8 poll".into(),
    }
}

fn print_row(args: &OutboxBench, relay: Relay, idle: bool, o: &Outcome) {
    let c = &o.cpu;
    println!(
        "{:<16} {:<9} {:>13} {:>10.0} {:>11.2} {:>13} {:>9.2} {:>9.2} {:>9.2} {:>8.0}  {:.2}/{:.2}/{:.2}",
        name(args, relay),
        if idle { "open" } else { "none" },
        format!("{}/{}", o.drained, args.events),
        o.drain_rate,
        o.first_after.as_secs_f64(),
        format!("{}/{}", o.steady_received, o.steady_sent),
        o.p50_ms,
        o.p99_ms,
        o.max_ms,
        o.achieved_rate,
        c.relay,
        c.nats,
        c.postgres
    );
}

fn print_ratios(idle: bool, walcast: &Outcome, poll: &Outcome) {
    // Two significant digits, however small (behind an idle transaction the polling
    // relay's latency is thousands of times walcast's).
    let r = |a: f64, b: f64| {
        let x = if b > 0.0 { a / b } else { f64::NAN };
        let decimals = if x > 0.0 && x < 1.0 {
            (1.0 - x.log10().floor()) as usize
        } else {
            2
        };
        format!("{x:.decimals$}")
    };
    println!(
        "  ratio walcast / xid8 poll, idle txn {}: events/s {}, p50 {}, p99 {}",
        if idle { "open" } else { "none" },
        r(walcast.drain_rate, poll.drain_rate),
        r(walcast.p50_ms, poll.p50_ms),
        r(walcast.p99_ms, poll.p99_ms)
    );
}

fn check_complete(args: &OutboxBench, relay: Relay, idle: bool, o: &Outcome) -> anyhow::Result<()> {
    let what = format!("{}, idle txn {idle}", name(args, relay));
    if o.drained != args.events as usize || o.steady_received != o.steady_sent {
        bail!(
            "{what}: expected {} backlog and {} steady events in JetStream, got {} and {} \
             within {} s",
            args.events,
            o.steady_sent,
            o.drained,
            o.steady_received,
            args.max_wait
        );
    }
    if o.duplicates > 0 {
        bail!("{what}: {} events stored more than once", o.duplicates);
    }
    Ok(())
}

/// A relay under test, running.
enum Running {
    Walcast(Proc),
    Poll(
        CancellationToken,
        tokio::task::JoinHandle<anyhow::Result<()>>,
    ),
}

impl Running {
    async fn start(
        args: &OutboxBench,
        relay: Relay,
        env: &crate::env::BenchEnv,
    ) -> anyhow::Result<Running> {
        if relay == Relay::Walcast {
            let vars = [
                ("DATABASE_URL", env.pg.url()),
                ("CHECK_DATABASE_URL", env.pg.check_url()),
                ("NATS_URL", env.nats.url()),
                ("LEASE_MODE", "none".to_string()),
                ("CDC_SOURCE", args.source.clone()),
                // Not the LEASE_MODE=none warning amid the table.
                ("LOG_LEVEL", "error".to_string()),
            ];
            return Ok(Running::Walcast(Proc::start(
                "scale-worker",
                "cdc-worker".into(),
                &vars,
            )?));
        }
        let nats = async_nats::connect(env.nats.url()).await?;
        let poller = PollRelay {
            db: env.pg.connect().await?,
            js: outbox_poll::context(nats),
            batch: args.poll_batch,
            interval: Duration::from_millis(args.poll_interval_ms),
        };
        let cancel = CancellationToken::new();
        let task = tokio::spawn(poller.run(cancel.clone()));
        Ok(Running::Poll(cancel, task))
    }

    /// An error once the relay stopped by itself.
    async fn check(&mut self) -> anyhow::Result<()> {
        match self {
            Running::Walcast(p) => match p.child.try_wait()? {
                Some(status) => bail!("the cdc-worker exited: {status}"),
                None => Ok(()),
            },
            Running::Poll(_, task) if task.is_finished() => {
                let outcome = task.await?;
                bail!("the polling relay stopped: {outcome:?}")
            }
            Running::Poll(..) => Ok(()),
        }
    }

    async fn stop(self) {
        if let Running::Poll(cancel, task) = self {
            cancel.cancel();
            let _ = task.await;
        }
    }
}

/// A session idle in a transaction that took an xid.
async fn open_idle(pg: &walcast_testkit::Postgres) -> anyhow::Result<Client> {
    let c = pg.connect().await?;
    c.batch_execute("BEGIN").await?;
    c.query_one("SELECT pg_current_xact_id()::text", &[])
        .await?;
    Ok(c)
}

/// Messages in `stream` (0 before it exists).
async fn count(js: &jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut s) => s.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

/// Wait until `stream` holds `n` messages or `deadline` passed (the caller checks what
/// arrived); fails if the relay stopped.
async fn wait_count(
    js: &jetstream::Context,
    stream: &str,
    n: u64,
    deadline: Instant,
    relay: &mut Running,
) -> anyhow::Result<()> {
    while count(js, stream).await < n && Instant::now() < deadline {
        relay.check().await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// `--rate` events/s for `--secs` from seq `first`, one connection, one transaction each
/// (a tick every millisecond sends the events due by then): (sent, achieved rate).
async fn steady(
    pg: &walcast_testkit::Postgres,
    args: &OutboxBench,
    first: i64,
) -> anyhow::Result<(usize, f64)> {
    let writer = pg.connect().await?;
    let stmt = writer.prepare("SELECT bench_emit($1, $2)").await?;
    let pad = "x".repeat(args.pad);
    let total = (args.rate as u64 * args.secs) as usize;
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut sent = 0usize;
    while sent < total {
        tick.tick().await;
        let due = ((started.elapsed().as_secs_f64() * args.rate as f64) as usize).min(total);
        while sent < due {
            writer
                .execute(&stmt, &[&(first + sent as i64), &pad])
                .await?;
            sent += 1;
        }
    }
    Ok((sent, sent as f64 / started.elapsed().as_secs_f64()))
}

async fn scenario(args: &OutboxBench, relay: Relay, idle: bool) -> anyhow::Result<Outcome> {
    let env =
        crate::env::start_without_table(&format!("{}{SETUP_SQL}", outbox_poll::SETUP_SQL)).await?;
    // walcast's slot, before any idle transaction (creating a slot waits for those).
    crate::env::create_slots(&env.admin, &["walcast_cdc_slot"]).await?;
    let js = jetstream::new(async_nats::connect(env.nats.url()).await?);
    let stream = match relay {
        Relay::Walcast => walcast_outbox::config::DEFAULT_STREAM,
        Relay::Poll => outbox_poll::STREAM,
    };
    let max_wait = Duration::from_secs(args.max_wait);
    let hold = Duration::from_secs(if idle { args.idle_hold_secs } else { 0 });
    let idle_session = if idle {
        Some(open_idle(&env.pg).await?)
    } else {
        None
    };
    let pad = "x".repeat(args.pad);
    env.admin
        .execute("CALL bench_load($1, $2, $3)", &[&0i64, &args.events, &pad])
        .await
        .context("writing the backlog")?;

    let started = SystemTime::now();
    let meter = CpuMeter::start(&env);
    let mut running = Running::start(args, relay, &env).await?;
    let release = idle_session.map(|c| {
        tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            c.batch_execute("ROLLBACK").await
        })
    });
    let deadline = Instant::now() + hold + max_wait;
    wait_count(&js, stream, args.events as u64, deadline, &mut running).await?;
    let cpu = meter.stop(&running);
    if let Some(r) = release {
        r.await??;
    }

    let idle_session = if idle {
        Some(open_idle(&env.pg).await?)
    } else {
        None
    };
    let (sent, achieved) = steady(&env.pg, args, args.events).await?;
    if let Some(c) = idle_session {
        c.batch_execute("ROLLBACK").await?;
    }
    let want = (args.events as usize + sent) as u64;
    wait_count(&js, stream, want, Instant::now() + max_wait, &mut running).await?;
    let msgs = read_stored(&js, stream).await?;
    running.stop().await;
    Ok(Outcome {
        cpu,
        ..summarize(args.events, started, &msgs, sent, achieved)
    })
}

/// One stored event: its `seq` and `at` (µs) from the payload, when JetStream stored it.
struct Msg {
    seq: i64,
    at_us: i64,
    stored_us: i64,
}

/// Every message `stream` holds, in stream order (an ordered consumer).
async fn read_stored(js: &jetstream::Context, stream: &str) -> anyhow::Result<Vec<Msg>> {
    let mut out = Vec::new();
    let Ok(mut s) = js.get_stream(stream).await else {
        return Ok(out);
    };
    let last = s.info().await?.state.last_sequence;
    if last == 0 {
        return Ok(out);
    }
    let reader = s
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await?;
    let mut messages = reader.messages().await?;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .with_context(|| format!("reading {stream}: nothing for 30 s after {}", out.len()))?
            .context("the consumer ended")??;
        let info = m.info().map_err(|e| anyhow::anyhow!(e))?;
        let v: serde_json::Value = serde_json::from_slice(&m.payload)?;
        out.push(Msg {
            seq: v["seq"].as_i64().context("payload without seq")?,
            at_us: v["at"].as_i64().context("payload without at")?,
            stored_us: (info.published.unix_timestamp_nanos() / 1000) as i64,
        });
        if info.stream_sequence >= last {
            break;
        }
    }
    Ok(out)
}

fn micros(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// The numbers of one scenario from what the stream holds (backlog: seq < `events`).
fn summarize(
    events: i64,
    started: SystemTime,
    msgs: &[Msg],
    steady_sent: usize,
    achieved_rate: f64,
) -> Outcome {
    let distinct: HashSet<i64> = msgs.iter().map(|m| m.seq).collect();
    let (backlog, live): (Vec<&Msg>, Vec<&Msg>) = msgs.iter().partition(|m| m.seq < events);
    let drained = distinct.iter().filter(|s| **s < events).count();
    let first = backlog.iter().map(|m| m.stored_us).min().unwrap_or(0);
    let last = backlog.iter().map(|m| m.stored_us).max().unwrap_or(0);
    let span = (last - first) as f64 / 1e6;
    let mut lat: Vec<f64> = live
        .iter()
        .map(|m| (m.stored_us - m.at_us) as f64 / 1000.0)
        .collect();
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        let i = ((lat.len() as f64 * p) as usize).min(lat.len().saturating_sub(1));
        lat.get(i).copied().unwrap_or(f64::NAN)
    };
    Outcome {
        drained,
        drain_rate: if span > 0.0 {
            (drained - 1) as f64 / span
        } else {
            f64::NAN
        },
        first_after: Duration::from_micros((first - micros(started)).max(0) as u64),
        steady_sent,
        steady_received: distinct.len() - drained,
        p50_ms: pct(0.50),
        p99_ms: pct(0.99),
        max_ms: lat.last().copied().unwrap_or(f64::NAN),
        achieved_rate,
        duplicates: msgs.len() - distinct.len(),
        cpu: DrainCpu::default(),
    }
}
