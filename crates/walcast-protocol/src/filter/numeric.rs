//! Exact comparison of Postgres `numeric` text (arbitrary precision, no f64 loss).

use std::cmp::Ordering;

/// A decimal number normalised as `±0.d1d2…dn × 10^exp` (no leading or trailing zero
/// digits; zero has no digits), or a special value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Decimal {
    NegInfinity,
    Finite {
        negative: bool,
        digits: Vec<u8>,
        exp: i64,
    },
    Infinity,
    /// Postgres orders NaN above every other value and equal to itself.
    NaN,
}

impl Decimal {
    /// Parse Postgres numeric input: `[+-]digits[.digits][e[+-]digits]`, `NaN`,
    /// `[+-]Infinity`/`inf` (case-insensitive), surrounding whitespace allowed.
    pub(crate) fn parse(text: &str) -> Option<Decimal> {
        let t = text.trim();
        let lower = t.to_ascii_lowercase();
        match lower.as_str() {
            "nan" => return Some(Decimal::NaN),
            "infinity" | "+infinity" | "inf" | "+inf" => return Some(Decimal::Infinity),
            "-infinity" | "-inf" => return Some(Decimal::NegInfinity),
            _ => {}
        }
        let bytes = t.as_bytes();
        let mut i = 0;
        let mut negative = false;
        if let Some(&s) = bytes.first() {
            if s == b'+' || s == b'-' {
                negative = s == b'-';
                i = 1;
            }
        }
        let mut digits = Vec::new();
        let mut int_digits: i64 = 0;
        let mut seen_digit = false;
        let mut seen_point = false;
        while let Some(&b) = bytes.get(i) {
            match b {
                b'0'..=b'9' => {
                    seen_digit = true;
                    digits.push(b - b'0');
                    if !seen_point {
                        int_digits += 1;
                    }
                }
                b'.' if !seen_point => seen_point = true,
                _ => break,
            }
            i += 1;
        }
        if !seen_digit {
            return None;
        }
        let mut exp_adj: i64 = 0;
        if let Some(&b) = bytes.get(i) {
            if b != b'e' && b != b'E' {
                return None;
            }
            i += 1;
            let mut exp_neg = false;
            if let Some(&s) = bytes.get(i) {
                if s == b'+' || s == b'-' {
                    exp_neg = s == b'-';
                    i += 1;
                }
            }
            let exp_text = t.get(i..)?;
            if exp_text.is_empty() || !exp_text.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            // Postgres limits the exponent to about ±1000; cap to avoid overflow.
            let e: i64 = exp_text.parse().ok().filter(|e| *e <= 100_000)?;
            exp_adj = if exp_neg { -e } else { e };
        }
        // Normalise: strip leading zeros (adjusting the exponent) and trailing zeros.
        let lead = digits.iter().take_while(|d| **d == 0).count();
        let mut exp = int_digits - lead as i64 + exp_adj;
        digits.drain(..lead);
        while digits.last() == Some(&0) {
            digits.pop();
        }
        if digits.is_empty() {
            negative = false;
            exp = 0;
        }
        Some(Decimal::Finite {
            negative,
            digits,
            exp,
        })
    }

    fn rank(&self) -> u8 {
        match self {
            Decimal::NegInfinity => 0,
            Decimal::Finite { .. } => 1,
            Decimal::Infinity => 2,
            Decimal::NaN => 3,
        }
    }
}

fn cmp_magnitude(a: &[u8], ae: i64, b: &[u8], be: i64) -> Ordering {
    match (a.is_empty(), b.is_empty()) {
        (true, true) => return Ordering::Equal,
        (true, false) => return Ordering::Less,
        (false, true) => return Ordering::Greater,
        _ => {}
    }
    ae.cmp(&be).then_with(|| a.cmp(b))
}

impl Ord for Decimal {
    fn cmp(&self, other: &Self) -> Ordering {
        match (self, other) {
            (
                Decimal::Finite {
                    negative: an,
                    digits: ad,
                    exp: ae,
                },
                Decimal::Finite {
                    negative: bn,
                    digits: bd,
                    exp: be,
                },
            ) => match (an, bn) {
                (false, true) => Ordering::Greater,
                (true, false) => Ordering::Less,
                (false, false) => cmp_magnitude(ad, *ae, bd, *be),
                (true, true) => cmp_magnitude(bd, *be, ad, *ae),
            },
            _ => self.rank().cmp(&other.rank()),
        }
    }
}

impl PartialOrd for Decimal {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> Decimal {
        Decimal::parse(s).unwrap()
    }

    #[test]
    fn equality_forms() {
        assert_eq!(d("1"), d("1.000"));
        assert_eq!(d("0"), d("-0.0"));
        assert_eq!(d("12.5e1"), d("125"));
        assert_eq!(d(" 0.00123 "), d("1.23E-3"));
        assert_eq!(d(".5"), d("0.5"));
        assert_eq!(d("5."), d("5"));
        assert_eq!(d("NaN"), d("nan"));
    }

    #[test]
    fn ordering() {
        let ordered = [
            "-Infinity",
            "-100",
            "-99.99999999999999999999",
            "-1",
            "-0.5",
            "0",
            "0.000000000000000000001",
            "0.5",
            "1",
            "9.99999999999999999999999",
            "10",
            "123456789012345678901234567890",
            "Infinity",
            "NaN",
        ];
        for w in ordered.windows(2) {
            assert_eq!(d(w[0]).cmp(&d(w[1])), Ordering::Less, "{} < {}", w[0], w[1]);
        }
        // Beyond f64 precision.
        assert!(d("9007199254740993") > d("9007199254740992"));
    }

    #[test]
    fn rejects() {
        for s in ["", "abc", "1.2.3", "1e", "--1", "1x", ".", "e5", "1e+"] {
            assert!(Decimal::parse(s).is_none(), "{s}");
        }
    }
}
