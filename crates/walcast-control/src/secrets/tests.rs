use proptest::prelude::*;

use super::*;

const A: &str = "key-a-0123456789abcdef0123456789abcdef";
const B: &str = "key-b-0123456789abcdef0123456789abcdef";

fn keys(current: &str, previous: Option<&str>) -> SecretKeys {
    SecretKeys::new(current, previous).unwrap()
}

fn here(row: &str) -> Place<'_> {
    Place::project("jwt_secret", row)
}

#[test]
fn a_value_round_trips_and_names_its_key() {
    let k = keys(A, None);
    let sealed = k.seal(here("p1"), "s3cret").unwrap();
    assert!(
        sealed.starts_with(&format!("{PREFIX}{}:", k.key_id())),
        "{sealed}"
    );
    assert!(!sealed.contains("s3cret"));
    assert_eq!(k.open(here("p1"), &sealed).unwrap(), "s3cret");
    assert_eq!(k.classify(&sealed), Stored::Current);
    assert_eq!(k.key_id().len(), 8);
    assert_ne!(
        k.seal(here("p1"), "s3cret").unwrap(),
        sealed,
        "a nonce of its own per value"
    );
    assert_eq!(keys(A, None).key_id(), k.key_id(), "one string, one key");
    assert_ne!(keys(B, None).key_id(), k.key_id());
    assert_eq!(
        k.seal_opt(here("p1"), None).unwrap(),
        None,
        "nothing to hide"
    );
    assert_eq!(k.open_opt(here("p1"), None).unwrap(), None);
}

#[test]
fn keys_are_checked() {
    assert!(matches!(
        SecretKeys::new("short", None),
        Err(SecretError::ShortKey { option: KEY_OPTION })
    ));
    assert!(matches!(
        SecretKeys::new(A, Some("short")),
        Err(SecretError::ShortKey {
            option: PREVIOUS_KEY_OPTION
        })
    ));
    assert!(matches!(
        SecretKeys::new(A, Some(A)),
        Err(SecretError::SameKey)
    ));
    assert!(SecretKeys::new(A, Some(""))
        .unwrap()
        .previous_key_id()
        .is_none());
    let debug = format!("{:?}", keys(A, Some(B)));
    assert!(
        !debug.contains("key-a") && !debug.contains("key-b"),
        "{debug}"
    );
}

#[test]
fn a_wrong_key_is_an_error_naming_the_key_needed() {
    let sealed = keys(A, None).seal(here("p1"), "s3cret").unwrap();
    let other = keys(B, None);
    let e = other.open(here("p1"), &sealed).unwrap_err();
    assert!(e.is_unknown_key(), "{e}");
    let a_id = keys(A, None).key_id().to_string();
    let text = e.to_string();
    assert!(
        text.contains(&format!("encrypted with key {a_id}"))
            && text.contains(other.key_id())
            && text.contains("SECRETS_KEY_PREVIOUS is unset")
            && text.contains("walcast.projects.jwt_secret of \"p1\""),
        "{text}"
    );
    assert_eq!(other.classify(&sealed), Stored::Unknown(a_id));
}

#[test]
fn the_previous_key_reads_during_a_rotation() {
    let sealed = keys(A, None).seal(here("p1"), "s3cret").unwrap();
    let rotating = keys(B, Some(A));
    assert_eq!(rotating.classify(&sealed), Stored::Previous);
    assert_eq!(rotating.open(here("p1"), &sealed).unwrap(), "s3cret");
    let again = rotating.seal(here("p1"), "s3cret").unwrap();
    assert_eq!(rotating.classify(&again), Stored::Current);
    let e = keys(A, None).open(here("p1"), &again).unwrap_err();
    assert!(e.is_unknown_key(), "the new key is needed now: {e}");
}

#[test]
fn plain_and_malformed_values_are_named() {
    let k = keys(A, None);
    assert_eq!(k.classify("0123abcd"), Stored::Plain);
    assert_eq!(k.classify("postgres://u:pw@h/db"), Stored::Plain);
    let e = k.open(here("p1"), "0123abcd").unwrap_err();
    assert!(matches!(e, SecretError::Plain { .. }), "{e}");
    assert!(
        !e.to_string().contains("0123abcd"),
        "the value is never told: {e}"
    );
    for bad in [
        "enc:v2:00000000:AAAA",
        "enc:v1:",
        "enc:v1:xyz:AAAA",
        "enc:v1:0000:AA",
    ] {
        assert!(
            matches!(k.classify(bad), Stored::Malformed(_)),
            "{bad}: {:?}",
            k.classify(bad)
        );
        let e = k.open(here("p1"), bad).unwrap_err();
        assert!(matches!(e, SecretError::Malformed { .. }), "{bad}: {e}");
    }
    let id = k.key_id();
    for bad in [
        format!("{PREFIX}{id}:"),
        format!("{PREFIX}{id}:not base64!"),
        format!("{PREFIX}{id}:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),
    ] {
        let e = k.open(here("p1"), &bad).unwrap_err();
        assert!(matches!(e, SecretError::Corrupt { .. }), "{bad}: {e}");
    }
}

/// Every column and row a value may be moved to.
fn places() -> Vec<Place<'static>> {
    let mut all = Vec::new();
    for row in ["p1", "p2", "p1\u{1}", "", "shop"] {
        for column in ["jwt_secret", "jwt_secret_previous"] {
            all.push(Place::project(column, row));
        }
        for column in ["database_url", "replication_url", "check_url"] {
            all.push(Place::source(column, row));
        }
    }
    all
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn any_value_round_trips(plain in ".*", row in "[a-z0-9_-]{0,40}") {
        let k = keys(A, None);
        let place = Place::source("database_url", &row);
        let sealed = k.seal(place, &plain).unwrap();
        prop_assert!(sealed.starts_with(PREFIX));
        prop_assert_eq!(k.open(place, &sealed).unwrap(), plain);
    }

    /// A ciphertext copied to any other row or column does not decrypt.
    #[test]
    fn a_value_moved_elsewhere_does_not_decrypt(plain in ".{0,64}", from in 0usize..40) {
        let k = keys(A, None);
        let all = places();
        let from = all[from % all.len()];
        let sealed = k.seal(from, &plain).unwrap();
        for to in all.iter().filter(|p| **p != from) {
            let e = k.open(*to, &sealed).unwrap_err();
            prop_assert!(matches!(e, SecretError::Corrupt { .. }), "{} → {}: {}", from, to, e);
        }
    }

    /// Any change of any character of a stored value is refused, never read as another
    /// plain text.
    #[test]
    fn a_tampered_value_is_refused(plain in ".{0,64}", at in any::<prop::sample::Index>(), to in any::<char>()) {
        let k = keys(A, Some(B));
        let sealed = k.seal(here("p1"), &plain).unwrap();
        let mut chars: Vec<char> = sealed.chars().collect();
        let i = at.index(chars.len());
        prop_assume!(chars[i] != to);
        chars[i] = to;
        let tampered: String = chars.into_iter().collect();
        if let Ok(got) = k.open(here("p1"), &tampered) {
            prop_assert!(false, "{} opened as {:?}", tampered, got);
        }
    }

    /// A truncated or extended value is refused too.
    #[test]
    fn a_cut_or_extended_value_is_refused(plain in ".{0,64}", cut in 1usize..200, extra in "[A-Za-z0-9_-]{1,8}") {
        let k = keys(A, None);
        let sealed = k.seal(here("p1"), &plain).unwrap();
        let cut = &sealed[..sealed.len().saturating_sub(cut)];
        prop_assert!(k.open(here("p1"), cut).is_err());
        let longer = format!("{sealed}{extra}");
        prop_assert!(k.open(here("p1"), &longer).is_err());
    }
}
