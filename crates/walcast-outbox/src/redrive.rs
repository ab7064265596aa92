//! `walcast outbox redrive`: quarantined events sent to JetStream again, once whatever
//! refused them (a too small `max_payload`, a missing stream) has been fixed.

use tokio_postgres::Client;

use crate::publish::Publisher;
use crate::quarantine;

#[derive(Debug, thiserror::Error)]
pub enum RedriveError {
    #[error("the quarantine: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("the JetStream stream: {0}")]
    Stream(String),
}

/// What became of one quarantined event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub id: String,
    pub subject: String,
    /// `None`: JetStream acknowledged it and it left the quarantine. Otherwise why not
    /// (it stays).
    pub error: Option<String>,
    /// JetStream already had it (an earlier redrive sent it and stopped before removing
    /// it): acknowledged as a duplicate, removed all the same.
    pub duplicate: bool,
}

/// A redrive's outcome.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// In the order sent: oldest commit first.
    pub outcomes: Vec<Outcome>,
    /// Ids asked for that are not in the quarantine (of that project).
    pub missing: Vec<String>,
}

impl Report {
    pub fn failed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.error.is_some()).count()
    }
}

/// Send the quarantined events of `project` (all if `None`; only `ids` if any are
/// given) again, oldest commit first, each waiting for its PubAck (the event id is still
/// the `Nats-Msg-Id`, so a redrive repeated within the duplicate window stores nothing
/// twice). An acknowledged event leaves the quarantine; one refused again stays there
/// and its error is reported. Creates the stream if it is missing, but never changes an
/// existing one.
pub async fn redrive(
    db: &Client,
    publisher: &mut Publisher,
    project: Option<&str>,
    ids: &[String],
) -> Result<Report, RedriveError> {
    let wanted: Vec<String> = ids.iter().map(|i| i.trim().to_ascii_lowercase()).collect();
    let mut events = quarantine::list(db, project).await?;
    if !wanted.is_empty() {
        events.retain(|q| wanted.contains(&q.event.id.to_ascii_lowercase()));
    }
    let mut report = Report {
        missing: wanted
            .iter()
            .filter(|w| !events.iter().any(|q| q.event.id.eq_ignore_ascii_case(w)))
            .cloned()
            .collect(),
        ..Default::default()
    };
    if events.is_empty() {
        return Ok(report);
    }
    publisher
        .ensure_stream_exists()
        .await
        .map_err(|f| RedriveError::Stream(f.message()))?;
    for q in events {
        let ev = q.event;
        let answer = match publisher.send(&ev).await {
            Ok(token) => publisher.answer_to(token).await,
            Err(failure) => Err(failure),
        };
        let mut outcome = Outcome {
            subject: ev.subject(),
            id: ev.id,
            error: None,
            duplicate: false,
        };
        match answer {
            Ok(ack) => {
                quarantine::remove(db, &outcome.id).await?;
                outcome.duplicate = ack.duplicate;
            }
            Err(f) => outcome.error = Some(f.message()),
        }
        report.outcomes.push(outcome);
    }
    Ok(report)
}
