//! SSE snapshot rows (`AdminRequest::SnapshotRows`) in parts, over NATS.
//!
//! One reply holding every row could be no larger than NATS' `max_payload`. Asked with a
//! `nonce`, the worker answers on the request's reply inbox with parts instead, each at
//! most [`part_bytes`] of rows (256 KiB, or half of `max_payload` if that is less):
//!
//! ```text
//! {"nonce":"…","seq":0,"body":{"rows":[{…},{…}]}}
//! …
//! {"nonce":"…","seq":N,"body":{"done":{"snapshot":"…","lsn":"…","columns":[…],"rows":R,"bytes":B,"parts":N,"digest":"<sha-256 hex>"}}}
//! ```
//!
//! or, in the place of any part, `{"nonce":"…","seq":K,"body":{"error":{…}}}`. The last
//! part carries the cut (snapshot, WAL position), the columns and the totals: the rows,
//! their bytes, the parts before it and the SHA-256 of the rows (each followed by `\n`).
//!
//! The front ([`Reassembly`]) takes parts only on an inbox of its own (a fresh
//! subscription per request, dropped after), only with its request's nonce (128 random
//! bits), in order from 0 without a gap or a repeat, each with at least one row, the rows
//! within its limits as they come, and the end only when its totals and digest are those
//! of the rows taken. Anything else — a part lost (NATS drops a slow consumer's
//! messages), repeated, reordered, of another request, or forged with a sequence number
//! already taken (the genuine part then repeats it) — ends the exchange with an error:
//! a snapshot is refused, never cut short.

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use super::{AdminError, AdminErrorKind, SnapshotRows};

/// The most bytes of rows in one part.
pub const PART_BYTES: usize = 256 * 1024;

/// Room in a part for its nonce, sequence number and framing (a nonce is at most
/// [`MAX_NONCE`] characters).
const PART_OVERHEAD: usize = 512;

/// The longest nonce a worker echoes (a front sends 32 hex digits).
pub const MAX_NONCE: usize = 64;

/// Bytes of rows in one part under a server's `max_payload`.
pub fn part_bytes(max_payload: usize) -> usize {
    PART_BYTES.min(max_payload / 2)
}

/// A fresh nonce: 128 random bits, hex.
pub fn nonce() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Whether a request's nonce may be echoed (short, letters and digits only).
pub fn nonce_ok(nonce: &str) -> bool {
    !nonce.is_empty()
        && nonce.len() <= MAX_NONCE
        && nonce.bytes().all(|b| b.is_ascii_alphanumeric())
}

#[derive(Serialize, Deserialize, Debug)]
struct Part {
    nonce: String,
    seq: u32,
    body: PartBody,
}

#[derive(Serialize, Deserialize, Debug)]
#[serde(rename_all = "snake_case")]
enum PartBody {
    Rows(Vec<Box<RawValue>>),
    Done(PartsDone),
    Error(AdminError),
}

/// The last part: the cut, the columns, the totals.
#[derive(Serialize, Deserialize, Debug, Clone, PartialEq, Eq)]
struct PartsDone {
    snapshot: String,
    lsn: walcast_core::Lsn,
    columns: Vec<crate::ColumnInfo>,
    rows: u64,
    bytes: u64,
    parts: u32,
    digest: String,
}

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The worker's parts of one answer, each a NATS payload, in order.
pub struct Parts {
    nonce: String,
    answer: Option<Result<SnapshotRows, AdminError>>,
    /// Rows already put in parts.
    next: usize,
    seq: u32,
    bytes: u64,
    digest: Sha256,
    part_bytes: usize,
}

impl Parts {
    /// The parts of `answer` for the request of `nonce`, under `max_payload`. A row that
    /// fits no message makes the whole answer an error (`TooLarge`).
    pub fn new(nonce: &str, answer: Result<SnapshotRows, AdminError>, max_payload: usize) -> Parts {
        let room = max_payload.saturating_sub(PART_OVERHEAD);
        let answer = match answer {
            Ok(rows) => match rows.rows.iter().map(|r| r.len()).max() {
                Some(big) if big > room => Err(AdminError::new(
                    AdminErrorKind::TooLarge,
                    format!(
                        "a row of {big} bytes does not fit one NATS message ({max_payload} bytes)"
                    ),
                )),
                _ => Ok(rows),
            },
            e => e,
        };
        Parts {
            nonce: nonce.to_string(),
            answer: Some(answer),
            next: 0,
            seq: 0,
            bytes: 0,
            digest: Sha256::new(),
            part_bytes: part_bytes(max_payload).max(1),
        }
    }

    /// A part's opening, up to its body; the next sequence number.
    fn head(&mut self) -> String {
        let head = format!(
            "{{\"nonce\":{},\"seq\":{},\"body\":",
            serde_json::Value::from(self.nonce.as_str()),
            self.seq
        );
        self.seq += 1;
        head
    }

    fn frame(&mut self, body: &PartBody) -> Bytes {
        let head = self.head();
        let body = serde_json::to_string(body).unwrap_or_else(|e| {
            let e = AdminError::new(AdminErrorKind::Internal, e.to_string());
            serde_json::to_string(&PartBody::Error(e)).unwrap_or_default()
        });
        Bytes::from(format!("{head}{body}}}"))
    }

    /// The next part of rows: as many as fit [`PART_BYTES`] (at least one).
    fn rows_part(&mut self, rows: &SnapshotRows) -> Bytes {
        let mut text = String::new();
        let mut taken = 0;
        for row in &rows.rows[self.next..] {
            if taken > 0 && text.len() + row.len() + 1 > self.part_bytes {
                break;
            }
            if taken > 0 {
                text.push(',');
            }
            text.push_str(row);
            self.digest.update(row.as_bytes());
            self.digest.update(b"\n");
            self.bytes += row.len() as u64;
            taken += 1;
        }
        self.next += taken;
        let head = self.head();
        Bytes::from(format!("{head}{{\"rows\":[{text}]}}}}"))
    }
}

impl Iterator for Parts {
    type Item = Bytes;

    fn next(&mut self) -> Option<Bytes> {
        match self.answer.take()? {
            Err(e) => Some(self.frame(&PartBody::Error(e))),
            Ok(rows) if self.next < rows.rows.len() => {
                let part = self.rows_part(&rows);
                self.answer = Some(Ok(rows));
                Some(part)
            }
            Ok(rows) => {
                let done = PartsDone {
                    snapshot: rows.snapshot,
                    lsn: rows.lsn,
                    columns: rows.columns,
                    rows: rows.rows.len() as u64,
                    bytes: self.bytes,
                    parts: self.seq,
                    digest: hex(&std::mem::take(&mut self.digest).finalize()),
                };
                Some(self.frame(&PartBody::Done(done)))
            }
        }
    }
}

/// What one more part gives.
#[derive(Debug)]
pub enum Step {
    /// More parts are due.
    More,
    /// The whole answer.
    Done(SnapshotRows),
}

/// The front's side: parts taken in order into the rows, within limits.
pub struct Reassembly {
    nonce: String,
    seq: u32,
    rows: Vec<String>,
    bytes: u64,
    max_rows: usize,
    max_bytes: u64,
    digest: Sha256,
}

fn unavailable(message: impl Into<String>) -> AdminError {
    AdminError::new(AdminErrorKind::Unavailable, message)
}

/// Called with each part's rows and bytes before they are kept: an error refuses them
/// (the front's memory budget).
pub type Admit<'a> = dyn FnMut(usize, usize) -> Result<(), AdminError> + Send + 'a;

impl Reassembly {
    /// For the request of `nonce`, at most `max_rows` rows of `max_bytes` bytes.
    pub fn new(nonce: &str, max_rows: u32, max_bytes: u32) -> Reassembly {
        Reassembly {
            nonce: nonce.to_string(),
            seq: 0,
            rows: Vec::new(),
            bytes: 0,
            max_rows: max_rows as usize,
            max_bytes: max_bytes as u64,
            digest: Sha256::new(),
        }
    }

    fn too_large(&self) -> AdminError {
        AdminError::new(
            AdminErrorKind::TooLarge,
            format!(
                "more than {} rows or {} bytes (SSE_SNAPSHOT_MAX_ROWS, SSE_SNAPSHOT_MAX_BYTES)",
                self.max_rows, self.max_bytes
            ),
        )
    }

    /// Take one message of the inbox. `Err`: the exchange is over (the worker's error, or
    /// a part that breaks it).
    pub fn take(&mut self, payload: &[u8], admit: &mut Admit<'_>) -> Result<Step, AdminError> {
        let part = match serde_json::from_slice::<Part>(payload) {
            Ok(p) => p,
            // A whole reply from a worker that predates parts is refused too: it carries
            // no nonce, so it could be anyone's.
            Err(e) => {
                return Err(unavailable(format!(
                    "a snapshot part that does not parse (a cdc-worker older than this front?): {e}"
                )))
            }
        };
        if part.nonce != self.nonce {
            return Err(unavailable("a snapshot part of another request"));
        }
        if part.seq != self.seq {
            return Err(unavailable(format!(
                "snapshot part {} where {} was due (lost, repeated, reordered or forged)",
                part.seq, self.seq
            )));
        }
        self.seq += 1;
        match part.body {
            PartBody::Error(e) => Err(e),
            PartBody::Rows(rows) => self.rows(rows, admit).map(|()| Step::More),
            PartBody::Done(done) => self.done(done).map(Step::Done),
        }
    }

    fn rows(&mut self, rows: Vec<Box<RawValue>>, admit: &mut Admit<'_>) -> Result<(), AdminError> {
        if rows.is_empty() {
            return Err(unavailable("an empty snapshot part"));
        }
        let bytes: usize = rows.iter().map(|r| r.get().len()).sum();
        self.bytes += bytes as u64;
        if self.rows.len() + rows.len() > self.max_rows || self.bytes > self.max_bytes {
            return Err(self.too_large());
        }
        admit(rows.len(), bytes)?;
        for row in rows {
            self.digest.update(row.get().as_bytes());
            self.digest.update(b"\n");
            self.rows.push(String::from(Box::<str>::from(row)));
        }
        Ok(())
    }

    fn done(&mut self, done: PartsDone) -> Result<SnapshotRows, AdminError> {
        let digest = hex(&std::mem::take(&mut self.digest).finalize());
        let ours = (self.rows.len() as u64, self.bytes, self.seq - 1, digest);
        if (done.rows, done.bytes, done.parts, done.digest) != ours {
            return Err(unavailable(format!(
                "snapshot parts do not add up: {} rows of {} bytes in {} parts taken",
                ours.0, ours.1, ours.2
            )));
        }
        Ok(SnapshotRows {
            snapshot: done.snapshot,
            lsn: done.lsn,
            columns: done.columns,
            rows: std::mem::take(&mut self.rows),
        })
    }
}

#[cfg(test)]
mod tests;
