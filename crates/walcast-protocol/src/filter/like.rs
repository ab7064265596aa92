//! SQL `LIKE` / `ILIKE` patterns, compiled once to an anchored regular expression: the
//! regex crate matches in time linear in the text (finite automata, no backtracking),
//! whatever the pattern, so `%a%a%a…` on a long value costs no more than a plain scan.

use super::pattern::{self, Pattern};

/// A pattern ends with a lone escape character (Postgres rejects it too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TrailingEscape;

/// The regular expression of a LIKE pattern: `%` (or PostgREST's `*`) any sequence, `_`
/// one character, `\x` a literal `x`, anything else itself; the whole text must match.
fn translate(pattern: &str) -> Result<String, TrailingEscape> {
    let mut re = String::with_capacity(pattern.len() * 2 + 8);
    re.push_str("^(?s:");
    let mut chars = pattern.chars();
    let mut after_any = false;
    while let Some(c) = chars.next() {
        let any = matches!(c, '%' | '*');
        match c {
            '%' | '*' if after_any => {}
            '%' | '*' => re.push_str(".*"),
            '_' => re.push('.'),
            '\\' => push_literal(&mut re, chars.next().ok_or(TrailingEscape)?),
            c => push_literal(&mut re, c),
        }
        after_any = any;
    }
    re.push_str(")$");
    Ok(re)
}

fn push_literal(re: &mut String, c: char) {
    let mut buf = [0u8; 4];
    re.push_str(&regex::escape(c.encode_utf8(&mut buf)));
}

/// Compile a LIKE pattern; `fold` = case-insensitive (`ILIKE`). `Err`: a readable reason.
pub(crate) fn compile(like: &str, fold: bool) -> Result<Pattern, String> {
    let re = translate(like)
        .map_err(|_| "LIKE pattern must not end with escape character".to_owned())?;
    pattern::compile(&re, fold)
}

/// Whether `text` matches `pattern` entirely (compiles it: for one-off use and tests).
#[cfg(test)]
pub(crate) fn like(text: &str, pattern: &str, fold: bool) -> Result<bool, TrailingEscape> {
    translate(pattern)?;
    Ok(compile(pattern, fold)
        .map(|re| re.is_match(text))
        .unwrap_or(false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cases() {
        let yes = [
            ("hello", "hello"),
            ("hello", "h%"),
            ("hello", "%llo"),
            ("hello", "h_llo"),
            ("hello", "%"),
            ("", "%"),
            ("a%b", "a\\%b"),
            ("abcabc", "%abc"),
            ("mississippi", "%iss%ppi"),
            ("hello", "*ell*"),
            ("a.b", "a.b"),
            ("line\nbreak", "line_break"),
            ("(x)+[y]", "(x)+[y]"),
        ];
        for (t, p) in yes {
            assert_eq!(like(t, p, false), Ok(true), "{t} LIKE {p}");
        }
        let no = [
            ("hello", "Hello"),
            ("hello", "h_lo"),
            ("axb", "a\\%b"),
            ("", "_"),
            ("abc", "ab"),
            ("axb", "a.b"),
            ("hello\n", "hello"),
        ];
        for (t, p) in no {
            assert_eq!(like(t, p, false), Ok(false), "{t} NOT LIKE {p}");
        }
        assert_eq!(like("HeLLo", "hel%", true), Ok(true));
        assert_eq!(like("ÄBC", "äb_", true), Ok(true));
        assert_eq!(like("x", "x\\", false), Err(TrailingEscape));
    }

    /// The fastest of three matches of `re` on `text` (the least disturbed by a busy box).
    fn fastest(re: &Pattern, text: &str) -> std::time::Duration {
        (0..3)
            .map(|_| {
                let started = std::time::Instant::now();
                assert!(!re.is_match(text));
                started.elapsed()
            })
            .min()
            .expect("three runs")
    }

    #[test]
    fn a_pathological_pattern_on_a_long_value_is_fast() {
        // Backtracking matchers take O(n·m) (or worse) on these: n = 1 MiB, m = 1 KiB, i.e.
        // about a thousand times a linear scan of the value. Measured against a pattern that
        // needs one linear scan (`%b`), in the same process, so a loaded machine slows both:
        // an absolute bound failed under CI load (51 ms against 50).
        let text = "a".repeat(1 << 20);
        let scan = fastest(&compile("%b", false).expect("compiles"), &text);
        let patterns = [
            format!("%{}b", "a".repeat(1000)),
            format!("{}b", "%a".repeat(200)),
        ];
        for (pattern, fold) in patterns.iter().flat_map(|p| [(p, false), (p, true)]) {
            let re = compile(pattern, fold).expect("compiles");
            let took = fastest(&re, &text);
            assert!(
                took < scan * 50 + std::time::Duration::from_millis(50),
                "{took:?} for a 1 MiB value (fold: {fold}; one linear scan: {scan:?})"
            );
        }
        // Past the bound of a pattern's automaton: refused, saying why.
        let e = compile(&format!("{}b", "%a".repeat(511)), false).unwrap_err();
        assert!(e.contains("too complex"), "{e}");
    }
}
