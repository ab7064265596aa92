//! Leadership through a Postgres advisory lock held by a dedicated session.
//!
//! The lock is taken with `pg_try_advisory_lock` on a session used for nothing else and
//! checked every `check_interval`; when the session fails or does not answer in time, the
//! term is cancelled at once (and the session dropped, which releases the lock). Postgres
//! releases the lock of a session that died, so a killed leader is replaced as soon as the
//! server notices (a closed socket: immediately).

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

#[derive(Clone, Debug)]
pub struct PgLeaseConfig {
    pub url: String,
    /// The lock key: workers with the same key compete.
    pub key: i64,
    /// How often the holder checks its session, and how long a check may take.
    pub check_interval: Duration,
    /// How often a follower tries to take the lock.
    pub retry_interval: Duration,
}

/// A stable 64-bit key for a lease name (FNV-1a), e.g. the slot name.
pub fn lock_key(name: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in "walcast-lease:".bytes().chain(name.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h as i64
}

/// Shared view of the elector, for `/health`.
#[derive(Default, Debug)]
pub struct LeaderFlag(AtomicBool);

impl LeaderFlag {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    pub(crate) fn set(&self, v: bool) {
        self.0.store(v, Ordering::SeqCst);
    }
}

/// Elect until `shutdown`. Each time we become leader, `lead(term)` runs; it must return
/// soon after `term` is cancelled (leadership lost or shutdown).
pub async fn run<F, Fut>(
    cfg: PgLeaseConfig,
    flag: Arc<LeaderFlag>,
    shutdown: CancellationToken,
    mut lead: F,
) where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()>,
{
    while !shutdown.is_cancelled() {
        let Some(client) = acquire(&cfg, &shutdown).await else {
            return;
        };
        tracing::info!(key = cfg.key, "became leader (advisory lock held)");
        flag.set(true);
        let term = shutdown.child_token();
        let watch = {
            let term = term.clone();
            let cfg = cfg.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(cfg.check_interval);
                loop {
                    tokio::select! {
                        _ = term.cancelled() => break,
                        _ = tick.tick() => {
                            let ok = tokio::time::timeout(cfg.check_interval, client.simple_query("SELECT 1")).await;
                            if !matches!(ok, Ok(Ok(_))) {
                                tracing::error!("leader session lost or unresponsive: stepping down");
                                break;
                            }
                        }
                    }
                }
                term.cancel();
                // Dropping the client ends the session and releases the lock.
                drop(client);
            })
        };
        lead(term.clone()).await;
        term.cancel();
        let _ = watch.await;
        flag.set(false);
        tracing::warn!("leadership ended");
    }
}

/// Connect and wait for the lock; None on shutdown.
async fn acquire(
    cfg: &PgLeaseConfig,
    shutdown: &CancellationToken,
) -> Option<tokio_postgres::Client> {
    let mut announced = false;
    loop {
        if shutdown.is_cancelled() {
            return None;
        }
        match try_once(cfg).await {
            Ok(Some(client)) => return Some(client),
            Ok(None) => {
                if !announced {
                    tracing::info!(
                        key = cfg.key,
                        "another worker leads; waiting for the advisory lock"
                    );
                    announced = true;
                }
            }
            Err(e) => tracing::warn!(error = %e, "leader election: cannot reach Postgres"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(cfg.retry_interval) => {}
        }
    }
}

async fn try_once(
    cfg: &PgLeaseConfig,
) -> Result<Option<tokio_postgres::Client>, walcast_pgtls::ConnectError> {
    // TLS as the URL's sslmode says, like every other connection.
    let client = walcast_pgtls::connect(&cfg.url).await?;
    client
        .simple_query("SET application_name = 'walcast-leader-election'")
        .await?;
    let got: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&cfg.key])
        .await?
        .get(0);
    Ok(got.then_some(client))
}
