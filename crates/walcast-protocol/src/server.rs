//! Builders for server → client frames.

use serde_json::value::RawValue;

use crate::events;
use crate::frame::{BroadcastBody, Frame, Payload, UserBroadcast};
use crate::join::PgChangeBinding;
use crate::json;
use crate::message::channel_name;

fn frame(
    join_ref: Option<&str>,
    ref_: Option<&str>,
    topic: &str,
    event: &str,
    payload: String,
) -> Frame {
    Frame::new(join_ref, ref_, topic, event, json::raw(payload))
}

/// `phx_reply` `{"status":"ok","response":<response or {}>}`.
pub fn reply_ok(
    join_ref: Option<&str>,
    ref_: Option<&str>,
    topic: &str,
    response: Option<&RawValue>,
) -> Frame {
    let resp = response.map_or("{}", RawValue::get);
    let mut p = String::with_capacity(resp.len() + 32);
    p.push_str("{\"status\":\"ok\",\"response\":");
    p.push_str(resp);
    p.push('}');
    frame(join_ref, ref_, topic, events::REPLY, p)
}

/// `phx_reply` `{"status":"error","response":{"reason":<reason>}}`.
pub fn reply_error(join_ref: Option<&str>, ref_: Option<&str>, topic: &str, reason: &str) -> Frame {
    let mut p = String::with_capacity(reason.len() + 48);
    p.push_str("{\"status\":\"error\",\"response\":{\"reason\":");
    json::write_str(&mut p, reason);
    p.push_str("}}");
    frame(join_ref, ref_, topic, events::REPLY, p)
}

/// A join error reason as realtime-js displays it: `"<Code>: <text>"`.
pub fn error_reason(code: &str, text: &str) -> String {
    format!("{code}: {text}")
}

/// Successful join reply echoing every binding (in order) with its `id`.
pub fn join_reply_ok(
    join_ref: Option<&str>,
    ref_: Option<&str>,
    topic: &str,
    bindings: &[PgChangeBinding],
) -> Frame {
    let mut resp = String::from("{\"postgres_changes\":[");
    for (i, b) in bindings.iter().enumerate() {
        if i > 0 {
            resp.push(',');
        }
        resp.push_str(&b.reply_entry());
    }
    resp.push_str("]}");
    let resp = json::raw(resp);
    reply_ok(join_ref, ref_, topic, Some(&resp))
}

/// `status` of a `system` message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SystemStatus {
    /// `"ok"`
    Ok,
    /// `"error"`
    Error,
}

/// `system` message `{extension, status, message, channel}` (`channel` = topic minus
/// `realtime:`); `extension` is e.g. `postgres_changes` or `system`.
pub fn system(
    join_ref: Option<&str>,
    topic: &str,
    extension: &str,
    status: SystemStatus,
    message: &str,
) -> Frame {
    let mut p = String::with_capacity(message.len() + topic.len() + 64);
    p.push_str("{\"extension\":");
    json::write_str(&mut p, extension);
    p.push_str(",\"status\":");
    p.push_str(match status {
        SystemStatus::Ok => "\"ok\"",
        SystemStatus::Error => "\"error\"",
    });
    p.push_str(",\"message\":");
    json::write_str(&mut p, message);
    p.push_str(",\"channel\":");
    json::write_str(&mut p, channel_name(topic));
    p.push('}');
    frame(join_ref, None, topic, events::SYSTEM, p)
}

/// `phx_close` `{}` with `ref = join_ref`.
pub fn phx_close(join_ref: Option<&str>, topic: &str) -> Frame {
    frame(join_ref, join_ref, topic, events::CLOSE, "{}".to_owned())
}

/// `phx_error` (`{}` or `{"reason":…}`) with `ref = join_ref`.
pub fn phx_error(join_ref: Option<&str>, topic: &str, reason: Option<&str>) -> Frame {
    let p = match reason {
        None => "{}".to_owned(),
        Some(r) => {
            let mut p = String::from("{\"reason\":");
            json::write_str(&mut p, r);
            p.push('}');
            p
        }
    };
    frame(join_ref, join_ref, topic, events::ERROR, p)
}

/// A presence meta: the track payload (a JSON object) plus `phx_ref` (and `phx_ref_prev`
/// on an update). A non-object payload yields a meta with only the refs.
pub fn presence_meta(
    payload: &RawValue,
    phx_ref: &str,
    phx_ref_prev: Option<&str>,
) -> Box<RawValue> {
    let text = payload.get().trim();
    let inner = text
        .strip_prefix('{')
        .and_then(|t| t.strip_suffix('}'))
        .unwrap_or("");
    let mut out = String::with_capacity(text.len() + phx_ref.len() + 32);
    out.push_str("{\"phx_ref\":");
    json::write_str(&mut out, phx_ref);
    if let Some(prev) = phx_ref_prev {
        out.push_str(",\"phx_ref_prev\":");
        json::write_str(&mut out, prev);
    }
    if !inner.trim().is_empty() {
        out.push(',');
        out.push_str(inner);
    }
    out.push('}');
    json::raw(out)
}

/// `{key:{"metas":[…]}, …}` from `(key, metas)` pairs.
pub fn presence_map<'a, K, M>(entries: impl IntoIterator<Item = (K, M)>) -> String
where
    K: AsRef<str>,
    M: IntoIterator<Item = &'a RawValue>,
{
    let mut out = String::from("{");
    for (i, (key, metas)) in entries.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json::write_str(&mut out, key.as_ref());
        out.push_str(":{\"metas\":[");
        for (j, m) in metas.into_iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            out.push_str(m.get());
        }
        out.push_str("]}");
    }
    out.push('}');
    out
}

/// `presence_state` with a map built by [`presence_map`] (carries the current join_ref).
pub fn presence_state(join_ref: Option<&str>, topic: &str, state: &str) -> Frame {
    frame(
        join_ref,
        None,
        topic,
        events::PRESENCE_STATE,
        state.to_owned(),
    )
}

/// `presence_diff` `{"joins":…,"leaves":…}` with maps built by [`presence_map`].
pub fn presence_diff(topic: &str, joins: &str, leaves: &str) -> Frame {
    let mut p = String::with_capacity(joins.len() + leaves.len() + 24);
    p.push_str("{\"joins\":");
    p.push_str(joins);
    p.push_str(",\"leaves\":");
    p.push_str(leaves);
    p.push('}');
    frame(None, None, topic, events::PRESENCE_DIFF, p)
}

/// A fan-out broadcast in text form `{"type":"broadcast","event","payload","meta"?}`.
pub fn broadcast_text(
    topic: &str,
    event: &str,
    payload: &RawValue,
    meta: Option<&RawValue>,
) -> Frame {
    let b = UserBroadcast {
        event: event.to_owned(),
        meta: meta.map(RawValue::to_owned),
        body: BroadcastBody::Json(payload.to_owned()),
    };
    // A JSON body always has a text form.
    let p = b.to_json_text().unwrap_or_else(|_| "{}".to_owned());
    frame(None, None, topic, events::BROADCAST, p)
}

/// A fan-out broadcast framed as Supabase frames one that did not come as a binary push (a
/// client's JSON push, the REST API, the database): a JSON body goes as a text frame under
/// both versions (`[null,null,topic,"broadcast",{type,event,payload,meta?}]` under 2.0.0);
/// a raw-bytes body as binary kind 4 under 2.0.0 (it has no text form: under 1.0.0
/// [`Frame::encode_server`] fails for it).
pub fn broadcast(topic: &str, b: UserBroadcast) -> Frame {
    match b.to_json_text() {
        Ok(p) => frame(None, None, topic, events::BROADCAST, p),
        Err(_) => broadcast_pushed(topic, b),
    }
}

/// A fan-out broadcast that came as a binary push (kind 3): binary kind 4 under 2.0.0
/// whatever its body, as Supabase relays those; text under 1.0.0 (which fails for a
/// raw-bytes body).
pub fn broadcast_pushed(topic: &str, b: UserBroadcast) -> Frame {
    Frame {
        join_ref: None,
        ref_: None,
        topic: topic.to_owned(),
        event: events::BROADCAST.to_owned(),
        payload: Payload::Broadcast(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::WireMessage;
    use crate::vsn::Vsn;

    fn rv(s: &str) -> Box<RawValue> {
        RawValue::from_string(s.to_owned()).unwrap()
    }

    #[test]
    fn heartbeat_reply() {
        let f = reply_ok(None, Some("5"), "phoenix", None);
        assert_eq!(
            f.encode_text(Vsn::V2).unwrap(),
            r#"[null,"5","phoenix","phx_reply",{"status":"ok","response":{}}]"#
        );
    }

    #[test]
    fn error_reply() {
        let f = reply_error(
            Some("3"),
            Some("3"),
            "realtime:r",
            &error_reason("InvalidJWTToken", "Token has expired 12 seconds ago"),
        );
        assert_eq!(
            f.encode_text(Vsn::V2).unwrap(),
            r#"["3","3","realtime:r","phx_reply",{"status":"error","response":{"reason":"InvalidJWTToken: Token has expired 12 seconds ago"}}]"#
        );
    }

    #[test]
    fn system_and_close() {
        let s = system(
            Some("3"),
            "realtime:room1",
            "postgres_changes",
            SystemStatus::Ok,
            "Subscribed to PostgreSQL",
        );
        assert_eq!(
            s.encode_text(Vsn::V2).unwrap(),
            r#"["3",null,"realtime:room1","system",{"extension":"postgres_changes","status":"ok","message":"Subscribed to PostgreSQL","channel":"room1"}]"#
        );
        assert_eq!(
            phx_close(Some("3"), "realtime:r")
                .encode_text(Vsn::V2)
                .unwrap(),
            r#"["3","3","realtime:r","phx_close",{}]"#
        );
        assert_eq!(
            phx_error(Some("3"), "realtime:r", Some("channel_crash"))
                .encode_text(Vsn::V2)
                .unwrap(),
            r#"["3","3","realtime:r","phx_error",{"reason":"channel_crash"}]"#
        );
    }

    #[test]
    fn presence() {
        let m = presence_meta(&rv(r#"{"user":"ann"}"#), "F1a", None);
        assert_eq!(m.get(), r#"{"phx_ref":"F1a","user":"ann"}"#);
        let m2 = presence_meta(&rv("{}"), "F2", Some("F1"));
        assert_eq!(m2.get(), r#"{"phx_ref":"F2","phx_ref_prev":"F1"}"#);
        let state = presence_map([("ann", [m.as_ref()])]);
        assert_eq!(
            state,
            r#"{"ann":{"metas":[{"phx_ref":"F1a","user":"ann"}]}}"#
        );
        let f = presence_diff(
            "realtime:r",
            &state,
            &presence_map::<&str, Vec<&RawValue>>([]),
        );
        assert_eq!(
            f.encode_text(Vsn::V2).unwrap(),
            r#"[null,null,"realtime:r","presence_diff",{"joins":{"ann":{"metas":[{"phx_ref":"F1a","user":"ann"}]}},"leaves":{}}]"#
        );
        let s = presence_state(Some("3"), "realtime:r", &state);
        assert_eq!(s.join_ref.as_deref(), Some("3"));
    }

    #[test]
    fn broadcast_framing_follows_the_origin() {
        let json = UserBroadcast {
            event: "cursor".into(),
            meta: Some(rv(r#"{"id":"7"}"#)),
            body: BroadcastBody::Json(rv(r#"{"x":1}"#)),
        };
        let text = r#"[null,null,"realtime:r","broadcast",{"type":"broadcast","event":"cursor","payload":{"x":1},"meta":{"id":"7"}}]"#;
        let f = broadcast("realtime:r", json.clone());
        assert_eq!(
            f.encode_server(Vsn::V2).unwrap(),
            WireMessage::Text(text.into())
        );
        assert!(matches!(
            f.encode_server(Vsn::V1).unwrap(),
            WireMessage::Text(t) if t.starts_with('{')
        ));
        let pushed = broadcast_pushed("realtime:r", json);
        assert!(matches!(
            pushed.encode_server(Vsn::V2).unwrap(),
            WireMessage::Binary(b) if b[0] == 4
        ));
        assert!(matches!(
            pushed.encode_server(Vsn::V1).unwrap(),
            WireMessage::Text(t) if t.contains(r#""payload":{"x":1}"#)
        ));
        let raw = UserBroadcast {
            event: "blob".into(),
            meta: None,
            body: BroadcastBody::Binary(bytes::Bytes::from_static(b"\x00\x01")),
        };
        let f = broadcast("realtime:r", raw);
        assert!(matches!(
            f.encode_server(Vsn::V2).unwrap(),
            WireMessage::Binary(b) if b[0] == 4
        ));
        assert!(f.encode_server(Vsn::V1).is_err(), "no text form");
    }

    #[test]
    fn broadcast_forms() {
        let f = broadcast_text("realtime:r", "cursor", &rv(r#"{"x":1}"#), None);
        assert_eq!(
            f.encode_text(Vsn::V2).unwrap(),
            r#"[null,null,"realtime:r","broadcast",{"type":"broadcast","event":"cursor","payload":{"x":1}}]"#
        );
    }
}
