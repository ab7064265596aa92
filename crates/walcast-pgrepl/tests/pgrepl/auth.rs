//! Password authentication against real clusters.

use walcast_pgrepl::{ReplError, ReplicationClient};
use walcast_testkit::Postgres;

async fn assert_connects(url: &str) {
    let mut client = ReplicationClient::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    let info = client.identify_system().await.unwrap();
    assert_eq!(info.dbname.as_deref(), Some("postgres"));
    client.close().await;
}

async fn assert_rejected(url: &str, want: &str) {
    match ReplicationClient::connect(url).await {
        Err(ReplError::Auth(msg)) => assert!(msg.contains(want), "{msg}"),
        Err(other) => panic!("expected an auth error, got {other:?}"),
        Ok(_) => panic!("connected with {url}"),
    }
}

#[tokio::test]
async fn scram_sha_256_and_md5() {
    let pg = Postgres::builder()
        .password_auth("md5", "s3cret 'x'")
        .start()
        .unwrap();
    let port = pg.port();
    // The password is stored as SCRAM, so the server upgrades md5 to SCRAM-SHA-256.
    assert_connects(&pg.url()).await;
    assert_rejected(
        &format!("postgres://postgres:wrong@127.0.0.1:{port}/postgres"),
        "password authentication failed for user \"postgres\"",
    )
    .await;
    assert_rejected(
        &format!("postgres://postgres@127.0.0.1:{port}/postgres"),
        "connection string has none",
    )
    .await;

    // Store an MD5 hash instead: now the md5 method is used.
    pg.psql("SET password_encryption = 'md5'; ALTER ROLE postgres PASSWORD 'md5pw'")
        .unwrap();
    assert_connects(&format!(
        "postgres://postgres:md5pw@127.0.0.1:{port}/postgres"
    ))
    .await;
    assert_rejected(
        &format!("postgres://postgres:wrong@127.0.0.1:{port}/postgres"),
        "password authentication failed",
    )
    .await;
}

#[tokio::test]
async fn scram_only_cluster() {
    let pg = Postgres::builder()
        .password_auth("scram-sha-256", "pw")
        .start()
        .unwrap();
    assert_connects(&pg.url()).await;
    let port = pg.port();
    assert_rejected(
        &format!("postgres://postgres:nope@127.0.0.1:{port}/postgres"),
        "SQLSTATE 28P01",
    )
    .await;
    // An unknown database is a server error after authentication.
    match ReplicationClient::connect(&format!("postgres://postgres:pw@127.0.0.1:{port}/nodb")).await
    {
        Err(e) => assert_eq!(e.code(), Some("3D000"), "{e}"),
        Ok(_) => panic!("connected to a missing database"),
    }
}

#[tokio::test]
async fn cleartext_password() {
    let pg = Postgres::builder()
        .password_auth("password", "plain")
        .start()
        .unwrap();
    assert_connects(&pg.url()).await;
    assert_rejected(
        &format!("postgres://postgres:bad@127.0.0.1:{}/postgres", pg.port()),
        "password authentication failed",
    )
    .await;
}
