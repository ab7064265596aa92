//! Phase A, slow tenant: the default project's plain table alone, then beside projects
//! whose `SELECT` policy is slow (see the module doc of [`super`]).

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use walcast_testkit::tokens::Claims;

use super::client::{self, lock, Shared};
use super::{ratio, wait_until, IsolationBench, Stack, Window};
use crate::ws::now_micros;

const QUIET_SQL: &str = "CREATE TABLE quiet (id int8 PRIMARY KEY, at int8 NOT NULL);
     GRANT SELECT ON quiet TO anon, authenticated;";
const QUIET_INSERT: &str = "INSERT INTO quiet (id, at) VALUES ($1, $2)";
/// The policy of every noisy project's table: a correlated subquery on an unindexed table
/// (a sequential scan per version checked), the most common RLS mistake.
const POLICY: &str = "auth.uid() IN (SELECT m.member FROM members m WHERE m.room = items.room)";
/// First row id of each window (the windows never share ids).
const WARMUP_ID: i64 = 1;
const ALONE_ID: i64 = 1_000;
const BESIDE_ID: i64 = 1_000_000;

/// A noisy project: its id, schema, and its subscribers' records.
struct Noisy {
    id: String,
    schema: String,
    subs: Vec<Shared>,
}

fn uid(u: usize) -> String {
    format!("00000000-0000-4000-8000-{u:012}")
}

/// A project whose `items` table is read through the slow policy; the subscribers
/// `1..=subs` are members of room 1, where every row is written, behind `members` rows
/// of other rooms (so each check scans the whole table before it finds them).
async fn create_noisy(
    admin: &mut tokio_postgres::Client,
    n: usize,
    members: usize,
    subs: usize,
) -> anyhow::Result<(String, String, String)> {
    let keys = crate::env::secret_keys()?;
    let p = walcast_control::projects::create(admin, &keys, &format!("noisy-{n}")).await?;
    let s = walcast_core::sql::quote_ident(&p.schema);
    admin
        .batch_execute(&format!(
            "SET search_path = {s};
             CREATE TABLE members (room int NOT NULL, member uuid NOT NULL);
             INSERT INTO members SELECT 2 + i % 1000, gen_random_uuid()
               FROM generate_series(1, {members}) i;
             INSERT INTO members SELECT 1, ('00000000-0000-4000-8000-' || lpad(u::text, 12, '0'))::uuid
               FROM generate_series(1, {subs}) u;
             CREATE TABLE items (id int8 PRIMARY KEY, at int8 NOT NULL, room int NOT NULL DEFAULT 1,
                                 pad text NOT NULL DEFAULT repeat('x', 64));
             ALTER TABLE items ENABLE ROW LEVEL SECURITY;
             CREATE POLICY members_read ON items FOR SELECT TO authenticated USING ({POLICY});
             GRANT SELECT ON items, members TO authenticated;
             ANALYZE members;
             RESET search_path;"
        ))
        .await?;
    walcast_control::tables::enable(&*admin, &p.id, &p.schema, "items").await?;
    Ok((p.id, p.schema, p.jwt_secret))
}

/// Services, the quiet table and the noisy projects, the worker and the front, and every
/// subscriber joined.
async fn setup(
    args: &IsolationBench,
    stop: &CancellationToken,
) -> anyhow::Result<(Stack, Shared, Vec<Noisy>)> {
    let mut env = crate::env::start(QUIET_SQL, "quiet").await?;
    let mut made = Vec::new();
    for n in 0..args.noisy {
        made.push(create_noisy(&mut env.admin, n, args.members, args.noisy_subscribers).await?);
    }
    let stack = Stack::start(env, "slow", &args.log_level).await?;
    let port = stack.front.port;
    let quiet =
        client::subscribe(port, &crate::ws::jwt()?, "public", "quiet", stop.clone()).await?;
    let mut noisy = Vec::new();
    for (id, schema, secret) in made {
        let mut subs = Vec::new();
        for u in 1..=args.noisy_subscribers {
            let key = Claims::role("authenticated")
                .project(&id)
                .claim("sub", uid(u))
                .expires_in(24 * 3600)
                .sign(&secret);
            subs.push(client::subscribe(port, &key, &schema, "items", stop.clone()).await?);
        }
        noisy.push(Noisy { id, schema, subs });
    }
    Ok((stack, quiet, noisy))
}

/// The quiet table's latencies of rows `first..first + n`, written from `start_us` at
/// `rate`; a row missing at `end_us` counts as arriving then.
fn quiet_window(q: &Shared, first: i64, n: u64, start_us: i64, end_us: i64, rate: u64) -> Window {
    let s = lock(q);
    let lat: Vec<Option<f64>> = (0..n as i64)
        .map(|i| s.rows.get(&(first + i)).copied())
        .collect();
    Window::of(&lat, |i| {
        (end_us - start_us) as f64 / 1000.0 - i as f64 * 1000.0 / rate.max(1) as f64
    })
}

fn has_rows(q: &Shared, first: i64, n: u64) -> bool {
    let s = lock(q);
    (first..first + n as i64).all(|id| s.rows.contains_key(&id))
}

/// Write the quiet table for `--secs` (the noisy ones beside it when `noisy_rows` is
/// set), then wait for its rows; returns the window and the noisy rows written.
async fn window(
    args: &IsolationBench,
    stack: &Stack,
    quiet: &Shared,
    first: i64,
    noisy: &[Noisy],
) -> anyhow::Result<(Window, Vec<u64>)> {
    let n = args.rows_per_sec * args.secs;
    let stop = CancellationToken::new();
    let mut writers = Vec::new();
    for p in noisy {
        let db = stack.env.pg.connect().await?;
        let sql = format!(
            "INSERT INTO {}.items (id, at) VALUES ($1, $2)",
            walcast_core::sql::quote_ident(&p.schema)
        );
        let (stop, rate) = (stop.clone(), args.noisy_rate);
        writers.push(tokio::spawn(async move {
            client::write_paced(&db, &sql, 1, u64::MAX, rate, &stop).await
        }));
    }
    let db = stack.env.pg.connect().await?;
    let start_us = now_micros();
    client::write_paced(&db, QUIET_INSERT, first, n, args.rows_per_sec, &stop).await?;
    stop.cancel();
    let mut written = Vec::new();
    for w in writers {
        written.push(w.await??);
    }
    let deadline = Instant::now() + Duration::from_secs(args.max_wait);
    wait_until(deadline, || {
        has_rows(quiet, first, n)
            && noisy.iter().zip(&written).all(|(p, &w)| {
                p.subs.iter().all(|s| {
                    let s = lock(s);
                    !s.errors.is_empty() || (1..=w as i64).all(|id| s.rows.contains_key(&id))
                })
            })
    })
    .await;
    let w = quiet_window(quiet, first, n, start_us, now_micros(), args.rows_per_sec);
    Ok((w, written))
}

/// What the noisy subscribers got: one line per project; the failures (subscribers that
/// missed rows with no `system` notice).
fn report_noisy(noisy: &[Noisy], written: &[u64], failures: &mut Vec<String>) {
    println!(
        "{:<10} {:>8} {:>22} {:>24} {:>14} {:>8}",
        "project", "written", "delivered/expected", "p50 / p99 / max ms", "system errors", "silent"
    );
    for (p, &w) in noisy.iter().zip(written) {
        let (mut delivered, mut errors, mut silent, mut lat) = (0u64, 0usize, 0usize, Vec::new());
        let mut sample = None;
        for s in &p.subs {
            let s = lock(s);
            let got = (1..=w as i64).filter(|id| s.rows.contains_key(id)).count() as u64;
            delivered += got;
            lat.extend(s.rows.values().map(|v| Some(*v)));
            errors += s.errors.len();
            sample = sample.or_else(|| s.errors.first().cloned());
            if got < w && s.errors.is_empty() {
                silent += 1;
            }
            if let Some(why) = &s.closed {
                println!("           a subscriber's socket closed: {why}");
            }
        }
        let expected = w * p.subs.len() as u64;
        println!(
            "{:<10} {:>8} {:>22} {:>24} {:>14} {:>8}",
            &p.id[..8],
            w,
            format!("{delivered}/{expected}"),
            Window::of(&lat, |_| 0.0).text(),
            errors,
            silent
        );
        if let Some(msg) = sample {
            println!("           first system error: {msg}");
        }
        if silent > 0 {
            failures.push(format!(
                "noisy project {}: {silent} subscriber(s) missed rows ({delivered} of {expected} \
                 delivered) with no system notice",
                p.id
            ));
        }
    }
}

/// Phase A; returns the failures (rows missed with no `system` notice).
pub(super) async fn run(args: &IsolationBench) -> anyhow::Result<Vec<String>> {
    let stop = CancellationToken::new();
    let (stack, quiet, noisy) = setup(args, &stop).await?;
    eprintln!(
        "slow: {} noisy project(s) with {} subscriber(s) each joined; logs in {}",
        noisy.len(),
        args.noisy_subscribers,
        stack.log.display()
    );
    let warm = IsolationBench {
        secs: 1,
        ..args.clone()
    };
    window(&warm, &stack, &quiet, WARMUP_ID, &[]).await?;
    let (alone, _) = window(args, &stack, &quiet, ALONE_ID, &[]).await?;
    eprintln!("slow: alone {}", alone.text());
    let (beside, written) = window(args, &stack, &quiet, BESIDE_ID, &noisy).await?;
    eprintln!("slow: beside {}", beside.text());
    stop.cancel();

    println!();
    println!(
        "phase A, slow tenant: {} noisy project(s) × {} subscriber(s), {} rows/s each, policy \
         `{POLICY}` over {} unindexed rows; the default project's plain table at {} rows/s, one \
         subscriber; {} s per window",
        args.noisy,
        args.noisy_subscribers,
        args.noisy_rate,
        args.members,
        args.rows_per_sec,
        args.secs
    );
    println!(
        "{:<26} {:>18} {:>26}",
        "quiet table", "rows (missed)", "p50 / p99 / max ms"
    );
    for (name, w) in [
        ("alone (baseline)", &alone),
        ("beside the noisy ones", &beside),
    ] {
        println!(
            "{:<26} {:>18} {:>26}",
            name,
            format!("{} ({})", w.sent, w.missed),
            w.text()
        );
    }
    let target = 2.0 * alone.p99 + 100.0;
    println!(
        "ratio beside/alone: p50 {:.1}x, p99 {:.1}x; acceptance p99 ≤ 2 × {:.0} + 100 = {:.0} ms: {}",
        ratio(beside.p50, alone.p50),
        ratio(beside.p99, alone.p99),
        alone.p99,
        target,
        if beside.p99 <= target && beside.missed == 0 { "met" } else { "NOT met" }
    );
    let mut failures = Vec::new();
    let q = lock(&quiet);
    if !q.errors.is_empty() {
        println!("quiet subscriber's system errors: {:?}", q.errors);
    }
    if let Some(why) = &q.closed {
        println!("quiet subscriber's socket closed: {why}");
    }
    if q.duplicates > 0 {
        println!("quiet subscriber got {} duplicate(s)", q.duplicates);
    }
    if alone.missed + beside.missed > 0 && q.errors.is_empty() {
        failures.push(format!(
            "quiet table: {} row(s) alone and {} beside the noisy projects not delivered {} s \
             after the last write, with no system notice",
            alone.missed, beside.missed, args.max_wait
        ));
    }
    drop(q);
    report_noisy(&noisy, &written, &mut failures);
    stack.report_log();
    Ok(failures)
}
