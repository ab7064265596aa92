//! Fan-out of change events from the bus to channels.
//!
//! One task reads this front's delivery subject (`walcast.deliver.<front id>`, see
//! [`walcast_bus::subject::delivery_subject`]): the cdc-worker sends there only the
//! changes this front's subscriptions matched, and its notices about them. Per event:
//! parse once, keep only this front's subscription ids, group them by channel, encode the
//! change once, and produce each channel's frame text once (cached by version, topic and
//! ids, so identical channels share the bytes). Frames go into each connection's bounded
//! queue without waiting.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use walcast_bus::subs::{NOTICE_SUBS_ENDED, NOTICE_SUBS_LAGGED};
use walcast_bus::HEADER_TERM;
use walcast_bus::{BusMessage, ChangeEvent, Subscription, HEADER_NOTICE};

use crate::delivery::Delivery;
use crate::encode::encode;
use crate::guards::{ReplayGuard, TermGuard};
use crate::listen::next_message;
use crate::registration::Registrar;
use crate::sink::Change;
use crate::telemetry;

pub(crate) async fn run(
    delivery: Arc<Delivery>,
    registrar: Arc<Registrar>,
    mut sub: Subscription,
    cancel: CancellationToken,
) {
    let mut replays = ReplayGuard::default();
    let mut terms = TermGuard::default();
    while let Some(m) = next_message(&mut sub, &cancel, "change").await {
        if !terms.admit(m.header(HEADER_TERM), std::time::Instant::now()) {
            continue;
        }
        match m.header(HEADER_NOTICE) {
            None => deliver(&delivery, &m, &mut replays),
            Some(NOTICE_SUBS_ENDED) => registrar.subs_ended(&m).await,
            Some(NOTICE_SUBS_LAGGED) => registrar.subs_lagged(&m),
            Some(other) => {
                telemetry::error("unknown_notice");
                tracing::warn!(notice = other, "unknown notice on the delivery subject");
            }
        }
    }
}

fn deliver(delivery: &Delivery, msg: &BusMessage, replays: &mut ReplayGuard) {
    let ev: ChangeEvent = match serde_json::from_slice(&msg.payload) {
        Ok(ev) => ev,
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "undecodable change event");
            return;
        }
    };
    delivery.registry.saw(ev.commit_lsn);
    if !replays.admit(&ev) {
        return;
    }
    if ev.restricted.is_empty() {
        deliver_event(delivery, &ev);
        return;
    }
    // Subscribers that may see only some columns get their own, reduced copy.
    match ev.variants() {
        Ok(variants) => variants.iter().for_each(|v| deliver_event(delivery, v)),
        Err(e) => {
            telemetry::error("bad_change_event");
            tracing::warn!(subject = %msg.subject, error = %e, "cannot reduce a change event");
        }
    }
}

fn deliver_event(delivery: &Delivery, ev: &ChangeEvent) {
    let groups = delivery.registry.groups(ev);
    if groups.is_empty() {
        return;
    }
    let Some(encoded) = encode(ev) else {
        return;
    };
    let mut change = Change::new(ev, &encoded);
    for (sink, ids) in groups {
        if sink.deliver(&mut change, ids) {
            metrics::counter!(telemetry::DELIVERIES).increment(1);
        }
    }
}
