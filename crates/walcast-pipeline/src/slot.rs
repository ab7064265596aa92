//! The replication slot: create it when missing, recreate it (loudly) when lost.

use tokio_postgres::Client;
use walcast_wal2json::Lsn;

use crate::health::{LostRange, PipelineHealth};
use crate::preflight::{classify_plugin_error, PreflightError};

#[derive(Debug, Clone)]
pub struct SlotState {
    pub confirmed_flush: Lsn,
    pub created: bool,
    pub recovered_loss: Option<LostRange>,
}

fn parse_lsn(text: Option<String>) -> Option<Lsn> {
    text.and_then(|t| t.parse().ok())
}

/// Make sure the slot exists, uses wal2json, and is not lost. A lost slot (WAL beyond
/// `max_slot_wal_keep_size` was removed) is dropped and recreated; the lost LSN range is
/// logged at error level, counted in `walcast_cdc_slot_lost_total` and kept for `/health`.
pub async fn ensure_slot(
    client: &Client,
    slot: &str,
    major: i32,
    health: &PipelineHealth,
) -> Result<SlotState, PreflightError> {
    let existing = client
        .query_opt(
            "SELECT wal_status, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    // Some(confirmed position) when the slot we found was lost.
    let mut lost: Option<Option<Lsn>> = None;
    if let Some(row) = existing {
        {
            let status: Option<String> = row.get(0);
            let confirmed = parse_lsn(row.get(1));
            if status.as_deref() != Some("lost") {
                // Reading one row loads the plugin: a missing wal2json fails here, clearly.
                client
                    .query(
                        "SELECT 1 FROM pg_logical_slot_peek_changes($1, NULL, 1, 'format-version', '2')",
                        &[&slot],
                    )
                    .await
                    .map_err(|e| classify_plugin_error(e, major))?;
                return Ok(SlotState {
                    confirmed_flush: confirmed.unwrap_or_default(),
                    created: false,
                    recovered_loss: None,
                });
            }
            lost = Some(confirmed);
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                .await?;
        }
    }
    tracing::info!(
        slot,
        "creating logical replication slot (waits for running transactions to end)"
    );
    let row = client
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'wal2json')",
            &[&slot],
        )
        .await
        .map_err(|e| classify_plugin_error(e, major))?;
    let start = parse_lsn(row.get(0)).unwrap_or_default();
    let recovered_loss = lost.map(|from| LostRange { from, to: start });
    if let Some(range) = &recovered_loss {
        tracing::error!(
            slot,
            lost_from = ?range.from.map(|l| l.to_string()),
            lost_to = %range.to,
            "replication slot was lost (WAL removed past max_slot_wal_keep_size): changes committed in this LSN range were NOT delivered; slot recreated"
        );
        metrics::counter!(crate::telemetry::SLOT_LOST).increment(1);
        health.record_slot_loss(range.clone());
    }
    Ok(SlotState {
        confirmed_flush: start,
        created: true,
        recovered_loss,
    })
}

/// Read the slot's position, lag and retained WAL into `/health` and metrics; a lost or vanished slot
/// is an error (the pipeline then restarts and [`ensure_slot`] recovers it).
pub async fn report_position(
    client: &Client,
    slot: &str,
    health: &PipelineHealth,
) -> Result<(), crate::PipelineError> {
    let row = client
        .query_opt(
            "SELECT wal_status, confirmed_flush_lsn::text,
                    coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::int8,
                    coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::int8
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    let Some(row) = row else {
        return Err(crate::PipelineError::SlotMissing(slot.to_string()));
    };
    let status: Option<String> = row.get(0);
    if status.as_deref() == Some("lost") {
        return Err(crate::PipelineError::SlotLost(slot.to_string()));
    }
    if let Some(c) = parse_lsn(row.get(1)) {
        health.set_slot_position(c, row.get(2), row.get(3));
    }
    Ok(())
}
