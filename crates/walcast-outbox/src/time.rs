//! Commit timestamps (`YYYY-MM-DDTHH:MM:SS.mmmZ`, as the cdc crate writes them) as
//! milliseconds since the epoch, pure.

/// Days from 1970-01-01 to a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Milliseconds since the epoch of `2026-12-01T10:00:00.123Z` (the fraction optional).
pub fn epoch_ms(ts: &str) -> Option<i64> {
    let ts = ts.strip_suffix('Z')?;
    let (date, time) = ts.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, mo, da) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (h, mi, s) = (t.next()??, t.next()??, t.next()??);
    let ms = millis(frac)?;
    let days = days_from_civil(y, mo, da);
    Some(((days * 24 + h) * 60 + mi) * 60_000 + s * 1000 + ms)
}

/// The milliseconds of a fraction of a second (`"5"` → 500, `"123456"` → 123): its
/// first three characters, padded with zeros; `None` unless those are digits.
fn millis(frac: &str) -> Option<i64> {
    let mut digits = frac.bytes().chain(std::iter::repeat(b'0')).take(3);
    digits.try_fold(0, |ms, b| {
        b.is_ascii_digit().then(|| ms * 10 + i64::from(b - b'0'))
    })
}

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commit_timestamps() {
        assert_eq!(epoch_ms("1970-01-01T00:00:00.000Z"), Some(0));
        assert_eq!(
            epoch_ms("2026-12-01T10:00:00.123Z"),
            Some(1_796_119_200_123)
        );
        assert_eq!(epoch_ms("2000-02-29T23:59:59Z"), Some(951_868_799_000));
        assert_eq!(epoch_ms("2026-12-01 10:00:00Z"), None);
        assert_eq!(epoch_ms("garbage"), None);
        assert_eq!(epoch_ms("1970-01-01T00:00:01.5Z"), Some(1500));
        assert_eq!(epoch_ms("1970-01-01T00:00:01.123456Z"), Some(1123));
        assert_eq!(epoch_ms("1970-01-01T00:00:01.Z"), Some(1000));
        assert_eq!(epoch_ms("1970-01-01T00:00:01.1x3Z"), None);
    }
}
