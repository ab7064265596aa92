//! Connection strings with their secrets hidden, for logs, error messages and the effective
//! configuration a process prints at start.
//!
//! Both forms a Postgres or NATS address takes are covered:
//!
//! - **URLs** (`postgres://user:password@host/db?sslpassword=…`, `nats://token@host`, and
//!   comma-separated lists of them): the password of the user-info (an `@` inside it, left
//!   unencoded, included), a NATS URL's lone user-info (a token), and every query parameter
//!   whose name says it holds a secret ([`is_secret_name`]).
//! - **`key=value` strings** (libpq's `host=h password='a b\'c'`): every value whose key
//!   says it holds a secret, quoted or not; a string that cannot be read whole is hidden
//!   from the point where reading stopped.
//!
//! What is hidden becomes [`HIDDEN`]; everything else is kept as written, so the result
//! still says which host, database and options were meant.

/// What a hidden secret is shown as.
pub const HIDDEN: &str = "***";

/// `s`, a connection URL (or a comma-separated list of them) or a `key=value` connection
/// string, with every secret it holds replaced by [`HIDDEN`].
pub fn redact_url(s: &str) -> String {
    if scheme_end(s).is_some() {
        split_urls(s)
            .iter()
            .map(|u| redact_one_url(u))
            .collect::<Vec<_>>()
            .join(",")
    } else if looks_like_key_values(s) {
        redact_key_values(s)
    } else {
        // No scheme: `user:password@host:4222` (NATS takes it), or a plain host.
        redact_one_url(s)
    }
}

/// Whether `s` starts as a `key=value` string does: a word, then `=`.
fn looks_like_key_values(s: &str) -> bool {
    let s = s.trim_start();
    let word = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    word > 0 && s[word..].trim_start().starts_with('=')
}

/// Whether a parameter or key named `name` holds a secret: passwords (`password`,
/// `sslpassword`, `passphrase`, `pwd`…), tokens, keys, secrets and credentials, whatever
/// the case or percent-encoding of the name.
pub fn is_secret_name(name: &str) -> bool {
    let name = percent_decode(name).to_ascii_lowercase();
    ["pass", "pwd", "secret", "token", "key", "auth", "cred"]
        .iter()
        .any(|w| name.contains(w))
}

/// Where `s`'s `scheme://` ends, if it starts with one (`[A-Za-z][A-Za-z0-9+.-]*://`).
fn scheme_end(s: &str) -> Option<usize> {
    let i = s.find("://")?;
    let scheme = &s[..i];
    let mut chars = scheme.chars();
    let first = chars.next()?;
    let valid = first.is_ascii_alphabetic()
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'));
    valid.then_some(i + 3)
}

/// A comma-separated list of NATS URLs (as `NATS_URL` may be) cut into its URLs. Any
/// other part belongs to the URL before it (a Postgres URL's `host1,host2`, or a comma in
/// a password).
fn split_urls(s: &str) -> Vec<String> {
    let mut urls: Vec<String> = Vec::new();
    for part in s.split(',') {
        match urls.last_mut() {
            Some(last) if !(is_nats_url(last) && is_nats_url(part)) => {
                last.push(',');
                last.push_str(part);
            }
            _ => urls.push(part.to_string()),
        }
    }
    urls
}

/// Whether `s` starts with a NATS server's scheme.
fn is_nats_url(s: &str) -> bool {
    scheme_end(s).is_some_and(|end| is_nats_scheme(&s[..end - 3]))
}

fn is_nats_scheme(scheme: &str) -> bool {
    ["nats", "tls", "ws", "wss"]
        .iter()
        .any(|n| scheme.eq_ignore_ascii_case(n))
}

/// One URL, its scheme optional.
fn redact_one_url(url: &str) -> String {
    let (head, rest) = url.split_at(scheme_end(url).unwrap_or(0));
    let scheme = head.trim_end_matches("://");
    let (userinfo, after) = split_userinfo(rest);
    let mut out = String::with_capacity(url.len());
    out.push_str(head);
    if let Some(ui) = userinfo {
        match ui.split_once(':') {
            Some((user, _)) => {
                out.push_str(user);
                out.push(':');
                out.push_str(HIDDEN);
            }
            // A NATS URL's user-info without a password is a token (and a URL
            // without a scheme may be one).
            None if scheme.is_empty() || is_nats_scheme(scheme) => out.push_str(HIDDEN),
            None => out.push_str(ui),
        }
        out.push('@');
    }
    out.push_str(&redact_query(after));
    out
}

/// The user-info of what follows `scheme://`, and the rest. The user-info ends at the last
/// `@` (a password may hold an unencoded `@`); an `@` that comes after the path or the
/// query started is no user-info, unless a `:` before them says a password began (then
/// too much is hidden rather than too little).
fn split_userinfo(rest: &str) -> (Option<&str>, &str) {
    let Some(at) = rest.rfind('@') else {
        return (None, rest);
    };
    let (ui, after) = (&rest[..at], &rest[at + 1..]);
    match ui.find(['/', '?', '#']) {
        Some(cut) if !ui[..cut].contains(':') => (None, rest),
        _ => (Some(ui), after),
    }
}

/// A URL's host, path and query, the values of secret parameters hidden. Everything after
/// the `?` counts as the query (a `#` in a password is not taken for a fragment).
fn redact_query(s: &str) -> String {
    let Some(q) = s.find('?') else {
        return s.to_string();
    };
    let (before, query) = s.split_at(q + 1);
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if is_secret_name(k) => format!("{k}={HIDDEN}"),
            _ => p.to_string(),
        })
        .collect();
    format!("{before}{}", params.join("&"))
}

/// A libpq `key = value` string, secret values hidden. Values may be single-quoted, with
/// `\'` and `\\` escapes (unquoted ones may hold escapes too). What cannot be read (a key
/// without `=`, a quote left open) is hidden from there on.
fn redact_key_values(s: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let Some((key, value, tail)) = next_key_value(rest) else {
            out.push(HIDDEN.to_string());
            break;
        };
        if is_secret_name(key) {
            out.push(format!("{key}={HIDDEN}"));
        } else {
            out.push(format!("{key}={value}"));
        }
        rest = tail.trim_start();
    }
    out.join(" ")
}

/// The first `key = value` of `s` (which starts with the key): the key, the value as
/// written (quotes included) and what follows; `None` if it cannot be read.
fn next_key_value(s: &str) -> Option<(&str, &str, &str)> {
    let key_end = s.find(|c: char| c == '=' || c.is_whitespace())?;
    let key = &s[..key_end];
    let after_key = s[key_end..].trim_start();
    let value_start = after_key.strip_prefix('=')?.trim_start();
    let len = value_len(value_start)?;
    Some((key, &value_start[..len], &value_start[len..]))
}

/// The length of the value `s` starts with: a quoted one up to its closing quote, an
/// unquoted one up to the next whitespace (a backslash escapes the next character in
/// both). `None`: a quote left open or an escape at the very end.
fn value_len(s: &str) -> Option<usize> {
    let quoted = s.starts_with('\'');
    let mut chars = s.char_indices().skip(usize::from(quoted));
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next()?;
            }
            '\'' if quoted => return Some(i + 1),
            c if !quoted && c.is_whitespace() => return Some(i),
            _ => {}
        }
    }
    (!quoted).then_some(s.len())
}

/// `%xx` escapes decoded (as far as they form valid text; others are kept as written).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes.get(i + 1..i + 3).and_then(|h| {
            std::str::from_utf8(h)
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        });
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests;
