//! `walcast.outbox_quarantine`: events JetStream refused for good, kept with the error
//! until redriven.

use tokio_postgres::Client;
use walcast_wal2json::Lsn;

use crate::event::OutboxEvent;

/// At most this much of an error is stored (JetStream's errors carry no secrets).
const ERROR_CHARS: usize = 500;

/// Keep `ev` with `error`. A replay after a crash finds it already there.
pub async fn put(
    client: &Client,
    ev: &OutboxEvent,
    error: &str,
) -> Result<(), tokio_postgres::Error> {
    let error: String = error.chars().take(ERROR_CHARS).collect();
    let headers = serde_json::to_string(&ev.headers).unwrap_or_else(|_| "[]".into());
    let lsn = ev.commit_lsn.to_string();
    client
        .execute(
            "INSERT INTO walcast.outbox_quarantine
                 (id, project, topic, key, subject, payload, headers, commit_lsn, error)
             VALUES ($1::text::uuid, $2, $3, $4, $5, $6::text::jsonb, $7::text::jsonb,
                     $8::text::pg_lsn, $9)
             ON CONFLICT (id) DO NOTHING",
            &[
                &ev.id,
                &ev.project,
                &ev.topic,
                &ev.key,
                &ev.subject(),
                &ev.payload,
                &headers,
                &lsn,
                &error,
            ],
        )
        .await?;
    Ok(())
}

/// Rows in the quarantine.
pub async fn size(client: &Client) -> Result<i64, tokio_postgres::Error> {
    let row = client
        .query_one("SELECT count(*) FROM walcast.outbox_quarantine", &[])
        .await?;
    Ok(row.get(0))
}

/// A quarantined event and why.
#[derive(Debug, Clone)]
pub struct Quarantined {
    pub event: OutboxEvent,
    pub error: String,
}

/// The quarantined events (of `project`, or all), oldest commit first.
pub async fn list(
    client: &Client,
    project: Option<&str>,
) -> Result<Vec<Quarantined>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT id::text, project, topic, key, payload::text, headers::text, commit_lsn::text,
                    error, to_char(quarantined_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')
             FROM walcast.outbox_quarantine
             WHERE $1::text IS NULL OR project = $1
             ORDER BY commit_lsn, quarantined_at",
            &[&project],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let headers: Option<String> = r.get(5);
            let lsn: String = r.get(6);
            Quarantined {
                event: OutboxEvent {
                    id: r.get(0),
                    project: r.get(1),
                    topic: r.get(2),
                    key: r.get(3),
                    payload: r.get(4),
                    headers: headers
                        .and_then(|h| serde_json::from_str(&h).ok())
                        .unwrap_or_default(),
                    commit_lsn: lsn.parse().unwrap_or(Lsn(0)),
                    // The commit time is not kept: the quarantine time stands in.
                    committed_at: r.get(8),
                },
                error: r.get(7),
            }
        })
        .collect())
}

/// Forget a quarantined event (it was sent again).
pub async fn remove(client: &Client, id: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "DELETE FROM walcast.outbox_quarantine WHERE id = $1::text::uuid",
            &[&id],
        )
        .await?;
    Ok(())
}
