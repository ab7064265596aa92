//! Partition maintenance: the leading cdc-worker calls `walcast.outbox_maintain()` (and
//! `walcast.realtime_messages_maintain()`, for broadcast from the database) at the start
//! of each term and then periodically, so every outbox table and `realtime.messages` have
//! partitions for the next days and drop those older than their retention (never a
//! `DELETE`).

use std::future::Future;
use std::time::Duration;

use tokio_postgres::Client;

use crate::telemetry;

/// Why one maintenance run failed (the next interval tries again).
#[derive(Debug, thiserror::Error)]
pub enum MaintainError {
    #[error("connecting: {0}")]
    Connect(#[from] walcast_pgtls::ConnectError),
    #[error("walcast.outbox_maintain(): {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

/// One run: `walcast.outbox_maintain()` with `lock_timeout`, so that a partition it
/// cannot lock at once never queues the outbox's writers behind it for long. Returns the
/// number of partitions dropped.
pub async fn maintain_once(client: &Client, lock_timeout: Duration) -> Result<u32, MaintainError> {
    let timeout = format!("{}ms", lock_timeout.as_millis().max(1));
    client
        .execute("SELECT set_config('lock_timeout', $1, false)", &[&timeout])
        .await?;
    // realtime.messages (broadcast from the database) is day-partitioned the same way.
    let row = client
        .query_one(
            "SELECT walcast.outbox_maintain() + walcast.realtime_messages_maintain()",
            &[],
        )
        .await?;
    let dropped: i32 = row.get(0);
    Ok(u32::try_from(dropped).unwrap_or(0))
}

/// Settings of `run`.
#[derive(Clone, Debug)]
pub struct Maintenance {
    pub database_url: String,
    pub interval: Duration,
    pub lock_timeout: Duration,
}

impl Maintenance {
    /// Run now, then every `interval`, until `stop` resolves or `may_act` says no (the
    /// leader's fence closed). Failures are logged and counted, never fatal.
    pub async fn run(self, may_act: impl Fn() -> bool, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut tick = tokio::time::interval(self.interval.max(Duration::from_secs(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut client: Option<Client> = None;
        loop {
            tokio::select! {
                _ = &mut stop => return,
                _ = tick.tick() => {}
            }
            if !may_act() {
                return;
            }
            let result = tokio::select! {
                _ = &mut stop => return,
                r = self.once(&mut client) => r,
            };
            match result {
                Ok(0) => tracing::debug!("outbox partition maintenance: nothing dropped"),
                Ok(n) => {
                    metrics::counter!(telemetry::PARTITIONS_DROPPED).increment(u64::from(n));
                    tracing::info!(
                        dropped = n,
                        "outbox partitions older than their retention dropped"
                    );
                }
                Err(e) => {
                    metrics::counter!(telemetry::MAINTENANCE_FAILURES).increment(1);
                    tracing::warn!(error = %e, retry_in_secs = self.interval.as_secs(), "outbox partition maintenance failed");
                    client = None;
                }
            }
        }
    }

    /// One run on `client`, connecting first when there is none (or it closed).
    async fn once(&self, client: &mut Option<Client>) -> Result<u32, MaintainError> {
        if client.as_ref().is_none_or(Client::is_closed) {
            *client = Some(walcast_pgtls::connect(&self.database_url).await?);
        }
        match client.as_ref() {
            Some(c) => maintain_once(c, self.lock_timeout).await,
            None => Ok(0),
        }
    }
}
