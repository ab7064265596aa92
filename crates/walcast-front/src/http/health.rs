//! This front's health: the counts `/health`, the health beacon and the inspector show.

use std::sync::Arc;

use serde::Serialize;
use walcast_bus::Bus;

use crate::connection::open::Connections;
use crate::subscription::registry::Registry;

/// `GET /health` material.
#[derive(Serialize, Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// This front's id.
    pub front_id: String,
    /// Open WebSocket connections.
    pub connections: usize,
    /// Joined WebSocket channels.
    pub channels: usize,
    /// Open SSE streams.
    pub sse_streams: usize,
    /// Registered subscriptions (WebSocket bindings and SSE streams).
    pub subscriptions: usize,
    /// Bus kind (`nats` / `in-process`).
    pub bus: &'static str,
    /// Whether the bus is connected.
    pub bus_connected: bool,
    /// Whether the NATS connection was lost within the last minute (what was published
    /// to this front meanwhile is recovered or reported, see the README's guarantees).
    pub bus_disconnected_recently: bool,
    /// When it was last lost (RFC 3339, UTC), if ever.
    pub bus_last_disconnect: Option<String>,
    /// Times it was lost since start.
    pub bus_disconnects: u64,
    /// Shutting down (see [`crate::Front::drain`]): not ready for new clients.
    pub draining: bool,
    /// Connected users per project (in the beacon; `/health` leaves it out).
    #[serde(skip)]
    pub project_users: std::collections::BTreeMap<String, u64>,
    /// Rates per project (in the beacon; `/health` leaves them out).
    #[serde(skip)]
    pub project_rates: std::collections::BTreeMap<String, walcast_bus::beacon::ProjectRates>,
}

impl Health {
    /// The front part of this process's health beacon ([`walcast_bus::beacon`]).
    pub fn beacon(&self) -> walcast_bus::beacon::FrontBeacon {
        walcast_bus::beacon::FrontBeacon {
            connections: self.connections,
            channels: self.channels,
            sse_streams: self.sse_streams,
            subscriptions: self.subscriptions,
            draining: self.draining,
            project_users: self.project_users.clone(),
            project_rates: self.project_rates.clone(),
        }
    }
}

/// How long a disconnect counts as recent: a minute, in microseconds.
const RECENT_MICROS: i64 = 60_000_000;

/// Where the counts come from.
pub(crate) struct Probe {
    pub front_id: String,
    pub bus: Bus,
    pub connections: Arc<Connections>,
    pub registry: Arc<Registry>,
    pub usage: Arc<crate::limits::usage::Usage>,
}

impl Probe {
    pub(crate) fn health(&self) -> Health {
        let counts = self.connections.counts();
        let events = self.bus.link_events();
        let last = events.and_then(|e| e.last_disconnect());
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i64);
        Health {
            front_id: self.front_id.clone(),
            connections: counts.connections,
            channels: counts.channels,
            sse_streams: counts.sse_streams,
            subscriptions: self.registry.len(),
            bus: self.bus.kind(),
            bus_connected: self.bus.is_connected(),
            bus_disconnected_recently: last.is_some_and(|t| now - t < RECENT_MICROS),
            bus_last_disconnect: last.map(walcast_core::timestamp::format_rfc3339_millis),
            bus_disconnects: events.map_or(0, |e| e.disconnects()),
            draining: self.connections.is_draining(),
            project_users: self.usage.users(),
            project_rates: self.usage.rates(),
        }
    }
}
