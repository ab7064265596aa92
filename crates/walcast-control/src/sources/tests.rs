use super::*;

fn new(name: &str) -> NewSource {
    NewSource {
        name: name.to_string(),
        database_url: "postgres://u:pw@h/db".to_string(),
        check_url: Some("postgres://check:pw@h/db".to_string()),
        ..NewSource::default()
    }
}

#[test]
fn names_are_checked_and_the_default_refused() {
    let ok = new("shop-db").checked().unwrap();
    assert_eq!(ok.slot_name.as_deref(), Some("walcast_src_shop_db"));
    assert_eq!(ok.replication_url, None);
    let thirty = "a".repeat(30);
    assert!(new(&thirty).checked().is_ok());
    for bad in ["../x", "a.b", "*", "Default", "", "1a", "-a", "a b", "é"] {
        let e = new(bad).checked().unwrap_err();
        assert!(matches!(e, SourceError::Name { .. }), "{bad:?}: {e}");
        assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
    }
    let e = new(&"a".repeat(31)).checked().unwrap_err();
    assert!(
        matches!(
            e,
            SourceError::Name {
                error: SourceNameError::TooLong,
                ..
            }
        ),
        "{e}"
    );
    assert!(matches!(
        new("default").checked().unwrap_err(),
        SourceError::Default
    ));
    let no_url = NewSource {
        database_url: "  ".into(),
        ..new("a")
    };
    assert!(matches!(
        no_url.checked().unwrap_err(),
        SourceError::NoDatabaseUrl(_)
    ));
    for blank in [None, Some(" ")] {
        let no_check = NewSource {
            check_url: blank.map(Into::into),
            ..new("a")
        };
        assert!(matches!(
            no_check.checked().unwrap_err(),
            SourceError::NoCheckUrl(_)
        ));
    }
}

#[test]
fn slot_names_are_plain() {
    assert_eq!(default_slot_name("a-b_c"), "walcast_src_a_b_c");
    // The longest source name gives a slot name Postgres accepts.
    assert!(check_slot_name(&default_slot_name(&"a".repeat(30))).is_ok());
    for good in ["a", "0", "my_slot", &"x".repeat(63)] {
        assert!(check_slot_name(good).is_ok(), "{good}");
    }
    for bad in ["", "A", "a-b", "a b", "a.b", &"x".repeat(64), "slot;drop"] {
        assert!(check_slot_name(bad).is_err(), "{bad:?}");
        let given = NewSource {
            slot_name: Some(bad.to_string()),
            ..new("a")
        };
        assert!(
            matches!(given.checked(), Err(SourceError::SlotName(_))),
            "{bad:?}"
        );
    }
    let blank_repl = NewSource {
        replication_url: Some(" ".into()),
        slot_name: Some("mine".into()),
        ..new("a")
    };
    let c = blank_repl.checked().unwrap();
    assert_eq!(
        (c.replication_url, c.slot_name.as_deref()),
        (None, Some("mine"))
    );
}

fn source(name: &str, db: Option<&str>, repl: Option<&str>, slot: Option<&str>) -> Source {
    Source {
        name: name.into(),
        database_url: db.map(Into::into),
        replication_url: repl.map(Into::into),
        slot_name: slot.map(Into::into),
        check_url: db.map(|d| format!("{d}-check")),
        created_at: "2026-01-01T00:00:00.000Z".into(),
    }
}

#[test]
fn effective_urls_and_slots() {
    let d = source("default", None, None, None);
    let urls = |db: &str, repl: &str| SourceUrls {
        database_url: db.into(),
        replication_url: repl.into(),
        check_url: Some(format!("{db}-check")),
    };
    assert_eq!(
        d.urls("postgres://ctl", None, Some("postgres://ctl-check")),
        urls("postgres://ctl", "postgres://ctl")
    );
    assert_eq!(
        d.urls(
            "postgres://ctl",
            Some("postgres://repl"),
            Some("postgres://ctl-check")
        ),
        urls("postgres://ctl", "postgres://repl")
    );
    assert_eq!(d.slot("walcast"), "walcast");
    let s = source(
        "shop",
        Some("postgres://shop"),
        None,
        Some("walcast_src_shop"),
    );
    assert_eq!(
        s.urls(
            "postgres://ctl",
            Some("postgres://repl"),
            Some("postgres://ctl-check")
        ),
        urls("postgres://shop", "postgres://shop")
    );
    assert_eq!(s.slot("walcast"), "walcast_src_shop");
    let s = source(
        "shop",
        Some("postgres://shop"),
        Some("postgres://shop-r"),
        Some("x"),
    );
    assert_eq!(
        s.urls("postgres://ctl", None, None),
        urls("postgres://shop", "postgres://shop-r")
    );
}

#[test]
fn passwords_are_hidden() {
    for (url, want) in [
        (
            "postgres://u:secret@h:5432/db",
            "postgres://u:***@h:5432/db",
        ),
        ("postgres://u@h/db", "postgres://u@h/db"),
        ("postgres://h/db", "postgres://h/db"),
        ("postgres://u:p@ss@h/db", "postgres://u:***@h/db"),
        (
            "postgres://u:pw@h/db?sslmode=require&password=x2",
            "postgres://u:***@h/db?sslmode=require&password=***",
        ),
        (
            "postgres://h/db?password=x&user=u",
            "postgres://h/db?password=***&user=u",
        ),
        // An '@' after the authority is not a user-info.
        (
            "postgres://h/db?application_name=a@b",
            "postgres://h/db?application_name=a@b",
        ),
        ("host=x password=y user=z", "host=x password=*** user=z"),
        ("host=x sslpassword=y", "host=x sslpassword=***"),
    ] {
        assert_eq!(redact_url(url), want, "{url}");
    }
    let s = source(
        "shop",
        Some("postgres://u:pw1@h/db"),
        Some("postgres://r:pw2@h/db"),
        Some("s"),
    );
    let v = s.view().to_string();
    assert!(!v.contains("pw1") && !v.contains("pw2"), "{v}");
    assert!(v.contains("postgres://u:***@h/db"), "{v}");
}
