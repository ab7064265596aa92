//! NATS subjects for changes: `walcast.realtime.<project>.<schema>.<table>`.
//!
//! A NATS token may not be empty or contain `.`, `*`, `>` or white space, and should stay
//! printable ASCII; a whole subject must fit nats-server's control line (4 KB by default),
//! or the server cuts the connection that published it — the one every part of a
//! process shares. Names are encoded token by token: ASCII letters, digits, `_` and `-`
//! stay as they are; every other byte of the UTF-8 form becomes `~XX` (upper-case hex),
//! `~` included; the empty name is the lone token `~`. A name whose encoding would be
//! longer than [`MAX_TOKEN_CHARS`] (a client's channel name, say; never a Postgres
//! identifier, at most 63 bytes) becomes a *digest token*: the first characters of its
//! encoding, `~~`, and the SHA-256 of the name in hex. No plain encoding contains `~~`
//! (an escape's `~` is always followed by two hex digits), so the encoding stays
//! injective (but for a SHA-256 collision) and bounded; a digest token cannot be decoded,
//! and a message whose receivers need the name back carries it in its payload (as a
//! broadcast's head line does).

use sha2::{Digest, Sha256};

/// The longest token [`encode_token`] writes: the encoding of any name of up to 64 bytes
/// (a Postgres identifier, a project id) fits as it is, and a subject of a few such tokens
/// stays far below nats-server's 4 KB control line.
pub const MAX_TOKEN_CHARS: usize = 192;
/// How much of a long name's encoding leads its digest token (for people reading
/// subjects).
const DIGEST_LEAD_CHARS: usize = 32;
/// What separates a digest token's lead from its digest.
const DIGEST_MARK: &str = "~~";

/// Prefix of every realtime change subject.
pub const REALTIME_PREFIX: &str = "walcast.realtime";
/// Subscribes to every realtime change.
pub const REALTIME_ALL: &str = "walcast.realtime.>";

/// Why a subject could not be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SubjectError {
    #[error("subject does not start with {REALTIME_PREFIX}.")]
    Prefix,
    #[error("subject must have exactly project, schema and table tokens after the prefix")]
    TokenCount,
    #[error("bad escape in subject token {0:?}")]
    Escape(String),
    #[error("subject token {0:?} is not UTF-8 once decoded")]
    Utf8(String),
    #[error("subject token {0:?} is the digest of a long name, which it cannot give back")]
    Digest(String),
}

fn is_plain(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// Encode one name as a subject token (at most [`MAX_TOKEN_CHARS`] characters, valid in
/// any subject position; see the module docs).
pub fn encode_token(ident: &str) -> String {
    if ident.is_empty() {
        return "~".to_string();
    }
    let mut out = String::with_capacity(ident.len().min(MAX_TOKEN_CHARS));
    for &b in ident.as_bytes() {
        if is_plain(b) {
            out.push(b as char);
        } else {
            out.push('~');
            out.push(char::from(HEX[(b >> 4) as usize]));
            out.push(char::from(HEX[(b & 0xF) as usize]));
        }
        if out.len() > MAX_TOKEN_CHARS {
            return digest_token(&out, ident);
        }
    }
    out
}

/// The token of a name too long to spell: the start of its encoding `escaped` (cut
/// between escapes), [`DIGEST_MARK`], and the SHA-256 of the name.
fn digest_token(escaped: &str, ident: &str) -> String {
    let bytes = escaped.as_bytes();
    let mut lead = 0;
    loop {
        let step = if bytes.get(lead) == Some(&b'~') { 3 } else { 1 };
        if lead + step > DIGEST_LEAD_CHARS || lead + step > bytes.len() {
            break;
        }
        lead += step;
    }
    let digest = Sha256::digest(ident.as_bytes());
    let mut out = String::with_capacity(lead + DIGEST_MARK.len() + 2 * digest.len());
    out.push_str(&escaped[..lead]);
    out.push_str(DIGEST_MARK);
    for b in digest {
        out.push(char::from(HEX[(b >> 4) as usize]));
        out.push(char::from(HEX[(b & 0xF) as usize]));
    }
    out
}

/// Whether a token is the digest of a long name (see [`encode_token`]).
pub fn is_digest(token: &str) -> bool {
    token.contains(DIGEST_MARK)
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex_val(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Decode a token made by [`encode_token`].
pub fn decode_token(token: &str) -> Result<String, SubjectError> {
    if token == "~" {
        return Ok(String::new());
    }
    if is_digest(token) {
        return Err(SubjectError::Digest(token.to_string()));
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'~' {
            let hi = bytes.get(i + 1).copied().and_then(hex_val);
            let lo = bytes.get(i + 2).copied().and_then(hex_val);
            match (hi, lo) {
                (Some(h), Some(l)) => out.push(h << 4 | l),
                _ => return Err(SubjectError::Escape(token.to_string())),
            }
            i += 3;
        } else if is_plain(b) {
            out.push(b);
            i += 1;
        } else {
            return Err(SubjectError::Escape(token.to_string()));
        }
    }
    if out.is_empty() {
        return Err(SubjectError::Escape(token.to_string()));
    }
    String::from_utf8(out).map_err(|_| SubjectError::Utf8(token.to_string()))
}

/// The subject for a change of `schema.table` in `project`.
pub fn change_subject(project: &str, schema: &str, table: &str) -> String {
    format!(
        "{REALTIME_PREFIX}.{}.{}.{}",
        encode_token(project),
        encode_token(schema),
        encode_token(table)
    )
}

/// Prefix of the change-stream subjects (README "Change streams"): the same events as
/// on [`change_subject`], for the tables whose change stream is on, published to
/// JetStream (stream `WALCAST_CHANGES`) with a `Nats-Msg-Id`. A subject of its own: a
/// stream over `walcast.realtime.>` would also store the core copies, without an id.
pub const CHANGES_PREFIX: &str = "walcast.changes";
/// Every change-stream subject.
pub const CHANGES_ALL: &str = "walcast.changes.>";

/// `walcast.changes.<project>.<schema>.<table>`, tokens encoded as [`change_subject`]'s.
pub fn changes_subject(project: &str, schema: &str, table: &str) -> String {
    format!(
        "{CHANGES_PREFIX}.{}.{}.{}",
        encode_token(project),
        encode_token(schema),
        encode_token(table)
    )
}

/// Prefix of the per-front delivery subjects.
pub const DELIVER_PREFIX: &str = "walcast.deliver";

/// The subject on which the cdc-worker sends one front the changes its subscriptions
/// matched, with their audience (see [`crate::event::ChangeEvent::subs`]). Only that
/// front listens: no front parses what another's subscribers may see.
pub fn delivery_subject(front: &str) -> String {
    format!("{DELIVER_PREFIX}.{}", encode_token(front))
}

/// The subscription pattern for every change of one project.
pub fn project_pattern(project: &str) -> String {
    format!("{REALTIME_PREFIX}.{}.>", encode_token(project))
}

/// Split a change subject back into (project, schema, table).
pub fn parse_change_subject(subject: &str) -> Result<(String, String, String), SubjectError> {
    let rest = subject
        .strip_prefix(REALTIME_PREFIX)
        .and_then(|r| r.strip_prefix('.'))
        .ok_or(SubjectError::Prefix)?;
    let tokens: Vec<&str> = rest.split('.').collect();
    if tokens.len() != 3 {
        return Err(SubjectError::TokenCount);
    }
    Ok((
        decode_token(tokens[0])?,
        decode_token(tokens[1])?,
        decode_token(tokens[2])?,
    ))
}

/// NATS wildcard matching (`*` one token, `>` the rest), for the in-process bus.
pub fn matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn valid_token(t: &str) -> bool {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_graphic() && b != b'.' && b != b'*' && b != b'>')
    }

    #[test]
    fn plain_names_stay_readable() {
        assert_eq!(
            change_subject("default", "public", "todos"),
            "walcast.realtime.default.public.todos"
        );
    }

    #[test]
    fn awkward_names_are_escaped() {
        assert_eq!(encode_token("a.b"), "a~2Eb");
        assert_eq!(encode_token("My Table"), "My~20Table");
        assert_eq!(encode_token(">"), "~3E");
        assert_eq!(encode_token("~"), "~7E");
        assert_eq!(encode_token(""), "~");
        assert_eq!(encode_token("é"), "~C3~A9");
    }

    #[test]
    fn bad_tokens_are_typed_errors() {
        assert!(decode_token("~4").is_err());
        assert!(decode_token("a b").is_err());
        assert!(decode_token("~FF").is_err());
        assert_eq!(
            parse_change_subject("walcast.realtime.a.b"),
            Err(SubjectError::TokenCount)
        );
        assert_eq!(
            parse_change_subject("other.a.b.c"),
            Err(SubjectError::Prefix)
        );
    }

    #[test]
    fn wildcards() {
        assert!(matches("walcast.realtime.>", "walcast.realtime.a.b.c"));
        assert!(!matches("walcast.realtime.>", "walcast.realtime"));
        assert!(matches("walcast.*.a", "walcast.x.a"));
        assert!(!matches("walcast.*.a", "walcast.x.b"));
        assert!(matches(
            &project_pattern("p 1"),
            &change_subject("p 1", "s", "t")
        ));
        assert!(!matches(
            &project_pattern("p"),
            &change_subject("p2", "s", "t")
        ));
    }

    #[test]
    fn long_names_become_bounded_digest_tokens() {
        // A Postgres identifier (63 bytes) is always spelled, even all escapes.
        let ident = "é".repeat(31);
        assert_eq!(decode_token(&encode_token(&ident)), Ok(ident));
        for name in [
            "k".repeat(1500),
            "é".repeat(1500),
            "🙂".repeat(700),
            ".".repeat(65),
        ] {
            let t = encode_token(&name);
            assert!(t.len() <= MAX_TOKEN_CHARS && valid_token(&t), "{t}");
            assert!(is_digest(&t), "{t}");
            assert_eq!(decode_token(&t), Err(SubjectError::Digest(t.clone())));
        }
        // The lead is cut between escapes, and tells the name apart from its neighbours.
        let t = encode_token(&format!("ab{}", ".".repeat(100)));
        assert!(t.starts_with("ab~2E~2E~2E~2E~2E~2E~2E~2E~2E~2E~~"), "{t}");
        let long = "k".repeat(1500);
        assert_ne!(
            encode_token(&format!("{long}1")),
            encode_token(&format!("{long}2"))
        );
        assert_eq!(encode_token(&long), encode_token(&long.clone()));
    }

    /// A name of at most 64 bytes (a Postgres identifier, a project id).
    fn ident() -> impl Strategy<Value = String> {
        ".{0,64}".prop_map(|mut s| {
            while s.len() > 64 {
                s.pop();
            }
            s
        })
    }

    proptest! {
        #[test]
        fn any_name_gives_a_bounded_valid_token(name in ".{0,300}") {
            let t = encode_token(&name);
            prop_assert!(t.len() <= MAX_TOKEN_CHARS, "{} chars", t.len());
            prop_assert!(valid_token(&t), "invalid token {t:?}");
            match decode_token(&t) {
                Ok(back) => prop_assert_eq!(back, name),
                Err(SubjectError::Digest(_)) => prop_assert!(name.len() > MAX_TOKEN_CHARS / 3),
                Err(e) => prop_assert!(false, "{e}"),
            }
        }

        #[test]
        fn any_identifier_round_trips(p in ident(), s in ident(), t in ident()) {
            let subject = change_subject(&p, &s, &t);
            for token in subject.split('.') {
                prop_assert!(valid_token(token), "invalid token {token:?}");
            }
            prop_assert_eq!(parse_change_subject(&subject), Ok((p, s, t)));
        }

        #[test]
        fn distinct_names_get_distinct_tokens(a in ".{0,300}", b in ".{0,300}") {
            prop_assume!(a != b);
            prop_assert_ne!(encode_token(&a), encode_token(&b));
        }

        #[test]
        fn long_names_differing_at_the_end_get_distinct_tokens(
            lead in ".{70,120}", a in ".{0,4}", b in ".{0,4}"
        ) {
            prop_assume!(a != b);
            let (x, y) = (format!("{lead}{a}"), format!("{lead}{b}"));
            prop_assert_ne!(encode_token(&x), encode_token(&y));
        }

        #[test]
        fn decoding_arbitrary_text_never_panics(s in "\\PC*") {
            let _ = decode_token(&s);
            let _ = parse_change_subject(&s);
        }
    }
}
