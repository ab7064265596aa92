//! This front's health: the counts `/health`, the health beacon and the inspector show.

use std::sync::Arc;

use serde::Serialize;
use walcast_bus::Bus;

use crate::connections::Connections;
use crate::delivery::Delivery;

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
    /// Shutting down (see [`crate::Front::drain`]): not ready for new clients.
    pub draining: bool,
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
        }
    }
}

/// Where the counts come from.
pub(crate) struct Probe {
    pub front_id: String,
    pub bus: Bus,
    pub connections: Arc<Connections>,
    pub delivery: Arc<Delivery>,
}

impl Probe {
    pub(crate) fn health(&self) -> Health {
        let counts = self.connections.counts();
        Health {
            front_id: self.front_id.clone(),
            connections: counts.connections,
            channels: counts.channels,
            sse_streams: counts.sse_streams,
            subscriptions: self.delivery.registry.len(),
            bus: self.bus.kind(),
            bus_connected: self.bus.is_connected(),
            draining: self.connections.is_draining(),
        }
    }
}
