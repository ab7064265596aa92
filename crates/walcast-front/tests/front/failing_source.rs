//! A join while a worker reports that the project's source fails: accepted (its changes
//! come once the source streams), and told why none come yet, as a class of reason,
//! with nothing of the error itself (docs/architecture.md "Several databases": "its clients
//! say why").

use std::time::Duration;

use serde_json::json;
use walcast_bus::beacon::{Beacon, WorkerBeacon};

use crate::support::*;

#[tokio::test]
async fn a_join_while_its_source_fails_is_told_why_and_nothing_of_the_error() {
    let s = start().await;
    let b = Beacon {
        process: "worker-failing".into(),
        at_ms: 1,
        bus_connected: true,
        worker: Some(WorkerBeacon {
            last_error: Some(
                "database: error connecting to server 10.1.2.3:5432: Connection refused".into(),
            ),
            ..Default::default()
        }),
        front: None,
        sources: Vec::new(),
    };
    s.bus.publish(b.subject(), &[], b.encode()).await.unwrap();
    let bindings = json!([{"event":"*","schema":"public","table":"todos"}]);
    let mut c = s.client("2.0.0").await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    // Joined (its changes come once the source streams), then told why none come yet
    // (once the front heard the beacon).
    let mut n = 0;
    let message = loop {
        n += 1;
        let topic = format!("realtime:r{n}");
        let (_, reply) = c.join(&topic, pg_config(bindings.clone()), None).await;
        assert_eq!(reply[4]["status"], "ok");
        assert_eq!(
            c.recv().await.payload()["message"],
            "Subscribed to PostgreSQL"
        );
        if let Ok(next) = tokio::time::timeout(Duration::from_millis(300), c.recv()).await {
            assert_eq!(next.payload()["status"], "error");
            break next.payload()["message"]
                .as_str()
                .unwrap_or_default()
                .to_string();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the failing source not told"
        );
    };
    assert_eq!(
        message,
        "Subscribed, but the database of project \"default\" (source \"default\") is not streaming changes: its database cannot be reached"
    );
}
