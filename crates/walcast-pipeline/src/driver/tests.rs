//! The driver without a database: a scripted source and recording consumers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use walcast_lease::Fence;
use walcast_wal2json::{Change, Lsn};

use super::{Driver, DriverOptions};
use crate::consumer::{Consumer, Handled, Item};
use crate::health::PipelineHealth;
use crate::signed::MessageKey;
use crate::source::Filter;
use crate::source::{Input, Source};
use crate::PipelineError;

type Log = Arc<Mutex<Vec<String>>>;

/// Yields its script, then fails (which ends the run); logs starts, acks and stops.
/// A `Toggle` entry sets consumer `b`'s gate (whether it accepts) and is not yielded.
struct Scripted {
    script: VecDeque<Entry>,
    log: Log,
    gate: Arc<AtomicBool>,
}

enum Entry {
    Input(Input),
    Toggle(bool),
}

impl From<Input> for Entry {
    fn from(i: Input) -> Entry {
        Entry::Input(i)
    }
}

impl Source for Scripted {
    const FLUSH_WHILE_WAITING: bool = true;

    async fn start(&mut self, from: Lsn, filter: &Filter) -> Result<(), PipelineError> {
        self.log
            .lock()
            .unwrap()
            .push(format!("start {from} {filter}"));
        Ok(())
    }

    async fn next(&mut self) -> Result<Input, PipelineError> {
        loop {
            match self.script.pop_front().ok_or(PipelineError::StreamEnded)? {
                Entry::Input(input) => return Ok(input),
                Entry::Toggle(on) => self.gate.store(on, Ordering::SeqCst),
            }
        }
    }

    async fn ack(&mut self, upto: Lsn) -> Result<Lsn, PipelineError> {
        self.log.lock().unwrap().push(format!("ack {upto}"));
        Ok(upto)
    }

    async fn stop(&mut self) {
        self.log.lock().unwrap().push("stop".into());
    }
}

/// Logs what it is handed; its tables change when it sees a row of table `switch`.
/// It accepts while its gate is open; it settles no further than `settles_to`.
struct Recording {
    name: &'static str,
    tables: Vec<(String, String)>,
    log: Log,
    gate: Arc<AtomicBool>,
    settles_to: Option<Lsn>,
}

impl Consumer for Recording {
    fn name(&self) -> &'static str {
        self.name
    }

    fn tables(&self) -> Vec<(String, String)> {
        self.tables.clone()
    }

    fn handle<'a>(
        &'a mut self,
        item: Item<'a>,
    ) -> BoxFuture<'a, Result<Handled, crate::ConsumerError>> {
        let (entry, handled) = match item {
            Item::Begin(t) => (format!("{} begin {}", self.name, t.commit_lsn), None),
            Item::Change(_, Change::Insert(row)) if row.table == "boom" && self.name == "a" => {
                panic!("a cannot take {}", row.table)
            }
            Item::Change(_, Change::Insert(row)) => {
                let switch = row.table == "switch";
                if switch {
                    self.tables.push(("public".into(), "added".into()));
                }
                let handled = switch.then_some(Handled::TablesChanged);
                (format!("{} insert {}", self.name, row.table), handled)
            }
            Item::Change(_, Change::Message(m)) => (
                format!("{} message {} {}", self.name, m.prefix, m.content),
                None,
            ),
            Item::Change(..) => (format!("{} other", self.name), None),
            Item::Commit(t) => (format!("{} commit {}", self.name, t.commit_lsn), None),
        };
        self.log.lock().unwrap().push(entry);
        Box::pin(async move { Ok(handled.unwrap_or(Handled::Continue)) })
    }

    fn barrier(&mut self) -> BoxFuture<'_, Result<(), crate::ConsumerError>> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} barrier", self.name));
        Box::pin(async { Ok(()) })
    }

    fn settle(&mut self, handed: Lsn) -> BoxFuture<'_, Result<Lsn, crate::ConsumerError>> {
        self.log
            .lock()
            .unwrap()
            .push(format!("{} barrier", self.name));
        let to = self.settles_to.map_or(handed, |s| s.min(handed));
        Box::pin(async move { Ok(to) })
    }

    fn accepting(&self) -> bool {
        self.name != "b" || self.gate.load(Ordering::SeqCst)
    }
}

fn line(s: String) -> Input {
    Input::Line(Bytes::from(s))
}

/// A transaction with one insert into `table`, committing at `0/<commit>`.
fn txn(table: &str, commit: u32) -> Vec<Input> {
    vec![
        line(format!(
            r#"{{"action":"B","xid":{commit},"nextlsn":"0/{commit:X}"}}"#
        )),
        line(format!(
            r#"{{"action":"I","xid":{commit},"schema":"public","table":"{table}","columns":[{{"name":"i","type":"integer","typeoid":23,"value":1}}]}}"#
        )),
        line(format!(
            r#"{{"action":"C","xid":{commit},"nextlsn":"0/{commit:X}"}}"#
        )),
    ]
}

fn checkpoint() -> Input {
    Input::Checkpoint {
        busy: true,
        reply: false,
    }
}

/// Run the driver over `script` with consumers `a` (table `ta`) and `b` (table `tb`).
async fn run(script: Vec<Input>) -> Vec<String> {
    run_with(script, None).await.0
}

/// [`run`] with a message key; also the health report at the end.
async fn run_with(
    script: Vec<Input>,
    message_key: Option<MessageKey>,
) -> (Vec<String>, crate::health::PipelineHealthReport) {
    let script = script.into_iter().map(Entry::from).collect();
    run_entries(script, message_key, None).await
}

/// [`run_with`] with toggles of `b`'s gate, and `b` settling no further than `b_settles_to`.
async fn run_entries(
    script: Vec<Entry>,
    message_key: Option<MessageKey>,
    b_settles_to: Option<Lsn>,
) -> (Vec<String>, crate::health::PipelineHealthReport) {
    let log = Log::default();
    let health = PipelineHealth::new("s");
    let gate = Arc::new(AtomicBool::new(true));
    let consumers: Vec<Box<dyn Consumer>> = ["a", "b"]
        .into_iter()
        .map(|name| {
            Box::new(Recording {
                name,
                tables: vec![("public".into(), format!("t{name}"))],
                log: log.clone(),
                gate: gate.clone(),
                settles_to: (name == "b").then_some(b_settles_to).flatten(),
            }) as Box<dyn Consumer>
        })
        .collect();
    let driver = Driver::new(
        DriverOptions {
            client: None,
            slot: "s".into(),
            health: &health,
            fence: Fence::unfenced(CancellationToken::new()),
            refresh: std::time::Duration::from_secs(3600),
            confirmed: Lsn(0x10),
            message_key,
        },
        consumers,
    );
    let mut source = Scripted {
        script: script.into(),
        log: log.clone(),
        gate,
    };
    let end = driver.run(&mut source, &CancellationToken::new()).await;
    assert!(matches!(end, Err(PipelineError::StreamEnded)), "{end:?}");
    let log = log.lock().unwrap().clone();
    (log, health.report())
}

#[tokio::test]
async fn every_consumer_sees_each_transaction_and_its_barrier_comes_before_the_ack() {
    let mut script = txn("ta", 0x20);
    script.extend(txn("tb", 0x30));
    script.push(checkpoint());
    assert_eq!(
        run(script).await,
        [
            "start 0/10 public.ta,public.tb",
            "a begin 0/20",
            "b begin 0/20",
            "a insert ta",
            "b insert ta",
            "a commit 0/20",
            "b commit 0/20",
            "a begin 0/30",
            "b begin 0/30",
            "a insert tb",
            "b insert tb",
            "a commit 0/30",
            "b commit 0/30",
            "a barrier",
            "b barrier",
            "ack 0/30",
        ]
    );
}

#[tokio::test]
async fn a_changed_table_set_acknowledges_its_commit_and_restarts_with_the_union() {
    let mut script = txn("switch", 0x20);
    script.extend(txn("ta", 0x30));
    let log = run(script).await;
    let restart: Vec<&str> = log
        .iter()
        .map(String::as_str)
        .skip_while(|e| *e != "b commit 0/20")
        .collect();
    assert_eq!(
        restart[..6],
        [
            "b commit 0/20",
            "a barrier",
            "b barrier",
            "ack 0/20",
            "stop",
            "start 0/20 public.added,public.ta,public.tb",
        ]
    );
}

#[tokio::test]
async fn caught_up_is_acknowledged_between_transactions_only() {
    let mut script = txn("ta", 0x20);
    script.insert(1, Input::CaughtUp(Lsn(0x90)));
    script.push(checkpoint());
    script.push(Input::CaughtUp(Lsn(0x40)));
    script.push(checkpoint());
    let acks: Vec<String> = run(script)
        .await
        .into_iter()
        .filter(|e| e.starts_with("ack") || e.ends_with("barrier"))
        .collect();
    // The second acknowledgement hands nothing new over: no barrier before it.
    assert_eq!(acks, ["a barrier", "b barrier", "ack 0/20", "ack 0/40"]);
}

/// A transaction with one transactional message, committing at `0/<commit>`.
fn message(prefix: &str, content: &str, commit: u32) -> Vec<Input> {
    let m = serde_json::json!({"action": "M", "xid": commit, "transactional": true,
                               "prefix": prefix, "content": content});
    let mut t = txn("ta", commit);
    t[1] = line(m.to_string());
    t
}

#[tokio::test]
async fn walcast_messages_reach_consumers_only_signed_and_without_their_mac() {
    let key = MessageKey::new("k");
    let body = r#"{"epoch":1,"tag":"GRANT"}"#;
    let signed = format!("{}{body}", key.mac("walcast.ddl", body));
    let mut script = message("walcast.ddl", &signed, 0x20);
    // Unsigned, signed for another prefix, signed with another key.
    script.extend(message("walcast.ddl", body, 0x30));
    script.extend(message("walcast.outbox", &signed, 0x40));
    let other = MessageKey::new("other").mac("walcast.ddl", body);
    script.extend(message("walcast.ddl", &format!("{other}{body}"), 0x50));
    // Not walcast's: as it is.
    script.extend(message("app.events", "plain", 0x60));
    let (log, health) = run_with(script, Some(key)).await;
    let messages: Vec<&String> = log.iter().filter(|e| e.starts_with("a message")).collect();
    assert_eq!(
        messages,
        [
            &format!("a message walcast.ddl {body}"),
            &"a message app.events plain".to_string()
        ]
    );
    assert_eq!(health.skipped_changes_total, 3);
    let last = health.last_skipped_change.unwrap();
    assert_eq!(last.table, "walcast.ddl");
    assert_eq!(last.reason, "forged_message: bad_mac");
    // Without a key nothing of walcast's is trusted.
    let script = message("walcast.ddl", &signed, 0x20);
    let (log, health) = run_with(script, None).await;
    assert!(
        !log.iter().any(|e| e.contains("message walcast")),
        "{log:?}"
    );
    assert_eq!(health.skipped_changes_total, 1);
}

#[tokio::test]
async fn a_consumer_panicking_on_an_item_skips_it_and_the_rest_flows() {
    let mut script = txn("boom", 0x20);
    script.extend(txn("ta", 0x30));
    script.push(checkpoint());
    let (log, health) = run_with(script, None).await;
    assert_eq!(
        log[1..],
        [
            "a begin 0/20",
            "b begin 0/20",
            "b insert boom",
            "a commit 0/20",
            "b commit 0/20",
            "a begin 0/30",
            "b begin 0/30",
            "a insert ta",
            "b insert ta",
            "a commit 0/30",
            "b commit 0/30",
            "a barrier",
            "b barrier",
            "ack 0/30",
        ]
    );
    assert_eq!(health.skipped_changes_total, 1);
    let last = health.last_skipped_change.unwrap();
    assert_eq!(
        (last.table.as_str(), last.reason.as_str()),
        ("public.boom", "consumer_panic")
    );
}

fn entries(inputs: Vec<Input>) -> Vec<Entry> {
    inputs.into_iter().map(Entry::from).collect()
}

/// What matters to these tests: begins, acks, starts and stops.
fn progress(log: Vec<String>) -> Vec<String> {
    log.into_iter()
        .filter(|e| e.contains("begin") || e.starts_with("ack") || e.starts_with("st"))
        .collect()
}

#[tokio::test]
async fn a_consumer_that_settles_slowly_holds_the_ack_not_the_others() {
    let mut script = entries(txn("ta", 0x20));
    script.extend(entries(txn("ta", 0x30)));
    script.push(checkpoint().into());
    script.extend(entries(txn("ta", 0x40)));
    script.push(checkpoint().into());
    let (log, health) = run_entries(script, None, Some(Lsn(0x20))).await;
    assert_eq!(
        progress(log),
        [
            "start 0/10 public.ta,public.tb",
            "a begin 0/20",
            "b begin 0/20",
            "a begin 0/30",
            "b begin 0/30",
            "ack 0/20",
            "a begin 0/40",
            "b begin 0/40",
        ]
    );
    let b = &health.consumers["b"];
    assert_eq!(
        (b.settled, b.lag_bytes, b.detached),
        (Lsn(0x20), 0x20, false)
    );
    assert_eq!(health.consumers["a"].settled, Lsn(0x40));
}

#[tokio::test]
async fn a_full_consumer_is_detached_then_fed_what_it_missed_and_nobody_gets_twice() {
    let mut script = entries(txn("ta", 0x20));
    script.push(Entry::Toggle(false));
    script.extend(entries(txn("ta", 0x30)));
    script.push(checkpoint().into());
    script.push(Entry::Toggle(true));
    script.push(checkpoint().into());
    // Read again from the acknowledged position, as a source does after a restart.
    script.extend(entries(txn("ta", 0x30)));
    script.extend(entries(txn("ta", 0x40)));
    script.push(checkpoint().into());
    let (log, health) = run_entries(script, None, None).await;
    assert_eq!(
        progress(log),
        [
            "start 0/10 public.ta,public.tb",
            "a begin 0/20",
            "b begin 0/20",
            "a begin 0/30",
            "ack 0/20",
            "stop",
            "start 0/20 public.ta,public.tb",
            "b begin 0/30",
            "a begin 0/40",
            "b begin 0/40",
            "ack 0/40",
        ]
    );
    assert!(!health.consumers["b"].detached);
}
