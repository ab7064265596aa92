//! Private channels: may a subscriber read (join) or write (send, track presence) a
//! topic? Decided by the app's row-level security policies on `realtime.messages`, as
//! Supabase does, evaluated as the subscriber: its `role` (bound through
//! `set_config('role', …)`), its claims in `request.jwt.claims` and `realtime.topic()` =
//! the topic, all transaction-local, in a transaction that is always rolled back.
//!
//! - read: a probe message of the topic is inserted (`walcast.probe_message`, as the
//!   table's owner, to whom RLS does not apply), then selected as the subscriber:
//!   allowed if it sees it;
//! - write: the subscriber inserts one: allowed unless a policy refuses it.
//!
//! The check runs on the check login's connection ([`walcast_control::check_login`]), so a policy
//! that resets the role regains no power; the rows it writes never commit (the check is
//! rolled back, and a constraint trigger refuses any commit of the check login's rows)
//! and so never reach the WAL's readers. A role that bypasses row-level security (which
//! the check login may not act as) is answered by its privilege on `realtime.messages`
//! alone, on walcast's own connection, without running anything of the tenant's.
//!
//! Everything is one project's: the check runs with `walcast.project` = the joining
//! project (policies can read it with `current_setting('walcast.project')`), its rows
//! carry that project (walcast-control/sql/0014_project_messages.sql), a token whose `ref` names
//! another project is refused, and so is a role no token may act as
//! ([`walcast_control::roles`]). Replays read only the project's rows.

use serde_json::Value;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

use walcast_control::roles::{RolePolicy, RoleRefused};
use walcast_control::tables::DEFAULT_PROJECT;

/// Why a private-channel check said no without asking the policies.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error(transparent)]
    Role(#[from] RoleRefused),
    #[error("the token belongs to project {token:?}, not {project:?}")]
    OtherProject { token: String, project: String },
}

/// The project a token's claims name (`ref`; absent = the default project).
fn token_project(claims: &Value) -> Option<&str> {
    match claims.get("ref") {
        None | Some(Value::Null) => Some(DEFAULT_PROJECT),
        Some(r) => r.as_str(),
    }
}

/// Whether `claims` belong to `project` and may act as their role, before any policy.
pub async fn precheck<'a>(
    client: &Client,
    roles: &RolePolicy,
    project: &str,
    claims: &'a Value,
) -> Result<Result<&'a str, Refused>, tokio_postgres::Error> {
    let token = token_project(claims);
    if token != Some(project) {
        return Ok(Err(Refused::OtherProject {
            token: token.unwrap_or("?").to_string(),
            project: project.to_string(),
        }));
    }
    Ok(roles.check(client, claims).await?.map_err(Refused::from))
}

const INSERT: &str = "INSERT INTO realtime.messages (topic, extension, private, event, payload)
     VALUES ($1, 'broadcast', true, 'walcast:authorize', '{}')";

/// For a role that bypasses row-level security: its privilege on `realtime.messages`
/// (`$2`: `SELECT` or `INSERT`); `None`: it does not bypass it.
const BYPASS_SQL: &str = "SELECT CASE WHEN r.rolbypassrls
        THEN has_table_privilege(r.oid, 'realtime.messages', $2) END
   FROM pg_roles r WHERE r.rolname = $1";

/// A private channel `topic` of `project`.
#[derive(Clone, Copy, Debug)]
pub struct Channel<'a> {
    pub project: &'a str,
    pub topic: &'a str,
}

/// Whether `claims` may read (`write` false) or write the channel: decided on walcast's
/// own connection `own` as far as it can be without the tenant's policies, then on the
/// check login's `check`. Neither may be in a transaction; each is left outside one.
pub async fn may(
    own: &Client,
    check: &Client,
    roles: &RolePolicy,
    channel: Channel<'_>,
    claims: &Value,
    write: bool,
) -> Result<bool, tokio_postgres::Error> {
    let role = match precheck(own, roles, channel.project, claims).await? {
        Ok(role) => role,
        Err(refused) => {
            tracing::info!(project = channel.project, topic = channel.topic, %refused, "private channel refused");
            return Ok(false);
        }
    };
    let privilege = if write { "INSERT" } else { "SELECT" };
    let bypass = own.query_opt(BYPASS_SQL, &[&role, &privilege]).await?;
    if let Some(allowed) = bypass.and_then(|r| r.get::<_, Option<bool>>(0)) {
        return Ok(allowed);
    }
    let client = check;
    client.batch_execute("BEGIN").await?;
    let result = judge(client, channel, &claims.to_string(), role, write).await;
    client.batch_execute("ROLLBACK").await?;
    match result {
        Err(e) if refused(&e) => Ok(false),
        other => other,
    }
}

/// Errors that mean "no": a policy or privilege refused it, the role does not exist, or
/// the policies took longer than the session's `statement_timeout` (a slow policy
/// denies its own subscriber; it never holds the other checks).
fn refused(e: &tokio_postgres::Error) -> bool {
    e.code().is_some_and(|c| {
        *c == SqlState::INSUFFICIENT_PRIVILEGE
            || *c == SqlState::INVALID_PARAMETER_VALUE
            || *c == SqlState::QUERY_CANCELED
    })
}

async fn judge(
    client: &Client,
    channel: Channel<'_>,
    claims: &str,
    role: &str,
    write: bool,
) -> Result<bool, tokio_postgres::Error> {
    let topic = channel.topic;
    // The rows written here are the project's (the trigger reads it).
    client
        .execute(
            "SELECT set_config('walcast.project', $1, true)",
            &[&channel.project],
        )
        .await?;
    let id: Option<String> = match write {
        false => Some(
            client
                .query_one("SELECT walcast.probe_message($1)::text", &[&topic])
                .await?
                .get(0),
        ),
        true => None,
    };
    client
        .execute(
            concat!(
                "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true), \
                 set_config('realtime.topic', $3, true)",
                claim_settings!()
            ),
            &[&role, &claims, &topic],
        )
        .await?;
    match id {
        Some(id) => {
            let row = client
                .query_one(
                    "SELECT count(*) FROM realtime.messages WHERE id = $1::text::uuid",
                    &[&id],
                )
                .await?;
            Ok(row.get::<_, i64>(0) == 1)
        }
        // No RETURNING: that would need a SELECT policy too.
        None => client.execute(INSERT, &[&topic]).await.map(|_| true),
    }
}

/// The latest `since` a replay may ask for: 9999-12-31 (Postgres timestamps go further,
/// but no stored message is that new).
pub const REPLAY_SINCE_MAX_MS: i64 = 253_402_300_799_999;
/// The most messages one replay returns.
pub const REPLAY_LIMIT_MAX: u32 = 25;

/// `since_ms` and `limit` brought within what a replay may ask (a front is trusted no
/// more than its clients): since 1970 at the earliest, 9999 at the latest.
pub fn replay_bounds(since_ms: i64, limit: u32) -> (i64, i64) {
    (
        since_ms.clamp(0, REPLAY_SINCE_MAX_MS),
        i64::from(limit.min(REPLAY_LIMIT_MAX)),
    )
}

/// The broadcasts stored for private channel `topic` of `project` since `since_ms` (Unix
/// ms), oldest first, at most `limit`; each payload with its `id`, as they were
/// delivered, and a binary message's bytes (`realtime.send_binary`) as they were sent.
///
/// `inserted_at` is a `timestamp` (as Supabase's): `now()` in the inserting session's
/// time zone. `since` is turned into the same wall-clock time in this session's zone,
/// which is the database's default like every session that does not set its own.
pub async fn stored(
    client: &Client,
    channel: Channel<'_>,
    since_ms: i64,
    limit: u32,
) -> Result<Vec<walcast_bus::admin::StoredBroadcast>, tokio_postgres::Error> {
    let (since_ms, limit) = replay_bounds(since_ms, limit);
    let rows = client
        .query(
            "SELECT id::text, coalesce(event, ''),
                    CASE WHEN jsonb_typeof(payload) = 'object'
                         THEN jsonb_build_object('id', id) || payload ELSE payload END::text,
                    binary_payload
             FROM realtime.messages
             WHERE project = $1 AND topic = $2 AND extension = 'broadcast' AND private
               AND inserted_at >= to_timestamp($3::float8 / 1000)::timestamp
               AND event IS DISTINCT FROM 'walcast:authorize'
             ORDER BY inserted_at, id
             LIMIT $4",
            &[&channel.project, &channel.topic, &(since_ms as f64), &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| walcast_bus::admin::StoredBroadcast {
            id: r.get(0),
            event: r.get(1),
            payload: r
                .get::<_, Option<String>>(2)
                .unwrap_or_else(|| "null".into()),
            binary: r.get(3),
        })
        .collect())
}
