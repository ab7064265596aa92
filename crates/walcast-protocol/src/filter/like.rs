//! SQL `LIKE` / `ILIKE` matching.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok {
    /// `%` (or PostgREST's `*`): any sequence.
    Any,
    /// `_`: one character.
    One,
    /// A literal character.
    Lit(char),
}

/// A pattern ends with a lone escape character (Postgres rejects it too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TrailingEscape;

fn compile(pattern: &str, fold: bool) -> Result<Vec<Tok>, TrailingEscape> {
    let mut toks = Vec::with_capacity(pattern.len());
    let mut chars = pattern.chars();
    while let Some(c) = chars.next() {
        let tok = match c {
            '%' | '*' => Tok::Any,
            '_' => Tok::One,
            '\\' => Tok::Lit(chars.next().ok_or(TrailingEscape)?),
            c => Tok::Lit(c),
        };
        let tok = match tok {
            Tok::Lit(c) if fold => Tok::Lit(fold_char(c)),
            t => t,
        };
        if tok == Tok::Any && toks.last() == Some(&Tok::Any) {
            continue;
        }
        toks.push(tok);
    }
    Ok(toks)
}

fn fold_char(c: char) -> char {
    // Simple case folding: single-char lowercase mapping.
    let mut lower = c.to_lowercase();
    match (lower.next(), lower.next()) {
        (Some(l), None) => l,
        _ => c,
    }
}

/// Whether `text` matches `pattern` entirely; `fold` = case-insensitive (`ILIKE`).
pub(crate) fn like(text: &str, pattern: &str, fold: bool) -> Result<bool, TrailingEscape> {
    let toks = compile(pattern, fold)?;
    let text: Vec<char> = if fold {
        text.chars().map(fold_char).collect()
    } else {
        text.chars().collect()
    };
    // Iterative wildcard matching with a single backtrack point (linear in practice).
    let (mut t, mut p) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match toks.get(p) {
            Some(Tok::Any) => {
                star = Some((p, t));
                p += 1;
            }
            Some(Tok::One) => {
                t += 1;
                p += 1;
            }
            Some(Tok::Lit(c)) if text.get(t) == Some(c) => {
                t += 1;
                p += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return Ok(false),
            },
        }
    }
    Ok(toks[p.min(toks.len())..].iter().all(|t| *t == Tok::Any))
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
        ];
        for (t, p) in no {
            assert_eq!(like(t, p, false), Ok(false), "{t} NOT LIKE {p}");
        }
        assert_eq!(like("HeLLo", "hel%", true), Ok(true));
        assert_eq!(like("ÄBC", "äb_", true), Ok(true));
        assert_eq!(like("x", "x\\", false), Err(TrailingEscape));
    }
}
