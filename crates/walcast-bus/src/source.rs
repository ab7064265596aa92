//! Sources: the databases walcast reads. Each has a name; the default one
//! ([`DEFAULT_SOURCE`]) is the deployment's own `DATABASE_URL`, every other one is a row
//! of the control database's `walcast.sources`. A project belongs to one source.
//!
//! Each source has its own leader (its own lease, term and fence). Everything a front
//! asks of "the leader" (registrations, resync, resends, private-channel checks, REST
//! enables) goes to the leader of the project's source, on that source's subjects
//! ([`subject`]): the default source keeps the subjects walcast always used
//! (`walcast.cdc.…`), another source `s` uses `walcast.src.s.cdc.…`. Every message a
//! leader sends to a front carries its source in [`HEADER_SOURCE`] (absent: the default).

/// The name of the default source (the deployment's `DATABASE_URL`).
pub const DEFAULT_SOURCE: &str = "default";

/// Header naming the source whose leader published a message (absent: the default).
pub const HEADER_SOURCE: &str = "Walcast-Source";

/// The prefix of every non-default source's subjects.
pub const SOURCE_PREFIX: &str = "walcast.src";

/// Longest source name: it is part of Postgres `application_name`s (at most 63 bytes,
/// with the process's own tag) and of subjects.
pub const MAX_NAME_LEN: usize = 30;

/// The source named by a [`HEADER_SOURCE`] value (absent: the default).
pub fn of_header(value: Option<&str>) -> &str {
    value.unwrap_or(DEFAULT_SOURCE)
}

/// Whether `source` is the default source.
pub fn is_default(source: &str) -> bool {
    source == DEFAULT_SOURCE
}

/// The subject of `base` (a `walcast.…` subject) for `source`: `base` itself for the
/// default source, `walcast.src.<source>.…` for another.
pub fn subject(source: &str, base: &str) -> String {
    if is_default(source) {
        return base.to_string();
    }
    let rest = base.strip_prefix("walcast.").unwrap_or(base);
    format!("{SOURCE_PREFIX}.{source}.{rest}")
}

/// The subscription pattern of `base` for every non-default source.
pub fn every_other(base: &str) -> String {
    subject("*", base)
}

/// The source of a subject made by [`subject`] from `base` (`None`: not one of them).
pub fn of_subject<'a>(subject: &'a str, base: &str) -> Option<&'a str> {
    if subject == base {
        return Some(DEFAULT_SOURCE);
    }
    let rest = base.strip_prefix("walcast.").unwrap_or(base);
    let tail = subject.strip_prefix(SOURCE_PREFIX)?.strip_prefix('.')?;
    let (name, after) = tail.split_once('.')?;
    (after == rest && check_name(name).is_ok()).then_some(name)
}

/// Why a source name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SourceNameError {
    #[error("a source name must not be empty")]
    Empty,
    #[error("a source name is at most {MAX_NAME_LEN} characters")]
    TooLong,
    #[error("a source name starts with a lower-case letter and has only lower-case letters, digits, '-' and '_'")]
    Characters,
}

/// A source name: `[a-z][a-z0-9_-]*`, at most [`MAX_NAME_LEN`] characters (safe in a
/// subject token, an `application_name`, a Kubernetes name and a metric label).
pub fn check_name(name: &str) -> Result<&str, SourceNameError> {
    let mut chars = name.chars();
    let Some(first) = chars.next() else {
        return Err(SourceNameError::Empty);
    };
    if name.len() > MAX_NAME_LEN {
        return Err(SourceNameError::TooLong);
    }
    let rest_ok = chars.all(|c| matches!(c, 'a'..='z' | '0'..='9' | '-' | '_'));
    if !first.is_ascii_lowercase() || !rest_ok {
        return Err(SourceNameError::Characters);
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_source_keeps_todays_subjects() {
        assert_eq!(
            subject(DEFAULT_SOURCE, "walcast.cdc.subs.register"),
            "walcast.cdc.subs.register"
        );
        assert_eq!(
            subject("shop-db", "walcast.cdc.subs.register"),
            "walcast.src.shop-db.cdc.subs.register"
        );
        assert_eq!(every_other("walcast.cdc.admin"), "walcast.src.*.cdc.admin");
    }

    #[test]
    fn subjects_name_their_source() {
        let base = "walcast.cdc.subs.resync";
        assert_eq!(of_subject(base, base), Some(DEFAULT_SOURCE));
        assert_eq!(
            of_subject("walcast.src.shop.cdc.subs.resync", base),
            Some("shop")
        );
        assert_eq!(of_subject("walcast.src.shop.cdc.subs.sync", base), None);
        assert_eq!(of_subject("walcast.src.Shop.cdc.subs.resync", base), None);
        assert_eq!(of_subject("walcast.cdc.other", base), None);
    }

    #[test]
    fn names_are_plain_words() {
        for ok in ["a", "shop-db", "db_2", "abcdefghijklmnopqrstuvwxyz0123"] {
            assert_eq!(check_name(ok), Ok(ok));
        }
        assert_eq!(check_name(""), Err(SourceNameError::Empty));
        assert_eq!(
            check_name("abcdefghijklmnopqrstuvwxyz01234"),
            Err(SourceNameError::TooLong)
        );
        for bad in ["1db", "Shop", "a.b", "a*", "a>", "a b", "-a", "é", "a\u{0}"] {
            assert_eq!(check_name(bad), Err(SourceNameError::Characters), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_header_is_the_default_source() {
        assert_eq!(of_header(None), DEFAULT_SOURCE);
        assert_eq!(of_header(Some("shop")), "shop");
    }
}
