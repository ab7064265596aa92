//! HTTP routes: the WebSocket upgrade, SSE, the broadcast REST API and the REST API that
//! enables realtime per table; the operator's (`/metrics/projects`, the management API);
//! the inspector's, if enabled ([`crate::inspector`]). Each
//! group of routes has the state of the part that serves it.

use std::sync::Arc;

use axum::routing::{get, post, put};
use axum::Router;

use crate::broadcast::{self, Broadcasts};
use crate::conn::{self, Sockets};
use crate::inspector::{self, Inspector};
use crate::projects::Projects;
use crate::realtime_api;
use crate::sse::{self, SseHub};

/// The parts that serve the routes.
pub(crate) struct Routes {
    pub sockets: Arc<Sockets>,
    pub sse: Arc<SseHub>,
    pub broadcasts: Arc<Broadcasts>,
    pub projects: Projects,
    /// `None`: the inspector is off.
    pub inspector: Option<Arc<Inspector>>,
    /// `None`: no operator key, no management API.
    pub management: Option<Arc<crate::management::Management>>,
    /// The operator's figures (`/metrics/projects`).
    pub figures: Arc<crate::operator::Figures>,
}

pub(crate) fn router(r: &Routes) -> Router {
    let websocket = Router::new()
        .route("/realtime/v1/websocket", get(conn::upgrade))
        .route("/socket/websocket", get(conn::upgrade))
        .with_state(r.sockets.clone());
    let sse = Router::new()
        .route("/realtime/v1/sse", get(sse::handler))
        .with_state(r.sse.clone());
    let broadcast = Router::new()
        .route("/realtime/v1/api/broadcast", post(broadcast::rest_batch))
        .route(
            "/realtime/v1/api/broadcast/{topic}/events/{event}",
            post(broadcast::rest_single),
        )
        .with_state(r.broadcasts.clone());
    let tables = Router::new()
        .route(
            "/v1/db/{project_id}/schema/tables/{table}/realtime",
            put(realtime_api::put)
                .delete(realtime_api::delete)
                .get(realtime_api::get_one),
        )
        .route(
            "/v1/db/{project_id}/realtime/tables",
            get(realtime_api::list),
        )
        .with_state(r.projects.clone());
    let mut router = websocket
        .merge(sse)
        .merge(broadcast)
        .merge(tables)
        .merge(crate::operator::routes(r.figures.clone()));
    if let Some(m) = &r.management {
        router = router.merge(crate::management::routes(m.clone()));
    }
    if let Some(state) = &r.inspector {
        router = router.merge(inspector::routes().with_state(state.clone()));
    }
    router
}
