//! The KV key of a tracked meta: `<project>.<pub|prv>.<topic>.<presence key>.<phx_ref>`,
//! each part a bounded token, whatever the client chose.

use sha2::Digest;

use crate::connection::topics::TopicKey;

/// `<project>.<pub|prv>.<topic>.<presence key>.<phx_ref>`, each part a bounded token
/// ([`push_token`]): at most 5 × [`MAX_KV_TOKEN_CHARS`] characters whatever the client
/// chose, far below nats-server's 4 KB control line (a longer subject makes the server
/// cut the connection every part of the front shares). The key is never read back: the
/// entry's value carries its topic and presence key as they are.
pub(super) fn kv_key(topic: &TopicKey, key: &str, phx_ref: &str) -> String {
    let mut out = String::with_capacity(5 * 48);
    push_token(&mut out, &topic.project);
    out.push_str(if topic.private { ".prv." } else { ".pub." });
    push_token(&mut out, &topic.topic);
    out.push('.');
    push_token(&mut out, key);
    out.push('.');
    push_token(&mut out, phx_ref);
    out
}

/// The longest token of a KV key.
const MAX_KV_TOKEN_CHARS: usize = 192;
/// How much of a long part's encoding leads its digest token.
const DIGEST_LEAD_CHARS: usize = 32;
const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// One KV key token: `[a-zA-Z0-9-]` as is, every other byte as `_XX` (upper hex), the
/// empty string as `=`. A part whose encoding would be longer than
/// [`MAX_KV_TOKEN_CHARS`] becomes the start of its encoding, `=`, and the SHA-256 of the
/// part in hex. Injective (but for a SHA-256 collision: no encoding holds a `=`), and only
/// uses `[-_=a-zA-Z0-9]`.
fn push_token(out: &mut String, s: &str) {
    if s.is_empty() {
        out.push('=');
        return;
    }
    let start = out.len();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' {
            out.push(b as char);
        } else {
            out.push('_');
            out.push(HEX[(b >> 4) as usize] as char);
            out.push(HEX[(b & 15) as usize] as char);
        }
        if out.len() - start > MAX_KV_TOKEN_CHARS {
            out.truncate(start + digest_lead(&out.as_bytes()[start..]));
            out.push('=');
            for b in sha2::Sha256::digest(s.as_bytes()) {
                out.push(HEX[(b >> 4) as usize] as char);
                out.push(HEX[(b & 15) as usize] as char);
            }
            return;
        }
    }
}

/// How many characters of an encoding lead its digest: at most [`DIGEST_LEAD_CHARS`],
/// cut between escapes.
fn digest_lead(encoded: &[u8]) -> usize {
    let mut lead = 0;
    loop {
        let step = if encoded.get(lead) == Some(&b'_') {
            3
        } else {
            1
        };
        if lead + step > DIGEST_LEAD_CHARS.min(encoded.len()) {
            return lead;
        }
        lead += step;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_kv_keys() {
        let t = TopicKey {
            project: "default".into(),
            private: true,
            topic: "realtime:room.1 ü/*>".into(),
        };
        let k = kv_key(&t, "", "K1a");
        assert_eq!(k, "default.prv.realtime_3Aroom_2E1_20_C3_BC_2F_2A_3E.=.K1a");
        assert!(k
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-/_=.".contains(&b)));
        assert_ne!(kv_key(&t, "a_2E", "r"), kv_key(&t, "a.", "r"));
    }

    #[test]
    fn long_parts_make_bounded_keys_that_stay_distinct() {
        let t = |topic: String| TopicKey {
            project: "p".into(),
            private: false,
            topic,
        };
        let long = "k".repeat(1500);
        let mut seen = std::collections::HashSet::new();
        for key in [
            long.clone(),
            format!("{long}1"),
            format!("{long}2"),
            "é".repeat(1500),
            "🙂".repeat(700),
            ".".repeat(65),
            "_2E".repeat(65),
        ] {
            for topic in [t("realtime:room".into()), t(format!("realtime:{key}"))] {
                let k = kv_key(&topic, &key, "K1");
                assert!(k.len() <= 5 * MAX_KV_TOKEN_CHARS, "{} chars", k.len());
                assert!(k
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_=.".contains(&b)));
                assert_eq!(k.split('.').count(), 5, "{k}");
                assert!(seen.insert(k), "two parts share a key");
            }
        }
        let k = kv_key(&t("r".into()), &".".repeat(65), "K1");
        assert!(k.contains(".pub.r._2E_2E_2E_2E_2E_2E_2E_2E_2E_2E="), "{k}");
    }
}
