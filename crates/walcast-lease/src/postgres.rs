//! Leadership through a lease row in Postgres (`walcast.leases`, see
//! `walcast-control/sql/0005_leases.sql`), renewed by its holder and judged by the database's clock.
//!
//! A session-bound advisory lock is not enough: a frozen process keeps its session, so
//! its lock never expires. The row has a holder, a renew time written with the
//! database's `clock_timestamp()`, a duration, and a **term** that grows by one on every
//! acquisition (the fencing number). Every write is one statement, compare-and-set on the
//! term, so no row lock is ever held across a round trip (a frozen elector cannot block
//! the others):
//!
//! * the holder renews every third of the duration (`renewed_at = clock_timestamp()`
//!   where the term and its session tag are still ours) and keeps a [`Fence`] open until
//!   `duration - margin` after it *sent* its last renewal that succeeded;
//! * a follower reads the row and takes it (term + 1) once it is free, or expired by the
//!   database clock (`clock_timestamp() >= renewed_at + duration`), checked again by the
//!   taking statement itself. It then terminates the stale holder's Postgres sessions,
//!   found by their `application_name` (the holder's session tag, recorded in the row):
//!   the lease session, and — when the cdc-worker tags its connections with the same
//!   name (see [`tagged_url`]) — its walsender, which keeps the slot active, and the
//!   session that advances the slot;
//! * on shutdown the holder closes its fence, then releases the row (empty holder), so a
//!   follower takes over at its next read, never while that fence is open.
//!
//! A follower reads again when the holder's lease runs out (or every third of the
//! duration, whichever comes first), so a holder that stops renewing is replaced about
//! one duration after its last renewal.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

use crate::decision::{decide_row, Row, RowDecision, Timing};
use crate::fence::Fence;
use crate::status::LeaseStatus;
use crate::telemetry;

#[derive(Clone, Debug)]
pub struct PgLeaseConfig {
    pub url: String,
    /// The lease name: workers with the same name compete.
    pub name: String,
    /// Who we are, for people (`holder` in the row, `/health`): e.g. the pod name.
    pub identity: String,
    /// The `application_name` of our sessions, unique to this process: recorded in the
    /// row so that a worker taking over from us can terminate them.
    pub session_tag: String,
    /// Lease duration; the holder renews every third of it.
    pub duration: Duration,
}

impl PgLeaseConfig {
    pub fn timing(&self) -> Timing {
        Timing::for_duration(self.duration)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PgLeaseError {
    #[error("database: {0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("postgres TLS: {0}")]
    Tls(#[from] walcast_pgtls::PgTlsError),
    #[error("no answer from Postgres within {0:?}")]
    Timeout(Duration),
}

/// `url` with `application_name` set to `name` (replacing one the URL may have), in the
/// URL's own syntax: `postgres://…?…&application_name=name` or `… application_name=name`.
/// `name` must be a plain word (letters, digits, `-`, `_`).
pub fn tagged_url(url: &str, name: &str) -> String {
    let trimmed = url.trim_end();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let sep = if trimmed.contains('?') { '&' } else { '?' };
        format!("{trimmed}{sep}application_name={name}")
    } else {
        format!("{trimmed} application_name={name}")
    }
}

const READ: &str = r#"
SELECT holder, holder_session, term,
       holder_session IS NOT NULL AND renewed_at IS NOT NULL
         AND clock_timestamp() < renewed_at + duration_ms * interval '1 millisecond' AS live,
       greatest(0, floor(extract(epoch FROM renewed_at + duration_ms * interval '1 millisecond'
                                              - clock_timestamp()) * 1000))::int8 AS left_ms
  FROM "walcast"."leases" WHERE name = $1"#;

const INSERT: &str = r#"
INSERT INTO "walcast"."leases" (name, holder, holder_session, term, renewed_at, acquired_at, duration_ms)
VALUES ($1, $2, $3, 1, clock_timestamp(), clock_timestamp(), $4)
ON CONFLICT (name) DO NOTHING
RETURNING term"#;

const TAKE: &str = r#"
UPDATE "walcast"."leases"
   SET holder = $2, holder_session = $3, term = term + 1, duration_ms = $4,
       renewed_at = clock_timestamp(), acquired_at = clock_timestamp()
 WHERE name = $1 AND term = $5
   AND (holder_session IS NULL OR holder_session = $3 OR renewed_at IS NULL
        OR clock_timestamp() >= renewed_at + duration_ms * interval '1 millisecond')
RETURNING term"#;

const RENEW: &str = r#"
UPDATE "walcast"."leases" SET renewed_at = clock_timestamp(), duration_ms = $4
 WHERE name = $1 AND term = $2 AND holder_session = $3
RETURNING term"#;

const RELEASE: &str = r#"
UPDATE "walcast"."leases" SET holder = NULL, holder_session = NULL, renewed_at = NULL
 WHERE name = $1 AND term = $2 AND holder_session = $3"#;

const TERMINATE: &str = r#"
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
  FROM pg_stat_activity
 WHERE application_name = $1 AND pid <> pg_backend_pid()"#;

/// The lease session: connected on first use, dropped after any failure.
struct Session {
    cfg: PgLeaseConfig,
    client: Option<Client>,
}

impl Session {
    fn new(cfg: PgLeaseConfig) -> Session {
        Session { cfg, client: None }
    }

    /// Run `f` on the session within `bound`; any failure drops the session.
    async fn with<T, F>(&mut self, bound: Duration, f: F) -> Result<T, PgLeaseError>
    where
        F: for<'c> FnOnce(&'c Client, &'c PgLeaseConfig) -> BoxFut<'c, T>,
    {
        let Session { cfg, client } = self;
        let result = tokio::time::timeout(bound, async {
            let c = connected(client, cfg).await?;
            f(c, cfg).await
        })
        .await
        .unwrap_or(Err(PgLeaseError::Timeout(bound)));
        if result.is_err() {
            *client = None;
        }
        result
    }
}

/// The session, connected (tagged with our `application_name`) if it is not.
async fn connected<'c>(
    slot: &'c mut Option<Client>,
    cfg: &PgLeaseConfig,
) -> Result<&'c Client, PgLeaseError> {
    let client = match slot.take() {
        Some(c) if !c.is_closed() => c,
        _ => {
            // TLS as the URL's sslmode says, like every other connection.
            let client = walcast_pgtls::connect(&cfg.url).await?;
            client
                .execute(
                    "SELECT set_config('application_name', $1, false)",
                    &[&cfg.session_tag],
                )
                .await?;
            client
        }
    };
    Ok(slot.insert(client))
}

type BoxFut<'c, T> = std::pin::Pin<Box<dyn Future<Output = Result<T, PgLeaseError>> + Send + 'c>>;

impl From<walcast_pgtls::ConnectError> for PgLeaseError {
    fn from(e: walcast_pgtls::ConnectError) -> Self {
        match e {
            walcast_pgtls::ConnectError::Tls(e) => PgLeaseError::Tls(e),
            walcast_pgtls::ConnectError::Postgres(e) => PgLeaseError::Db(e),
        }
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

fn term_of(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// A lease we just won.
struct Won {
    term: u64,
    /// When the winning statement was sent, on our clock.
    sent: Instant,
    /// The session tag of a holder that let its lease expire.
    stale: Option<String>,
}

/// A lease someone else holds.
struct Held {
    holder: Option<String>,
    term: u64,
    left: Option<Duration>,
}

enum Attempt {
    Won(Won),
    Held(Held),
}

/// One read, and a write when the rule says so.
fn attempt<'c>(client: &'c Client, cfg: &'c PgLeaseConfig) -> BoxFut<'c, Attempt> {
    Box::pin(async move {
        let row = client.query_opt(READ, &[&cfg.name]).await?;
        let seen = row.as_ref().map(|r| {
            let holder: Option<String> = r.get(0);
            let left: Option<i64> = r.get(4);
            let held = Held {
                holder,
                term: term_of(r.get(2)),
                left: left.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
            };
            let row = Row {
                session: r.get(1),
                term: held.term,
                live: r.get(3),
            };
            (row, held)
        });
        let duration = millis(cfg.duration);
        let (term, stale) = match decide_row(seen.as_ref().map(|(r, _)| r), &cfg.session_tag) {
            RowDecision::Wait => {
                return Ok(Attempt::Held(seen.map(|(_, h)| h).unwrap_or_else(free)))
            }
            RowDecision::Insert => (None, None),
            RowDecision::Take { term, stale } => (Some(term), stale),
        };
        let sent = Instant::now();
        let written = match term {
            None => {
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
                    [&cfg.name, &cfg.identity, &cfg.session_tag, &duration];
                client.query_opt(INSERT, &params).await?
            }
            Some(t) => {
                let t = i64::try_from(t).unwrap_or(i64::MAX);
                let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
                    [&cfg.name, &cfg.identity, &cfg.session_tag, &duration, &t];
                client.query_opt(TAKE, &params).await?
            }
        };
        Ok(match written {
            Some(r) => Attempt::Won(Won {
                term: term_of(r.get(0)),
                sent,
                stale,
            }),
            // Someone wrote in between: read again next time.
            None => Attempt::Held(seen.map(|(_, h)| h).unwrap_or_else(free)),
        })
    })
}

fn free() -> Held {
    Held {
        holder: None,
        term: 0,
        left: None,
    }
}

/// Elect until `shutdown`. Each time we become leader, `lead(fence)` runs; it must check
/// the fence before acting and return soon after the fence's token is cancelled (the
/// fence closed, leadership lost, or shutdown).
pub async fn run<F, Fut>(
    cfg: PgLeaseConfig,
    status: Arc<LeaseStatus>,
    shutdown: CancellationToken,
    lead: F,
) where
    F: FnMut(Fence) -> Fut,
    Fut: Future<Output = ()>,
{
    run_gated(cfg, status, shutdown, || true, lead).await
}

/// [`run`], trying to take the lease only while `may_lead` says so (asked before every
/// attempt): a worker that already leads its fair share of the sources leaves the others
/// to the other workers. A lease already held is kept whatever it says; to give one up,
/// end the term (`lead` returns) and the lease is released.
pub async fn run_gated<G, F, Fut>(
    cfg: PgLeaseConfig,
    status: Arc<LeaseStatus>,
    shutdown: CancellationToken,
    may_lead: G,
    mut lead: F,
) where
    G: Fn() -> bool + Send + Sync,
    F: FnMut(Fence) -> Fut,
    Fut: Future<Output = ()>,
{
    let mut db = Session::new(cfg.clone());
    while !shutdown.is_cancelled() {
        let Some(won) = acquire(&mut db, &status, &shutdown, &may_lead).await else {
            return;
        };
        let window = cfg.timing().leader_window();
        let fence = Fence::new(won.term, shutdown.child_token(), won.sent + window);
        metrics::counter!(telemetry::TERMS).increment(1);
        tracing::info!(lease = %cfg.name, term = won.term, identity = %cfg.identity, "became leader (Postgres lease)");
        if let Some(stale) = &won.stale {
            metrics::counter!(telemetry::TAKEOVERS).increment(1);
            terminate(&mut db, stale, &fence).await;
        }
        status.leading(&cfg.identity, &fence);
        let work_done = CancellationToken::new();
        let keeper = {
            let (fence, work_done) = (fence.clone(), work_done.clone());
            let mut db = std::mem::replace(&mut db, Session::new(cfg.clone()));
            crate::Keeper::spawn(async move {
                hold(&mut db, &fence).await;
                fence.token().cancel();
                // Released only once the work has stopped, only while still ours, and
                // with the fence already closed: a follower takes a free row at its next
                // read, maybe before the answer to our release reaches us.
                work_done.cancelled().await;
                let left = fence.expires_in().filter(|d| !d.is_zero());
                fence.revoke();
                if let Some(left) = left {
                    release(&mut db, fence.term(), left).await;
                }
                db
            })
        };
        // Let it start before the work: spawned from a worker thread, it waits in that
        // worker's own slot, which no other thread takes from while the work runs.
        tokio::task::yield_now().await;
        lead(fence.clone()).await;
        fence.token().cancel();
        work_done.cancel();
        db = keeper
            .join()
            .await
            .unwrap_or_else(|| Session::new(cfg.clone()));
        status.following();
        tracing::warn!(lease = %cfg.name, term = won.term, "leadership ended");
    }
}

/// How often a gated elector asks again whether it may lead.
const GATE_RECHECK: Duration = Duration::from_millis(500);

/// Read (and write) until we hold the lease; None on shutdown.
async fn acquire(
    db: &mut Session,
    status: &LeaseStatus,
    shutdown: &CancellationToken,
    may_lead: &(dyn Fn() -> bool + Send + Sync),
) -> Option<Won> {
    let every = db.cfg.timing().renew_every();
    let mut announced: Option<Option<String>> = None;
    loop {
        if shutdown.is_cancelled() {
            return None;
        }
        let mut wait = every;
        if !may_lead() {
            // Not our turn: look again soon (a share changes within a beacon or two).
            tokio::select! {
                _ = shutdown.cancelled() => return None,
                _ = tokio::time::sleep(GATE_RECHECK.min(every)) => {}
            }
            continue;
        }
        match db.with(every, attempt).await {
            Ok(Attempt::Won(won)) => return Some(won),
            Ok(Attempt::Held(h)) => {
                status.observed(h.holder.as_deref(), Some(h.term), h.left);
                if announced.as_ref() != Some(&h.holder) {
                    tracing::info!(lease = %db.cfg.name, holder = ?h.holder, term = h.term, "another worker leads; waiting for its lease to expire");
                    announced = Some(h.holder.clone());
                }
                // Read again as soon as it could have expired.
                if let Some(left) = h.left {
                    wait = wait.min(left + Duration::from_millis(5));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, lease = %db.cfg.name, "leader election: cannot read or write the lease row")
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Renew until the term's token is cancelled, the lease is lost, or the fence closes
/// (then revoked).
async fn hold(db: &mut Session, fence: &Fence) {
    let timing = db.cfg.timing();
    let every = timing.renew_every();
    let mut next = Instant::now() + every;
    loop {
        let Some(deadline) = fence.deadline() else {
            return;
        };
        tokio::select! {
            _ = fence.cancelled() => return,
            _ = tokio::time::sleep_until(next.min(deadline).into()) => {}
        }
        if !fence.is_open() {
            tracing::error!(lease = %db.cfg.name, term = fence.term(), "lease not renewed before the fence deadline: stepping down");
            fence.revoke();
            return;
        }
        if Instant::now() < next {
            continue;
        }
        let sent = Instant::now();
        let left = deadline.saturating_duration_since(sent);
        let term = i64::try_from(fence.term()).unwrap_or(i64::MAX);
        let duration = millis(db.cfg.duration);
        let renewed = tokio::select! {
            _ = fence.cancelled() => return,
            r = db.with(left, |c, cfg| Box::pin(async move {
                Ok(c.query_opt(RENEW, &[&cfg.name, &term, &cfg.session_tag, &duration]).await?.is_some())
            })) => r,
        };
        match renewed {
            Ok(true) => {
                metrics::counter!(telemetry::RENEWALS, "result" => "ok").increment(1);
                fence.extend(sent + timing.leader_window());
                next = sent + every;
            }
            Ok(false) => {
                metrics::counter!(telemetry::RENEWALS, "result" => "lost").increment(1);
                tracing::error!(lease = %db.cfg.name, term = fence.term(), "the lease row names another holder or term: stepping down");
                fence.revoke();
                return;
            }
            Err(e) => {
                metrics::counter!(telemetry::RENEWALS, "result" => "failed").increment(1);
                tracing::warn!(error = %e, lease = %db.cfg.name, term = fence.term(), "renewing the lease failed; retrying until the fence closes");
                next = Instant::now() + every / 4;
            }
        }
    }
}

/// End the stale holder's sessions (lease session, walsender, slot session).
async fn terminate(db: &mut Session, stale: &str, fence: &Fence) {
    let bound = fence.expires_in().unwrap_or(Duration::from_secs(5));
    let tag = stale.to_string();
    let ended = db
        .with(bound, |c, _| {
            Box::pin(async move { Ok(c.query_one(TERMINATE, &[&tag]).await?.get::<_, i64>(0)) })
        })
        .await;
    match ended {
        Ok(n) => {
            metrics::counter!(telemetry::SESSIONS_TERMINATED)
                .increment(u64::try_from(n).unwrap_or(0));
            tracing::warn!(
                stale_holder = stale,
                sessions = n,
                "took over an expired lease: terminated the stale holder's sessions"
            );
        }
        Err(e) => {
            tracing::warn!(error = %e, stale_holder = stale, "took over an expired lease but could not terminate the stale holder's sessions (the worker's role needs pg_signal_backend, or to be the same role); its slot is taken over when found active")
        }
    }
}

/// Give the lease up (empty holder) so that a follower need not wait for it to expire.
/// `left`: the time our closed fence had left, the bound of the statement.
async fn release(db: &mut Session, term: u64, left: Duration) {
    let fencing = i64::try_from(term).unwrap_or(i64::MAX);
    let released = db
        .with(left, |c, cfg| {
            Box::pin(async move {
                Ok(c.execute(RELEASE, &[&cfg.name, &fencing, &cfg.session_tag])
                    .await?)
            })
        })
        .await;
    match released {
        Ok(1) => tracing::info!(lease = %db.cfg.name, term, "released the lease"),
        Ok(_) => tracing::warn!(lease = %db.cfg.name, "the lease was no longer ours to release"),
        Err(e) => tracing::warn!(error = %e, lease = %db.cfg.name, "could not release the lease"),
    }
}

#[cfg(test)]
mod tests {
    use super::tagged_url;

    #[test]
    fn the_session_tag_is_added_in_the_urls_own_syntax() {
        assert_eq!(
            tagged_url("postgres://u:p@h:5432/db", "walcast-cdc-1"),
            "postgres://u:p@h:5432/db?application_name=walcast-cdc-1"
        );
        assert_eq!(
            tagged_url("postgresql://h/db?sslmode=disable&application_name=x", "t"),
            "postgresql://h/db?sslmode=disable&application_name=x&application_name=t"
        );
        assert_eq!(
            tagged_url("host=h user=u dbname=db ", "t"),
            "host=h user=u dbname=db application_name=t"
        );
    }

    #[test]
    fn the_last_application_name_wins() {
        for url in [
            "postgres://u@h/db?application_name=mine",
            "host=h user=u application_name=mine",
        ] {
            let cfg: tokio_postgres::Config = tagged_url(url, "walcast-cdc-ab").parse().unwrap();
            assert_eq!(cfg.get_application_name(), Some("walcast-cdc-ab"), "{url}");
        }
    }
}
