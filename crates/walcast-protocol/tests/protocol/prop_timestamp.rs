//! Property test: timestamp conversion agrees with a naive reference computation.

use proptest::prelude::*;
use walcast_protocol::pg_to_rfc3339_millis;

fn leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn month_len(y: i64, m: i64) -> i64 {
    [
        31,
        if leap(y) { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ][(m - 1) as usize]
}

/// Naive: count days year by year and month by month.
fn reference_epoch_secs(y: i64, mo: i64, d: i64, h: i64, mi: i64, s: i64) -> i64 {
    let mut days = 0;
    if y >= 1970 {
        for yy in 1970..y {
            days += if leap(yy) { 366 } else { 365 };
        }
    } else {
        for yy in y..1970 {
            days -= if leap(yy) { 366 } else { 365 };
        }
    }
    for mm in 1..mo {
        days += month_len(y, mm);
    }
    days += d - 1;
    days * 86_400 + h * 3600 + mi * 60 + s
}

/// Naive inverse: walk years and months.
fn reference_format(secs: i64, millis: i64) -> String {
    let mut days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let mut y = 1970;
    loop {
        let len = if leap(y) { 366 } else { 365 };
        if days < 0 {
            y -= 1;
            days += if leap(y) { 366 } else { 365 };
        } else if days >= len {
            days -= len;
            y += 1;
        } else {
            break;
        }
    }
    let mut m = 1;
    while days >= month_len(y, m) {
        days -= month_len(y, m);
        m += 1;
    }
    format!(
        "{y:04}-{m:02}-{:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        days + 1,
        rem / 3600,
        (rem / 60) % 60,
        rem % 60
    )
}

proptest! {
    #![proptest_config(ProptestConfig { failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn agrees_with_reference(
        y in 1600i64..2600,
        mo in 1i64..=12,
        d_seed in 0i64..31,
        h in 0i64..24,
        mi in 0i64..60,
        s in 0i64..60,
        micros in 0i64..1_000_000,
        frac_digits in 0usize..=6,
        off_sign in prop_oneof![Just(1i64), Just(-1i64)],
        off_h in 0i64..=14,
        off_m in prop_oneof![Just(0i64), Just(30), Just(45)],
        off_style in 0u8..3,
    ) {
        let d = d_seed % month_len(y, mo) + 1;
        // Fraction written with `frac_digits` digits (truncating `micros`).
        let frac_text = if frac_digits == 0 {
            String::new()
        } else {
            format!(".{:06}", micros)[..=frac_digits].to_owned()
        };
        let kept_micros = if frac_digits == 0 {
            0
        } else {
            micros / 10i64.pow(6 - frac_digits as u32) * 10i64.pow(6 - frac_digits as u32)
        };
        let sign = if off_sign > 0 { '+' } else { '-' };
        let (off_text, off_secs) = match off_style {
            0 => (format!("{sign}{off_h:02}"), off_h * 3600),
            1 => (format!("{sign}{off_h:02}:{off_m:02}"), off_h * 3600 + off_m * 60),
            _ => ("Z".to_owned(), 0),
        };
        let text = format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}{frac_text}{off_text}");
        let off = if off_style == 2 { 0 } else { off_sign * off_secs };
        let secs = reference_epoch_secs(y, mo, d, h, mi, s) - off;
        let want = reference_format(secs, kept_micros / 1000);
        prop_assert_eq!(pg_to_rfc3339_millis(&text).unwrap(), want, "{}", text);
    }

    #[test]
    fn never_panics(text in "\\PC{0,40}") {
        let _ = pg_to_rfc3339_millis(&text);
    }

    #[test]
    fn never_panics_near_valid(text in "[0-9]{1,6}-[0-9]{1,3}-[0-9]{1,3}[ T][0-9:.]{0,16}[-+Z0-9:]{0,8}") {
        let _ = pg_to_rfc3339_millis(&text);
    }
}
