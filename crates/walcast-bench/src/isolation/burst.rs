//! Phase B, enable burst: `--tables` tables of one project enabled through the REST API
//! while the default project's table is written (see the module doc of [`super`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use walcast_testkit::tokens::Claims;

use super::client::{self, lock, Shared};
use super::{ratio, wait_until, IsolationBench, Stack, Window};
use crate::ws::now_micros;

const STEADY_SQL: &str = "CREATE TABLE steady (id int8 PRIMARY KEY, at int8 NOT NULL);
     GRANT SELECT ON steady TO anon, authenticated;";
const STEADY_INSERT: &str = "INSERT INTO steady (id, at) VALUES ($1, $2)";
const WARMUP_ID: i64 = 1;
const BEFORE_ID: i64 = 1_000;
const DURING_ID: i64 = 1_000_000;

/// The project whose tables are enabled: id, schema, secret.
struct Burst {
    id: String,
    schema: String,
    secret: String,
}

fn table(i: usize) -> String {
    format!("t{i:05}")
}

async fn setup(args: &IsolationBench) -> anyhow::Result<(Stack, Burst)> {
    let mut env = crate::env::start(STEADY_SQL, "steady").await?;
    let keys = crate::env::secret_keys()?;
    let p = walcast_control::projects::create(&mut env.admin, &keys, "burst").await?;
    let s = walcast_core::sql::quote_ident(&p.schema);
    env.admin
        .batch_execute(&format!(
            "DO $$ BEGIN FOR i IN 1..{n} LOOP
                EXECUTE format('CREATE TABLE {s}.%I (id int8 PRIMARY KEY, at int8 NOT NULL)',
                               't' || lpad(i::text, 5, '0'));
             END LOOP; END $$;
             GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO anon, authenticated;",
            n = args.tables
        ))
        .await?;
    let stack = Stack::start(env, "burst", &args.log_level).await?;
    Ok((
        stack,
        Burst {
            id: p.id,
            schema: p.schema,
            secret: p.jwt_secret,
        },
    ))
}

/// What the enables took.
struct Enables {
    /// From the first request sent to the last answer.
    total: Duration,
    /// Each request's status and time.
    answers: Vec<(u16, f64)>,
    /// The first answer that was not 200.
    first_failure: Option<String>,
}

/// Enable every table, the requests spread evenly over `--burst-secs`, at most
/// `--enable-concurrency` in flight.
async fn enable_all(args: &IsolationBench, port: u16, b: &Burst) -> anyhow::Result<Enables> {
    let key: Arc<str> = Claims::role("service_role")
        .project(&b.id)
        .expires_in(24 * 3600)
        .sign(&b.secret)
        .into();
    let limit = Arc::new(Semaphore::new(args.enable_concurrency.max(1)));
    let every = Duration::from_secs_f64(args.burst_secs as f64 / args.tables.max(1) as f64);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for i in 1..=args.tables {
        tokio::time::sleep_until((start + every * (i as u32 - 1)).into()).await;
        let permit = limit.clone().acquire_owned().await?;
        let path = format!("/v1/db/{}/schema/tables/{}/realtime", b.id, table(i));
        let key = key.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = client::put(port, &path, &key, r#"{"enabled": true}"#).await;
            drop(permit);
            (r, t.elapsed().as_secs_f64() * 1000.0)
        }));
    }
    let (mut answers, mut first_failure) = (Vec::new(), None);
    for t in tasks {
        let (r, ms) = t.await?;
        let status = match r {
            Ok((200, _)) => 200,
            Ok((status, body)) => {
                first_failure.get_or_insert(format!("{status} {body}"));
                status
            }
            Err(e) => {
                first_failure.get_or_insert(format!("{e:#}"));
                0
            }
        };
        answers.push((status, ms));
    }
    Ok(Enables {
        total: start.elapsed(),
        answers,
        first_failure,
    })
}

/// The steady table's latencies of rows `first..first + n`; missing ones count as
/// arriving at `end_us`, each written `1/rate` s after the one before from `start_us`.
fn steady_window(s: &Shared, first: i64, n: u64, start_us: i64, end_us: i64, rate: u64) -> Window {
    let s = lock(s);
    let lat: Vec<Option<f64>> = (0..n as i64)
        .map(|i| s.rows.get(&(first + i)).copied())
        .collect();
    Window::of(&lat, |i| {
        (end_us - start_us) as f64 / 1000.0 - i as f64 * 1000.0 / rate.max(1) as f64
    })
}

/// Write the steady table from `first` for `secs` (or, with `until`, until that future
/// ends), then wait for its rows; the window and what `until` returned.
async fn steady<T>(
    args: &IsolationBench,
    stack: &Stack,
    sub: &Shared,
    first: i64,
    secs: u64,
    until: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(Window, T)> {
    let db = stack.env.pg.connect().await?;
    let stop = CancellationToken::new();
    let start_us = now_micros();
    let rate = args.rows_per_sec;
    let writer = client::write_paced(
        &db,
        STEADY_INSERT,
        first,
        rate.saturating_mul(secs),
        rate,
        &stop,
    );
    let (written, out) = tokio::join!(writer, async {
        let out = until.await;
        if secs == u64::MAX {
            stop.cancel();
        }
        out
    });
    let (n, out) = (written?, out?);
    let deadline = Instant::now() + Duration::from_secs(args.max_wait);
    wait_until(deadline, || {
        let s = lock(sub);
        (first..first + n as i64).all(|id| s.rows.contains_key(&id))
    })
    .await;
    Ok((
        steady_window(sub, first, n, start_us, now_micros(), rate),
        out,
    ))
}

/// Join the last enabled table once the burst is over and insert one row: (join ms,
/// INSERT→client ms or `None` within `--max-wait`).
async fn last_table(
    args: &IsolationBench,
    stack: &Stack,
    b: &Burst,
    stop: &CancellationToken,
) -> anyhow::Result<(f64, Option<f64>)> {
    let key = Claims::role("anon")
        .project(&b.id)
        .expires_in(3600)
        .sign(&b.secret);
    let t = Instant::now();
    let last = table(args.tables);
    let sub = client::subscribe(stack.front.port, &key, &b.schema, &last, stop.clone()).await?;
    let join_ms = t.elapsed().as_secs_f64() * 1000.0;
    let sql = format!(
        "INSERT INTO {}.{last} (id, at) VALUES ($1, $2)",
        walcast_core::sql::quote_ident(&b.schema)
    );
    let db = stack.env.pg.connect().await?;
    db.execute(&sql, &[&1i64, &now_micros()]).await?;
    let deadline = Instant::now() + Duration::from_secs(args.max_wait);
    wait_until(deadline, || lock(&sub).rows.contains_key(&1)).await;
    let got = lock(&sub).rows.get(&1).copied();
    Ok((join_ms, got))
}

/// Phase B; returns the failures (rows missed with no `system` notice).
pub(super) async fn run(args: &IsolationBench) -> anyhow::Result<Vec<String>> {
    let stop = CancellationToken::new();
    let (stack, b) = setup(args).await?;
    let sub = client::subscribe(
        stack.front.port,
        &crate::ws::jwt()?,
        "public",
        "steady",
        stop.clone(),
    )
    .await?;
    eprintln!(
        "burst: {} tables created; logs in {}",
        args.tables,
        stack.log.display()
    );
    steady(args, &stack, &sub, WARMUP_ID, 1, async { Ok(()) }).await?;
    let idle = async {
        tokio::time::sleep(Duration::from_secs(args.before_secs)).await;
        Ok(())
    };
    let (before, ()) = steady(args, &stack, &sub, BEFORE_ID, args.before_secs, idle).await?;
    eprintln!("burst: before {}", before.text());
    let enables = enable_all(args, stack.front.port, &b);
    let (during, enables) = steady(args, &stack, &sub, DURING_ID, u64::MAX, enables).await?;
    eprintln!("burst: during {}", during.text());
    let (join_ms, last_ms) = last_table(args, &stack, &b, &stop).await?;
    stop.cancel();
    report(args, &before, &during, &enables, join_ms, last_ms);
    stack.report_log();
    let s = lock(&sub);
    if let Some(why) = &s.closed {
        println!("steady subscriber's socket closed: {why}");
    }
    if s.duplicates > 0 {
        println!("steady subscriber got {} duplicate(s)", s.duplicates);
    }
    if before.missed + during.missed > 0 && s.errors.is_empty() {
        return Ok(vec![format!(
            "steady table: {} row(s) before and {} during the burst not delivered {} s after \
             the last write, with no system notice",
            before.missed, during.missed, args.max_wait
        )]);
    }
    Ok(Vec::new())
}

fn report(
    args: &IsolationBench,
    before: &Window,
    during: &Window,
    e: &Enables,
    join_ms: f64,
    last_ms: Option<f64>,
) {
    println!();
    println!(
        "phase B, enable burst: {} tables of another project enabled through the REST API, \
         spread over {} s, at most {} in flight; the default project's table at {} rows/s, one \
         subscriber",
        args.tables, args.burst_secs, args.enable_concurrency, args.rows_per_sec
    );
    println!(
        "{:<26} {:>18} {:>26}",
        "steady table", "rows (missed)", "p50 / p99 / max ms"
    );
    for (name, w) in [("before (baseline)", before), ("during the burst", during)] {
        println!(
            "{:<26} {:>18} {:>26}",
            name,
            format!("{} ({})", w.sent, w.missed),
            w.text()
        );
    }
    println!(
        "ratio during/before: p50 {:.1}x, p99 {:.1}x; acceptance p99 < 500 ms: {}",
        ratio(during.p50, before.p50),
        ratio(during.p99, before.p99),
        if during.p99 < 500.0 && during.missed == 0 {
            "met"
        } else {
            "NOT met"
        }
    );
    let ok = e.answers.iter().filter(|(s, _)| *s == 200).count();
    let lat: Vec<Option<f64>> = e.answers.iter().map(|(_, ms)| Some(*ms)).collect();
    println!(
        "enables: {ok} of {} answered 200 in {:.1} s (target {} s); each request p50 / p99 / \
         max {} ms",
        e.answers.len(),
        e.total.as_secs_f64(),
        args.burst_secs,
        Window::of(&lat, |_| 0.0).text()
    );
    if let Some(f) = &e.first_failure {
        println!("first failed enable: {f}");
    }
    match last_ms {
        Some(ms) => println!(
            "last enabled table, after the burst: joined in {join_ms:.0} ms, an INSERT reached \
             the subscriber in {ms:.0} ms"
        ),
        None => println!(
            "last enabled table, after the burst: joined in {join_ms:.0} ms, an INSERT did NOT \
             reach the subscriber within {} s",
            args.max_wait
        ),
    }
}
