use super::*;

fn rows(n: usize, width: usize) -> SnapshotRows {
    SnapshotRows {
        snapshot: "10:20:15".into(),
        lsn: walcast_core::Lsn(0x1530AD8),
        columns: vec![crate::ColumnInfo {
            name: "id".into(),
            type_name: "int4".into(),
        }],
        rows: (0..n)
            .map(|i| format!("{{\"id\":{i},\"pad\":\"{}\"}}", "x".repeat(width)))
            .collect(),
    }
}

fn parts(n: usize, width: usize, max_payload: usize) -> Vec<Bytes> {
    Parts::new("n0nce", Ok(rows(n, width)), max_payload).collect()
}

/// Feed `parts` to a reassembly of nonce `n0nce`: its answer, or the first error.
fn feed(parts: &[Bytes], max_rows: u32, max_bytes: u32) -> Result<SnapshotRows, AdminError> {
    let mut r = Reassembly::new("n0nce", max_rows, max_bytes);
    let mut admit = |_: usize, _: usize| Ok(());
    for p in parts {
        if let Step::Done(rows) = r.take(p, &mut admit)? {
            return Ok(rows);
        }
    }
    Err(unavailable("no end"))
}

#[test]
fn rows_in_many_parts_come_back_whole_and_in_order() {
    let ps = parts(1000, 100, 16 * 1024);
    assert!(ps.len() > 10, "{} parts", ps.len());
    assert!(ps.iter().all(|p| p.len() <= 16 * 1024), "each fits");
    assert_eq!(feed(&ps, 1000, u32::MAX).unwrap(), rows(1000, 100));
    // Large max_payload: 256 KiB parts.
    let ps = parts(5000, 100, 8 << 20);
    assert!(ps.iter().all(|p| p.len() <= PART_BYTES + PART_OVERHEAD));
    assert_eq!(feed(&ps, 5000, u32::MAX).unwrap(), rows(5000, 100));
    // No rows: only the end.
    let ps = parts(0, 1, 1024);
    assert_eq!(ps.len(), 1);
    assert_eq!(feed(&ps, 10, 10).unwrap(), rows(0, 1));
}

#[test]
fn the_budget_sees_every_part_before_it_is_kept() {
    let ps = parts(300, 50, 8 * 1024);
    let mut r = Reassembly::new("n0nce", 1000, u32::MAX);
    let (mut seen_rows, mut seen_bytes) = (0, 0);
    let mut admit = |n: usize, b: usize| {
        seen_rows += n;
        seen_bytes += b;
        if seen_rows > 200 {
            Err(unavailable("over budget"))
        } else {
            Ok(())
        }
    };
    let err = ps
        .iter()
        .find_map(|p| r.take(p, &mut admit).err())
        .expect("refused");
    assert_eq!(err.message, "over budget");
}

#[test]
fn a_lost_repeated_reordered_or_foreign_part_breaks_the_exchange() {
    let ps = parts(200, 100, 4 * 1024);
    assert!(ps.len() > 4);
    let broken = |ps: Vec<Bytes>| {
        let e = feed(&ps, 1000, u32::MAX).unwrap_err();
        assert_eq!(e.kind, AdminErrorKind::Unavailable, "{e}");
        e.message
    };
    let mut lost = ps.clone();
    lost.remove(2);
    assert!(broken(lost).contains("part 3 where 2 was due"));
    let mut repeated = ps.clone();
    repeated.insert(2, ps[1].clone());
    broken(repeated);
    let mut reordered = ps.clone();
    reordered.swap(1, 2);
    broken(reordered);
    let mut last_lost = ps.clone();
    last_lost.remove(last_lost.len() - 2);
    broken(last_lost);
    // Parts of another request, even numbered right.
    let other: Vec<Bytes> = Parts::new("other", Ok(rows(200, 100)), 4 * 1024).collect();
    assert!(broken(other).contains("another request"));
    // A forged part takes a number: the genuine one then repeats it.
    let forged = Bytes::from(r#"{"nonce":"n0nce","seq":0,"body":{"rows":[{"id":-1}]}}"#);
    let mut with_forged = vec![forged];
    with_forged.extend(ps.iter().cloned());
    broken(with_forged);
    // A forged end: its totals and digest are not those of the rows taken.
    let forged_end = format!(
        r#"{{"nonce":"n0nce","seq":1,"body":{{"done":{{"snapshot":"1:1:","lsn":"0/1","columns":[],"rows":{},"bytes":1,"parts":1,"digest":"00"}}}}}}"#,
        1
    );
    let cut_short = vec![ps[0].clone(), Bytes::from(forged_end)];
    assert!(broken(cut_short).contains("do not add up"));
    // Garbage, an empty part, a whole reply without a nonce.
    broken(vec![Bytes::from_static(b"{not json")]);
    broken(vec![Bytes::from_static(
        br#"{"nonce":"n0nce","seq":0,"body":{"rows":[]}}"#,
    )]);
    let whole = serde_json::to_vec(&super::super::Response::Ok(
        super::super::AdminReply::SnapshotRows(rows(1, 1)),
    ))
    .unwrap();
    broken(vec![Bytes::from(whole)]);
}

#[test]
fn limits_and_errors_arrive_as_errors() {
    let ps = parts(200, 10, 4 * 1024);
    let e = feed(&ps, 199, u32::MAX).unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::TooLarge);
    assert!(e.message.contains("SSE_SNAPSHOT_MAX_ROWS"), "{e}");
    let e = feed(&ps, 1000, 1000).unwrap_err();
    assert_eq!(e.kind, AdminErrorKind::TooLarge);
    let refused = AdminError::new(AdminErrorKind::Refused, "no");
    let ps: Vec<Bytes> = Parts::new("n0nce", Err(refused.clone()), 1024).collect();
    assert_eq!(ps.len(), 1);
    assert_eq!(feed(&ps, 10, 10).unwrap_err(), refused);
    // A row that fits no message: the whole answer is refused.
    let ps = parts(3, 2000, 1024);
    assert_eq!(ps.len(), 1);
    assert_eq!(
        feed(&ps, 10, u32::MAX).unwrap_err().kind,
        AdminErrorKind::TooLarge
    );
}

#[test]
fn nonces_are_fresh_and_checked() {
    let (a, b) = (nonce(), nonce());
    assert_ne!(a, b);
    assert!(nonce_ok(&a) && a.len() == 32);
    assert!(!nonce_ok(""));
    assert!(!nonce_ok("a\"b"));
    assert!(!nonce_ok(&"a".repeat(MAX_NONCE + 1)));
}
