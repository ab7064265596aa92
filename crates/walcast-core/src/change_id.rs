//! The identity of one message of a change stream (README "Change streams"): the change's
//! project, the commit LSN of its transaction, its place in the transaction (`seq`) and
//! its part (`part`, always 0 today: the stream's copy carries no audience to split).
//!
//! Two forms, both stable across every replay of the same WAL:
//! - [`ChangeId::msg_id`], JetStream's `Nats-Msg-Id`: `<project>:<commit_lsn>:<seq>:<part>`
//!   (`shop:16/B374D848:3:0`), which the stream's duplicate window de-duplicates by;
//! - [`ChangeId::uuid_bytes`], the `Walcast-Event-Id` an inbox records: the 16 bytes
//!   `commit_lsn` (8, big-endian) · `seq` (4) · `part` (4). Exact, not a hash: two
//!   changes of one source never share it. It does not hold the project (LSNs of two
//!   sources' databases may coincide), so an inbox records it per project.

use std::fmt;

use crate::Lsn;

/// See the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChangeId {
    pub project: String,
    pub commit_lsn: Lsn,
    pub seq: u32,
    pub part: u32,
}

impl ChangeId {
    /// `Nats-Msg-Id`: `<project>:<commit_lsn>:<seq>:<part>`.
    pub fn msg_id(&self) -> String {
        self.to_string()
    }

    /// The 16 bytes of the event id (see the module docs).
    pub fn uuid_bytes(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.commit_lsn.0.to_be_bytes());
        out[8..12].copy_from_slice(&self.seq.to_be_bytes());
        out[12..].copy_from_slice(&self.part.to_be_bytes());
        out
    }

    /// The event id as a UUID's text (`xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`).
    pub fn uuid(&self) -> String {
        let mut s = String::with_capacity(36);
        for (i, b) in self.uuid_bytes().iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                s.push('-');
            }
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    /// Read a `Nats-Msg-Id` made by [`ChangeId::msg_id`] (a project may hold `:`: the
    /// last three fields are the position).
    pub fn parse(text: &str) -> Option<ChangeId> {
        let mut it = text.rsplitn(4, ':');
        let part = it.next()?.parse().ok()?;
        let seq = it.next()?.parse().ok()?;
        let commit_lsn = it.next()?.parse().ok()?;
        let project = it.next()?.to_string();
        Some(ChangeId {
            project,
            commit_lsn,
            seq,
            part,
        })
    }
}

impl fmt::Display for ChangeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.project, self.commit_lsn, self.seq, self.part
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_exact() {
        let id = ChangeId {
            project: "a:b".into(),
            commit_lsn: Lsn(0x16_B374_D848),
            seq: 3,
            part: 0,
        };
        assert_eq!(id.msg_id(), "a:b:16/B374D848:3:0");
        assert_eq!(ChangeId::parse(&id.msg_id()), Some(id.clone()));
        assert_eq!(id.uuid(), "00000016-b374-d848-0000-000300000000");
        let next = ChangeId {
            seq: 4,
            ..id.clone()
        };
        assert_ne!(next.uuid_bytes(), id.uuid_bytes());
        for bad in ["", "p:1/2:x:0", "p:zz:1:0", "1/2:3:0"] {
            assert_eq!(ChangeId::parse(bad), None, "{bad}");
        }
    }
}
