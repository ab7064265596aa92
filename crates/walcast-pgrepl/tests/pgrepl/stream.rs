//! Streaming from a wal2json slot on a real throwaway Postgres.

use std::time::Duration;

use crate::common::{next, read_commits, wait_for_value, Line, OPTIONS, WAIT};
use walcast_core::Lsn;
use walcast_pgrepl::{ReplError, ReplEvent, ReplicationClient};
use walcast_testkit::Postgres;

fn commit_lines(lines: &[Line]) -> Vec<&Line> {
    lines.iter().filter(|l| l.action() == "C").collect()
}

#[tokio::test]
async fn connects_with_trust_and_identifies_the_system() {
    let pg = Postgres::start().unwrap();
    let mut client = ReplicationClient::connect(&pg.url()).await.unwrap();
    assert!(client.backend_pid().is_some());
    assert!(client
        .parameter("server_version")
        .unwrap()
        .starts_with("15"));

    let info = client.identify_system().await.unwrap();
    assert_eq!(info.dbname.as_deref(), Some("postgres"));
    assert_eq!(info.timeline, 1);
    assert_eq!(
        info.systemid,
        pg.psql("SELECT system_identifier FROM pg_control_system()")
            .unwrap()
    );
    let current: Lsn = pg
        .psql("SELECT pg_current_wal_flush_lsn()")
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        info.xlogpos > Lsn::ZERO && info.xlogpos <= current,
        "{info:?}"
    );

    // The connection stays usable after a failed command.
    let err = client.simple_query("NOT A COMMAND").await.unwrap_err();
    assert_eq!(err.code(), Some("42601"), "{err}");
    let rows = client
        .simple_query("CREATE_REPLICATION_SLOT \"made_here\" LOGICAL wal2json")
        .await
        .unwrap();
    assert_eq!(rows[0][0].as_deref(), Some("made_here"));
    assert_eq!(rows[0][3].as_deref(), Some("wal2json"));
    client.close().await;
}

#[tokio::test]
async fn streams_transactions_in_order_and_resumes_after_confirmed_flush() {
    let pg = Postgres::start().unwrap();
    pg.psql("CREATE TABLE t (id int PRIMARY KEY, v text)")
        .unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('s', 'wal2json')")
        .unwrap();
    for txn in 0..3 {
        let (a, b) = (txn * 2, txn * 2 + 1);
        pg.psql(&format!(
            "INSERT INTO t VALUES ({a}, 'row {a}'), ({b}, 'row {b}')"
        ))
        .unwrap();
    }

    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client.start_logical("s", Lsn::ZERO, OPTIONS).await.unwrap();
    let lines = read_commits(&mut stream, 3).await;

    let actions: Vec<&str> = lines.iter().map(Line::action).collect();
    assert_eq!(actions, ["B", "I", "I", "C"].repeat(3), "{lines:#?}");
    for txn in lines.chunks(4) {
        let xid = txn[0].xid().expect("include-xids gives xid");
        assert!(txn.iter().all(|l| l.xid() == Some(xid)), "{txn:#?}");
        assert!(txn[3].json["timestamp"].is_string());
    }
    for pair in lines.windows(2) {
        assert!(pair[0].wal_start <= pair[1].wal_start, "{pair:#?}");
    }
    let commits = commit_lines(&lines);
    // For a commit message the walsender reports the end of the commit record, which
    // wal2json prints as "nextlsn".
    for c in &commits {
        assert_eq!(
            c.json["nextlsn"]
                .as_str()
                .map(|s| s.parse::<Lsn>().unwrap()),
            Some(c.wal_start),
            "{c:?}"
        );
    }
    let txn2_end = commits[1].wal_start;
    let txn3_xid = commits[2].xid();

    stream.send_status(txn2_end, false).await.unwrap();
    tokio::time::timeout(WAIT, stream.stop())
        .await
        .unwrap()
        .unwrap();

    let sql_client = pg.connect().await.unwrap();
    wait_for_value(
        &sql_client,
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 's'",
        &txn2_end.to_string(),
    )
    .await;
    wait_for_value(
        &sql_client,
        "SELECT active::text FROM pg_replication_slots WHERE slot_name = 's'",
        "false",
    )
    .await;

    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client.start_logical("s", Lsn::ZERO, OPTIONS).await.unwrap();
    let again = read_commits(&mut stream, 1).await;
    let actions: Vec<&str> = again.iter().map(Line::action).collect();
    assert_eq!(actions, ["B", "I", "I", "C"], "{again:#?}");
    assert!(again.iter().all(|l| l.xid() == txn3_xid), "{again:#?}");
    assert_eq!(again[1].json["columns"][0]["value"], 4);
    stream.stop().await.unwrap();
}

#[tokio::test]
async fn answers_keepalives_and_survives_wal_sender_timeout() {
    let pg = Postgres::builder()
        .setting("wal_sender_timeout", "2s")
        .start()
        .unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('idle', 'wal2json')")
        .unwrap();
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client
        .start_logical("idle", Lsn::ZERO, OPTIONS)
        .await
        .unwrap();

    // Keep the stream open for 3 wal_sender_timeouts, answering every request.
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut requested = 0;
    let mut confirmed = Lsn::ZERO;
    loop {
        tokio::select! {
            event = stream.next_event() => match event.unwrap().unwrap() {
                ReplEvent::Keepalive { wal_end, reply_requested, .. } => {
                    // Nothing was streamed, so everything up to wal_end is handled.
                    confirmed = wal_end;
                    if reply_requested {
                        requested += 1;
                        stream.send_status(wal_end, false).await.unwrap();
                    }
                }
                other => panic!("unexpected {other:?}"),
            },
            _ = tokio::time::sleep_until(until) => break,
        }
    }
    assert!(
        requested >= 2,
        "only {requested} keepalives asked for a reply"
    );
    assert!(stream.last_wal_end() >= confirmed);

    // Still alive: a new change comes through.
    // One psql -c is one transaction.
    pg.psql("CREATE TABLE k (id int); INSERT INTO k VALUES (1)")
        .unwrap();
    let lines = read_commits(&mut stream, 1).await;
    assert!(lines.iter().any(|l| l.action() == "I"), "{lines:#?}");
    stream.stop().await.unwrap();
}

#[tokio::test]
async fn second_stream_on_an_active_slot_fails_with_55006() {
    let pg = Postgres::start().unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('busy', 'wal2json')")
        .unwrap();
    let first = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = first
        .start_logical("busy", Lsn::ZERO, OPTIONS)
        .await
        .unwrap();

    let second = ReplicationClient::connect(&pg.url()).await.unwrap();
    let err = second
        .start_logical("busy", Lsn::ZERO, OPTIONS)
        .await
        .err()
        .expect("second stream must fail");
    match &err {
        ReplError::Server { code, message, .. } => {
            assert_eq!(code, "55006", "{err}");
            assert!(message.contains("busy"), "{message}");
        }
        other => panic!("expected a server error, got {other:?}"),
    }

    // The first stream is unaffected.
    pg.psql("CREATE TABLE b (id int); INSERT INTO b VALUES (7)")
        .unwrap();
    let lines = read_commits(&mut stream, 1).await;
    assert!(lines.iter().any(|l| l.json["columns"][0]["value"] == 7));
    stream.stop().await.unwrap();
}

#[tokio::test]
async fn server_error_while_streaming_is_reported_with_its_code() {
    let pg = Postgres::start().unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('term', 'wal2json')")
        .unwrap();
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let pid = client.backend_pid().unwrap();
    let mut stream = client
        .start_logical("term", Lsn::ZERO, OPTIONS)
        .await
        .unwrap();
    pg.psql(&format!("SELECT pg_terminate_backend({pid})"))
        .unwrap();
    let err = loop {
        match tokio::time::timeout(WAIT, stream.next_event())
            .await
            .unwrap()
        {
            Ok(Some(ReplEvent::Keepalive { .. })) => continue,
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => break e,
        }
    };
    assert_eq!(err.code(), Some("57P01"), "{err}");
    assert!(matches!(stream.next_event().await, Err(ReplError::Closed)));
    stream.stop().await.unwrap();
}

#[tokio::test]
async fn quotes_slot_names_and_option_values() {
    let pg = Postgres::start().unwrap();
    pg.psql(r#"CREATE TABLE "it's" (id int); CREATE TABLE other (id int)"#)
        .unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('q', 'wal2json')")
        .unwrap();
    pg.psql(r#"BEGIN; INSERT INTO other VALUES (1); INSERT INTO "it's" VALUES (2); COMMIT"#)
        .unwrap();

    let mut options = OPTIONS.to_vec();
    options.push(("add-tables", "public.it's"));
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client
        .start_logical("q", Lsn::ZERO, &options)
        .await
        .unwrap();
    let lines = read_commits(&mut stream, 1).await;
    let actions: Vec<&str> = lines.iter().map(|l| l.action()).collect();
    assert_eq!(actions, ["B", "I", "C"], "{lines:#?}");
    assert_eq!(lines[1].json["table"], "it's");
    stream.stop().await.unwrap();

    // The replication grammar cannot quote a double quote in a name: a clear local
    // error instead of the server's bare "syntax error".
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let err = client
        .start_logical("we\"ird", Lsn::ZERO, OPTIONS)
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, ReplError::Config(ref m) if m.contains("we\\\"ird")),
        "{err}"
    );

    // A quote-free name that is not a slot: the server's own error comes back.
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let err = client
        .start_logical("no_such_slot", Lsn::ZERO, OPTIONS)
        .await
        .err()
        .unwrap();
    assert_eq!(err.code(), Some("42704"), "{err}");
}

#[tokio::test]
async fn next_event_is_cancel_safe_under_select() {
    let pg = Postgres::start().unwrap();
    pg.psql("CREATE TABLE c (id int)").unwrap();
    pg.psql("SELECT pg_create_logical_replication_slot('c', 'wal2json')")
        .unwrap();
    pg.psql("INSERT INTO c SELECT generate_series(1, 2000)")
        .unwrap();
    let client = ReplicationClient::connect(&pg.url()).await.unwrap();
    let mut stream = client.start_logical("c", Lsn::ZERO, OPTIONS).await.unwrap();
    // A timer that fires constantly drops next_event futures mid-read.
    let mut ticks = tokio::time::interval(Duration::from_micros(50));
    let mut ids = Vec::new();
    let mut cancelled = 0u64;
    let deadline = tokio::time::Instant::now() + WAIT;
    while ids.len() < 2000 {
        assert!(tokio::time::Instant::now() < deadline, "timed out");
        tokio::select! {
            biased;
            _ = ticks.tick() => cancelled += 1,
            event = stream.next_event() => {
                if let ReplEvent::XLogData { data, .. } = event.unwrap().unwrap() {
                    let json: serde_json::Value = serde_json::from_slice(&data).unwrap();
                    if json["action"] == "I" {
                        ids.push(json["columns"][0]["value"].as_i64().unwrap());
                    }
                }
            }
        }
    }
    assert_eq!(ids, (1..=2000).collect::<Vec<_>>());
    assert!(cancelled > 0);
    // Make sure the helper compiles for keepalive-only use too.
    let _ = next;
    stream.stop().await.unwrap();
}
