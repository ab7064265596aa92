//! Unit tests for [`super`]: how a group's replies combine into its verdict, and the
//! bound arrays.

use super::*;

fn set(rows: &[usize]) -> HashSet<usize> {
    rows.iter().copied().collect()
}

fn replies(own: Option<&[usize]>, by_row: Option<&[usize]>) -> GroupReplies {
    GroupReplies {
        claims: None,
        own: own.map(|r| Ok(set(r))),
        by_row: by_row.map(|r| Ok(set(r))),
    }
}

#[test]
fn own_values_and_current_rows_combine() {
    // Versions 0-2 by their own values (0 and 2 pass), 3-5 by their row (3 and 4
    // visible by the row; 3 still holds it, 4 was replaced).
    let got = outcome(
        replies(Some(&[0, 2]), Some(&[3, 4])),
        Some(None),
        Some(None),
        &Ok(set(&[3, 5])),
    );
    assert_eq!(
        got,
        Ok(GroupOutcome {
            visible: set(&[0, 2, 3]),
            superseded: set(&[4]),
        })
    );
}

#[test]
fn a_failed_comparison_withholds_only_the_current_row_versions() {
    let got = outcome(
        replies(Some(&[1]), Some(&[3])),
        Some(None),
        Some(None),
        &Err("boom".into()),
    );
    assert_eq!(
        got,
        Ok(GroupOutcome {
            visible: set(&[1]),
            superseded: set(&[]),
        })
    );
}

#[test]
fn any_failure_of_the_group_denies_it() {
    let claims = GroupReplies {
        claims: Some("no such role".into()),
        ..replies(Some(&[1]), None)
    };
    assert_eq!(
        outcome(claims, Some(None), None, &Ok(set(&[]))),
        Err("no such role".into())
    );
    let failed = GroupReplies {
        own: Some(Err("policy raised".into())),
        ..replies(None, None)
    };
    assert_eq!(
        outcome(failed, Some(None), None, &Ok(set(&[]))),
        Err("policy raised".into())
    );
    // A statement that did not prepare was never answered.
    let unprepared = replies(None, None);
    assert_eq!(
        outcome(unprepared, Some(Some("syntax".into())), None, &Ok(set(&[]))),
        Err("syntax".into())
    );
    // Nothing planned, nothing visible, no error.
    assert_eq!(
        outcome(replies(None, None), None, None, &Ok(set(&[]))),
        Ok(GroupOutcome::default())
    );
}

#[test]
fn arrays_bind_absent_columns_as_null_and_positions_map_back() {
    let v = |cols: &[(&str, Option<&str>)]| -> Version {
        cols.iter()
            .map(|(n, x)| (n.to_string(), x.map(str::to_string)))
            .collect()
    };
    let versions = vec![
        v(&[("id", Some("1")), ("owner", Some("a"))]),
        v(&[("id", Some("2"))]),
        v(&[("id", Some("3")), ("owner", None)]),
    ];
    let got = arrays(&versions, &[2, 1], ["owner", "id"].into_iter());
    assert_eq!(
        got,
        vec![
            vec![None, None],
            vec![Some("3".to_string()), Some("2".to_string())]
        ]
    );
    assert_eq!(to_rows(&[1, 2, 9, 0], &[2, 1]), set(&[2, 1]));
}
