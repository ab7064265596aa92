//! The keys that verify a project's tokens: HMAC secrets (HS256/384/512; the current one
//! and, during a rotation, the previous one) and public keys from a JWKS (RS256/384/512,
//! PS256/384/512, ES256/384, EdDSA), chosen by the token's `kid`.
//!
//! Which key may verify which token is decided by the token's `alg` and the key's own
//! algorithm together: an HMAC algorithm only ever meets the secrets, an asymmetric one
//! only the JWKS key with the token's `kid` *and* that key's algorithm (no algorithm
//! confusion: a public key is never used as an HMAC secret); `alg: none` is not an
//! algorithm at all here.
//!
//! The public keys may also come from a URL ([`super::remote_jwks`]), and a project may
//! require its tokens' `iss` and `aud` to be among given values ([`ClaimRules`]).

use std::sync::Arc;

use super::remote_jwks::RemoteJwks;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey};

/// The shortest HMAC secret a process accepts at start (`JWT_SECRET`): RFC 7518 asks
/// for at least the hash's size, 32 bytes for HS256; a shorter one can be guessed.
pub const MIN_SECRET_BYTES: usize = 32;

/// One public key of a JWKS.
#[derive(Clone)]
pub struct PublicKey {
    pub kid: String,
    pub alg: Algorithm,
    pub key: DecodingKey,
}

/// A project's verification keys. Cheap to clone.
#[derive(Clone)]
pub struct ProjectKeys {
    /// HMAC secrets, the current one first.
    pub secrets: Arc<[Arc<[u8]>]>,
    pub public: Arc<[PublicKey]>,
    /// Public keys fetched from a URL, besides `public`.
    pub remote: Option<Arc<RemoteJwks>>,
    pub rules: Arc<ClaimRules>,
}

/// Values a verified token's claims must have (empty: any, or none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimRules {
    /// `iss` must be one of these.
    pub issuers: Vec<String>,
    /// `aud` (a string, or a list) must hold one of these.
    pub audiences: Vec<String>,
}

impl ClaimRules {
    /// From comma-separated lists (blank entries ignored).
    pub fn from_lists(issuers: &str, audiences: &str) -> ClaimRules {
        let list = |s: &str| {
            s.split(',')
                .map(str::trim)
                .filter(|v| !v.is_empty())
                .map(str::to_string)
                .collect()
        };
        ClaimRules {
            issuers: list(issuers),
            audiences: list(audiences),
        }
    }
}

/// Why a JWKS cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JwksError {
    #[error("not a JWKS (`{{\"keys\": [...]}}`): {0}")]
    Parse(String),
    #[error("key {index}: {why}")]
    Key { index: usize, why: String },
}

impl ProjectKeys {
    /// Only an HMAC secret.
    pub fn secret(secret: impl AsRef<[u8]>) -> ProjectKeys {
        ProjectKeys {
            secrets: Arc::from(vec![Arc::from(secret.as_ref())]),
            public: Arc::from(Vec::new()),
            remote: None,
            rules: Arc::default(),
        }
    }

    /// Also accept `previous` (during a rotation) and the keys of `jwks`.
    pub fn with(mut self, previous: Option<&[u8]>, jwks: Vec<PublicKey>) -> ProjectKeys {
        let mut secrets: Vec<Arc<[u8]>> = self.secrets.to_vec();
        secrets.extend(previous.filter(|p| !p.is_empty()).map(Arc::from));
        self.secrets = Arc::from(secrets);
        self.public = Arc::from(jwks);
        self
    }

    /// Also accept the keys fetched by `remote`.
    pub fn with_remote(mut self, remote: Arc<RemoteJwks>) -> ProjectKeys {
        self.remote = Some(remote);
        self
    }

    /// Require `rules` of every token.
    pub fn with_rules(mut self, rules: ClaimRules) -> ProjectKeys {
        self.rules = Arc::new(rules);
        self
    }

    /// The JWKS key for `kid` and `alg` (configured ones first, then fetched ones).
    pub fn public_key(&self, kid: &str, alg: Algorithm) -> Option<PublicKey> {
        let found = |k: &&PublicKey| k.kid == kid && k.alg == alg;
        if let Some(k) = self.public.iter().find(found) {
            return Some(k.clone());
        }
        let remote = self.remote.as_ref()?.keys();
        remote.iter().find(found).cloned()
    }
}

impl<T: AsRef<[u8]>> From<T> for ProjectKeys {
    fn from(secret: T) -> ProjectKeys {
        ProjectKeys::secret(secret)
    }
}

/// Whether `alg` is an HMAC algorithm (verified with the secrets).
pub fn is_hmac(alg: Algorithm) -> bool {
    matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512)
}

/// The algorithm of a JWK: its `alg`, else the one its key type implies.
fn algorithm_of(jwk: &Jwk) -> Result<Algorithm, String> {
    if let Some(alg) = jwk.common.key_algorithm {
        return match alg {
            KeyAlgorithm::RS256 => Ok(Algorithm::RS256),
            KeyAlgorithm::RS384 => Ok(Algorithm::RS384),
            KeyAlgorithm::RS512 => Ok(Algorithm::RS512),
            KeyAlgorithm::PS256 => Ok(Algorithm::PS256),
            KeyAlgorithm::PS384 => Ok(Algorithm::PS384),
            KeyAlgorithm::PS512 => Ok(Algorithm::PS512),
            KeyAlgorithm::ES256 => Ok(Algorithm::ES256),
            KeyAlgorithm::ES384 => Ok(Algorithm::ES384),
            KeyAlgorithm::EdDSA => Ok(Algorithm::EdDSA),
            other => Err(format!("algorithm {other:?} is not accepted from a JWKS")),
        };
    }
    match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Ok(Algorithm::RS256),
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Ok(Algorithm::ES256),
            EllipticCurve::P384 => Ok(Algorithm::ES384),
            _ => Err("unsupported elliptic curve".into()),
        },
        AlgorithmParameters::OctetKeyPair(_) => Ok(Algorithm::EdDSA),
        AlgorithmParameters::OctetKey(_) => Err("a symmetric key does not belong in a JWKS".into()),
        _ => Err("unsupported key type".into()),
    }
}

/// The public keys of a JWKS document. Every key needs a `kid`; symmetric keys are
/// refused (HMAC secrets are configured as secrets).
pub fn parse_jwks(json: &str) -> Result<Vec<PublicKey>, JwksError> {
    let set: JwkSet = serde_json::from_str(json).map_err(|e| JwksError::Parse(e.to_string()))?;
    set.keys
        .iter()
        .enumerate()
        .map(|(index, jwk)| {
            let bad = |why: String| JwksError::Key { index, why };
            let kid = jwk
                .common
                .key_id
                .clone()
                .ok_or_else(|| bad("no `kid`".into()))?;
            let alg = algorithm_of(jwk).map_err(bad)?;
            let key = DecodingKey::from_jwk(jwk).map_err(|e| bad(e.to_string()))?;
            Ok(PublicKey { kid, alg, key })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EC: &str = r#"{"keys":[{"kty":"EC","crv":"P-256","kid":"k1","use":"sig",
        "x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;

    #[test]
    fn a_jwks_gives_keys_by_kid_and_algorithm() {
        let keys = parse_jwks(EC).unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(
            (keys[0].kid.as_str(), keys[0].alg),
            ("k1", Algorithm::ES256)
        );
        let pk = ProjectKeys::secret("s").with(Some(b"old"), keys);
        assert!(pk.public_key("k1", Algorithm::ES256).is_some());
        assert!(
            pk.public_key("k1", Algorithm::RS256).is_none(),
            "no algorithm confusion"
        );
        assert!(pk.public_key("k2", Algorithm::ES256).is_none());
        assert_eq!(pk.secrets.len(), 2);
    }

    #[test]
    fn bad_jwks_are_refused_with_the_reason() {
        assert!(matches!(parse_jwks("nope"), Err(JwksError::Parse(_))));
        let no_kid = r#"{"keys":[{"kty":"EC","crv":"P-256","x":"f83OJ3D2xF1Bg8vub9tLe1gHMzV76e8Tus9uPHvRVEU","y":"x_FEzRu9m36HLN_tue659LNpXW6pCyStikYjKIWI5a0"}]}"#;
        assert!(matches!(
            parse_jwks(no_kid),
            Err(JwksError::Key { index: 0, .. })
        ));
        let oct = r#"{"keys":[{"kty":"oct","kid":"h","k":"c2VjcmV0"}]}"#;
        assert!(matches!(parse_jwks(oct), Err(JwksError::Key { .. })));
    }
}
