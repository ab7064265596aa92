//! How realtime delivery plugs into the pipeline: a [`ConsumerFactory`] for the realtime
//! consumer (its catalog connection, DDL tracking and RLS checkers made per session) and
//! one for database broadcast.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use tokio_postgres::Client;
use walcast_pipeline::slot::SlotState;
use walcast_pipeline::{Consumer, ConsumerError, ConsumerFactory, PipelineHealth, Session};

use crate::catalog::change::{self, Resume, Tracking};
use crate::config::RealtimeConfig;
use crate::delivery::broadcast::DbBroadcast;
use crate::delivery::consumer::{CatalogTracking, RealtimeConsumer, RealtimeOptions};
use crate::delivery::links::FrontLinks;
use crate::error::RealtimeError;
use crate::subscriptions::matcher::Matcher;
use crate::telemetry;

/// The consumers realtime delivery adds to a pipeline: the realtime consumer, then
/// database broadcast.
/// Every message to a front goes through `links` (numbered, kept for resending; the
/// caller runs [`FrontLinks::lead`] for each term it leads).
pub fn factories(
    cfg: RealtimeConfig,
    matcher: Arc<Matcher>,
    links: Arc<FrontLinks>,
) -> Vec<Arc<dyn ConsumerFactory>> {
    let max_record_bytes = cfg.max_record_bytes;
    let projects = cfg.projects.clone();
    let broadcast = walcast_pipeline::factory(move |s| {
        let publisher = s.publisher("db_broadcast");
        let health = s.health.clone();
        let b = DbBroadcast::new(publisher, health, max_record_bytes);
        Box::new(b.for_projects(projects.clone()))
    });
    vec![
        Arc::new(RealtimeFactory {
            cfg,
            matcher,
            links,
        }),
        broadcast,
    ]
}

struct RealtimeFactory {
    cfg: RealtimeConfig,
    matcher: Arc<Matcher>,
    links: Arc<FrontLinks>,
}

impl ConsumerFactory for RealtimeFactory {
    fn build<'a>(
        &'a self,
        session: &'a Session<'a>,
    ) -> BoxFuture<'a, Result<Box<dyn Consumer>, ConsumerError>> {
        Box::pin(async move {
            let consumer = self.consumer(session).await?;
            Ok(Box::new(consumer) as Box<dyn Consumer>)
        })
    }
}

impl RealtimeFactory {
    async fn consumer(&self, session: &Session<'_>) -> Result<RealtimeConsumer, RealtimeError> {
        let catalog = walcast_pgtls::connect(&self.cfg.database_url).await?;
        let slot_name = &session.config.read.slot;
        let tracking =
            catalog_tracking(session.replication, slot_name, session.slot, session.health).await?;
        let opts = RealtimeOptions {
            database_url: self.cfg.database_url.clone(),
            check_url: self.cfg.check_url.clone(),
            rls: self.cfg.rls.clone(),
            max_record_bytes: self.cfg.max_record_bytes,
            health: session.health.clone(),
            publisher: session.publisher("realtime"),
            links: self.links.clone(),
            slot: slot_name.clone(),
            catalog: tracking,
            limits: self.cfg.lanes,
            projects: self.cfg.projects.clone(),
        };
        RealtimeConsumer::new(self.matcher.clone(), catalog, opts).await
    }
}

/// Event triggers where possible (see [`crate::catalog::change`]), and the epoch at the
/// slot's position; reported in `/health` and warned about once when missing.
async fn catalog_tracking(
    client: &Client,
    slot_name: &str,
    slot: &SlotState,
    health: &PipelineHealth,
) -> Result<CatalogTracking, RealtimeError> {
    let tracking = change::ensure_triggers(client).await?;
    let changed = health.set_ddl_tracking(tracking.name());
    metrics::gauge!(telemetry::DDL_EVENT_TRIGGER).set(match tracking {
        Tracking::EventTrigger => 1.0,
        Tracking::PerBatch(_) => 0.0,
    });
    let resume = match &tracking {
        Tracking::EventTrigger => {
            let resume =
                change::resume_at(client, slot_name, slot.confirmed_flush, slot.created).await?;
            if resume.seen.is_none() {
                tracing::warn!("the DDL epoch at the slot's position is unknown (DDL committed before the event triggers existed): catalog facts are taken as read until the next DDL notice");
            }
            resume
        }
        Tracking::PerBatch(why) => {
            if changed {
                tracing::warn!(reason = %why, "DDL and GRANT/REVOKE are not tracked at their WAL position: every batch re-reads privileges and columns instead (see the README's guarantees)");
            }
            Resume::default()
        }
    };
    Ok(CatalogTracking::new(tracking, resume))
}
