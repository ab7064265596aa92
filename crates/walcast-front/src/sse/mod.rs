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
//! | `access_token` | the user's JWT whose claims (`role`, …) the worker uses for RLS; needs `role` and `exp` | `Authorization: Bearer`, else the key ([`crate::credentials`]) |
//! | `channel` | a name for the stream (echoed in `ready`); streams with the same name, parameters and claims share one subscription and one history | `sse` |
//! | `event` | `*`, `INSERT`, `UPDATE` or `DELETE` | `*` |
//! | `schema` | schema name (`*` = all) | `public` |
//! | `table` | table name (absent = every table of the schema) | — |
//! | `filter` | a `postgres_changes` filter, e.g. `user_id=eq.42` | — |
//! | `select` | comma-separated column list | — |
//! | `last_event_id` | resume point when the `Last-Event-ID` header cannot be set | — |
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
//! ```sh
//! curl -N "http://localhost:4000/realtime/v1/sse?apikey=$ANON_KEY&table=todos"
//! ```

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value};
use tokio::sync::{broadcast, OnceCell};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use walcast_bus::ChangeEvent;
use walcast_protocol::{EncodedChange, PgChangeBinding, RawValue};
use walcast_wal2json::Lsn;

use crate::auth::{now_secs, AuthError, Verified};
use crate::credentials::Credentials;
use crate::http::error_response;
use crate::limits::{OpenRate, SseSlot};
use crate::registration;
use crate::sink::{Change, Sink, SinkRef};
use crate::state::Shared;
use crate::subscribe;
use crate::telemetry;

type Pos = (Lsn, u32);

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct SseKey {
    project: String,
    channel: String,
    binding: String,
    identity: String,
}

pub(crate) struct Item {
    pos: Pos,
    id: String,
    data: String,
    /// The last item: the subscription ended (`data` is the `system` event's).
    end: bool,
}

struct Inner {
    ring: VecDeque<Arc<Item>>,
    /// Position of the newest entry evicted from the ring.
    evicted: Option<Pos>,
    readers: usize,
    idle_since: Option<Instant>,
}

/// One shared SSE subscription with its history.
pub(crate) struct SseChannel {
    pub id: u64,
    key: SseKey,
    binding: PgChangeBinding,
    cap: usize,
    /// Its subscription's number, once its first reader subscribed (the others wait for
    /// the same answer).
    sub: OnceCell<Result<u64, (StatusCode, String)>>,
    inner: Mutex<Inner>,
    live: broadcast::Sender<Arc<Item>>,
}

impl SseChannel {
    /// Its subscription's number, if it has one.
    fn sub(&self) -> Option<u64> {
        self.sub.get().and_then(|r| r.as_ref().ok()).copied()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Record a change and hand it to live readers.
    pub(crate) fn push(&self, ev: &ChangeEvent, enc: &EncodedChange, ids: &[u32]) {
        let pos = ev.position();
        let mut g = self.lock();
        if g.ring.back().is_some_and(|last| last.pos >= pos) {
            return; // a replay of something already recorded
        }
        let item = Arc::new(Item {
            pos,
            id: format!("{}:{}", pos.0, pos.1),
            data: enc.payload_json(ids),
            end: false,
        });
        g.ring.push_back(item.clone());
        while g.ring.len() > self.cap {
            if let Some(old) = g.ring.pop_front() {
                g.evicted = Some(old.pos);
            }
        }
        let _ = self.live.send(item);
    }

    /// The worker ended the subscription (its table was dropped): live readers get a
    /// `system` error event, then their stream ends.
    pub(crate) fn end(&self, message: &str) {
        let data = serde_json::json!({
            "extension": "postgres_changes",
            "status": "error",
            "message": message,
        });
        let item = Arc::new(Item {
            pos: (Lsn(u64::MAX), u32::MAX),
            id: String::new(),
            data: data.to_string(),
            end: true,
        });
        let _ = self.live.send(item);
    }
}

impl Sink for SseChannel {
    fn id(&self) -> u64 {
        self.id
    }

    fn deliver(&self, change: &mut Change<'_>, ids: Vec<u32>) -> bool {
        self.push(change.event, change.encoded, &ids);
        true
    }

    /// Live readers get the reason and their streams end; a reader coming back
    /// subscribes anew (and is refused with the reason).
    fn end(&self, shared: &Shared, why: &str) {
        shared.sse.remove_if(self);
        SseChannel::end(self, why);
    }
}

pub(crate) struct SseHub {
    map: Mutex<HashMap<SseKey, Arc<SseChannel>>>,
    /// New streams per project per second (see [`OpenRate`]).
    opens: OpenRate,
}

impl SseHub {
    /// `burst` and `per_second`: new streams per project (the joins' limits).
    pub(crate) fn new(burst: u32, per_second: u32) -> SseHub {
        SseHub {
            map: Mutex::default(),
            opens: OpenRate::new(burst, per_second),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<SseKey, Arc<SseChannel>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn remove_if(&self, chan: &SseChannel) -> bool {
        let mut g = self.lock();
        if g.get(&chan.key)
            .is_some_and(|c| std::ptr::eq(Arc::as_ptr(c), chan))
        {
            g.remove(&chan.key);
            true
        } else {
            false
        }
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
    State(shared): State<Arc<Shared>>,
    Query(p): Query<SseParams>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    if shared.is_draining() {
        return crate::http::draining_response();
    }
    // WebSocket connections and SSE streams share MAX_CONNECTIONS.
    let Some(slot) = SseSlot::acquire(&shared) else {
        return error_response(StatusCode::TOO_MANY_REQUESTS, "too many connections");
    };
    let (socket, user, binding) = match subscriber(&shared, &p, &q, &headers).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    if !shared.sse.opens.take(&socket.project) {
        return error_response(
            StatusCode::TOO_MANY_REQUESTS,
            "too many new streams for this project (JOINS_PER_SECOND)",
        );
    }
    let resume = match resume_from(&p, &headers) {
        Ok(r) => r,
        Err(e) => return bad(e),
    };
    let name = p.channel.clone().unwrap_or_else(|| "sse".to_string());
    let key = SseKey {
        project: socket.project.clone(),
        channel: name.clone(),
        binding: binding.raw.get().to_string(),
        identity: identity(&user.claims),
    };
    let claims = Value::Object(user.claims.clone());
    let (chan, guard) = open_channel(&shared, key, &binding);
    if let Err((status, why)) = subscribe(&shared, &chan, &claims).await {
        drop(guard);
        discard(&shared, &chan).await;
        return error_response(status, &why);
    }
    let (first, rx, last) = first_events(&chan, &name, resume);
    let exp = user.exp().unwrap_or(i64::MAX);
    let until_exp = Duration::from_secs(exp.saturating_sub(now_secs()).max(0) as u64);
    let state = StreamState {
        first,
        rx,
        last,
        expires: Instant::now() + until_exp.min(Duration::from_secs(10 * 365 * 86400)),
        exp,
        cancel: shared.cancel.clone(),
        done: false,
        _guard: guard,
        _slot: slot,
    };
    let stream = futures_util::stream::unfold(state, next_event);
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(shared.cfg.sse_keepalive))
        .into_response()
}

/// The project's key and the subscriber's token (see [`crate::credentials`]) verified,
/// and the binding asked for (in a schema the project may use).
async fn subscriber(
    shared: &Shared,
    p: &SseParams,
    query: &HashMap<String, String>,
    headers: &HeaderMap,
) -> Result<(Verified, Verified, PgChangeBinding), Response> {
    let refuse = |e: AuthError| error_response(crate::http::auth_status(&e), &e.to_string());
    let creds = Credentials::from_request(query, headers);
    let socket = shared
        .projects
        .verify(creds.key().unwrap_or(""))
        .await
        .map_err(refuse)?;
    let binding = binding_from(p, &socket.schema).map_err(bad)?;
    let token = creds.token().unwrap_or("");
    let bindings = std::slice::from_ref(&binding);
    let user = subscribe::verify_subscriber(shared, &socket.project, token, bindings)
        .await
        .map_err(refuse)?;
    Ok((socket, user, binding))
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
fn open_channel(
    shared: &Arc<Shared>,
    key: SseKey,
    binding: &PgChangeBinding,
) -> (Arc<SseChannel>, Reader) {
    let mut hub = shared.sse.lock();
    let chan = hub
        .entry(key.clone())
        .or_insert_with(|| {
            Arc::new(SseChannel {
                id: shared.next_id(),
                key,
                binding: binding.clone(),
                cap: shared.cfg.history_size.max(1),
                sub: OnceCell::new(),
                inner: Mutex::new(Inner {
                    ring: VecDeque::new(),
                    evicted: None,
                    readers: 0,
                    idle_since: Some(Instant::now()),
                }),
                live: broadcast::channel(shared.cfg.outbound_queue.max(1)).0,
            })
        })
        .clone();
    let guard = Reader::new(chan.clone());
    (chan, guard)
}

/// Subscribe the channel once (its first reader does, with its claims; the others wait
/// for the same answer). A refusal is the client's error (400), a failed registration
/// the server's (503).
async fn subscribe(
    shared: &Arc<Shared>,
    chan: &Arc<SseChannel>,
    claims: &Value,
) -> Result<(), (StatusCode, String)> {
    chan.sub
        .get_or_init(|| async {
            let bindings = std::slice::from_ref(&chan.binding);
            let sink: SinkRef = chan.clone();
            let project = &chan.key.project;
            match subscribe::subscribe(shared, project, bindings, claims, sink).await {
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

/// The stream's first events (`ready`, a `gap` if the history no longer reaches back to
/// `resume`, then what it holds after `resume`), the live receiver and the last position
/// sent, taken together under the channel's lock so nothing falls between them.
fn first_events(
    chan: &SseChannel,
    name: &str,
    resume: Option<Pos>,
) -> (VecDeque<Event>, broadcast::Receiver<Arc<Item>>, Option<Pos>) {
    let mut first = VecDeque::new();
    let ready_data = format!(
        "{{\"channel\":{},\"postgres_changes\":[{}]}}",
        Value::from(name),
        chan.binding.reply_entry()
    );
    first.push_back(Event::default().event("ready").data(ready_data));
    let g = chan.lock();
    let rx = chan.live.subscribe();
    let mut last = resume;
    if let Some(from) = resume {
        if g.evicted.is_some_and(|ev| ev > from) {
            let oldest = g.ring.front().map_or(String::new(), |i| i.id.clone());
            first.push_back(Event::default().event("gap").data(format!(
                "{{\"reason\":\"history exhausted\",\"oldest\":{}}}",
                Value::from(oldest)
            )));
        }
        for item in g.ring.iter().filter(|i| i.pos > from) {
            first.push_back(item_event(item));
            last = Some(item.pos);
        }
    }
    (first, rx, last)
}

fn item_event(item: &Item) -> Event {
    Event::default()
        .id(&item.id)
        .event("postgres_changes")
        .data(&item.data)
}

struct StreamState {
    first: VecDeque<Event>,
    rx: broadcast::Receiver<Arc<Item>>,
    last: Option<Pos>,
    expires: Instant,
    exp: i64,
    cancel: CancellationToken,
    done: bool,
    _guard: Reader,
    _slot: SseSlot,
}

async fn next_event(mut st: StreamState) -> Option<(Result<Event, Infallible>, StreamState)> {
    if let Some(ev) = st.first.pop_front() {
        return Some((Ok(ev), st));
    }
    if st.done {
        return None;
    }
    loop {
        tokio::select! {
            _ = st.cancel.cancelled() => return None,
            _ = tokio::time::sleep_until(st.expires) => {
                st.done = true;
                let msg = format!("Token has expired {} seconds ago", (now_secs() - st.exp).max(0));
                let data = format!("{{\"extension\":\"system\",\"status\":\"error\",\"message\":{}}}", Value::from(msg));
                return Some((Ok(Event::default().event("system").data(data)), st));
            }
            r = st.rx.recv() => match r {
                Ok(item) if item.end => {
                    st.done = true;
                    return Some((Ok(Event::default().event("system").data(&item.data)), st));
                }
                Ok(item) => {
                    if st.last.is_some_and(|l| item.pos <= l) {
                        continue;
                    }
                    st.last = Some(item.pos);
                    return Some((Ok(item_event(&item)), st));
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    st.done = true;
                    metrics::counter!(telemetry::SLOW_CONSUMERS).increment(1);
                    let data = format!("{{\"message\":\"slow consumer: {n} events dropped\"}}");
                    return Some((Ok(Event::default().event("error").data(data)), st));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// Counts a reader of a channel while the response lives.
struct Reader {
    chan: Arc<SseChannel>,
}

impl Reader {
    fn new(chan: Arc<SseChannel>) -> Reader {
        {
            let mut g = chan.lock();
            g.readers += 1;
            g.idle_since = None;
        }
        Reader { chan }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        let mut g = self.chan.lock();
        g.readers = g.readers.saturating_sub(1);
        if g.readers == 0 {
            g.idle_since = Some(Instant::now());
        }
    }
}

/// Drop a channel and its subscription.
async fn discard(shared: &Arc<Shared>, chan: &Arc<SseChannel>) {
    if shared.sse.remove_if(chan) {
        let removed = shared.registry.remove(chan.sub().as_slice());
        registration::unregister(shared, removed).await;
    }
}

/// Drop channels that have had no reader for `sse_linger`.
pub(crate) async fn reaper(shared: Arc<Shared>, cancel: CancellationToken) {
    let every =
        (shared.cfg.sse_linger / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let idle: Vec<Arc<SseChannel>> = {
            let mut hub = shared.sse.lock();
            let linger = shared.cfg.sse_linger;
            let keys: Vec<SseKey> = hub
                .iter()
                .filter(|(_, c)| {
                    let g = c.lock();
                    g.readers == 0 && g.idle_since.is_some_and(|t| t.elapsed() >= linger)
                })
                .map(|(k, _)| k.clone())
                .collect();
            keys.iter().filter_map(|k| hub.remove(k)).collect()
        };
        for c in idle {
            let removed = shared.registry.remove(c.sub().as_slice());
            registration::unregister(&shared, removed).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
