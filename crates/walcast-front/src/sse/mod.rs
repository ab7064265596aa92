//! Server-sent events: `postgres_changes` over plain HTTP, resumable.
//!
//! ```text
//! GET /realtime/v1/sse?apikey=<jwt>&channel=<name>&schema=public&table=todos&event=INSERT&filter=id=gt.10
//! ```
//!
//! Query parameters (all optional except `apikey`):
//!
//! | name | meaning | default |
//! |---|---|---|
//! | `apikey` | the project's JWT (anon or service_role key); also accepted as the `apikey` header or `Authorization: Bearer` | — |
//! | `access_token` | the user's JWT whose claims (`role`, …) the worker uses for RLS; needs `role` and `exp` | `Authorization: Bearer`, else the key ([`crate::auth::credentials`]) |
//! | `channel` | a name for the stream (echoed in `ready`); streams with the same name, parameters and claims share one subscription and one history | `sse` |
//! | `event` | `*`, `INSERT`, `UPDATE` or `DELETE` | `*` |
//! | `schema` | schema name (`*` = all) | `public` |
//! | `table` | table name (absent = every table of the schema) | — |
//! | `filter` | a `postgres_changes` filter, e.g. `user_id=eq.42` | — |
//! | `select` | comma-separated column list | — |
//! | `last_event_id` | resume point when the `Last-Event-ID` header cannot be set | — |
//! | `snapshot` | `true`: first the rows of `table` the subscriber may see, then the changes ([`snapshot`]) | `false` |
//!
//! The response starts with `event: ready` (data `{"channel":…,"postgres_changes":[{…,"id":N}]}`)
//! only once the cdc-worker has registered the subscription, so every change committed after
//! it arrives. Then each change is one event:
//!
//! ```text
//! id: 0/1530AD8:0
//! event: postgres_changes
//! data: {"ids":[N],"data":{"schema":"public","table":"todos","type":"INSERT",…}}
//! ```
//!
//! `id` is `<commit_lsn>:<seq>`, ordered like the WAL. A client reconnecting with
//! `Last-Event-ID` (browsers do it automatically) first gets every later change still in the
//! stream's history (the last `HISTORY_SIZE` changes; a stream and its history outlive
//! their last reader by `sse_linger`), then live ones. If the history no longer reaches back
//! to that id, an `event: gap` comes first. When the token expires the stream ends with
//! `event: system` (`{"status":"error","message":"Token has expired N seconds ago"}`); a
//! reader too slow to keep up gets `event: error` and the stream ends. Errors before the
//! stream starts are HTTP errors with `{"error":"…"}`: 400 (bad parameters, subscription
//! refused by the worker), 401 (token), 503 (no cdc-worker answered).
//!
//! With `snapshot=true` (one `table`), `ready` is followed by the rows the subscriber may
//! see, read by the worker as the subscriber (RLS applies), each
//!
//! ```text
//! event: snapshot
//! data: {"ids":[N],"data":{"schema":"public","table":"todos","type":"SNAPSHOT","columns":[…],"record":{…}}}
//! ```
//!
//! then `event: snapshot_done` (`{"rows":N,"lsn":"0/1530AD8"}`), then the changes the rows
//! lack (see [`snapshot`]), nothing twice. Row events have no `id`: a client that loses
//! the stream before the first change has no `Last-Event-ID` and gets a fresh snapshot;
//! a reconnect with `Last-Event-ID` resumes the changes without a snapshot. Too many
//! rows (`SSE_SNAPSHOT_MAX_ROWS`, `SSE_SNAPSHOT_MAX_BYTES`) is a 413 before the stream
//! starts; a role that may not read the table a 403; no `table` a 400; rows that did not
//! all come (in time, in order) or a front holding too many snapshots a 503.
//!
//! ```sh
//! curl -N "http://localhost:4000/realtime/v1/sse?apikey=$ANON_KEY&table=todos"
//! ```
//!
//! Here: the route ([`handler`]), its parameters, and [`SseHub`], the front's streams.
//! `stream`: one shared subscription (its history, its live readers) and the map of every
//! stream by key; `snapshot`: a `snapshot=true` stream's rows and what follows them;
//! `response`: what a response sends, from its first events to its end.

mod response;
mod snapshot;
mod stream;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use walcast_protocol::{PgChangeBinding, RawValue};

use crate::auth::credentials::Credentials;
use crate::auth::{now_secs, AuthError, Verified};
use crate::cluster::Heard;
use crate::config::FrontConfig;
use crate::connection::open::{Connections, SseSlot};
use crate::limits::usage::{TooManyUsers, Usage};
use crate::limits::OpenRate;
use crate::projects::Projects;
use crate::reply::{draining_response, error_response};
use crate::subscription::registration::Registration;
use crate::subscription::sink::SinkRef;
use crate::subscription::subscribe;
use response::{first_events, next_event, StreamState};
use stream::{Pos, Reader, SseChannel, SseKey, Streams};

/// The SSE route's state: the front's streams, and what opening one takes.
pub(crate) struct SseHub {
    cfg: FrontConfig,
    projects: Projects,
    registration: Arc<Registration>,
    connections: Arc<Connections>,
    usage: Arc<Usage>,
    /// What the health beacons say: why a project's source does not stream.
    heard: Arc<Heard>,
    /// Ends every stream when the front stops.
    cancel: CancellationToken,
    streams: Arc<Streams>,
    /// New streams per project per second (see [`OpenRate`]): the joins' limits.
    opens: OpenRate,
    /// Snapshot rows held, received and not yet sent.
    snapshot_budget: snapshot::SnapshotBudget,
}

impl SseHub {
    pub(crate) fn new(
        cfg: FrontConfig,
        projects: Projects,
        registration: Arc<Registration>,
        connections: Arc<Connections>,
        (usage, heard): (Arc<Usage>, Arc<Heard>),
        cancel: CancellationToken,
    ) -> SseHub {
        SseHub {
            opens: OpenRate::new(cfg.join_burst, cfg.joins_per_second),
            snapshot_budget: snapshot::SnapshotBudget::new(&cfg),
            cfg,
            projects,
            registration,
            connections,
            usage,
            heard,
            cancel,
            streams: Arc::default(),
        }
    }
}

impl SseHub {
    /// Its keys changed: every reader of a stream of `project` (`None`: of every
    /// project) verifies its token again, and ends if no key accepts it. How many streams
    /// were told.
    pub(crate) fn recheck(&self, project: Option<&str>) -> usize {
        let streams = self.streams.lock();
        let chans = streams
            .iter()
            .filter(|(k, _)| project.is_none_or(|want| k.project == want));
        chans
            .map(|(_, c)| c.recheck.send_modify(|n| *n += 1))
            .count()
    }

    /// End every stream of a project (deleted or suspended): a `system` error event,
    /// then the end. New streams are refused by the key check. How many ended.
    pub(crate) fn end_project(&self, project: &str, message: &str) -> usize {
        let chans: Vec<Arc<SseChannel>> = self
            .streams
            .lock()
            .iter()
            .filter(|(k, _)| k.project == project)
            .map(|(_, c)| c.clone())
            .collect();
        for c in &chans {
            c.end(message);
        }
        chans.len()
    }
}

#[derive(Deserialize, Default)]
pub(crate) struct SseParams {
    channel: Option<String>,
    event: Option<String>,
    schema: Option<String>,
    table: Option<String>,
    filter: Option<String>,
    select: Option<String>,
    last_event_id: Option<String>,
    snapshot: Option<String>,
}

/// `snapshot`: `true` or `false` (absent: false).
fn wants_snapshot(p: &SseParams) -> Result<bool, String> {
    match p.snapshot.as_deref() {
        None | Some("false") | Some("") => Ok(false),
        Some("true") => Ok(true),
        Some(other) => Err(format!("snapshot {other:?} is not true or false")),
    }
}

fn bad(msg: impl AsRef<str>) -> Response {
    error_response(StatusCode::BAD_REQUEST, msg.as_ref())
}

/// The binding an SSE request asks for; `schema` defaults to the project's own.
fn binding_from(p: &SseParams, project_schema: &str) -> Result<PgChangeBinding, String> {
    let mut m = Map::new();
    m.insert(
        "event".into(),
        Value::from(p.event.as_deref().unwrap_or("*")),
    );
    m.insert(
        "schema".into(),
        Value::from(p.schema.as_deref().unwrap_or(project_schema)),
    );
    if let Some(t) = p.table.as_deref().filter(|t| !t.is_empty()) {
        m.insert("table".into(), Value::from(t));
    }
    if let Some(f) = p.filter.as_deref().filter(|f| !f.is_empty()) {
        m.insert("filter".into(), Value::from(f));
    }
    if let Some(s) = p.select.as_deref().filter(|s| !s.is_empty()) {
        let cols: Vec<Value> = s.split(',').map(|c| Value::from(c.trim())).collect();
        m.insert("select".into(), Value::Array(cols));
    }
    let raw = RawValue::from_string(Value::Object(m).to_string()).map_err(|e| e.to_string())?;
    PgChangeBinding::from_raw(raw).map_err(|e| e.to_string())
}

/// Claims that identify the subscriber (everything but the token's lifetime fields).
fn identity(claims: &Map<String, Value>) -> String {
    let mut c = claims.clone();
    for k in ["exp", "iat", "nbf", "jti"] {
        c.remove(k);
    }
    Value::Object(c).to_string()
}

fn parse_pos(s: &str) -> Option<Pos> {
    let (lsn, seq) = s.trim().rsplit_once(':')?;
    Some((lsn.parse().ok()?, seq.parse().ok()?))
}

/// `GET /realtime/v1/sse`.
pub(crate) async fn handler(
    State(hub): State<Arc<SseHub>>,
    Query(p): Query<SseParams>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if hub.connections.is_draining() {
        return draining_response();
    }
    // WebSocket connections and SSE streams share MAX_CONNECTIONS.
    let Some(slot) = SseSlot::acquire(&hub.connections) else {
        return error_response(StatusCode::TOO_MANY_REQUESTS, "too many connections");
    };
    let (socket, (user, token), binding) = match subscriber(&hub.projects, &p, &q, &headers).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    if !hub.opens.take(&socket.project) {
        return error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "too many new streams for this project (JOINS_PER_SECOND)",
        );
    }
    let (resume, snapshot) = match (resume_from(&p, &headers), wants_snapshot(&p)) {
        (Ok(r), Ok(s)) => (r, s),
        (Err(e), _) | (_, Err(e)) => return bad(e),
    };
    // A stream is one of its project's connected users.
    let user_slot = match hub.usage.admit(&socket.project) {
        Ok(u) => u,
        Err(e) => return too_many_users(&e),
    };
    let name = p.channel.clone().unwrap_or_else(|| "sse".to_string());
    let key = SseKey {
        project: socket.project.clone(),
        channel: name.clone(),
        binding: binding.raw.get().to_string(),
        identity: identity(&user.claims),
    };
    let claims = Value::Object(user.claims.clone());
    let (chan, guard) = open_channel(&hub, key, &binding);
    if let Err((status, why)) = subscribe(&hub.registration, &chan, &claims).await {
        drop(guard);
        discard(&hub, &chan).await;
        let why = refusal(&hub, &chan.key.project, status, why);
        return error_response(status, &why);
    }
    // A reader resuming with `Last-Event-ID` already has the rows: no snapshot again.
    let (first, rows, rx, last, cut) = if snapshot && resume.is_none() {
        match snapshot::start(&hub, &chan, &name, &claims).await {
            Ok((first, rows, rx, last, cut)) => (first, Some(rows), rx, last, Some(cut)),
            Err(refused) => return refused,
        }
    } else {
        let (first, rx, last) = first_events(&chan, &name, resume);
        (first, None, rx, last, None)
    };
    let exp = user.exp().unwrap_or(i64::MAX);
    let until_exp = Duration::from_secs(exp.saturating_sub(now_secs()).max(0) as u64);
    let state = StreamState {
        first,
        rows,
        rx,
        last,
        expires: Instant::now() + until_exp.min(Duration::from_secs(10 * 365 * 86400)),
        exp,
        session: (hub.projects.clone(), socket.project.clone(), token),
        recheck: chan.recheck.subscribe(),
        cancel: hub.cancel.clone(),
        done: false,
        cut,
        _guard: guard,
        slot: (slot, user_slot),
    };
    serve(&hub, state)
}

/// The response streaming `state`'s events — unless its token fails now: a keys change
/// that came while the stream opened was told before it listened, so the token is judged
/// once more now that it does.
fn serve(hub: &SseHub, state: StreamState) -> Response {
    let (projects, project, token) = &state.session;
    if let Err(e) = projects.check_session(project, token) {
        return error_response(e.http_status(), &e.to_string());
    }
    let stream = futures_util::stream::unfold(state, next_event);
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(hub.cfg.sse_keepalive))
        .into_response()
}

/// A project at its connected-users limit: 429 with Supabase's code.
fn too_many_users(e: &TooManyUsers) -> Response {
    let text = walcast_protocol::server::error_reason(TooManyUsers::CODE, &e.to_string());
    error_response(StatusCode::TOO_MANY_REQUESTS, &text)
}

/// The project's key and the subscriber's token (see [`crate::auth::credentials`]) verified
/// (the token too, kept to be verified again when the project's keys change), and the
/// binding asked for (in a schema the project may use).
async fn subscriber(
    projects: &Projects,
    p: &SseParams,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Result<(Verified, (Verified, String), PgChangeBinding), Response> {
    let refuse = |e: AuthError| error_response(e.http_status(), &e.to_string());
    let creds = Credentials::from_request(query, headers);
    let socket = projects
        .verify(creds.key().unwrap_or(""))
        .await
        .map_err(refuse)?;
    let binding = binding_from(p, &socket.schema).map_err(bad)?;
    let token = creds.token().unwrap_or("");
    let bindings = std::slice::from_ref(&binding);
    let user = subscribe::verify_subscriber(projects, &socket.project, token, bindings)
        .await
        .map_err(refuse)?;
    Ok((socket, (user, token.to_string()), binding))
}

/// Where a reconnecting reader resumes: `Last-Event-ID` (header, else parameter).
fn resume_from(p: &SseParams, headers: &HeaderMap) -> Result<Option<Pos>, String> {
    let resume = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .or(p.last_event_id.as_deref())
        .filter(|s| !s.is_empty());
    match resume.map(|s| parse_pos(s).ok_or(s)) {
        None => Ok(None),
        Some(Ok(pos)) => Ok(Some(pos)),
        Some(Err(s)) => Err(format!("Last-Event-ID {s:?} is not <lsn>:<seq>")),
    }
}

/// The shared channel for `key` (created by its first reader), and this reader's guard.
/// The reader is counted under the hub lock, so the reaper never drops a stream in use.
fn open_channel(hub: &SseHub, key: SseKey, binding: &PgChangeBinding) -> (Arc<SseChannel>, Reader) {
    let mut streams = hub.streams.lock();
    let caps = (hub.cfg.history_size.max(1), hub.cfg.outbound_queue.max(1));
    let chan = streams
        .entry(key.clone())
        .or_insert_with(|| {
            let id = hub.connections.next_id();
            Arc::new(SseChannel::new(id, key, binding, caps, &hub.streams))
        })
        .clone();
    let guard = Reader::new(chan.clone());
    (chan, guard)
}

/// A failed subscription's message: when no leader answered (503), why the project's
/// source is not streaming, when that is known.
fn refusal(hub: &SseHub, project: &str, status: StatusCode, why: String) -> String {
    if status != StatusCode::SERVICE_UNAVAILABLE {
        return why;
    }
    crate::subscription::source_watch::not_streaming(&hub.heard, &hub.projects, project)
        .map_or(why, |(reason, _)| {
            format!("Unable to subscribe to changes: {reason}")
        })
}

/// Subscribe the channel once (its first reader does, with its claims; the others wait
/// for the same answer). A refusal is the client's error (400), a failed registration
/// the server's (503).
async fn subscribe(
    registration: &Arc<Registration>,
    chan: &Arc<SseChannel>,
    claims: &Value,
) -> Result<(), (StatusCode, String)> {
    chan.sub
        .get_or_init(|| async {
            let bindings = std::slice::from_ref(&chan.binding);
            let sink: SinkRef = chan.clone();
            let project = &chan.key.project;
            match subscribe::subscribe(registration, project, bindings, claims, sink).await {
                Ok(s) => match (s.subs.first(), s.refused.into_values().next()) {
                    (Some(n), _) => Ok(*n),
                    (None, why) => Err((StatusCode::BAD_REQUEST, why.unwrap_or_default())),
                },
                Err(e) => Err((StatusCode::SERVICE_UNAVAILABLE, e)),
            }
        })
        .await
        .clone()
        .map(|_| ())
}

/// Drop a channel and its subscription.
async fn discard(hub: &SseHub, chan: &Arc<SseChannel>) {
    if hub.streams.remove_if(chan) {
        let removed = hub.registration.registry().remove(chan.sub().as_slice());
        hub.registration.unregister(removed).await;
    }
}

/// Drop channels that have had no reader for `sse_linger`.
pub(crate) async fn reaper(hub: Arc<SseHub>, cancel: CancellationToken) {
    let linger = hub.cfg.sse_linger;
    let every = (linger / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let idle: Vec<Arc<SseChannel>> = {
            let mut streams = hub.streams.lock();
            let keys: Vec<SseKey> = streams
                .iter()
                .filter(|(_, c)| {
                    let g = c.lock();
                    g.readers == 0 && g.idle_since.is_some_and(|t| t.elapsed() >= linger)
                })
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| streams.remove(k)).collect()
        };
        for c in idle {
            let removed = hub.registration.registry().remove(c.sub().as_slice());
            hub.registration.unregister(removed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use walcast_core::Lsn;

    #[test]
    fn positions_parse() {
        assert_eq!(parse_pos("0/1530AD8:3"), Some((Lsn(0x1530AD8), 3)));
        assert_eq!(parse_pos("junk"), None);
        assert_eq!(parse_pos("0/1:x"), None);
    }

    #[test]
    fn binding_defaults() {
        let b = binding_from(&SseParams::default(), "public").unwrap();
        assert_eq!(b.event, "*");
        assert_eq!(b.schema, "public");
        let bad = SseParams {
            event: Some("TRUNCATE".into()),
            ..SseParams::default()
        };
        assert!(binding_from(&bad, "public").is_err());
    }
}
