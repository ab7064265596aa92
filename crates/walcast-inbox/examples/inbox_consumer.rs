//! A runnable inbox consumer: applies every outbox event once to a table of its own.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//! NATS_URL=nats://127.0.0.1:4222 \
//! WALCAST_STREAM=WALCAST_OUTBOX WALCAST_DURABLE=inbox-example \
//! cargo run -p walcast-inbox --example inbox_consumer
//! ```
//!
//! `NATS_URL`, `WALCAST_STREAM` and `WALCAST_DURABLE` have the defaults shown;
//! `RUST_LOG` sets the log level (default `info`). It creates the inbox table
//! (`walcast_inbox`) and its side-effect table (`inbox_example_effects`) if missing,
//! binds the durable consumer (the stream must exist: the relay creates it) and handles
//! events until Ctrl-C, which lets the event being handled finish. Each event becomes one
//! row of `inbox_example_effects`, written in the transaction that records the event in
//! the inbox: kill it anywhere, restart it, and no event has two rows.

use std::error::Error;
use std::time::Duration;

use tokio_postgres::{NoTls, Transaction};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};
use walcast_inbox::{ConsumerConfig, Event, Handler, HandlerError, Inbox, InboxConsumer};

/// The side effect: one row per event.
struct RecordEvent;

impl Handler for RecordEvent {
    async fn handle(&self, tx: &mut Transaction<'_>, event: &Event) -> Result<(), HandlerError> {
        // The payload is JSON text; a payload that is not JSON fails here, is retried
        // with a backoff and terminated at max_deliver.
        let payload = std::str::from_utf8(&event.payload)?;
        tx.execute(
            "INSERT INTO inbox_example_effects (event_id, project, topic, key, payload)
             VALUES ($1::text::uuid, $2, $3, $4, $5::text::jsonb)",
            &[
                &event.id.to_string(),
                &event.project,
                &event.topic,
                &event.key,
                &payload,
            ],
        )
        .await?;
        info!(id = %event.id, topic = %event.topic, key = ?event.key, "applied");
        Ok(())
    }
}

const EFFECTS_TABLE: &str = "CREATE TABLE IF NOT EXISTS inbox_example_effects (
    event_id uuid NOT NULL, -- no unique key: the inbox alone keeps events from applying twice
    project text NOT NULL,
    topic text NOT NULL,
    key text,
    payload jsonb NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)";

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let env = |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
    let database_url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let nats_url = env("NATS_URL", "nats://127.0.0.1:4222");
    let mut config = ConsumerConfig::new(env("WALCAST_DURABLE", "inbox-example"));
    config.stream = env("WALCAST_STREAM", walcast_inbox::DEFAULT_STREAM);

    let (db, connection) = tokio_postgres::connect(&database_url, NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            error!(error = %e, "Postgres connection ended");
        }
    });
    let inbox = Inbox::default();
    inbox.migrate(&db).await?;
    db.batch_execute(EFFECTS_TABLE).await?;

    let nats = async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(10))
        .connect(&nats_url)
        .await?;
    let js = async_nats::jetstream::new(nats);
    let mut consumer = match InboxConsumer::bind(&js, db, &inbox, config).await {
        Err(e) if e.is_stream_not_found() => {
            return Err(format!("{e}: start the walcast relay first, it creates the stream").into())
        }
        bound => bound?,
    };

    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            info!("stopping");
            on_signal.cancel();
        }
    });
    consumer.run(&RecordEvent, &cancel).await?;
    Ok(())
}
