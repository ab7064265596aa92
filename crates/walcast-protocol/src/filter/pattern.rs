//! The compiled form of a filter's pattern (`like`, `ilike`, `match`, `imatch`): a finite
//! automaton (no backtracking: time linear in the text) of bounded size, whose memory is
//! known, so that what a subscriber's filters cost can be counted and capped.

use regex_automata::meta::{Config, Regex};
use regex_automata::util::syntax;

/// The most bytes of automaton one pattern may compile to. A pattern's matching time on
/// a value grows with its automaton (`a.{N}c` on a 20 KB value: about 0.2 ms at this
/// size, 13 ms at 1 MiB), so this bounds the work of one pattern on one change.
pub const MAX_PATTERN_AUTOMATON: usize = 256 * 1024;
/// The lazy DFA's cache of one pattern (a pattern needing more falls back to a slower,
/// still linear, search rather than growing).
pub const PATTERN_CACHE_BYTES: usize = 256 * 1024;

/// A compiled pattern. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct Pattern {
    re: Regex,
}

impl Pattern {
    /// Whether the pattern matches somewhere in `text` (anchored patterns: the whole text).
    pub fn is_match(&self, text: &str) -> bool {
        self.re.is_match(text)
    }

    /// What it holds in memory: its automata, and the cache a search uses.
    pub fn heap_bytes(&self) -> usize {
        self.re.memory_usage() + PATTERN_CACHE_BYTES
    }
}

/// Compile a regular expression (`fold`: case-insensitive); `Err`: a readable reason.
pub(crate) fn compile(re: &str, fold: bool) -> Result<Pattern, String> {
    let built = Regex::builder()
        .syntax(syntax::Config::new().case_insensitive(fold))
        .configure(
            Config::new()
                .nfa_size_limit(Some(MAX_PATTERN_AUTOMATON))
                .hybrid_cache_capacity(PATTERN_CACHE_BYTES),
        )
        .build(re);
    match built {
        Ok(re) => Ok(Pattern { re }),
        Err(e) if e.syntax_error().is_none() => Err(format!(
            "the pattern is too complex: its automaton would exceed {} KiB",
            MAX_PATTERN_AUTOMATON / 1024
        )),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pattern_is_bounded_and_its_memory_known() {
        let small = compile("a.{10}c", false).expect("compiles");
        assert!(
            small.heap_bytes() >= PATTERN_CACHE_BYTES,
            "{}",
            small.heap_bytes()
        );
        assert!(small.heap_bytes() < MAX_PATTERN_AUTOMATON + PATTERN_CACHE_BYTES);
        for big in ["a.{1000}c", "(?i)\\w{50}", "(.*a){300}"] {
            let e = compile(big, false).unwrap_err();
            assert!(e.contains("too complex"), "{big}: {e}");
        }
        let e = compile("(", false).unwrap_err();
        assert!(!e.contains("too complex"), "a syntax error says so: {e}");
        let fold = compile("^é.$", true).expect("compiles");
        assert!(fold.is_match("Éx") && !fold.is_match("ex"));
    }
}
