//! Postgres timestamp text → UTC RFC 3339 with milliseconds, with hand-written civil date
//! math (no chrono). Also used by filter evaluation to compare `timestamptz`/`date` values.

use std::fmt::Write;

/// A timestamp string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TimestampError {
    /// The text does not have the expected shape.
    #[error("invalid timestamp {0:?}")]
    Invalid(String),
    /// A field is out of range (month 13, day 31 in April, hour 25, …).
    #[error("timestamp field out of range in {0:?}")]
    OutOfRange(String),
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
pub fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Proleptic Gregorian date `(year, month, day)` of a day count since 1970-01-01.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Whether `year` is a Gregorian leap year.
pub fn is_leap(year: i64) -> bool {
    year % 4 == 0 && (year % 100 != 0 || year % 400 == 0)
}

/// Number of days of `month` in `year`.
pub fn days_in_month(year: i64, month: u32) -> u32 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        _ => 28,
    }
}

const MICROS_PER_DAY: i64 = 86_400_000_000;

/// A parsed Postgres date/time text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgDateTime {
    /// Days since 1970-01-01 (local date as written).
    pub days: i64,
    /// Microseconds since local midnight (0 when no time was given).
    pub micros_of_day: i64,
    /// UTC offset in seconds, if the text had one.
    pub offset_secs: Option<i64>,
}

impl PgDateTime {
    /// Microseconds since the Unix epoch in UTC; a missing offset counts as UTC. `None` when
    /// the instant is beyond what microseconds in an `i64` hold (about 292,000 years either
    /// side of 1970, past Postgres's own timestamp range).
    pub fn checked_unix_micros(&self) -> Option<i64> {
        self.checked_local_micros()?
            .checked_sub(self.offset_secs.unwrap_or(0) * 1_000_000)
    }

    /// [`Self::checked_unix_micros`], clamped to the `i64` range: ordering is kept for every
    /// instant Postgres can store, and a far-out literal compares past all of them.
    pub fn unix_micros(&self) -> i64 {
        self.checked_unix_micros()
            .unwrap_or(if self.days < 0 { i64::MIN } else { i64::MAX })
    }

    fn checked_local_micros(&self) -> Option<i64> {
        self.days
            .checked_mul(MICROS_PER_DAY)?
            .checked_add(self.micros_of_day)
    }

    /// Microseconds since 1970-01-01 00:00 of the local (written) date and time, ignoring
    /// any offset (`timestamp without time zone` semantics); clamped like
    /// [`Self::unix_micros`].
    pub fn local_micros(&self) -> i64 {
        self.checked_local_micros()
            .unwrap_or(if self.days < 0 { i64::MIN } else { i64::MAX })
    }
}

struct Cursor<'a> {
    s: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.pos).copied()
    }

    fn eat(&mut self, b: u8) -> bool {
        if self.peek() == Some(b) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Read `min..=max` ASCII digits.
    fn digits(&mut self, min: usize, max: usize) -> Option<(i64, usize)> {
        let start = self.pos;
        let mut v: i64 = 0;
        while self.pos - start < max {
            match self.peek() {
                Some(b @ b'0'..=b'9') => {
                    v = v * 10 + i64::from(b - b'0');
                    self.pos += 1;
                }
                _ => break,
            }
        }
        let n = self.pos - start;
        (n >= min).then_some((v, n))
    }
}

/// Parse `YYYY-MM-DD[( |T)HH:MM[:SS[.ffffff]]][Z|±HH[[:]MM[[:]SS]]]`. Fraction digits beyond
/// microseconds are truncated. `BC` dates and special values are not accepted here.
pub fn parse_pg_datetime(text: &str) -> Result<PgDateTime, TimestampError> {
    let invalid = || TimestampError::Invalid(text.to_owned());
    let range = || TimestampError::OutOfRange(text.to_owned());
    let t = text.trim();
    let mut c = Cursor {
        s: t.as_bytes(),
        pos: 0,
    };
    let (year, _) = c.digits(4, 9).ok_or_else(invalid)?;
    if !c.eat(b'-') {
        return Err(invalid());
    }
    let (month, _) = c.digits(1, 2).ok_or_else(invalid)?;
    if !c.eat(b'-') {
        return Err(invalid());
    }
    let (day, _) = c.digits(1, 2).ok_or_else(invalid)?;
    let month = u32::try_from(month).map_err(|_| range())?;
    let day = u32::try_from(day).map_err(|_| range())?;
    if !(1..=12).contains(&month) || day == 0 || day > days_in_month(year, month) {
        return Err(range());
    }
    let mut micros_of_day = 0;
    let mut offset_secs = None;
    if c.eat(b' ') || c.eat(b'T') || c.eat(b't') {
        let (h, _) = c.digits(1, 2).ok_or_else(invalid)?;
        if !c.eat(b':') {
            return Err(invalid());
        }
        let (mi, _) = c.digits(2, 2).ok_or_else(invalid)?;
        let mut sec = 0;
        let mut frac = 0;
        if c.eat(b':') {
            sec = c.digits(2, 2).ok_or_else(invalid)?.0;
            if c.eat(b'.') {
                let start = c.pos;
                let (mut f, mut n) = c.digits(1, 6).ok_or_else(invalid)?;
                while n < 6 {
                    f *= 10;
                    n += 1;
                }
                frac = f;
                // Ignore digits beyond microseconds.
                while matches!(c.peek(), Some(b'0'..=b'9')) {
                    c.pos += 1;
                }
                debug_assert!(c.pos > start);
            }
        }
        let end_of_day = h == 24 && mi == 0 && sec == 0 && frac == 0;
        if (h > 23 && !end_of_day) || mi > 59 || sec > 60 {
            return Err(range());
        }
        micros_of_day = ((h * 60 + mi) * 60 + sec) * 1_000_000 + frac;
        offset_secs = parse_offset(&mut c).ok_or_else(invalid)?;
    }
    if c.pos != c.s.len() {
        return Err(invalid());
    }
    Ok(PgDateTime {
        days: days_from_civil(year, month, day),
        micros_of_day,
        offset_secs,
    })
}

/// `None` = malformed; `Some(None)` = no offset present.
fn parse_offset(c: &mut Cursor<'_>) -> Option<Option<i64>> {
    if c.eat(b'Z') || c.eat(b'z') {
        return Some(Some(0));
    }
    let sign = if c.eat(b'+') {
        1
    } else if c.eat(b'-') {
        -1
    } else {
        return Some(None);
    };
    let (h, n) = c.digits(1, 4)?;
    // "+0530" form.
    let (h, mut m) = if n > 2 { (h / 100, h % 100) } else { (h, 0) };
    let mut s = 0;
    if n <= 2 && c.eat(b':') {
        m = c.digits(2, 2)?.0;
        if c.eat(b':') {
            s = c.digits(2, 2)?.0;
        }
    }
    if h > 15 || m > 59 || s > 59 {
        return None;
    }
    Some(Some(sign * (h * 3600 + m * 60 + s)))
}

/// Format Unix microseconds as `YYYY-MM-DDTHH:MM:SS.mmmZ` (milliseconds truncated, like
/// Postgres `to_char(…, 'MS')`).
pub fn format_rfc3339_millis(unix_micros: i64) -> String {
    let days = unix_micros.div_euclid(MICROS_PER_DAY);
    let rem = unix_micros.rem_euclid(MICROS_PER_DAY);
    let (y, m, d) = civil_from_days(days);
    let secs = rem / 1_000_000;
    let millis = (rem % 1_000_000) / 1000;
    let mut out = String::with_capacity(24);
    let _ = write!(
        out,
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{millis:03}Z",
        secs / 3600,
        (secs / 60) % 60,
        secs % 60
    );
    out
}

/// Convert a Postgres timestamp text (`2026-11-30 05:26:07.323193+00`, `…+05:30`, `…-08`)
/// to UTC RFC 3339 with milliseconds (`2026-11-30T05:26:07.323Z`). Text without an offset
/// is taken as UTC.
pub fn pg_to_rfc3339_millis(text: &str) -> Result<String, TimestampError> {
    let dt = parse_pg_datetime(text)?;
    let micros = dt
        .checked_unix_micros()
        .ok_or_else(|| TimestampError::OutOfRange(text.to_owned()))?;
    Ok(format_rfc3339_millis(micros))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn examples() {
        let cases = [
            ("2026-11-30 05:26:07.323193+00", "2026-11-30T05:26:07.323Z"),
            (
                "2026-11-30 05:26:07.323193+05:30",
                "2026-11-29T23:56:07.323Z",
            ),
            ("2026-12-31 20:00:00-08", "2027-01-01T04:00:00.000Z"),
            ("2024-02-29 00:00:00.9999+00", "2024-02-29T00:00:00.999Z"),
            ("2000-03-01 00:30:00+01", "2000-02-29T23:30:00.000Z"),
            ("1969-12-31 23:59:59.5", "1969-12-31T23:59:59.500Z"),
            ("2025-06-01T10:00:00.123Z", "2025-06-01T10:00:00.123Z"),
            ("2025-06-01 10:00:00+0530", "2025-06-01T04:30:00.000Z"),
            ("1900-01-01 00:00:00+00:19:32", "1899-12-31T23:40:28.000Z"),
        ];
        for (input, want) in cases {
            assert_eq!(pg_to_rfc3339_millis(input).unwrap(), want, "{input}");
        }
    }

    #[test]
    fn rejects() {
        for bad in [
            "",
            "2026-13-01 00:00:00+00",
            "2026-02-29 00:00:00+00",
            "2026-01-01 25:00:00",
            "2026-01-01 00:00:00+",
            "2026-01-01 00:00:00 BC",
            "infinity",
            "2026-01-01x",
            "300000-1-1 ",
            "999999999-12-31 23:59:59+00",
        ] {
            assert!(pg_to_rfc3339_millis(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn civil_round_trip() {
        for days in -800_000..800_000 {
            if days % 997 != 0 {
                continue;
            }
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }
}
