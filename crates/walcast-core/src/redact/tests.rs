use proptest::prelude::*;

use super::*;

#[test]
fn urls_keep_everything_but_their_secrets() {
    for (url, want) in [
        (
            "postgres://u:secret@h:5432/db",
            "postgres://u:***@h:5432/db",
        ),
        ("postgres://u@h/db", "postgres://u@h/db"),
        ("postgres://h/db", "postgres://h/db"),
        ("postgres://u:p@ss@h/db", "postgres://u:***@h/db"),
        ("postgres://u:pa/ss@h/db", "postgres://u:***@h/db"),
        ("postgres://:only@h/db", "postgres://:***@h/db"),
        ("nats://a:b:c@h", "nats://a:***@h"),
        ("nats://s3cr3ttoken@h:4222", "nats://***@h:4222"),
        ("u:pw@h:4222", "u:***@h:4222"),
        ("localhost:4222", "localhost:4222"),
        (
            "postgres://u:pw@h/db?sslmode=require&password=x2",
            "postgres://u:***@h/db?sslmode=require&password=***",
        ),
        (
            "postgresql:///db?host=/tmp&PassWord=x&user=u",
            "postgresql:///db?host=/tmp&PassWord=***&user=u",
        ),
        (
            "postgres://h/db?sslpassword=k&sslmode=verify-full#frag",
            "postgres://h/db?sslpassword=***&sslmode=verify-full#frag",
        ),
        (
            "postgres://h/db?pass%77ord=x",
            "postgres://h/db?pass%77ord=***",
        ),
        // An '@' in the query is no user-info.
        (
            "postgres://h/db?application_name=a@b",
            "postgres://h/db?application_name=a@b",
        ),
        (
            "postgres://u:p1@h1:5432,h2:5433/db",
            "postgres://u:***@h1:5432,h2:5433/db",
        ),
        (
            "nats://u:p1@h1:4222,nats://u:p2@h2:4222",
            "nats://u:***@h1:4222,nats://u:***@h2:4222",
        ),
        ("https://k8s:6443/?token=abc", "https://k8s:6443/?token=***"),
    ] {
        assert_eq!(redact_url(url), want, "{url}");
    }
}

#[test]
fn key_value_strings_hide_secret_values_quoted_or_not() {
    for (s, want) in [
        ("host=x password=y user=z", "host=x password=*** user=z"),
        ("host=x nopassword=y", "host=x nopassword=***"),
        (
            "host = x  password = 'a b\\' c' dbname=d",
            "host=x password=*** dbname=d",
        ),
        (
            "host=x sslpassword=k sslmode=require",
            "host=x sslpassword=*** sslmode=require",
        ),
        ("host=x password='never closed", "host=x ***"),
        ("host=x password", "host=x ***"),
        ("dbname='my db' PASSWORD=q", "dbname='my db' PASSWORD=***"),
        ("host=x password=a\\ b user=u", "host=x password=*** user=u"),
    ] {
        assert_eq!(redact_url(s), want, "{s}");
    }
}

/// A secret that never appears in the templates below (they hold no `Z`).
fn secret() -> impl Strategy<Value = String> {
    "Z[A-Za-z0-9 !#$%&'()*+,/:;=?@\\[\\]^_`{|}~\"\\\\.-]{3,24}"
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A libpq value: quoted, with `'` and `\` escaped.
fn quoted(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn assert_hidden(s: &str, secret: &str) -> Result<(), TestCaseError> {
    let shown = redact_url(s);
    prop_assert!(!shown.contains(secret), "{s:?} shown as {shown:?}");
    let encoded = percent_encode(secret);
    prop_assert!(!shown.contains(&encoded), "{s:?} shown as {shown:?}");
    Ok(())
}

proptest! {
    #[test]
    fn no_form_of_connection_string_shows_its_password(s in secret(), user in "[a-y]{1,8}") {
        let enc = percent_encode(&s);
        for url in [
            format!("postgres://{user}:{enc}@h:5432/db"),
            format!("postgres://{user}:{s}@h:5432/db"),
            format!("postgresql://{user}:{enc}@h1,h2/db?sslmode=require"),
            format!("nats://{user}:{enc}@h:4222"),
            format!("nats://{enc}@h:4222"),
            format!("nats://a:b@h1:4222,nats://{user}:{enc}@h2:4222"),
            format!("postgres://h/db?user={user}&password={enc}"),
            format!("postgres://h/db?sslpassword={enc}&sslmode=require"),
            format!("postgres://h/db?options=x#{user}&password={enc}"),
            format!("host=h user={user} password={} dbname=d", quoted(&s)),
            format!("host=h password = {} sslmode=disable", quoted(&s)),
            format!("host=h sslpassword={}", quoted(&s)),
        ] {
            assert_hidden(&url, &s)?;
        }
    }

    #[test]
    fn unquoted_key_values_hide_their_password(s in "Z[A-Za-z0-9!#$%&()*+,/:;<>?@^_`{|}~.-]{3,24}") {
        assert_hidden(&format!("host=h password={s} user=u"), &s)?;
        assert_hidden(&format!("password={s}"), &s)?;
    }

    #[test]
    fn redaction_never_panics(s in "\\PC{0,64}") {
        let _ = redact_url(&s);
    }
}
