//! Takeover (README "Sources"): a worker killed with -9, then its successor frozen past the
//! lease: each source is taken over within its lease bound by another worker, under
//! writers, with nothing lost, nothing duplicated and nothing published by a frozen holder
//! after its takeover.

use std::time::{Duration, Instant};

use super::*;

/// Index of the worker leading `source` with an active pipeline.
fn lead_of(workers: &[&Worker], source: &str) -> Option<usize> {
    workers
        .iter()
        .position(|w| leading(w).iter().any(|s| s == source))
}

/// Wait until a worker other than `not` leads `source`; how long that took.
fn wait_taken_over(workers: &[&Worker], source: &str, not: usize, since: Instant) -> Duration {
    let deadline = since + Duration::from_secs(60);
    loop {
        // A frozen worker's /health would not answer: only the others are asked.
        let led = workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != not && leading(w).iter().any(|s| s == source));
        if led {
            return since.elapsed();
        }
        assert!(Instant::now() < deadline, "{source} not taken over");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Inserts `i` = 1, 2, 3 … into a table until stopped; the last `i` written.
struct Writer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<i64>,
}

impl Writer {
    async fn start(pg: &Postgres, table: String) -> Writer {
        let client = pg.connect().await.expect("connect writer");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut i = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let sql = format!("INSERT INTO {table} VALUES ({}, 'w')", i + 1);
                if client.batch_execute(&sql).await.is_ok() {
                    i += 1;
                }
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            i
        });
        Writer { stop, task }
    }

    async fn stop(self) -> i64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.expect("writer")
    }
}

/// No message of `project` from `frozen`'s terms of before `since` arrived after the first
/// message of another worker since then.
fn assert_fenced(collector: &Collector, project: &str, frozen: &str, since: Instant) {
    let prefix = format!("walcast.realtime.{project}.");
    let ours: Vec<_> = collector
        .messages()
        .into_iter()
        .filter(|a| a.subject.starts_with(&prefix))
        .collect();
    let old_terms: std::collections::HashSet<Option<u64>> = ours
        .iter()
        .filter(|a| a.origin == frozen && a.at < since)
        .map(|a| a.term)
        .collect();
    let Some(first) = ours
        .iter()
        .position(|a| a.at >= since && a.origin != frozen)
    else {
        panic!("{project}: no successor published");
    };
    let late: Vec<_> = ours[first..]
        .iter()
        .filter(|a| a.origin == frozen && old_terms.contains(&a.term))
        .collect();
    assert!(
        late.is_empty(),
        "{project}: the frozen holder published after its takeover: {} messages",
        late.len()
    );
}

/// The origins that published `project`'s table changes, in arrival order (runs kept).
fn publishers(collector: &Collector, project: &str) -> Vec<String> {
    let prefix = format!("walcast.realtime.{project}.");
    let mut runs: Vec<String> = Vec::new();
    for a in collector.messages() {
        if a.subject.starts_with(&prefix) && runs.last() != Some(&a.origin) {
            runs.push(a.origin.clone());
        }
    }
    runs
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_and_a_frozen_worker_lose_their_sources_within_the_lease_and_nothing_else() {
    let _machine = shared().await;
    let (stack, sources, collector) = three_sources().await;
    let mut ws = [
        stack.worker(LEASE),
        stack.worker(LEASE),
        stack.worker(LEASE),
    ];
    let names = ["default", "s1", "s2"];
    wait_spread(&[&ws[0], &ws[1], &ws[2]], &names, Duration::from_secs(90));
    let mut writers = vec![(
        "default".to_string(),
        Writer::start(&stack.pg, "public.t".into()).await,
    )];
    for s in &sources {
        let w = Writer::start(&s.pg, format!("{}.t", s.schema())).await;
        writers.push((s.project.to_string(), w));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;

    // kill -9 the worker leading s1: s1 moves within the lease.
    let killed = lead_of(&[&ws[0], &ws[1], &ws[2]], "s1").expect("s1 led");
    ws[killed].kill9();
    let at = Instant::now();
    let took = wait_taken_over(&[&ws[0], &ws[1], &ws[2]], "s1", killed, at);
    eprintln!("s1 taken over {took:?} after kill -9");
    assert!(
        took <= Duration::from_secs(3 + 4),
        "s1 took {took:?} (lease 3 s)"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;

    // SIGSTOP its successor past the lease: the last worker takes its sources.
    let successor = lead_of(&[&ws[0], &ws[1], &ws[2]], "s1").expect("s1 led again");
    let moved: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| leading(&ws[successor]).iter().any(|s| s == n))
        .collect();
    let frozen_origin = publishers(&collector, "p1")
        .last()
        .cloned()
        .expect("p1 published");
    ws[successor].signal("STOP");
    let at = Instant::now();
    for n in &moved {
        let took = wait_taken_over(&[&ws[0], &ws[1], &ws[2]], n, successor, at);
        eprintln!("{n} taken over {took:?} after SIGSTOP");
        if took > Duration::from_secs(3 + 5) {
            for (i, w) in ws.iter().enumerate() {
                let log = w.log_text();
                let lines: Vec<&str> = log
                    .lines()
                    .filter(|l| {
                        l.contains("lease")
                            || l.contains("leader")
                            || l.contains("slot")
                            || l.contains("source")
                    })
                    .collect();
                eprintln!("worker {i}:\n{}", lines.join("\n"));
            }
        }
        assert!(
            took <= Duration::from_secs(3 + 5),
            "{n} took {took:?} (lease 3 s)"
        );
    }
    tokio::time::sleep(Duration::from_secs(3 * 3)).await;
    ws[successor].signal("CONT");
    tokio::time::sleep(Duration::from_secs(3)).await;

    let written = all_rows_in_order(writers, &collector).await;
    eprintln!("rows written per project: {written:?}");
    let checked = crate::source_metrics::assert_former_leader_reports_zero(&ws[successor], &moved);
    eprintln!("the frozen worker reports 0 for the sources it lost: {checked:?}");
    // The frozen worker's terms published nothing once a successor had published.
    for n in &moved {
        let project = match *n {
            "default" => "default".to_string(),
            other => format!("p{}", &other[1..]),
        };
        assert_fenced(&collector, &project, &frozen_origin, at);
    }
}

/// Stop the writers, wait for every row they wrote, and check that each project's first
/// occurrences are 1..=n in order (a new leader replays from the slot's acknowledged
/// position, and the fronts drop what they saw). The rows written per project.
async fn all_rows_in_order(
    writers: Vec<(String, Writer)>,
    collector: &Collector,
) -> BTreeMap<String, i64> {
    let mut written = BTreeMap::new();
    for (project, w) in writers {
        written.insert(project, w.stop().await);
    }
    collector
        .wait_until("every row written", Duration::from_secs(120), |e| {
            let got = published(e);
            written.iter().all(|(p, n)| {
                got.get(p).is_some_and(|v| {
                    let set: std::collections::BTreeSet<_> = v.iter().collect();
                    set.len() as i64 >= *n
                })
            })
        })
        .await;
    let got = published(&collector.snapshot());
    for (project, n) in &written {
        let mut seen = std::collections::HashSet::new();
        let firsts: Vec<i64> = got[project]
            .iter()
            .copied()
            .filter(|i| seen.insert(*i))
            .collect();
        assert_eq!(
            firsts,
            (1..=*n).collect::<Vec<_>>(),
            "{project}: gap or reorder"
        );
    }
    written
}

/// Wait until `w` leads every one of `names` with an active pipeline; how long it took.
fn wait_leads(w: &Worker, names: &[&str], since: Instant, timeout: Duration) -> Duration {
    loop {
        let held = leading(w);
        if names.iter().all(|n| held.iter().any(|h| h == n)) {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < timeout,
            "{names:?} not led after {timeout:?}: leads {held:?}\n{}",
            w.log_tail(40)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One worker leads the default source and an added one; it is killed with -9 as a
/// second worker starts: the second takes both over, through the same election and
/// term code (its log says so for each), and no row of either is lost or reordered.
#[tokio::test(flavor = "multi_thread")]
async fn the_worker_leading_the_default_and_an_added_source_is_killed_and_both_move() {
    let _machine = shared().await;
    let stack = Stack::start("stream");
    stack.sql("CREATE TABLE t (i int PRIMARY KEY, v text)");
    stack.enable("t");
    let s1 = Source::start("s1", "p1");
    s1.register(&stack);
    let collector = Collector::start(&stack.nats.url()).await;
    let mut a = stack.worker(LEASE);
    let both = ["default", "s1"];
    wait_leads(&a, &both, Instant::now(), Duration::from_secs(90));
    let writers = vec![
        (
            "default".to_string(),
            Writer::start(&stack.pg, "public.t".into()).await,
        ),
        (
            "p1".to_string(),
            Writer::start(&s1.pg, format!("{}.t", s1.schema())).await,
        ),
    ];
    tokio::time::sleep(Duration::from_secs(2)).await;

    let b = stack.worker(LEASE);
    a.kill9();
    let took = wait_leads(&b, &both, Instant::now(), Duration::from_secs(60));
    eprintln!(
        "both taken over {took:?} after kill -9 (lease 3 s, the new worker's start included)"
    );
    let log = b.log_text();
    for source in both {
        let led = log.lines().any(|l| {
            l.contains("leading the source") && l.contains(&format!("\"source\":\"{source}\""))
        });
        assert!(
            led,
            "{source} not led through the one term code:\n{}",
            b.log_tail(40)
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let written = all_rows_in_order(writers, &collector).await;
    eprintln!("rows written per project: {written:?}");
    assert!(written.values().all(|n| *n > 0), "{written:?}");
}
