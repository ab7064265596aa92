//! The all-in-one process (`walcast serve`): the CDC pipeline and the realtime front on one
//! bus. In process the front calls the worker's subscription registry directly; over NATS
//! it uses request/reply like a separate ws-front. Admin requests (projects, the REST
//! API) are always answered in process.

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use walcast_bus::admin::{AdminClient, AdminHandler};
use walcast_bus::subs::{SubsClient, SubsHandler};
use walcast_bus::Bus;
use walcast_control::secrets::SecretKeys;
use walcast_realtime::admin::Admin;
use walcast_realtime::subscriptions::matcher::Matcher;
use walcast_realtime::subscriptions::registrar::Registrar;

use crate::config::{CdcArgs, DbArgs};
use crate::front::FrontArgs;

/// What the all-in-one process runs with, besides its signal.
pub struct Serve<'a> {
    pub db: &'a DbArgs,
    pub cdc: &'a CdcArgs,
    /// The keys of the secrets stored in the control database.
    pub keys: Arc<SecretKeys>,
    pub front: &'a FrontArgs,
    /// The NATS bus, or the in-process one.
    pub bus: Bus,
    pub ops: crate::http::OpsHttp,
}

/// Run until `signal` fires and the front has drained (or the pipeline hits an error the
/// operator must fix).
pub async fn run(s: Serve<'_>, signal: CancellationToken) -> anyhow::Result<()> {
    let Serve {
        db,
        cdc,
        keys,
        front: front_args,
        bus,
        ops,
    } = s;
    // Migrations and the stored secrets first: the front asks the database (its project
    // directory, through the in-process admin handler) from its start, and a fresh
    // database has no tables yet; the check login before the front answers anything that
    // runs a tenant's policies.
    let roles = front_args.roles.policy();
    crate::database::prepare_control(db, &keys, &roles).await?;
    let cancel = CancellationToken::new();
    let origin = crate::cdc_worker::instance_id();
    let registrar = Registrar::new(
        Matcher::with_limits(cdc.class_limits()),
        db.database_url.clone(),
        roles.clone(),
    );
    let local: Arc<dyn SubsHandler> = Arc::new(registrar.clone());
    let subs = SubsClient::new(&bus, Some(local))?;
    // The front's admin requests (project directory, REST API) need only the database,
    // which this process has: answered in process whoever leads.
    let check_url = db.check_database_url.as_deref().unwrap_or_default();
    let admin: Arc<dyn AdminHandler> = Arc::new(
        Admin::new(db.database_url.clone(), check_url, roles, keys.clone()).answering(Arc::new(
            walcast_changes::snapshot::manage::SnapshotRequests,
        )),
    );
    let admin_client = AdminClient::new(&bus, Some(admin.clone()))?;
    let front_id = format!("front-{origin}");
    let presence = front_args.presence(&bus, &front_id, &cancel);
    let front = walcast_front::Front::start_with_presence(
        front_args.config(&front_id),
        bus.clone(),
        subs,
        front_args.projects(admin_client)?,
        presence,
        cancel.clone(),
    )
    .await
    .context("starting the front")?;
    crate::shutdown::drain_then_stop(signal, front.clone(), cancel.clone());
    let worker = crate::cdc_worker::Worker {
        db,
        cdc,
        keys,
        bus,
        registrar,
        admin,
        roles: front_args.roles.policy(),
        front: Some(front),
        origin,
        ops,
    };
    let result = crate::cdc_worker::run(worker, cancel.clone()).await;
    cancel.cancel();
    result
}
