//! Property tests for the filter grammar and evaluation.

use proptest::prelude::*;
use walcast_protocol::filter::{Condition, IsValue, Op};
use walcast_protocol::{Filter, SliceRecord};

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-zA-Z0-9_.:%*-]{0,10}",
        "\\PC{0,10}",
        "[ ,()\"\\\\a]{0,8}",
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        value().prop_map(Op::Eq),
        value().prop_map(Op::Neq),
        value().prop_map(Op::Lt),
        value().prop_map(Op::Lte),
        value().prop_map(Op::Gt),
        value().prop_map(Op::Gte),
        prop::collection::vec(value(), 0..6).prop_map(Op::In),
        value().prop_map(Op::Like),
        value().prop_map(Op::Ilike),
        value().prop_map(Op::Match),
        value().prop_map(Op::Imatch),
        value().prop_map(Op::IsDistinct),
        prop_oneof![
            Just(IsValue::Null),
            Just(IsValue::True),
            Just(IsValue::False),
            Just(IsValue::Unknown)
        ]
        .prop_map(Op::Is),
    ]
}

fn filter() -> impl Strategy<Value = Filter> {
    prop::collection::vec(
        ("[a-z_][a-z0-9_]{0,10}", any::<bool>(), op()).prop_map(|(column, negated, op)| {
            Condition {
                column,
                negated,
                op,
            }
        }),
        0..5,
    )
    .prop_map(|conditions| Filter { conditions })
}

/// Scale an integer by 10^-scale and write it exactly as decimal text.
fn decimal_text(n: i64, scale: u32) -> String {
    let neg = n < 0;
    let digits = n.unsigned_abs().to_string();
    let scale = scale as usize;
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    let sign = if neg { "-" } else { "" };
    if scale == 0 {
        format!("{sign}{int}")
    } else {
        format!("{sign}{int}.{frac}")
    }
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn parse_never_panics(text in "\\PC{0,64}") {
        let _ = Filter::parse(&text);
    }

    #[test]
    fn parse_never_panics_on_grammar_soup(
        text in "([a-z]{0,3}(=|\\.|,|\\(|\\)|\"|\\\\|not|eq|in|is|like|null| ){0,3}){0,8}"
    ) {
        if let Ok(f) = Filter::parse(&text) {
            // Whatever parsed must also survive printing and re-parsing.
            prop_assert_eq!(Filter::parse(&f.to_string()).ok(), Some(f));
        }
    }

    #[test]
    fn display_parse_round_trip(f in filter()) {
        let text = f.to_string();
        prop_assert_eq!(Filter::parse(&text), Ok(f), "{}", text);
    }

    #[test]
    fn eval_never_panics(
        f in filter(),
        typ in prop_oneof![
            Just("int4"), Just("int8"), Just("numeric"), Just("float8"), Just("bool"),
            Just("text"), Just("uuid"), Just("timestamptz"), Just("date"), Just("jsonb"),
            Just("_int4"), Just("_text"), Just("bpchar"), Just("time"),
        ],
        val in prop::option::of(value()),
    ) {
        let cols: Vec<(&str, &str, Option<&str>)> =
            f.columns().map(|c| (c, typ, val.as_deref())).collect();
        let _ = f.matches(&SliceRecord(&cols));
        let _ = f.validate(|_| Some(typ));
    }

    #[test]
    fn numeric_compares_exactly(
        a in any::<i64>(), sa in 0u32..12,
        b in any::<i64>(), sb in 0u32..12,
    ) {
        // a·10^-sa vs b·10^-sb, compared exactly with i128 cross-multiplication.
        let (x, y) = (
            i128::from(a) * 10i128.pow(sb),
            i128::from(b) * 10i128.pow(sa),
        );
        let (ta, tb) = (decimal_text(a, sa), decimal_text(b, sb));
        let row = [("n", "numeric", Some(ta.as_str()))];
        let check = |op: &str| {
            Filter::parse(&format!("n={op}.{tb}")).unwrap().matches(&SliceRecord(&row)).unwrap()
        };
        prop_assert_eq!(check("eq"), x == y);
        prop_assert_eq!(check("lt"), x < y);
        prop_assert_eq!(check("gte"), x >= y);
    }

    #[test]
    fn int_compare_matches_i64(a in any::<i32>(), b in any::<i32>()) {
        let ta = a.to_string();
        let row = [("n", "int4", Some(ta.as_str()))];
        let r = |op: &str| {
            Filter::parse(&format!("n={op}.{b}")).unwrap().matches(&SliceRecord(&row)).unwrap()
        };
        prop_assert_eq!(r("lt"), a < b);
        prop_assert_eq!(r("lte"), a <= b);
        prop_assert_eq!(r("gt"), a > b);
        prop_assert_eq!(r("neq"), a != b);
        prop_assert_eq!(r("not.eq"), a != b);
    }
}
