//! The connections not yet upgraded (nor streaming an admitted response): at most
//! `max` of them, and `per_peer` from one address. A new one past either cap closes the
//! oldest one in its way rather than being refused: an attacker holding thousands of
//! stalled connections then churns its own, and a fresh health probe, even from the
//! attacker's address, is the newest and is served before it could be closed.
//!
//! "Oldest" is by when a connection last moved: accepted, a request started, a response
//! ended; so a keep-alive client that keeps asking is not the next to go. A connection
//! still waiting for a head goes before one whose request is being answered (a
//! handshake in flight during a reconnect storm is not cut for a slow-loris).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio_util::sync::CancellationToken;

use crate::telemetry;

/// Who a connection counts against for the per-peer cap: its IPv4 address, or the /64
/// of an IPv6 one (a host routinely holds a whole /64).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PeerKey(IpAddr);

impl PeerKey {
    pub(crate) fn of(ip: IpAddr) -> PeerKey {
        match ip {
            IpAddr::V4(v4) => PeerKey(IpAddr::V4(v4)),
            IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => PeerKey(IpAddr::V4(v4)),
                None => {
                    let s = v6.segments();
                    let net = Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0);
                    PeerKey(IpAddr::V6(net))
                }
            },
        }
    }
}

/// Why a pending connection was closed to make room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// `HTTP_MAX_PENDING` reached.
    Cap,
    /// `HTTP_MAX_PENDING_PER_PEER` reached for its address.
    Peer,
    /// The process ran out of file descriptors.
    Fds,
}

impl Eviction {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Eviction::Cap => "cap",
            Eviction::Peer => "peer",
            Eviction::Fds => "fds",
        }
    }
}

struct Entry {
    peer: PeerKey,
    evict: CancellationToken,
    /// Its request is being answered.
    busy: bool,
}

#[derive(Default)]
struct State {
    next: u64,
    by_age: BTreeMap<u64, Entry>,
    by_peer: HashMap<PeerKey, BTreeSet<u64>>,
}

impl State {
    fn insert(&mut self, peer: PeerKey, evict: CancellationToken, busy: bool) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.by_age.insert(seq, Entry { peer, evict, busy });
        self.by_peer.entry(peer).or_default().insert(seq);
        seq
    }

    fn remove(&mut self, seq: u64) -> Option<Entry> {
        let e = self.by_age.remove(&seq)?;
        if let Some(set) = self.by_peer.get_mut(&e.peer) {
            set.remove(&seq);
            if set.is_empty() {
                self.by_peer.remove(&e.peer);
            }
        }
        Some(e)
    }

    /// The oldest connection (of `peer`, if given) still waiting for a head, else the
    /// oldest being answered.
    fn oldest(&self, peer: Option<PeerKey>) -> Option<u64> {
        let idle = |seq: &&u64| self.by_age.get(*seq).is_some_and(|e| !e.busy);
        match peer {
            Some(p) => {
                let set = self.by_peer.get(&p)?;
                set.iter().find(idle).or_else(|| set.first()).copied()
            }
            None => {
                let mut seqs = self.by_age.keys();
                seqs.clone().find(idle).or_else(|| seqs.next()).copied()
            }
        }
    }

    /// Close the [`State::oldest`] connection.
    fn evict_oldest(&mut self, peer: Option<PeerKey>, why: Eviction) -> bool {
        let Some(e) = self.oldest(peer).and_then(|seq| self.remove(seq)) else {
            return false;
        };
        e.evict.cancel();
        telemetry::http_evicted(why.label());
        true
    }

    fn peer_count(&self, peer: PeerKey) -> usize {
        self.by_peer.get(&peer).map_or(0, BTreeSet::len)
    }
}

/// The registry of pending connections.
pub(crate) struct Pending {
    max: usize,
    per_peer: usize,
    state: Mutex<State>,
}

impl Pending {
    /// At most `max` pending connections, `per_peer` from one address (0: no per-peer cap).
    pub(crate) fn new(max: usize, per_peer: usize) -> Arc<Pending> {
        Arc::new(Pending {
            max: max.max(1),
            per_peer: if per_peer == 0 { usize::MAX } else { per_peer },
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new pending connection from `peer`, the oldest ones in its way closed; `evict`
    /// is cancelled if it is closed in turn.
    pub(crate) fn admit(self: &Arc<Self>, peer: PeerKey, evict: CancellationToken) -> Slot {
        let seq = self.insert(peer, evict.clone(), false);
        Slot {
            pending: self.clone(),
            peer,
            evict,
            seq: Some(seq),
        }
    }

    fn insert(&self, peer: PeerKey, evict: CancellationToken, busy: bool) -> u64 {
        let mut s = self.lock();
        while s.peer_count(peer) >= self.per_peer && s.evict_oldest(Some(peer), Eviction::Peer) {}
        while s.by_age.len() >= self.max && s.evict_oldest(None, Eviction::Cap) {}
        let seq = s.insert(peer, evict, busy);
        telemetry::http_pending(s.by_age.len());
        seq
    }

    fn remove(&self, seq: u64) {
        let mut s = self.lock();
        s.remove(seq);
        telemetry::http_pending(s.by_age.len());
    }

    /// Close the oldest pending connection to free its file descriptor; false if none.
    pub(crate) fn evict_for_fds(&self) -> bool {
        let mut s = self.lock();
        let evicted = s.evict_oldest(None, Eviction::Fds);
        telemetry::http_pending(s.by_age.len());
        evicted
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().by_age.len()
    }
}

/// A connection's place among the pending ones (none while it streams an admitted
/// response); it leaves when dropped.
pub(crate) struct Slot {
    pending: Arc<Pending>,
    peer: PeerKey,
    evict: CancellationToken,
    seq: Option<u64>,
}

impl Slot {
    /// Moved (a request started, `busy`; or its response ended): the newest again, and
    /// back among the pending if it had left.
    pub(crate) fn renew(&mut self, busy: bool) {
        if let Some(seq) = self.seq.take() {
            self.pending.remove(seq);
        }
        if !self.evict.is_cancelled() {
            let seq = self.pending.insert(self.peer, self.evict.clone(), busy);
            self.seq = Some(seq);
        }
    }

    /// No longer pending: its response was admitted (a stream its handler let in).
    pub(crate) fn leave(&mut self) {
        if let Some(seq) = self.seq.take() {
            self.pending.remove(seq);
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> PeerKey {
        PeerKey::of(s.parse().unwrap())
    }

    fn tokens(n: usize) -> Vec<CancellationToken> {
        (0..n).map(|_| CancellationToken::new()).collect()
    }

    fn closed(t: &[CancellationToken]) -> Vec<bool> {
        t.iter().map(CancellationToken::is_cancelled).collect()
    }

    #[test]
    fn past_the_cap_the_oldest_goes_not_the_newest() {
        let p = Pending::new(3, 0);
        let t = tokens(5);
        let slots: Vec<Slot> = t
            .iter()
            .enumerate()
            .map(|(i, t)| p.admit(ip(&format!("10.0.0.{i}")), t.clone()))
            .collect();
        assert_eq!(closed(&t), [true, true, false, false, false]);
        assert_eq!(p.len(), 3);
        drop(slots);
        assert_eq!(p.len(), 0);
    }

    #[test]
    fn one_address_evicts_only_its_own() {
        let p = Pending::new(100, 2);
        let other = CancellationToken::new();
        let _o = p.admit(ip("192.0.2.9"), other.clone());
        let mine = tokens(4);
        let _slots: Vec<Slot> = mine
            .iter()
            .map(|t| p.admit(ip("198.51.100.1"), t.clone()))
            .collect();
        assert!(!other.is_cancelled());
        assert_eq!(closed(&mine), [true, true, false, false]);
    }

    #[test]
    fn a_renewed_connection_is_the_newest() {
        let p = Pending::new(2, 0);
        let t = tokens(3);
        let mut sa = p.admit(ip("10.0.0.1"), t[0].clone());
        let _sb = p.admit(ip("10.0.0.2"), t[1].clone());
        sa.renew(false);
        let _sc = p.admit(ip("10.0.0.3"), t[2].clone());
        assert_eq!(closed(&t), [false, true, false]);
        // Left (an admitted stream): never evicted, not counted.
        sa.leave();
        assert_eq!(p.len(), 1);
    }

    #[test]
    fn a_connection_waiting_for_its_head_goes_before_one_being_answered() {
        let p = Pending::new(2, 0);
        let t = tokens(3);
        let mut busy = p.admit(ip("10.0.0.1"), t[0].clone());
        busy.renew(true);
        // The waiting one is newer than the busy one, and goes first all the same.
        let _waiting = p.admit(ip("10.0.0.1"), t[1].clone());
        let _new = p.admit(ip("10.0.0.1"), t[2].clone());
        assert_eq!(closed(&t), [false, true, false]);
    }

    #[test]
    fn ipv6_peers_are_grouped_by_their_64() {
        assert_eq!(ip("2001:db8:1:2::1"), ip("2001:db8:1:2:ffff::9"));
        assert_ne!(ip("2001:db8:1:2::1"), ip("2001:db8:1:3::1"));
        assert_eq!(ip("::ffff:192.0.2.1"), ip("192.0.2.1"));
    }
}
