//! Signed logical messages (`walcast-control/sql/0012_trust.sql`, `walcast-control/sql/0013_signed_messages.sql`).
//!
//! Any role may call `pg_logical_emit_message`, so the content of a `walcast.*` message
//! proves nothing by itself. walcast's own functions write theirs through
//! `walcast.emit_signed`, which prefixes the content with a MAC under a key only
//! walcast's role can read (`walcast.message_key`):
//! `hex(sha256(key ":" prefix ":" sha256(body)))`, 64 hex digits, then the body. The
//! driver checks every such message with [`verify`] before any consumer sees it; one that
//! fails is skipped and counted, never trusted, and consumers get only the body.

use std::borrow::Cow;

use sha2::{Digest, Sha256};
use tokio_postgres::Client;
use walcast_wal2json::Lsn;

use crate::PipelineError;

/// Messages whose prefix starts with this are walcast's own and must be signed.
pub const SIGNED_PREFIX: &str = "walcast.";
/// Hex digits of the MAC in front of the body.
pub const MAC_HEX: usize = 64;

/// The key messages are signed with (`walcast.message_key`), and where signing started
/// (`walcast.message_signing`). Its `Debug` hides the key.
#[derive(Clone)]
pub struct MessageKey {
    key: String,
    /// Transactions that committed at or before this position predate signing: their
    /// messages were written unsigned by walcast's former functions and are taken as
    /// they are.
    unsigned_until: Lsn,
}

impl std::fmt::Debug for MessageKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MessageKey(.., unsigned_until: {})", self.unsigned_until)
    }
}

impl MessageKey {
    /// A key with nothing taken unsigned.
    pub fn new(key: impl Into<String>) -> MessageKey {
        MessageKey {
            key: key.into(),
            unsigned_until: Lsn(0),
        }
    }

    /// Messages of transactions committed at or before `lsn` are taken unsigned.
    pub fn unsigned_until(mut self, lsn: Lsn) -> MessageKey {
        self.unsigned_until = lsn;
        self
    }

    /// The MAC of `body` under `prefix`, as `walcast.message_mac` computes it (hex).
    pub fn mac(&self, prefix: &str, body: &str) -> String {
        let inner = Sha256::digest(body.as_bytes());
        let mut outer = Sha256::new();
        outer.update(self.key.as_bytes());
        outer.update(b":");
        outer.update(prefix.as_bytes());
        outer.update(b":");
        outer.update(inner);
        hex(&outer.finalize())
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

/// Equal, in time that depends only on the length (the MACs compared have a fixed one).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Why a message was not trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Forged {
    /// No key could be read (migration 12 missing, or the role may not read it).
    #[error("no message key (walcast.message_key unreadable)")]
    NoKey,
    /// Shorter than a MAC, or not starting with 64 lowercase hex digits.
    #[error("no MAC in front of the content")]
    NoMac,
    #[error("the MAC does not verify")]
    BadMac,
}

impl Forged {
    /// For logs and `/health`.
    pub fn reason(self) -> &'static str {
        match self {
            Forged::NoKey => "no_key",
            Forged::NoMac => "no_mac",
            Forged::BadMac => "bad_mac",
        }
    }
}

/// Whether messages with this prefix must be signed.
pub fn must_be_signed(prefix: &str) -> bool {
    prefix.starts_with(SIGNED_PREFIX)
}

/// Check the content of a signed message of a transaction committing at `commit_lsn`;
/// its body (after the MAC) when it verifies, the content as it is when the transaction
/// predates signing.
pub fn verify<'a>(
    key: Option<&MessageKey>,
    prefix: &str,
    content: Cow<'a, str>,
    commit_lsn: Lsn,
) -> Result<Cow<'a, str>, Forged> {
    let key = key.ok_or(Forged::NoKey)?;
    if commit_lsn <= key.unsigned_until {
        return Ok(content);
    }
    let mac = content.as_bytes().get(..MAC_HEX).ok_or(Forged::NoMac)?;
    if !mac.iter().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(Forged::NoMac);
    }
    // 64 ASCII bytes: index MAC_HEX is a char boundary.
    let expected = key.mac(prefix, &content[MAC_HEX..]);
    if !constant_time_eq(mac, expected.as_bytes()) {
        return Err(Forged::BadMac);
    }
    Ok(match content {
        Cow::Borrowed(s) => Cow::Borrowed(&s[MAC_HEX..]),
        Cow::Owned(mut s) => {
            s.drain(..MAC_HEX);
            Cow::Owned(s)
        }
    })
}

/// Read the key on the catalog connection (`DATABASE_URL`). `None`, logged, when the
/// table is missing (migration 12 not applied) or the role may not read it: every
/// `walcast.*` message is then skipped as forged (never trusted unsigned).
pub async fn load_key(client: &Client) -> Result<Option<MessageKey>, PipelineError> {
    use tokio_postgres::error::SqlState;
    let sql = "SELECT k.key, coalesce((SELECT s.since::text FROM walcast.message_signing s), '0/0')
               FROM walcast.message_key k";
    match client.query_opt(sql, &[]).await {
        Ok(Some(row)) => {
            let since: String = row.get(1);
            let since = since.parse().unwrap_or(Lsn(0));
            Ok(Some(
                MessageKey::new(row.get::<_, String>(0)).unsigned_until(since),
            ))
        }
        Ok(None) => {
            tracing::error!("walcast.message_key is empty: walcast's notices and outbox events will be skipped as forged until a key exists (re-run the migrations)");
            Ok(None)
        }
        Err(e)
            if e.code() == Some(&SqlState::UNDEFINED_TABLE)
                || e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) =>
        {
            tracing::error!(error = %walcast_pgtls::db_message(&e), "cannot read walcast.message_key (migration 12 missing, or DATABASE_URL's role is not walcast's): walcast's notices and outbox events will be skipped as forged");
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A commit position after signing started.
    const AT: Lsn = Lsn(0x100);

    fn key() -> MessageKey {
        MessageKey::new("k3y")
    }

    fn signed(prefix: &str, body: &str) -> String {
        format!("{}{body}", key().mac(prefix, body))
    }

    #[test]
    fn the_mac_is_the_one_postgres_computes() {
        // walcast.message_mac('k3y', 'walcast.ddl', '{"a":1}') (checked independently:
        // sha256("k3y:walcast.ddl:" || sha256('{"a":1}')) in hex).
        assert_eq!(
            key().mac("walcast.ddl", r#"{"a":1}"#),
            "7845fad8c39b0a536bce78d812bc1f76019a4d89efd0b24503e89168e82dcccc"
        );
        assert_eq!(key().mac("p", "").len(), MAC_HEX);
    }

    #[test]
    fn a_signed_message_verifies_and_yields_its_body() {
        let content = signed("walcast.ddl", r#"{"epoch": 3}"#);
        let body = verify(Some(&key()), "walcast.ddl", Cow::Borrowed(&content), AT).unwrap();
        assert_eq!(body, r#"{"epoch": 3}"#);
        let owned = verify(Some(&key()), "walcast.ddl", Cow::Owned(content.clone()), AT).unwrap();
        assert_eq!(owned, r#"{"epoch": 3}"#);
        let empty = signed("walcast.outbox", "");
        assert_eq!(
            verify(Some(&key()), "walcast.outbox", Cow::Owned(empty), AT).unwrap(),
            ""
        );
    }

    #[test]
    fn anything_else_is_forged() {
        let k = Some(key());
        let k = k.as_ref();
        let body = r#"{"epoch": 3}"#;
        let good = signed("walcast.ddl", body);
        let v =
            |c: &str, p: &str| verify(k, p, Cow::Owned(c.to_string()), AT).map(|b| b.to_string());
        assert_eq!(v(body, "walcast.ddl"), Err(Forged::NoMac), "unsigned");
        assert_eq!(v("", "walcast.ddl"), Err(Forged::NoMac));
        assert_eq!(v(&good.to_uppercase(), "walcast.ddl"), Err(Forged::NoMac));
        // Another prefix, another body, another key.
        assert_eq!(v(&good, "walcast.outbox"), Err(Forged::BadMac));
        assert_eq!(v(&format!("{good} "), "walcast.ddl"), Err(Forged::BadMac));
        let other = MessageKey::new("other");
        let c = Cow::Borrowed(good.as_str());
        assert_eq!(
            verify(Some(&other), "walcast.ddl", c, AT),
            Err(Forged::BadMac)
        );
        assert_eq!(
            verify(None, "walcast.ddl", Cow::Borrowed(good.as_str()), AT),
            Err(Forged::NoKey)
        );
        // Multi-byte characters right after 64 bytes of non-hex: no panic.
        let tricky = format!("{}é", "g".repeat(63));
        assert_eq!(v(&tricky, "walcast.ddl"), Err(Forged::NoMac));
        let tricky = format!("{}é{{}}", "a".repeat(63));
        assert_eq!(v(&tricky, "walcast.ddl"), Err(Forged::NoMac));
    }

    #[test]
    fn transactions_from_before_signing_are_taken_unsigned() {
        let k = key().unsigned_until(Lsn(0x100));
        let body = r#"{"epoch": 3}"#;
        let c = |s: &str| Cow::Owned(s.to_string());
        assert_eq!(
            verify(Some(&k), "walcast.ddl", c(body), Lsn(0x100)).unwrap(),
            body
        );
        assert_eq!(
            verify(Some(&k), "walcast.ddl", c(body), Lsn(0x101)),
            Err(Forged::NoMac)
        );
        let signed = signed("walcast.ddl", body);
        assert_eq!(
            verify(Some(&k), "walcast.ddl", c(&signed), Lsn(0x101)).unwrap(),
            body
        );
        assert_eq!(
            verify(None, "walcast.ddl", c(body), Lsn(1)),
            Err(Forged::NoKey)
        );
    }

    #[test]
    fn only_walcast_prefixes_must_be_signed() {
        assert!(must_be_signed("walcast.ddl"));
        assert!(must_be_signed("walcast.outbox"));
        assert!(must_be_signed("walcast.anything"));
        assert!(!must_be_signed("walcast"));
        assert!(!must_be_signed("app.events"));
    }

    proptest::proptest! {
        /// Fuzz of what a login can put in the WAL: whatever the content (a MAC-shaped
        /// prefix or not, any bytes after it), it never panics and verifies only when it
        /// is exactly the MAC of its own body under this prefix; a real MAC of another
        /// prefix (a notice replayed as an outbox event) never verifies.
        #[test]
        fn no_content_but_a_signed_one_verifies(
            hex in "[0-9a-f]{0,70}",
            body in "\\PC{0,60}",
            prefix in "walcast\\.[a-z]{1,8}",
        ) {
            let content = format!("{hex}{body}");
            let got = verify(Some(&key()), &prefix, Cow::Borrowed(&content), AT);
            let genuine = content.get(..MAC_HEX).is_some_and(|m| {
                content.is_char_boundary(MAC_HEX) && m == key().mac(&prefix, &content[MAC_HEX..])
            });
            proptest::prop_assert_eq!(got.is_ok(), genuine);
            let other = signed("walcast.other", &body);
            proptest::prop_assume!(prefix != "walcast.other");
            proptest::prop_assert!(verify(Some(&key()), &prefix, Cow::Owned(other), AT).is_err());
        }
    }
}
