//! The socket: buffered, cancel-safe reads of backend messages and buffered writes.

use std::time::Duration;

use bytes::BytesMut;
use fallible_iterator::FallibleIterator;
use postgres_protocol::message::backend::{ErrorFields, ErrorResponseBody, Header, Message};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use walcast_pgtls::TlsSettings;

use crate::ReplError;

/// Bytes asked of the kernel per read when the buffer has little room left.
const READ_CHUNK: usize = 256 * 1024;
/// Below this much free capacity we grow the buffer before reading.
const MIN_FREE: usize = 16 * 1024;
/// Largest backend message we accept (Postgres caps a single allocation at 1 GiB).
const MAX_MESSAGE: usize = (1 << 30) + (1 << 20);
/// `CopyBothResponse`, which postgres-protocol's parser does not know.
const COPY_BOTH_RESPONSE_TAG: u8 = b'W';

/// A backend message, or the `CopyBothResponse` that starts streaming.
pub(crate) enum Backend {
    Msg(Message),
    CopyBoth,
}

pub(crate) struct Conn {
    /// Plain TCP or TLS, as negotiated.
    sock: Box<dyn walcast_pgtls::Io>,
    rbuf: BytesMut,
    pub(crate) wbuf: BytesMut,
}

impl Conn {
    /// Connect to `host:port` and negotiate TLS as `tls` says (`name`: the host name its
    /// certificate must be issued for).
    pub(crate) async fn open(
        host: &str,
        port: u16,
        timeout: Option<Duration>,
        name: &str,
        tls: &TlsSettings,
    ) -> Result<Conn, ReplError> {
        let connect = TcpStream::connect((host, port));
        let sock = match timeout {
            Some(t) => tokio::time::timeout(t, connect).await.map_err(|_| {
                ReplError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connecting to {host}:{port} timed out after {t:?}"),
                ))
            })??,
            None => connect.await?,
        };
        sock.set_nodelay(true)?;
        let sock = walcast_pgtls::negotiate(sock, name, tls).await?;
        Ok(Conn {
            sock,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::with_capacity(1024),
        })
    }

    /// Read the next backend message.
    ///
    /// Cancel-safe: bytes are only ever read into the struct-owned buffer and messages are
    /// only removed from it once complete, so dropping this future loses nothing.
    pub(crate) async fn read(&mut self) -> Result<Backend, ReplError> {
        loop {
            if let Some(msg) = parse_backend(&mut self.rbuf)? {
                return Ok(msg);
            }
            if self.rbuf.capacity() - self.rbuf.len() < MIN_FREE {
                self.rbuf.reserve(READ_CHUNK);
            }
            if self.sock.read_buf(&mut self.rbuf).await? == 0 {
                return Err(ReplError::Closed);
            }
        }
    }

    /// Write out everything in `wbuf`. If cancelled, unwritten bytes stay in `wbuf` and go
    /// out with the next flush.
    pub(crate) async fn flush(&mut self) -> Result<(), ReplError> {
        self.sock.write_all_buf(&mut self.wbuf).await?;
        Ok(())
    }

    pub(crate) async fn send_query(&mut self, sql: &str) -> Result<(), ReplError> {
        frontend::query(sql, &mut self.wbuf)
            .map_err(|e| ReplError::Config(format!("cannot send query: {e}")))?;
        self.flush().await
    }

    /// Run a simple query; rows as text (`None` for NULL). A server error is returned
    /// after the server is ready again, so the connection stays usable.
    pub(crate) async fn simple_query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, ReplError> {
        self.send_query(sql).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            match self.read().await? {
                Backend::Msg(Message::DataRow(row)) => {
                    let buf = row.buffer();
                    let mut cols = Vec::new();
                    let mut ranges = row.ranges();
                    while let Some(r) = ranges.next().map_err(protocol)? {
                        cols.push(match r {
                            Some(r) => Some(text(buf.get(r).ok_or_else(|| {
                                ReplError::Protocol("DataRow column out of range".into())
                            })?)?),
                            None => None,
                        });
                    }
                    rows.push(cols);
                }
                Backend::Msg(Message::ErrorResponse(body)) => error = Some(server_error(&body)),
                Backend::Msg(Message::ReadyForQuery(_)) => {
                    return match error {
                        Some(e) => Err(e),
                        None => Ok(rows),
                    }
                }
                Backend::Msg(
                    Message::RowDescription(_)
                    | Message::CommandComplete(_)
                    | Message::EmptyQueryResponse,
                ) => {}
                other => self.ignore_or_reject(other, "a simple query")?,
            }
        }
    }

    /// Log and skip notices and parameter changes; anything else is unexpected.
    pub(crate) fn ignore_or_reject(&self, msg: Backend, during: &str) -> Result<(), ReplError> {
        match msg {
            Backend::Msg(Message::NoticeResponse(body)) => {
                let f = collect_fields(body.fields()).unwrap_or_default();
                tracing::debug!(
                    severity = %f.severity,
                    code = %f.code,
                    message = %f.message,
                    "postgres notice"
                );
                Ok(())
            }
            Backend::Msg(Message::ParameterStatus(body)) => {
                tracing::debug!(
                    name = body.name().unwrap_or("?"),
                    value = body.value().unwrap_or("?"),
                    "postgres parameter status"
                );
                Ok(())
            }
            other => Err(ReplError::Protocol(format!(
                "unexpected {} during {during}",
                describe(&other)
            ))),
        }
    }

    /// Send Terminate (best effort) and close the socket.
    pub(crate) async fn close(mut self) {
        frontend::terminate(&mut self.wbuf);
        let _ = self.flush().await;
        let _ = self.sock.shutdown().await;
    }
}

/// Take one complete backend message off the front of `buf`, if there is one. Reserves
/// room for the rest of a partial message. Never panics on any input.
fn parse_backend(buf: &mut BytesMut) -> Result<Option<Backend>, ReplError> {
    let header = match Header::parse(buf) {
        Ok(Some(h)) => h,
        Ok(None) => return Ok(None),
        Err(e) => return Err(ReplError::Protocol(e.to_string())),
    };
    // Header::parse has checked len >= 4.
    let total = header.len() as usize + 1;
    if total > MAX_MESSAGE {
        return Err(ReplError::Protocol(format!(
            "backend message {:?} claims {total} bytes",
            header.tag() as char
        )));
    }
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    if header.tag() == COPY_BOTH_RESPONSE_TAG {
        let _ = buf.split_to(total);
        return Ok(Some(Backend::CopyBoth));
    }
    match Message::parse(buf) {
        Ok(Some(m)) => Ok(Some(Backend::Msg(m))),
        // Cannot happen: the whole message is buffered.
        Ok(None) => Err(ReplError::Protocol("incomplete backend message".into())),
        Err(e) => Err(ReplError::Protocol(format!(
            "bad backend message {:?}: {e}",
            header.tag() as char
        ))),
    }
}

/// A short name for a message, for error texts.
pub(crate) fn describe(msg: &Backend) -> &'static str {
    match msg {
        Backend::CopyBoth => "CopyBothResponse",
        Backend::Msg(m) => match m {
            Message::AuthenticationOk => "AuthenticationOk",
            Message::BackendKeyData(_) => "BackendKeyData",
            Message::CommandComplete(_) => "CommandComplete",
            Message::CopyData(_) => "CopyData",
            Message::CopyDone => "CopyDone",
            Message::CopyInResponse(_) => "CopyInResponse",
            Message::CopyOutResponse(_) => "CopyOutResponse",
            Message::DataRow(_) => "DataRow",
            Message::EmptyQueryResponse => "EmptyQueryResponse",
            Message::ErrorResponse(_) => "ErrorResponse",
            Message::NoticeResponse(_) => "NoticeResponse",
            Message::ParameterStatus(_) => "ParameterStatus",
            Message::ReadyForQuery(_) => "ReadyForQuery",
            Message::RowDescription(_) => "RowDescription",
            _ => "message",
        },
    }
}

/// Turn an `ErrorResponse` into [`ReplError::Server`].
pub(crate) fn server_error(body: &ErrorResponseBody) -> ReplError {
    match collect_fields(body.fields()) {
        Ok(f) => ReplError::Server {
            code: f.code,
            message: f.message,
            detail: f.detail,
        },
        Err(e) => ReplError::Protocol(format!("malformed ErrorResponse: {e}")),
    }
}

#[derive(Default)]
struct Fields {
    severity: String,
    code: String,
    message: String,
    detail: Option<String>,
}

fn collect_fields(mut fields: ErrorFields<'_>) -> std::io::Result<Fields> {
    let mut out = Fields::default();
    while let Some(f) = fields.next()? {
        let value = String::from_utf8_lossy(f.value_bytes()).into_owned();
        match f.type_() {
            b'S' => out.severity = value,
            b'C' => out.code = value,
            b'M' => out.message = value,
            b'D' => out.detail = Some(value),
            _ => {}
        }
    }
    Ok(out)
}

fn text(b: &[u8]) -> Result<String, ReplError> {
    String::from_utf8(b.to_vec())
        .map_err(|_| ReplError::Protocol("column value is not valid UTF-8".into()))
}

fn protocol(e: std::io::Error) -> ReplError {
    ReplError::Protocol(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn parses_many_messages_from_one_buffer() {
        let mut raw = frame(b'W', &[0, 0, 0]);
        raw.extend(frame(b'd', b"k0123456789abcdef\x01"));
        raw.extend(frame(b'c', b""));
        raw.extend(frame(b'Z', b"I"));
        let split = raw.len() - 3;
        let mut buf = BytesMut::from(&raw[..split]);
        assert!(matches!(
            parse_backend(&mut buf),
            Ok(Some(Backend::CopyBoth))
        ));
        assert!(matches!(
            parse_backend(&mut buf),
            Ok(Some(Backend::Msg(Message::CopyData(_))))
        ));
        assert!(matches!(
            parse_backend(&mut buf),
            Ok(Some(Backend::Msg(Message::CopyDone)))
        ));
        // The ReadyForQuery is cut short: nothing is consumed until it is complete.
        assert!(matches!(parse_backend(&mut buf), Ok(None)));
        assert_eq!(buf.len(), 3);
        buf.extend_from_slice(&raw[split..]);
        assert!(matches!(
            parse_backend(&mut buf),
            Ok(Some(Backend::Msg(Message::ReadyForQuery(_))))
        ));
        assert!(buf.is_empty());
    }

    #[test]
    fn bad_lengths_are_protocol_errors() {
        let mut buf = BytesMut::from(&[b'd', 0, 0, 0, 3][..]);
        assert!(matches!(
            parse_backend(&mut buf),
            Err(ReplError::Protocol(_))
        ));
        let mut buf = BytesMut::from(&[b'd', 0xFF, 0xFF, 0xFF, 0xFF][..]);
        assert!(matches!(
            parse_backend(&mut buf),
            Err(ReplError::Protocol(_))
        ));
        let mut buf = BytesMut::from(&frame(b'?', b"x")[..]);
        assert!(matches!(
            parse_backend(&mut buf),
            Err(ReplError::Protocol(_))
        ));
    }

    proptest! {
        #[test]
        fn framing_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..256)) {
            let mut buf = BytesMut::from(&raw[..]);
            for _ in 0..300 {
                match parse_backend(&mut buf) {
                    Ok(Some(Backend::Msg(Message::ErrorResponse(body)))) => {
                        let _ = server_error(&body);
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
        }
    }
}
