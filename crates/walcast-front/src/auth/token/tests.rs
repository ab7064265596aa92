//! Verification with secrets and JWKS keys: algorithms, `kid`, rotation, confusion.

use jsonwebtoken::{encode, Algorithm, EncodingKey, Header};
use serde_json::json;

use super::*;
use crate::auth::keys::{parse_jwks, ProjectKeys};

/// A P-256 key pair made for these tests (PKCS#8 DER, and its public half as a JWK).
const EC_PKCS8_HEX: &str = "308187020100301306072a8648ce3d020106082a8648ce3d030107046d306b0201010420bf8d69e7e659e68daaa545e0d999d3e7ce291fb52891e80bbe3c292fe504f8eaa144034200041bba7fd485174ada7a4791c01108f9dea95d5097084ea7068dde7a5988879371ab5b58748c9c6f45e43dce0b231df678f22f6f7c07efa291cd18d0ff9c1a7c89";
const JWKS: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","kid":"user-key","alg":"ES256",
    "x":"G7p_1IUXStp6R5HAEQj53qldUJcITqcGjd56WYiHk3E","y":"q1tYdIycb0XkPc4LIx32ePIvb3wH76KRzRjQ_5wafIk"}]}"#;

fn der() -> Vec<u8> {
    (0..EC_PKCS8_HEX.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&EC_PKCS8_HEX[i..i + 2], 16).unwrap())
        .collect()
}

fn claims() -> serde_json::Value {
    json!({"role": "authenticated", "sub": "u1", "exp": now_secs() + 600})
}

fn es256(kid: Option<&str>) -> String {
    let mut h = Header::new(Algorithm::ES256);
    h.kid = kid.map(String::from);
    encode(&h, &claims(), &EncodingKey::from_ec_der(&der())).unwrap()
}

fn hs(alg: Algorithm, secret: &str) -> String {
    encode(
        &Header::new(alg),
        &claims(),
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

fn keys() -> ProjectKeys {
    ProjectKeys::secret("current").with(Some(b"previous"), parse_jwks(JWKS).unwrap())
}

fn verify(token: &str) -> Result<Verified, AuthError> {
    verify_with("default".into(), "public", &keys(), token)
}

#[test]
fn an_es256_token_verifies_with_the_jwks_key_of_its_kid() {
    let v = verify(&es256(Some("user-key"))).unwrap();
    assert_eq!(v.role(), Some("authenticated"));
    assert!(matches!(
        verify(&es256(Some("other"))),
        Err(AuthError::UnknownKey { .. })
    ));
    assert!(matches!(
        verify(&es256(None)),
        Err(AuthError::UnknownKey { .. })
    ));
    assert_eq!(peek_claims(&es256(Some("user-key"))).unwrap()["sub"], "u1");
}

#[test]
fn every_hmac_size_and_the_previous_secret_verify() {
    for alg in [Algorithm::HS256, Algorithm::HS384, Algorithm::HS512] {
        assert!(verify(&hs(alg, "current")).is_ok(), "{alg:?}");
    }
    assert!(
        verify(&hs(Algorithm::HS256, "previous")).is_ok(),
        "rotation"
    );
    assert_eq!(
        verify(&hs(Algorithm::HS256, "wrong")).unwrap_err(),
        AuthError::Signature
    );
}

#[test]
fn algorithm_confusion_and_none_are_refused() {
    // An HS256 token signed with the public key's bytes as the secret: the secret list
    // never holds public keys, so it fails like any wrong secret.
    let x = "G7p_1IUXStp6R5HAEQj53qldUJcITqcGjd56WYiHk3E";
    assert_eq!(
        verify(&hs(Algorithm::HS256, x)).unwrap_err(),
        AuthError::Signature
    );
    // An ES256 header with an HMAC signature does not verify with the EC key.
    let hmac = hs(Algorithm::HS256, "current");
    let (_, rest) = hmac.split_once('.').unwrap();
    let header = r#"{"alg":"ES256","typ":"JWT","kid":"user-key"}"#;
    let forged = format!("{}.{rest}", b64(header));
    assert!(verify(&forged).is_err());
    // alg none.
    let none = format!(
        "{}.{}.",
        b64(r#"{"alg":"none","typ":"JWT"}"#),
        b64(&claims().to_string())
    );
    assert!(matches!(verify(&none), Err(AuthError::Malformed(_))));
}

fn b64(s: &str) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let b = s.as_bytes();
    let mut out = String::new();
    for chunk in b.chunks(3) {
        let n =
            chunk.iter().fold(0u32, |acc, &c| (acc << 8) | u32::from(c)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

#[test]
fn not_yet_valid_tokens_are_refused_beyond_the_leeway() {
    let at = |claims: serde_json::Value| check_times(claims.as_object().unwrap(), 1_000);
    assert_eq!(at(json!({"nbf": 1_000 + NBF_LEEWAY_SECS})), Ok(()));
    assert_eq!(at(json!({"nbf": 900, "exp": 2_000})), Ok(()));
    assert_eq!(
        at(json!({"nbf": 1_000 + NBF_LEEWAY_SECS + 1})),
        Err(AuthError::NotYetValid(NBF_LEEWAY_SECS + 1))
    );
    assert_eq!(
        at(json!({"nbf": 1e300})),
        Err(AuthError::NotYetValid(i64::MAX - 1_000))
    );
    assert!(matches!(
        at(json!({"nbf": "soon"})),
        Err(AuthError::Malformed(_))
    ));
    assert_eq!(at(json!({"exp": 1_000})), Err(AuthError::Expired(0)));
    assert_eq!(
        at(json!({"exp": -1e300})),
        Err(AuthError::Expired(i64::MAX))
    );
    let future = json!({"role": "anon", "exp": now_secs() + 600, "nbf": now_secs() + 600});
    let token = encode(
        &Header::new(Algorithm::HS256),
        &future,
        &EncodingKey::from_secret(b"current").unwrap(),
    )
    .unwrap();
    assert!(matches!(verify(&token), Err(AuthError::NotYetValid(_))));
}

fn hs_with(extra: serde_json::Value) -> String {
    let mut c = claims();
    c.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    encode(
        &Header::new(Algorithm::HS256),
        &c,
        &EncodingKey::from_secret(b"current").unwrap(),
    )
    .unwrap()
}

#[test]
fn issuer_and_audience_rules_refuse_other_and_missing_values() {
    use crate::auth::keys::ClaimRules;
    let ruled = keys().with_rules(ClaimRules::from_lists(
        " https://auth.example/ , other-issuer",
        "authenticated,",
    ));
    let check = |t: &str| verify_with("default".into(), "public", &ruled, t);
    let good = json!({"iss": "https://auth.example/", "aud": "authenticated"});
    assert!(check(&hs_with(good)).is_ok());
    let listed = json!({"iss": "other-issuer", "aud": ["x", "authenticated"]});
    assert!(
        check(&hs_with(listed)).is_ok(),
        "one of a list of audiences"
    );
    for (claims, which) in [
        (
            json!({"iss": "https://auth.example/", "aud": "anon"}),
            "aud",
        ),
        (json!({"iss": "https://auth.example/"}), "aud"),
        (
            json!({"iss": "https://evil.example/", "aud": "authenticated"}),
            "iss",
        ),
        (json!({"aud": "authenticated"}), "iss"),
    ] {
        assert_eq!(
            check(&hs_with(claims.clone())).unwrap_err(),
            AuthError::ClaimNotAccepted(which),
            "{claims}"
        );
    }
    assert!(
        verify(&hs_with(json!({"aud": "anything"}))).is_ok(),
        "without rules nothing is checked"
    );
    assert_eq!(
        verify_with(
            "default".into(),
            "public",
            &ruled,
            &hs(Algorithm::HS256, "wrong")
        )
        .unwrap_err(),
        AuthError::Signature,
        "the signature is judged first"
    );
}
