//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::time::Duration;

use serde_json::Value;
use walcast_core::Lsn;
use walcast_pgrepl::{ReplEvent, ReplicationStream};

pub const WAIT: Duration = Duration::from_secs(20);

/// The wal2json options the tests stream with.
pub const OPTIONS: &[(&str, &str)] = &[
    ("format-version", "2"),
    ("include-lsn", "1"),
    ("include-transaction", "1"),
    ("include-timestamp", "1"),
    ("include-xids", "1"),
];

/// One decoded XLogData message.
#[derive(Debug, Clone)]
pub struct Line {
    pub wal_start: Lsn,
    pub json: Value,
}

impl Line {
    pub fn action(&self) -> &str {
        self.json["action"].as_str().unwrap_or("?")
    }
    pub fn xid(&self) -> Option<u64> {
        self.json["xid"].as_u64()
    }
}

/// The next event, failing the test after [`WAIT`].
pub async fn next(stream: &mut ReplicationStream) -> ReplEvent {
    tokio::time::timeout(WAIT, stream.next_event())
        .await
        .expect("timed out waiting for a replication event")
        .expect("stream error")
        .expect("server ended the stream")
}

/// Read XLogData messages until `commits` commit messages came, answering keepalives
/// that ask for a reply (reporting `0/0`, which the server does not apply to the slot).
/// Checks that each message is exactly one JSON document.
pub async fn read_commits(stream: &mut ReplicationStream, commits: usize) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut seen = 0;
    while seen < commits {
        let event = next(stream).await;
        if let ReplEvent::Keepalive {
            reply_requested: true,
            ..
        } = event
        {
            stream.send_status(Lsn::ZERO, false).await.expect("status");
        }
        if let ReplEvent::XLogData {
            wal_start, data, ..
        } = event
        {
            assert!(!data.contains(&b'\n'), "more than one line in {data:?}");
            let json: Value = serde_json::from_slice(&data)
                .unwrap_or_else(|e| panic!("not one JSON document ({e}): {data:?}"));
            let line = Line { wal_start, json };
            if line.action() == "C" {
                seen += 1;
            }
            lines.push(line);
        }
    }
    lines
}

/// Poll `sql` (one text value) until it returns `want`, failing after [`WAIT`].
pub async fn wait_for_value(client: &tokio_postgres::Client, sql: &str, want: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut last = String::new();
    while tokio::time::Instant::now() < deadline {
        let row = client.query_one(sql, &[]).await.expect("poll query");
        last = row.get::<_, Option<String>>(0).unwrap_or_default();
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{sql} returned {last:?}, want {want:?}");
}
