//! Whether decoded transactions are visible to a snapshot (pure; see
//! `RlsChecker::wait_visible` in `authorize/rls.rs` for why checks wait for it).
//!
//! wal2json gives 32-bit transaction ids; a snapshot (`pg_current_snapshot()`, text form
//! `xmin:xmax:xip,…`) has 64-bit ones (epoch in the high half). A decoded transaction is
//! within 2^31 of the snapshot's xmax, on either side: before it once completed, at or
//! past it while it is still in the process array (xmax is the newest completed id plus
//! one, and another session may have taken a newer id and be committing). So its 64-bit
//! id is the one nearest xmax with those low 32 bits, never simply xmax's epoch (or the
//! one before): read as of the previous epoch, a transaction still committing would look
//! long committed.

/// A snapshot as `pg_current_snapshot()` prints it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmin: u64,
    pub xmax: u64,
    /// In progress between xmin and xmax.
    pub xip: Vec<u64>,
}

/// Parse `xmin:xmax:xip,xip,…` (`None`: not that form).
pub fn parse_snapshot(text: &str) -> Option<Snapshot> {
    let mut parts = text.trim().splitn(3, ':');
    let xmin = parts.next()?.parse().ok()?;
    let xmax = parts.next()?.parse().ok()?;
    let xip = match parts.next()? {
        "" => Vec::new(),
        list => list
            .split(',')
            .map(|x| x.parse().ok())
            .collect::<Option<Vec<u64>>>()?,
    };
    Some(Snapshot { xmin, xmax, xip })
}

/// The 64-bit id nearest `xmax` whose low half is `xid`.
pub fn widen(xid: u32, xmax: u64) -> u64 {
    // Low half of the difference, read as a signed 32-bit step from xmax.
    let step = xid.wrapping_sub(xmax as u32) as i32;
    xmax.checked_add_signed(i64::from(step)).unwrap_or(0)
}

/// Is transaction `xid` (32-bit, committed) visible to the snapshot, as
/// `pg_visible_in_snapshot` decides?
pub fn visible(snapshot: &Snapshot, xid: u32) -> bool {
    let x = widen(xid, snapshot.xmax);
    x < snapshot.xmin || (x < snapshot.xmax && !snapshot.xip.contains(&x))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCH: u64 = 1 << 32;

    #[test]
    fn snapshots_parse_in_their_text_form() {
        let s = parse_snapshot("764:766:764").unwrap();
        assert_eq!((s.xmin, s.xmax, s.xip), (764, 766, vec![764]));
        let s = parse_snapshot("770:770:").unwrap();
        assert!(s.xip.is_empty());
        let s = parse_snapshot("4294968000:4294968100:4294968001,4294968050").unwrap();
        assert_eq!(s.xip, vec![4294968001, 4294968050]);
        assert_eq!(parse_snapshot("770:770"), None);
        assert_eq!(parse_snapshot("a:1:"), None);
        assert_eq!(parse_snapshot("1:2:3,x"), None);
    }

    #[test]
    fn ids_widen_to_the_nearest_of_xmax() {
        // Same epoch, before xmax and past it (still committing).
        assert_eq!(widen(769, 770), 769);
        assert_eq!(widen(771, 770), 771);
        assert_eq!(widen(771, EPOCH + 770), EPOCH + 771);
        assert_eq!(widen(100, 5 * EPOCH + 770), 5 * EPOCH + 100);
        // Across the epoch boundary, both ways.
        assert_eq!(widen(u32::MAX - 5, EPOCH + 10), u64::from(u32::MAX - 5));
        assert_eq!(widen(3, EPOCH - 10), EPOCH + 3);
        // Nothing below zero.
        assert_eq!(widen(u32::MAX, 3), 0);
    }

    #[test]
    fn visible_as_postgres_decides() {
        let s = parse_snapshot("764:766:764").unwrap();
        assert!(!visible(&s, 764), "in progress");
        assert!(visible(&s, 765));
        assert!(visible(&s, 700), "before xmin");
        assert!(!visible(&s, 766), "at xmax");
        assert!(!visible(&s, 767), "past xmax");
    }

    #[test]
    fn a_transaction_past_xmax_is_not_visible_in_a_later_epoch() {
        // The newest completed id is 770 of epoch 1; 772 is still committing. Read as of
        // epoch 0 it would be below xmin: visible, wrongly.
        let s = Snapshot {
            xmin: EPOCH + 700,
            xmax: EPOCH + 771,
            xip: vec![],
        };
        assert!(!visible(&s, 772));
        assert!(visible(&s, 770));
        assert!(visible(&s, u32::MAX), "epoch 0, long committed");
    }
}
