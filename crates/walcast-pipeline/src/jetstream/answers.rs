//! JetStream's answers on one subscription, and what each says.

use async_nats::jetstream::{self, ErrorCode};
use async_nats::{PublishErrorKind as SendErrorKind, StatusCode, Subscriber};
use futures_util::StreamExt;
use serde::Deserialize;

/// Why a publish failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Retry it (no answer in time, connection lost, JetStream busy or restarting).
    Transient(String),
    /// No stream listens on the message's subject (NATS had no responder): the sender
    /// re-creates the stream, and calls it permanent only if it happens again.
    NoStream(String),
    /// JetStream will never take it. `kind` labels the metric (`too_large`, `invalid`,
    /// `no_stream`).
    Permanent { kind: &'static str, error: String },
    /// The leadership term ended (its fence closed): nothing was sent, and the sender
    /// stops.
    Fenced(walcast_lease::Fenced),
}

impl Failure {
    pub fn message(&self) -> String {
        match self {
            Failure::Transient(e) | Failure::NoStream(e) | Failure::Permanent { error: e, .. } => {
                e.clone()
            }
            Failure::Fenced(f) => f.to_string(),
        }
    }

    /// A publish through the fence that failed before it was sent.
    pub fn from_publish(e: crate::PublishError) -> Failure {
        match e {
            crate::PublishError::Send(e) => Failure::from_send(&e),
            crate::PublishError::Fenced(f) => Failure::Fenced(f),
            other => Failure::Transient(other.to_string()),
        }
    }

    /// A publish the NATS client refused before sending it.
    pub fn from_send(e: &async_nats::PublishError) -> Failure {
        let error = e.to_string();
        match e.kind() {
            SendErrorKind::MaxPayloadExceeded => Failure::Permanent {
                kind: "too_large",
                error,
            },
            SendErrorKind::InvalidSubject => Failure::Permanent {
                kind: "invalid",
                error,
            },
            SendErrorKind::Send => Failure::Transient(error),
        }
    }

    /// A JetStream error in an answer: a message over the stream's size limit will
    /// never be taken; anything else may pass later.
    fn from_jetstream(e: &jetstream::Error) -> Failure {
        match e.error_code() {
            ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM => Failure::Permanent {
                kind: "too_large",
                error: e.to_string(),
            },
            _ => Failure::Transient(e.to_string()),
        }
    }
}

/// JetStream stored the message (`duplicate`: it had it already, within the duplicate
/// window).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub duplicate: bool,
}

/// JetStream's answer to one message.
pub type Answer = Result<Stored, Failure>;

/// Names a sent message: its answer comes with the same token.
pub type Token = u64;

/// What an answer's payload holds: an error, or the stored message's sequence.
#[derive(Deserialize)]
struct Reply {
    #[serde(default)]
    error: Option<jetstream::Error>,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    duplicate: bool,
}

/// The answer an acknowledgement message carries.
fn read_answer(msg: &async_nats::Message) -> Answer {
    if msg.status == Some(StatusCode::NO_RESPONDERS) {
        return Err(Failure::NoStream(format!(
            "no stream listens on the subject ({})",
            msg.subject
        )));
    }
    match serde_json::from_slice::<Reply>(&msg.payload) {
        Ok(Reply { error: Some(e), .. }) => Err(Failure::from_jetstream(&e)),
        Ok(Reply {
            seq: Some(_),
            duplicate,
            ..
        }) => Ok(Stored { duplicate }),
        _ => Err(Failure::Transient(format!(
            "unreadable JetStream answer (status {:?})",
            msg.status
        ))),
    }
}

/// The subscription JetStream's answers come back on.
pub struct Answers {
    /// `<inbox>`: a message's reply subject is `<inbox>.<token>`.
    prefix: String,
    sub: Subscriber,
    next: Token,
}

impl Answers {
    /// Subscribe on `client` (the connection the messages go out on).
    pub async fn subscribe(client: &async_nats::Client) -> Result<Answers, Failure> {
        let prefix = client.new_inbox();
        let sub = client
            .subscribe(format!("{prefix}.*"))
            .await
            .map_err(|e| Failure::Transient(format!("subscribing to the answers: {e}")))?;
        Ok(Answers {
            prefix,
            sub,
            next: 0,
        })
    }

    /// A token for the next message, and the reply subject its answer comes to.
    pub fn next_reply(&mut self) -> (Token, String) {
        let token = self.next;
        self.next += 1;
        (token, format!("{}.{token}", self.prefix))
    }

    /// The next answer JetStream sent, in the order they come (cancel-safe); `None` if
    /// the subscription ended (the connection is gone for good).
    pub async fn next(&mut self) -> Option<(Token, Answer)> {
        loop {
            let msg = self.sub.next().await?;
            let token = msg.subject.rsplit('.').next().and_then(|t| t.parse().ok());
            if let Some(token) = token {
                return Some((token, read_answer(&msg)));
            }
        }
    }
}
