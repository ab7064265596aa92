//! `walcast tail`: what walcast publishes on NATS — the tables' change events, or with
//! `--outbox` the outbox events — printed as they come: each message's subject and
//! headers, then its body; `--json` prints one JSON object per message instead.

use anyhow::Context;
use clap::Args;
use futures_util::StreamExt;
use serde_json::{json, Value};
use walcast_bus::{Bus, BusMessage};

use walcast_worker::config::redact_url;

#[derive(Args, Debug, Clone)]
pub struct TailArgs {
    /// NATS server the cdc-worker publishes to.
    #[arg(
        long,
        env = "NATS_URL",
        hide_env_values = true,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,
    #[command(flatten)]
    pub nats_auth: walcast_worker::config::NatsAuthArgs,
    /// Subject pattern to follow (default: every table's change events).
    #[arg(long, conflicts_with = "outbox")]
    pub subject: Option<String>,
    /// Follow the outbox events (`walcast.outbox.>`) instead of the change events.
    #[arg(long)]
    pub outbox: bool,
    /// One JSON object per message: `{"subject", "headers", "body"}` (the body as JSON
    /// when it is, else as text).
    #[arg(long)]
    pub json: bool,
    /// Stop after this many messages.
    #[arg(long)]
    pub count: Option<usize>,
}

impl TailArgs {
    fn pattern(&self) -> String {
        match (&self.subject, self.outbox) {
            (Some(s), _) => s.clone(),
            (None, true) => walcast_outbox::config::DEFAULT_SUBJECTS.to_string(),
            (None, false) => walcast_bus::subject::REALTIME_ALL.to_string(),
        }
    }
}

/// Print what arrives on the pattern until stopped (or `--count` messages).
pub async fn tail(args: TailArgs) -> anyhow::Result<()> {
    let bus = Bus::nats_with(
        &args.nats_url,
        "walcast-tail",
        &args.nats_auth.auth().inbox_for("tail"),
    )
    .await
    .with_context(|| format!("connecting to {}", redact_url(&args.nats_url)))?;
    let pattern = args.pattern();
    let mut sub = bus
        .subscribe(&pattern)
        .await
        .with_context(|| format!("subscribing to {pattern}"))?;
    eprintln!(
        "listening on {pattern} at {} (Ctrl-C stops)",
        redact_url(&args.nats_url)
    );
    let mut seen = 0usize;
    while let Some(msg) = sub.next().await {
        if args.json {
            println!("{}", as_json(&msg));
        } else {
            println!("{}", as_text(&msg));
        }
        seen += 1;
        if args.count.is_some_and(|c| seen >= c) {
            break;
        }
    }
    Ok(())
}

/// `subject  Name=value …` and the body on the next line.
fn as_text(msg: &BusMessage) -> String {
    let mut head = msg.subject.clone();
    for (k, v) in &msg.headers {
        head.push_str(&format!("  {k}={v}"));
    }
    format!("{head}\n{}", String::from_utf8_lossy(&msg.payload))
}

fn as_json(msg: &BusMessage) -> Value {
    let body = serde_json::from_slice::<Value>(&msg.payload)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&msg.payload).into_owned()));
    let headers: serde_json::Map<String, Value> = msg
        .headers
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    json!({ "subject": msg.subject, "headers": headers, "body": body })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(payload: &str) -> BusMessage {
        BusMessage {
            subject: "walcast.realtime.default.public.todos".into(),
            headers: vec![("Walcast-Term".into(), "3".into())],
            payload: payload.as_bytes().to_vec().into(),
        }
    }

    #[test]
    fn text_shows_subject_and_headers_then_the_body() {
        assert_eq!(
            as_text(&msg(r#"{"a":1}"#)),
            "walcast.realtime.default.public.todos  Walcast-Term=3\n{\"a\":1}"
        );
    }

    #[test]
    fn json_keeps_a_json_body_as_json_and_any_other_as_text() {
        let v = as_json(&msg(r#"{"a":1}"#));
        assert_eq!(v["body"]["a"], 1);
        assert_eq!(v["headers"]["Walcast-Term"], "3");
        assert_eq!(as_json(&msg("plain")).get("body").unwrap(), "plain");
    }
}
