//! Server frames on the wire (RFC 6455 §5.2): a frame is encoded once, header and
//! payload in one buffer, and the same bytes go to every socket it is for. A server's
//! frames are never masked, so they do not differ between sockets.

use bytes::{BufMut, Bytes, BytesMut};
use walcast_protocol::{Frame, Vsn, WireMessage};

use crate::telemetry;

/// One frame for the socket, encoded for the wire (header and payload: see
/// [`frame`]). Cloning it shares the bytes: a change's frame is encoded
/// once and the same bytes are queued on every socket it goes to.
#[derive(Clone, Debug)]
pub(crate) struct Out(Bytes);

impl Out {
    /// A text frame.
    pub(crate) fn text(t: &str) -> Out {
        Out(frame(OP_TEXT, t.as_bytes()))
    }

    /// A binary frame.
    pub(crate) fn binary(b: &[u8]) -> Out {
        Out(frame(OP_BINARY, b))
    }

    /// Bytes already framed for the wire (tungstenite's replies, our Close).
    pub(crate) fn raw(wire: Bytes) -> Out {
        Out(wire)
    }

    /// Its payload's size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.0.len() - header_len(&self.0)
    }

    /// Its payload.
    #[cfg(test)]
    pub(crate) fn payload(&self) -> &[u8] {
        &self.0[header_len(&self.0)..]
    }

    /// The frame as written.
    pub(crate) fn wire(&self) -> &[u8] {
        &self.0
    }

    pub(crate) fn into_wire(self) -> Bytes {
        self.0
    }

    /// Encode a server frame for a socket of version `vsn`.
    pub(crate) fn frame(f: &Frame, vsn: Vsn) -> Option<Out> {
        match f.encode_server(vsn) {
            Ok(WireMessage::Text(t)) => Some(Out::text(&t)),
            Ok(WireMessage::Binary(b)) => Some(Out::binary(&b)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode server frame");
                telemetry::error("encode");
                None
            }
        }
    }
}

/// The opcode of a text frame.
pub(crate) const OP_TEXT: u8 = 0x1;
/// The opcode of a binary frame.
pub(crate) const OP_BINARY: u8 = 0x2;
/// The opcode of a Close frame.
pub(crate) const OP_CLOSE: u8 = 0x8;

/// The final fragment of a message (every frame we send is a whole message).
const FIN: u8 = 0x80;

/// A Close frame's reason is at most this long: a control frame's payload is at most
/// 125 bytes, two of them the code.
pub(crate) const MAX_CLOSE_REASON: usize = 123;

/// The length of the header for a payload of `len` bytes.
fn header_len_for(len: usize) -> usize {
    match len {
        0..=125 => 2,
        126..=0xFFFF => 4,
        _ => 10,
    }
}

/// One unfragmented, unmasked frame with `opcode` and `payload`.
pub(crate) fn frame(opcode: u8, payload: &[u8]) -> Bytes {
    let len = payload.len();
    let mut b = BytesMut::with_capacity(header_len_for(len) + len);
    b.put_u8(FIN | opcode);
    match len {
        0..=125 => b.put_u8(len as u8),
        126..=0xFFFF => {
            b.put_u8(126);
            b.put_u16(len as u16);
        }
        _ => {
            b.put_u8(127);
            b.put_u64(len as u64);
        }
    }
    b.put_slice(payload);
    b.freeze()
}

/// A Close frame with `code` and `reason`, the reason cut (at a character boundary) to
/// what a control frame can carry.
pub(crate) fn close(code: u16, reason: &str) -> Bytes {
    let mut end = reason.len().min(MAX_CLOSE_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut payload = Vec::with_capacity(2 + end);
    payload.extend_from_slice(&code.to_be_bytes());
    payload.extend_from_slice(&reason.as_bytes()[..end]);
    frame(OP_CLOSE, &payload)
}

/// The header's length of a frame made by [`frame`].
pub(crate) fn header_len(wire: &[u8]) -> usize {
    match wire.get(1).map(|b| b & 0x7F) {
        Some(126) => 4,
        Some(127) => 10,
        _ => 2,
    }
}

/// Whether a frame made by [`frame`] is a Close frame.
pub(crate) fn is_close(wire: &[u8]) -> bool {
    wire.first().is_some_and(|b| b & 0x0F == OP_CLOSE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{Control, Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::FrameHeader;

    /// What tungstenite's own parser reads from our bytes.
    fn parsed(wire: &[u8]) -> (FrameHeader, u64, usize) {
        let mut c = Cursor::new(wire);
        let (h, len) = FrameHeader::parse(&mut c).unwrap().unwrap();
        (h, len, c.position() as usize)
    }

    #[test]
    fn every_length_class_parses_back_with_its_payload() {
        for len in [0, 1, 125, 126, 127, 65_535, 65_536, 300_000] {
            let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            let wire = frame(OP_TEXT, &payload);
            let (h, n, at) = parsed(&wire);
            assert!(h.is_final && h.mask.is_none(), "len {len}");
            assert_eq!(h.opcode, OpCode::Data(Data::Text));
            assert_eq!(n as usize, len);
            assert_eq!(at, header_len(&wire), "len {len}");
            assert_eq!(&wire[at..], &payload[..]);
            assert!(!is_close(&wire));
        }
        let (h, _, _) = parsed(&frame(OP_BINARY, b"x"));
        assert_eq!(h.opcode, OpCode::Data(Data::Binary));
    }

    #[test]
    fn a_close_frame_carries_the_code_and_a_reason_cut_at_a_character() {
        let wire = close(1013, "slow consumer");
        let (h, n, at) = parsed(&wire);
        assert_eq!(h.opcode, OpCode::Control(Control::Close));
        assert!(is_close(&wire));
        assert_eq!(n as usize, 2 + 13);
        assert_eq!(&wire[at..at + 2], &1013u16.to_be_bytes());

        // 61 two-byte characters are 122 bytes; a 62nd would pass 123.
        let long = "é".repeat(100);
        let wire = close(1000, &long);
        let (_, n, at) = parsed(&wire);
        assert_eq!(n, 2 + 122);
        assert!(std::str::from_utf8(&wire[at + 2..]).is_ok());
    }
}
