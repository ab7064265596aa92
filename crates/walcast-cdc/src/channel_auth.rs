//! Private channels: may a subscriber read (join) or write (send, track presence) a
//! topic? Decided by the app's row-level security policies on `realtime.messages`, as
//! Supabase does, evaluated as the subscriber: its `role` (bound through
//! `set_config('role', …)`), its claims in `request.jwt.claims` and `realtime.topic()` =
//! the topic, all transaction-local, in a transaction that is always rolled back.
//!
//! - read: a message of the topic is inserted by walcast (the table's owner, to whom RLS
//!   does not apply), then selected as the subscriber: allowed if it sees it;
//! - write: the subscriber inserts one: allowed unless a policy refuses it.
//!
//! The rolled-back rows never reach the WAL's readers.

use serde_json::Value;
use tokio_postgres::error::SqlState;
use tokio_postgres::Client;

const INSERT: &str = "INSERT INTO realtime.messages (topic, extension, private, event, payload)
     VALUES ($1, 'broadcast', true, 'walcast:authorize', '{}')";

/// Whether `claims` may read (`write` false) or write `topic`. `client` must not be in a
/// transaction; it is left outside one.
pub async fn may(
    client: &Client,
    topic: &str,
    claims: &Value,
    write: bool,
) -> Result<bool, tokio_postgres::Error> {
    let Some(role) = claims
        .get("role")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty())
    else {
        return Ok(false);
    };
    client.batch_execute("BEGIN").await?;
    let result = check(client, topic, &claims.to_string(), role, write).await;
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

async fn check(
    client: &Client,
    topic: &str,
    claims: &str,
    role: &str,
    write: bool,
) -> Result<bool, tokio_postgres::Error> {
    let id: Option<String> = match write {
        false => {
            let returning = format!("{INSERT} RETURNING id::text");
            Some(
                client
                    .query_one(returning.as_str(), &[&topic])
                    .await?
                    .get(0),
            )
        }
        true => None,
    };
    client
        .execute(
            "SELECT set_config('role', $1, true), set_config('request.jwt.claims', $2, true),
                    set_config('realtime.topic', $3, true)",
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

/// The broadcasts stored for private channel `topic` since `since_ms` (Unix ms), oldest
/// first, at most `limit`; each payload with its `id`, as they were delivered.
///
/// `inserted_at` is a `timestamp` (as Supabase's): `now()` in the inserting session's
/// time zone. `since` is turned into the same wall-clock time in this session's zone,
/// which is the database's default like every session that does not set its own.
pub async fn stored(
    client: &Client,
    topic: &str,
    since_ms: i64,
    limit: u32,
) -> Result<Vec<walcast_bus::admin::StoredBroadcast>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id::text, coalesce(event, ''),
                    CASE WHEN jsonb_typeof(payload) = 'object'
                         THEN jsonb_build_object('id', id) || payload ELSE payload END::text
             FROM realtime.messages
             WHERE topic = $1 AND extension = 'broadcast' AND private
               AND inserted_at >= to_timestamp($2::float8 / 1000)::timestamp
               AND event IS DISTINCT FROM 'walcast:authorize'
             ORDER BY inserted_at, id
             LIMIT $3",
            &[&topic, &(since_ms as f64), &i64::from(limit)],
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
        })
        .collect())
}
