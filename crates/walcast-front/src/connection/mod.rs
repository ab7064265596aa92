//! A WebSocket connection beneath its channels: how every frame reaches its client, and
//! the front's count of what is open.
//!
//! * [`socket`]: the HTTP upgrade and the socket split in two: tungstenite reads and
//!   checks the client's frames; our writer (`socket::writer`) writes frames encoded
//!   once for every socket they go to (`socket::wire`).
//! * [`queue`]: a connection's bounded queue ([`ConnHandle`]) to its writer, and how the
//!   connection ends (close codes, the slow consumer).
//! * [`gate`]: a joined channel's gate into that queue ([`ChanOut`]): fan-out held while
//!   its join is in flight, replayed broadcasts not sent twice.
//! * [`topics`]: this front's channels by topic ([`Topics`], [`TopicKey`]), for
//!   broadcast and presence.
//! * [`open`]: the open connections ([`Connections`]): their handles, the counts of
//!   connections, channels and SSE streams, the `max_connections` slots, draining.
//!
//! A connection's read loop, which hands each client frame to its channels, is the
//! `channel` module's (`channel::websocket`).

pub(crate) mod gate;
pub(crate) mod open;
pub(crate) mod queue;
pub(crate) mod socket;
pub(crate) mod topics;

pub(crate) use gate::ChanOut;
pub(crate) use open::Connections;
pub(crate) use queue::ConnHandle;
pub use queue::{CLOSE_GOING_AWAY, CLOSE_SLOW_CONSUMER, CLOSE_TOO_BIG, REASON_SLOW_CONSUMER};
pub(crate) use socket::Out;
pub use socket::SOCKET_READ_BUFFER;
pub use topics::TopicKey;
pub(crate) use topics::Topics;
