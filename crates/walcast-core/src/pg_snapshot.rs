//! Postgres snapshots (`pg_current_snapshot()`, text `xmin:xmax:xip,…`) and the one
//! question asked of them: was a transaction's work visible in it?
//!
//! A snapshot's values are `xid8`: 64-bit, epoch-qualified transaction ids that never
//! wrap. A change event carries the 32-bit `xid` wal2json prints (the low 32 bits of the
//! transaction's `xid8`). To compare them consistently, the 32-bit id is widened to the
//! 64-bit id nearest to the snapshot's `xmax` with the same low 32 bits
//! ([`widen`]): Postgres keeps every live transaction id within 2^31 of the newest
//! (wraparound protection), so a transaction that can still be compared with a recent
//! snapshot is within 2^31 of its `xmax` and the widening is exact. Ids below 3
//! (invalid, bootstrap, frozen) are not transactions that write rows: [`PgSnapshot::visible`]
//! does not judge them (`None`).
//!
//! Visibility follows `pg_visible_in_snapshot`: an id below `xmin` is visible (finished
//! before the snapshot), one at or above `xmax` is not (not yet started), one in
//! between is visible unless it is listed in `xip` (in progress).

use std::fmt;

/// A parsed `pg_snapshot`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgSnapshot {
    pub xmin: u64,
    pub xmax: u64,
    /// Transactions in progress, sorted.
    pub xip: Vec<u64>,
}

/// A `pg_snapshot` text that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a pg_snapshot: {0:?}")]
pub struct ParseSnapshotError(pub String);

/// Most in-progress ids a parsed snapshot may list (Postgres lists at most one per
/// backend and prepared transaction; this only bounds hostile text).
pub const MAX_XIP: usize = 1 << 20;

const HALF: u64 = 1 << 31;
const SPAN: u64 = 1 << 32;

/// The 64-bit id with low 32 bits `xid` nearest to `reference` (see the module docs).
pub fn widen(xid: u32, reference: u64) -> u64 {
    let candidate = (reference & !(SPAN - 1)) | u64::from(xid);
    if candidate > reference.saturating_add(HALF) && candidate >= SPAN {
        candidate - SPAN
    } else if candidate.saturating_add(HALF) < reference {
        candidate.saturating_add(SPAN)
    } else {
        candidate
    }
}

impl PgSnapshot {
    /// Parse `xmin:xmax:xip,…` (the `xip` list may be empty).
    pub fn parse(text: &str) -> Result<PgSnapshot, ParseSnapshotError> {
        let bad = || ParseSnapshotError(text.chars().take(64).collect());
        let mut parts = text.trim().splitn(3, ':');
        let (Some(a), Some(b), Some(c)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let xmin: u64 = a.parse().map_err(|_| bad())?;
        let xmax: u64 = b.parse().map_err(|_| bad())?;
        let mut xip = Vec::new();
        for x in c.split(',').filter(|x| !x.is_empty()) {
            let x: u64 = x.parse().map_err(|_| bad())?;
            if xip.len() >= MAX_XIP || x < xmin || x >= xmax {
                return Err(bad());
            }
            xip.push(x);
        }
        if xmin > xmax {
            return Err(bad());
        }
        xip.sort_unstable();
        xip.dedup();
        Ok(PgSnapshot { xmin, xmax, xip })
    }

    /// Whether the 64-bit transaction `xid8` was visible (committed) in the snapshot.
    pub fn visible8(&self, xid8: u64) -> bool {
        if xid8 < self.xmin {
            true
        } else if xid8 >= self.xmax {
            false
        } else {
            self.xip.binary_search(&xid8).is_err()
        }
    }

    /// Whether the 32-bit transaction `xid` (a change event's) was visible in the
    /// snapshot; `None` for ids that are no writing transaction's (below 3).
    pub fn visible(&self, xid: u32) -> Option<bool> {
        (xid >= 3).then(|| self.visible8(widen(xid, self.xmax)))
    }
}

/// Where a read of rows stood in the change stream: its snapshot, and the WAL insert
/// position read after it (every transaction visible in the snapshot committed at or
/// before it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cut {
    pub snapshot: PgSnapshot,
    pub lsn: crate::Lsn,
}

impl Cut {
    /// Whether a change committed at `commit_lsn` by `xid` is news to a reader of the
    /// rows: committed after the cut, or not visible in its snapshot. A change without
    /// a judgeable `xid` at or before the cut is delivered (a possible duplicate, never
    /// a loss).
    pub fn delivers(&self, commit_lsn: crate::Lsn, xid: Option<u32>) -> bool {
        if commit_lsn > self.lsn {
            return true;
        }
        match xid.and_then(|x| self.snapshot.visible(x)) {
            Some(visible) => !visible,
            None => true,
        }
    }
}

impl fmt::Display for PgSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:", self.xmin, self.xmax)?;
        for (i, x) in self.xip.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_and_prints() {
        let s = PgSnapshot::parse("10:20:12,15").unwrap();
        assert_eq!((s.xmin, s.xmax, s.xip.clone()), (10, 20, vec![12, 15]));
        assert_eq!(s.to_string(), "10:20:12,15");
        assert_eq!(PgSnapshot::parse("7:7:").unwrap().xip, Vec::<u64>::new());
        for bad in [
            "", "1:2", "a:2:", "3:2:", "1:5:9", "1:5:0", "1:5:x", "-1:2:",
        ] {
            assert!(PgSnapshot::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn visibility_follows_pg_visible_in_snapshot() {
        let s = PgSnapshot::parse("100:110:103,107").unwrap();
        assert_eq!(s.visible(99), Some(true));
        assert_eq!(s.visible(100), Some(true));
        assert_eq!(s.visible(103), Some(false));
        assert_eq!(s.visible(105), Some(true));
        assert_eq!(s.visible(107), Some(false));
        assert_eq!(s.visible(110), Some(false));
        assert_eq!(s.visible(5000), Some(false));
        assert_eq!(s.visible(2), None);
        assert_eq!(s.visible(0), None);
    }

    #[test]
    fn epochs_compare_across_the_32_bit_wrap() {
        // xmax just past an epoch boundary: 32-bit ids just below 2^32 are the
        // previous epoch's, small ones this epoch's.
        let e1 = SPAN;
        let s = PgSnapshot {
            xmin: e1 - 5,
            xmax: e1 + 5,
            xip: vec![e1 - 2, e1 + 1],
        };
        assert_eq!(s.visible(u32::MAX - 1), Some(false)); // e1 - 2, in progress
        assert_eq!(s.visible(u32::MAX), Some(true)); // e1 - 1
        assert_eq!(s.visible(u32::MAX - 9), Some(true)); // below xmin
        assert_eq!(s.visible(1 + 2), Some(true)); // e1 + 3
        assert_eq!(s.visible(6), Some(false)); // e1 + 6, after xmax
        assert_eq!(widen(4, e1 - 3), e1 + 4);
        assert_eq!(widen(u32::MAX, e1 + 3), e1 - 1);
        assert_eq!(widen(7, 3), 7);
        assert_eq!(widen(u32::MAX, 3), u64::from(u32::MAX)); // no epoch -1
    }

    #[test]
    fn a_cut_delivers_what_the_rows_lack() {
        let cut = Cut {
            snapshot: PgSnapshot::parse("100:110:103").unwrap(),
            lsn: crate::Lsn(0x500),
        };
        assert!(cut.delivers(crate::Lsn(0x501), Some(50)), "after the cut");
        assert!(!cut.delivers(crate::Lsn(0x500), Some(101)), "in the rows");
        assert!(
            cut.delivers(crate::Lsn(0x400), Some(103)),
            "in progress then"
        );
        assert!(
            cut.delivers(crate::Lsn(0x400), None),
            "cannot tell: delivered"
        );
    }

    proptest! {
        #[test]
        fn widening_inverts_truncation(reference in 0u64..(1 << 40), delta in -(HALF as i64 - 1)..(HALF as i64)) {
            let full = reference as i64 + delta;
            prop_assume!(full >= 0);
            let full = full as u64;
            prop_assert_eq!(widen(full as u32, reference), full);
        }

        #[test]
        fn the_32_bit_answer_is_the_64_bit_one(
            base in (3u64..(1 << 40)),
            width in 0u64..1000,
            ips in proptest::collection::vec(0u64..1000, 0..20),
            probe in -(1i64 << 30)..(1i64 << 30),
        ) {
            let xmax = base + width;
            let xip: Vec<u64> = ips.into_iter().filter(|i| *i < width).map(|i| base + i).collect();
            let text = format!("{base}:{xmax}:{}", xip.iter().map(u64::to_string).collect::<Vec<_>>().join(","));
            let s = PgSnapshot::parse(&text).unwrap();
            let full = xmax as i64 + probe;
            prop_assume!(full >= 3);
            let full = full as u64;
            prop_assume!((full as u32) >= 3);
            prop_assert_eq!(s.visible(full as u32), Some(s.visible8(full)));
            prop_assert_eq!(PgSnapshot::parse(&s.to_string()).unwrap(), s);
        }
    }
}
