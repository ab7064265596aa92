//! A connection's writer task: it takes the connection's queued frames, already encoded
//! (see [`super::wire`]), and writes as many as are ready with one vectored write. It
//! keeps no buffer of its own: a frame stays the one shared copy made when it was
//! encoded until the kernel has taken it, so a socket that has nothing to write holds
//! nothing, whatever it wrote before.

use std::io::IoSlice;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, Bytes};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::{wire, Ending, Link, Out};
use crate::telemetry;

/// The socket's writing half.
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;

/// At most this many frames per write (the kernel takes up to 1,024 pieces; tokio hands
/// it 64 at a time).
const MAX_BATCH: usize = 64;

/// How long the closing writes may take.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Write queued frames until the connection is killed, then close it.
pub(crate) async fn write_loop(mut w: WriteHalf, mut rx: mpsc::Receiver<Out>, link: Arc<dyn Link>) {
    // A batch the kill interrupted: a frame may be half written.
    let mut unfinished = Frames::default();
    // Looked up once, not at every write.
    let frames_out = metrics::counter!(telemetry::FRAMES_OUT);
    // One wait for the kill for the whole loop, polled only when there is nothing to
    // write or a write has to wait: made and dropped twice per frame, it was a twentieth
    // of the front's CPU when each socket had one frame at a time to write.
    let killed = link.killed().cancelled();
    tokio::pin!(killed);
    loop {
        let first = match rx.try_recv() {
            Ok(o) => o,
            Err(mpsc::error::TryRecvError::Disconnected) => break,
            Err(mpsc::error::TryRecvError::Empty) => {
                // The queue first: woken for a frame, the kill's wait is not polled. A
                // kill that comes with it is seen below, before the write.
                let m = tokio::select! {
                    biased;
                    m = rx.recv() => m,
                    _ = &mut killed => break,
                };
                let Some(o) = m else { break };
                o
            }
        };
        let mut batch = Frames::new(first);
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(o) => batch.push(o),
                Err(_) => break,
            }
        }
        if link.killed().is_cancelled() {
            // Nothing of it written: `close` writes it or drops it, as it would have
            // had it stayed queued.
            unfinished = batch;
            break;
        }
        let n = batch.len() as u64;
        let r = tokio::select! {
            biased;
            r = batch.write_to(&mut w) => Some(r),
            _ = &mut killed => None,
        };
        match r {
            Some(Ok(())) => frames_out.increment(n),
            Some(Err(_)) => {
                link.killed().cancel();
                return;
            }
            None => {
                unfinished = batch;
                break;
            }
        }
    }
    let closing = close(&mut w, &mut rx, link.ending(), unfinished);
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
}

/// The closing writes, after the rest of a frame the kill interrupted (the client
/// would read what follows as part of it). After the client's Close: what was queued
/// before the answer to it, and the answer (the read side's tungstenite made it).
/// Otherwise what is queued (unless the client was too slow for it) and our Close with
/// the recorded code. Then the socket's writing side is shut.
async fn close(
    w: &mut WriteHalf,
    rx: &mut mpsc::Receiver<Out>,
    ending: Ending,
    mut last: Frames,
) -> std::io::Result<()> {
    match ending {
        Ending::Answered => {
            while let Ok(o) = rx.try_recv() {
                let answer = wire::is_close(o.wire());
                last.push(o);
                if answer {
                    break;
                }
            }
        }
        Ending::Close {
            code,
            reason,
            flush,
        } => {
            if flush {
                while let Ok(o) = rx.try_recv() {
                    last.push(o);
                }
            } else {
                last.keep_started();
            }
            last.push(Out::raw(wire::close(code, &reason)));
        }
    }
    last.write_to(w).await?;
    w.shutdown().await
}

/// Frames to write, in order, as one [`Buf`] whose pieces are the frames themselves.
#[derive(Default)]
struct Frames {
    list: Vec<Bytes>,
    /// The first frame not wholly written.
    at: usize,
    /// How much of it is written.
    off: usize,
}

impl Frames {
    fn new(first: Out) -> Frames {
        let mut f = Frames {
            list: Vec::with_capacity(4),
            ..Frames::default()
        };
        f.push(first);
        f
    }

    fn push(&mut self, o: Out) {
        let wire = o.into_wire();
        if !wire.is_empty() {
            self.list.push(wire);
        }
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    /// Write it all; cancel-safe: what is written is advanced over, nothing else. The
    /// last frame left goes alone with a plain write (a `send`, cheaper in the kernel
    /// than a `writev`): a socket with one frame at a time to write does only that.
    async fn write_to(&mut self, w: &mut WriteHalf) -> std::io::Result<()> {
        while self.has_remaining() {
            let n = if self.at + 1 >= self.list.len() {
                w.write(self.chunk()).await?
            } else {
                // The pieces are gathered in each poll, on the stack: held across an
                // await they would add a kilobyte to every idle socket's task.
                std::future::poll_fn(|cx| {
                    let mut slices = [IoSlice::new(&[]); MAX_BATCH];
                    let k = self.chunks_vectored(&mut slices);
                    Pin::new(&mut *w).poll_write_vectored(cx, &slices[..k])
                })
                .await?
            };
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            self.advance(n);
        }
        Ok(())
    }

    /// Drop what is not written yet but the rest of a frame already begun.
    fn keep_started(&mut self) {
        let keep = if self.off > 0 { self.at + 1 } else { self.at };
        self.list.truncate(keep);
    }
}

impl Buf for Frames {
    fn remaining(&self) -> usize {
        self.list[self.at..].iter().map(Bytes::len).sum::<usize>() - self.off
    }

    fn chunk(&self) -> &[u8] {
        self.list.get(self.at).map_or(&[], |b| &b[self.off..])
    }

    fn chunks_vectored<'a>(&'a self, dst: &mut [IoSlice<'a>]) -> usize {
        let mut n = 0;
        for (i, b) in self.list[self.at..].iter().enumerate() {
            if n == dst.len() {
                break;
            }
            let from = if i == 0 { self.off } else { 0 };
            if b.len() > from {
                dst[n] = IoSlice::new(&b[from..]);
                n += 1;
            }
        }
        n
    }

    fn advance(&mut self, mut cnt: usize) {
        while cnt > 0 {
            let Some(b) = self.list.get(self.at) else {
                return;
            };
            let left = b.len() - self.off;
            if cnt < left {
                self.off += cnt;
                return;
            }
            cnt -= left;
            self.at += 1;
            self.off = 0;
        }
        // Skip empty frames so `chunk` is empty only at the end.
        while self.list.get(self.at).is_some_and(Bytes::is_empty) {
            self.at += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(parts: &[&'static [u8]]) -> Frames {
        Frames {
            list: parts.iter().map(|p| Bytes::from_static(p)).collect(),
            ..Frames::default()
        }
    }

    #[test]
    fn partial_writes_resume_where_they_stopped() {
        let mut f = frames(&[b"abc", b"", b"defg", b"h"]);
        assert_eq!(f.remaining(), 8);
        let mut out = Vec::new();
        for step in [2, 1, 3, 2] {
            let mut slices = [IoSlice::new(&[]); 8];
            let n = f.chunks_vectored(&mut slices);
            let got: Vec<u8> = slices[..n].iter().flat_map(|s| s.to_vec()).collect();
            assert_eq!(got.len(), f.remaining());
            out.extend_from_slice(&got[..step]);
            f.advance(step);
        }
        assert_eq!(out, b"abcdefgh");
        assert_eq!(f.remaining(), 0);
        assert!(f.chunk().is_empty());
    }

    #[test]
    fn a_slow_consumer_gets_the_rest_of_a_begun_frame_only() {
        let mut f = frames(&[b"abc", b"def", b"ghi"]);
        f.advance(4);
        f.keep_started();
        assert_eq!(f.chunk(), b"ef");
        assert_eq!(f.remaining(), 2);
        let mut f = frames(&[b"abc", b"def"]);
        f.advance(3);
        f.keep_started();
        assert_eq!(f.remaining(), 0);
    }

    #[test]
    fn vectored_pieces_stop_at_the_slots_given() {
        let f = frames(&[b"a", b"b", b"c"]);
        let mut slices = [IoSlice::new(&[]); 2];
        assert_eq!(f.chunks_vectored(&mut slices), 2);
        assert_eq!(&*slices[1], b"b");
    }

    #[tokio::test]
    async fn a_slow_reader_gets_every_frame_whole_and_in_order() {
        let (client, server) = tokio::io::duplex(7);
        let mut w: WriteHalf = Box::new(server);
        let sent: Vec<Bytes> = (0..50)
            .map(|i| wire::frame(wire::OP_TEXT, format!("frame {i}").as_bytes()))
            .collect();
        let expect: Vec<u8> = sent.iter().flat_map(|b| b.to_vec()).collect();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut c = client;
            tokio::io::AsyncReadExt::read_to_end(&mut c, &mut got)
                .await
                .map(|_| got)
        });
        let mut batch = Frames::default();
        for b in sent {
            batch.list.push(b);
        }
        batch.write_to(&mut w).await.unwrap();
        w.shutdown().await.unwrap();
        drop(w);
        assert_eq!(reader.await.unwrap().unwrap(), expect);
    }
}
