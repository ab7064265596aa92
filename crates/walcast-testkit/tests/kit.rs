//! The kit starts real services, and they go away when dropped.

use walcast_testkit::{Nats, Postgres};

#[tokio::test]
async fn postgres_is_logical_and_has_wal2json() {
    let pg = Postgres::start().expect("start postgres");
    let client = pg.connect().await.expect("connect");
    let row = client.query_one("show wal_level", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "logical");
    let row = client
        .query_one(
            "select lsn::text from pg_create_logical_replication_slot('kit_probe', 'wal2json')",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, String>(0).contains('/'));
    let port = pg.port();
    drop(client);
    drop(pg);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "postgres still listening on {port} after drop"
    );
}

#[test]
fn nats_starts_and_restarts_on_the_same_port() {
    let mut nats = Nats::start().expect("start nats");
    let port = nats.port();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    nats.stop();
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    nats.restart().expect("restart");
    assert_eq!(nats.port(), port);
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
}
