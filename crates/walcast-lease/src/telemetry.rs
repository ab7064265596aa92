//! Metric names of leader election and fencing (registered by [`describe`]).

/// Counter: lease renewals, label `result`: `ok`, `failed` (no answer or an error; the
/// term goes on until its fence closes) or `lost` (another worker holds the lease).
pub const RENEWALS: &str = "walcast_lease_renewals_total";
/// Counter: terms this worker began.
pub const TERMS: &str = "walcast_lease_terms_total";
/// Counter: terms begun by taking over a lease whose holder let it expire (frozen,
/// partitioned or dead) instead of releasing it.
pub const TAKEOVERS: &str = "walcast_lease_takeovers_total";
/// Counter: actions refused by a closed fence, label `action`: `publish`, `ack`, `slot`,
/// `read`.
pub const FENCED: &str = "walcast_lease_fenced_total";
/// Counter: Postgres sessions of a stale holder terminated on takeover.
pub const SESSIONS_TERMINATED: &str = "walcast_lease_sessions_terminated_total";
/// Gauge: 1 while this worker leads with an open fence.
pub const LEADER: &str = "walcast_lease_leader";
/// Gauge: the term (fencing number) this worker last led.
pub const TERM: &str = "walcast_lease_term";

/// Register the descriptions with the installed recorder.
pub fn describe() {
    metrics::describe_counter!(
        RENEWALS,
        "Lease renewals by result: ok, failed (retried until the fence closes), lost (another holder)"
    );
    metrics::describe_counter!(TERMS, "Leadership terms this worker began");
    metrics::describe_counter!(
        TAKEOVERS,
        "Terms begun by taking over a lease its holder let expire without releasing it"
    );
    metrics::describe_counter!(
        FENCED,
        "Publishes, acknowledgements and slot take-overs refused because the lease was not renewed in time (label action)"
    );
    metrics::describe_counter!(
        SESSIONS_TERMINATED,
        "Postgres sessions of a stale lease holder terminated on takeover"
    );
    metrics::describe_gauge!(LEADER, "1 while this worker leads with an open fence");
    metrics::describe_gauge!(TERM, "The term (fencing number) this worker last led");
}
