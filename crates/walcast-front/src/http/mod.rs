//! The front over HTTP: its routes, each group with the state of the part that serves
//! it — the WebSocket upgrade (`crate::channel::websocket`), SSE (`crate::sse`), the
//! broadcast REST API (`crate::broadcast::rest`), the management API
//! (`crate::management`) — and the smaller endpoints that are only HTTP:
//!
//! * [`health`]: the counts of `/health` (and of the health beacon, and the inspector's).
//! * [`realtime_api`]: the REST API that enables realtime per table, for a project's
//!   servers.
//! * [`inspector`]: the page at `/inspector` and its health API, if enabled.
//! * [`figures`]: the operator's figures, `GET /metrics/projects`.
//! * [`unknown`]: the JSON answer to a route no one serves (and to `/`).
//!
//! What the routes a browser page calls answer other origins is [`crate::cors`]'s.

pub(crate) mod figures;
pub(crate) mod health;
pub(crate) mod inspector;
pub(crate) mod realtime_api;
pub(crate) mod unknown;

use std::sync::Arc;

use axum::http::{Method, Uri};
use axum::routing::{get, post, put};
use axum::Router;

use crate::broadcast::{self, Broadcasts};
use crate::channel::websocket::{self, Sockets};
use crate::projects::Projects;
use crate::sse::{self, SseHub};
use figures::Figures;
use inspector::Inspector;

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
    pub figures: Arc<Figures>,
    /// Cross-origin requests on the browser routes.
    pub cors: crate::cors::CorsConfig,
}

pub(crate) fn router(r: &Routes) -> Router {
    let websocket = Router::new()
        .route("/realtime/v1/websocket", get(websocket::upgrade))
        .route("/socket/websocket", get(websocket::upgrade))
        .with_state(r.sockets.clone());
    let sse = Router::new()
        .route("/realtime/v1/sse", get(sse::handler))
        .with_state(r.sse.clone());
    let broadcast = Router::new()
        .route("/realtime/v1/api/broadcast", post(broadcast::rest::batch))
        .route(
            "/realtime/v1/api/broadcast/{topic}/events/{event}",
            post(broadcast::rest::single),
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
    // The routes a page on another origin calls (a WebSocket needs no CORS). Their
    // answer to a method they do not serve is set before the layer, so that a preflight
    // (`OPTIONS`) reaches it.
    let mut browser = sse
        .merge(broadcast)
        .merge(tables)
        .method_not_allowed_fallback(not_allowed);
    if let Some(layer) = r.cors.layer() {
        browser = browser.layer(layer);
    }
    let mut router = websocket
        .merge(browser)
        .merge(figures::routes(r.figures.clone()));
    if let Some(m) = &r.management {
        router = router.merge(crate::management::routes(m.clone()));
    }
    if let Some(state) = &r.inspector {
        router = router.merge(inspector::routes().with_state(state.clone()));
    }
    let served = unknown::Served {
        management: r.management.is_some(),
        inspector: r.inspector.is_some(),
    };
    router
        .fallback(move |method: Method, uri: Uri| async move {
            unknown::answer(&method, uri.path(), served)
        })
        .method_not_allowed_fallback(not_allowed)
}

async fn not_allowed(method: Method, uri: Uri) -> axum::response::Response {
    unknown::method_not_allowed(&method, &uri)
}
