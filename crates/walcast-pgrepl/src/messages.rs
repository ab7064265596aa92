//! Encoding and parsing of the replication sub-protocol carried inside `CopyData`.
//!
//! Server to client: `XLogData` (`w`) and primary keepalive (`k`). Client to server:
//! standby status update (`r`). All integers are big-endian; times are microseconds
//! since the Postgres epoch, 2000-01-01 00:00:00 UTC.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use walcast_core::Lsn;

use crate::ReplError;

/// Seconds from the Unix epoch to the Postgres epoch (2000-01-01 UTC).
pub const PG_EPOCH_UNIX_SECS: i64 = 946_684_800;

const XLOG_DATA_HEADER: usize = 1 + 8 + 8 + 8;
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1;
const STATUS_LEN: usize = 1 + 8 + 8 + 8 + 8 + 1;

/// One message of the replication stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplEvent {
    /// One `XLogData` message: for wal2json format-version 2 this is exactly one JSON
    /// document (one line, no trailing newline).
    XLogData {
        /// WAL position the data belongs to (for wal2json: the change's LSN; for a
        /// commit (`"C"`) message, the end of the commit record).
        wal_start: Lsn,
        /// The server's current end of WAL.
        wal_end: Lsn,
        /// Server clock when sent, microseconds since 2000-01-01 UTC.
        server_time_micros: i64,
        /// The plugin's output, sliced from the read buffer without copying.
        data: Bytes,
    },
    /// Primary keepalive.
    Keepalive {
        /// The server's current end of WAL.
        wal_end: Lsn,
        /// Server clock when sent, microseconds since 2000-01-01 UTC.
        server_time_micros: i64,
        /// The server wants a status update soon (it disconnects after
        /// `wal_sender_timeout` without one).
        reply_requested: bool,
    },
}

/// Parse the payload of a server `CopyData` message (`w` or `k`). Never panics.
pub fn parse_copy_data(payload: Bytes) -> Result<ReplEvent, ReplError> {
    match payload.first() {
        Some(b'w') => {
            if payload.len() < XLOG_DATA_HEADER {
                return Err(truncated("XLogData", XLOG_DATA_HEADER, payload.len()));
            }
            Ok(ReplEvent::XLogData {
                wal_start: Lsn(be_u64(&payload, 1)),
                wal_end: Lsn(be_u64(&payload, 9)),
                server_time_micros: be_u64(&payload, 17) as i64,
                data: payload.slice(XLOG_DATA_HEADER..),
            })
        }
        Some(b'k') => {
            // Exactly 18 bytes today; tolerate a longer message from a future server.
            if payload.len() < KEEPALIVE_LEN {
                return Err(truncated("primary keepalive", KEEPALIVE_LEN, payload.len()));
            }
            Ok(ReplEvent::Keepalive {
                wal_end: Lsn(be_u64(&payload, 1)),
                server_time_micros: be_u64(&payload, 9) as i64,
                reply_requested: payload[17] != 0,
            })
        }
        Some(&other) => Err(ReplError::Protocol(format!(
            "unknown replication message type {:?} in CopyData",
            other as char
        ))),
        None => Err(ReplError::Protocol("empty CopyData message".into())),
    }
}

/// Append a complete `CopyData` frame holding a standby status update.
pub fn encode_standby_status(
    out: &mut BytesMut,
    written: Lsn,
    flushed: Lsn,
    applied: Lsn,
    client_time_micros: i64,
    reply_requested: bool,
) {
    out.reserve(1 + 4 + STATUS_LEN);
    out.put_u8(b'd');
    out.put_u32((4 + STATUS_LEN) as u32);
    out.put_u8(b'r');
    out.put_u64(written.0);
    out.put_u64(flushed.0);
    out.put_u64(applied.0);
    out.put_i64(client_time_micros);
    out.put_u8(u8::from(reply_requested));
}

/// The current time in microseconds since the Postgres epoch.
pub fn pg_now_micros() -> i64 {
    let unix_micros = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    };
    unix_micros.saturating_sub(PG_EPOCH_UNIX_SECS * 1_000_000)
}

fn be_u64(buf: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[at..at + 8]);
    u64::from_be_bytes(b)
}

fn truncated(what: &str, need: usize, got: usize) -> ReplError {
    ReplError::Protocol(format!(
        "truncated {what} message: {got} bytes, need at least {need}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn standby_status_exact_bytes() {
        let mut out = BytesMut::new();
        encode_standby_status(
            &mut out,
            Lsn(0x0000_0001_0000_00AA),
            Lsn(0x0000_0002_0000_00BB),
            Lsn(0x0000_0003_0000_00CC),
            0x0102_0304_0506_0708,
            true,
        );
        let mut want = vec![b'd', 0, 0, 0, 38, b'r'];
        want.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0xAA]);
        want.extend_from_slice(&[0, 0, 0, 2, 0, 0, 0, 0xBB]);
        want.extend_from_slice(&[0, 0, 0, 3, 0, 0, 0, 0xCC]);
        want.extend_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        want.push(1);
        assert_eq!(&out[..], &want[..]);
        assert_eq!(out.len(), 39);

        out.clear();
        encode_standby_status(&mut out, Lsn(0), Lsn(0), Lsn(0), -1, false);
        assert_eq!(out[5], b'r');
        assert_eq!(&out[30..38], &[0xFF; 8]);
        assert_eq!(out[38], 0);
    }

    #[test]
    fn xlogdata_exact_bytes() {
        let mut raw = vec![b'w'];
        raw.extend_from_slice(&[0, 0, 0, 0, 0x16, 0xB3, 0x74, 0xD8]);
        raw.extend_from_slice(&[0, 0, 0, 1, 0, 0, 0, 0x10]);
        raw.extend_from_slice(&(-5i64).to_be_bytes());
        raw.extend_from_slice(br#"{"action":"B"}"#);
        let ev = parse_copy_data(Bytes::from(raw)).unwrap();
        assert_eq!(
            ev,
            ReplEvent::XLogData {
                wal_start: Lsn(0x16B3_74D8),
                wal_end: Lsn(0x1_0000_0010),
                server_time_micros: -5,
                data: Bytes::from_static(br#"{"action":"B"}"#),
            }
        );
        if let ReplEvent::XLogData { wal_start, .. } = ev {
            assert_eq!(wal_start.to_string(), "0/16B374D8");
        }
        // Header only: empty data is valid.
        let ev = parse_copy_data(Bytes::from(vec![b'w'; 25])).unwrap();
        assert!(matches!(ev, ReplEvent::XLogData { ref data, .. } if data.is_empty()));
    }

    #[test]
    fn keepalive_exact_bytes() {
        let mut raw = vec![b'k'];
        raw.extend_from_slice(&[0, 0, 0, 2, 0, 0, 1, 0]);
        raw.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 42]);
        raw.push(1);
        let ev = parse_copy_data(Bytes::from(raw.clone())).unwrap();
        assert_eq!(
            ev,
            ReplEvent::Keepalive {
                wal_end: Lsn(0x2_0000_0100),
                server_time_micros: 42,
                reply_requested: true,
            }
        );
        raw[17] = 0;
        let ev = parse_copy_data(Bytes::from(raw)).unwrap();
        assert!(matches!(
            ev,
            ReplEvent::Keepalive {
                reply_requested: false,
                ..
            }
        ));
    }

    #[test]
    fn truncated_and_unknown_are_errors() {
        for n in 0..25 {
            let mut raw = vec![0u8; n];
            if n > 0 {
                raw[0] = b'w';
            }
            let err = parse_copy_data(Bytes::from(raw)).unwrap_err();
            assert!(matches!(err, ReplError::Protocol(_)), "{n}: {err}");
        }
        for n in 1..18 {
            let mut raw = vec![0u8; n];
            raw[0] = b'k';
            let err = parse_copy_data(Bytes::from(raw)).unwrap_err();
            assert!(
                err.to_string().contains("truncated primary keepalive"),
                "{err}"
            );
        }
        let err = parse_copy_data(Bytes::from_static(b"x123")).unwrap_err();
        assert!(err.to_string().contains("unknown replication message type"));
    }

    #[test]
    fn pg_clock_is_after_2020() {
        // 2020-01-01 is 631_152_000 s after the Postgres epoch.
        assert!(pg_now_micros() > 631_152_000 * 1_000_000);
    }

    proptest! {
        #[test]
        fn parser_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_copy_data(Bytes::from(raw));
        }

        #[test]
        fn xlogdata_roundtrip(start: u64, end: u64, t: i64, data in proptest::collection::vec(any::<u8>(), 0..32)) {
            let mut raw = vec![b'w'];
            raw.extend_from_slice(&start.to_be_bytes());
            raw.extend_from_slice(&end.to_be_bytes());
            raw.extend_from_slice(&t.to_be_bytes());
            raw.extend_from_slice(&data);
            let ev = parse_copy_data(Bytes::from(raw)).unwrap();
            prop_assert_eq!(ev, ReplEvent::XLogData {
                wal_start: Lsn(start), wal_end: Lsn(end), server_time_micros: t, data: Bytes::from(data),
            });
        }
    }
}
