//! Test JWTs: claims signed with a secret (HS256 unless another HMAC algorithm is asked
//! for), as a project's servers and users would present them.
//!
//! ```
//! use walcast_testkit::tokens::{self, Claims};
//!
//! let anon = Claims::role("anon").sign("secret");
//! let user = Claims::role("authenticated")
//!     .project("p1")
//!     .claim("sub", "u1")
//!     .expires_in(60)
//!     .sign("secret");
//! let expired = tokens::sign("secret", &serde_json::json!({"role": "anon", "exp": tokens::now() - 30}));
//! # let _ = (anon, user, expired);
//! ```

use serde_json::{Map, Value};

pub use jsonwebtoken::Algorithm;

/// How long a token from [`Claims::role`] is valid unless told otherwise.
pub const DEFAULT_LIFETIME_SECS: i64 = 3600;

/// Now, in Unix seconds (the unit of `exp`).
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_secs() as i64
}

/// `claims` signed with `secret`, HS256.
pub fn sign(secret: &str, claims: &Value) -> String {
    sign_with(Algorithm::HS256, secret, claims)
}

/// `claims` signed with `secret` and `alg` (an HMAC algorithm: HS256, HS384 or HS512).
pub fn sign_with(alg: Algorithm, secret: &str, claims: &Value) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(alg),
        claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()).expect("a test secret"),
    )
    .expect("sign a test JWT")
}

/// The claims of a test token, built up from a role.
#[derive(Clone, Debug, PartialEq)]
pub struct Claims {
    map: Map<String, Value>,
}

impl Claims {
    /// `{"role": role, "exp": now + DEFAULT_LIFETIME_SECS}`.
    pub fn role(role: &str) -> Claims {
        Claims { map: Map::new() }
            .claim("role", role)
            .expires_in(DEFAULT_LIFETIME_SECS)
    }

    /// The project the token names (its `ref` claim).
    pub fn project(self, project: &str) -> Claims {
        self.claim("ref", project)
    }

    /// `exp` `secs` from now (negative: expired that long ago).
    pub fn expires_in(self, secs: i64) -> Claims {
        self.exp(now() + secs)
    }

    /// `exp` at this Unix time.
    pub fn exp(self, exp: i64) -> Claims {
        self.claim("exp", exp)
    }

    /// No `exp` at all.
    pub fn without_exp(mut self) -> Claims {
        self.map.remove("exp");
        self
    }

    /// Any other claim (or a new value of one already set).
    pub fn claim(mut self, name: &str, value: impl Into<Value>) -> Claims {
        self.map.insert(name.to_string(), value.into());
        self
    }

    /// The claims as JSON.
    pub fn to_value(&self) -> Value {
        Value::Object(self.map.clone())
    }

    /// Signed with `secret`, HS256.
    pub fn sign(&self, secret: &str) -> String {
        sign(secret, &self.to_value())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn claims_of(token: &str, secret: &str, alg: Algorithm) -> Value {
        let mut v = jsonwebtoken::Validation::new(alg);
        v.required_spec_claims.clear();
        let key = jsonwebtoken::DecodingKey::from_secret(secret.as_bytes()).expect("a test secret");
        jsonwebtoken::decode::<Value>(token, &key, &v)
            .expect("verifies")
            .claims
    }

    #[test]
    fn signs_what_it_is_given() {
        let claims = json!({"role": "anon", "x": [1, 2]});
        assert_eq!(
            claims_of(&sign("s", &claims), "s", Algorithm::HS256),
            claims
        );
        let hs512 = sign_with(Algorithm::HS512, "s", &claims);
        assert_eq!(claims_of(&hs512, "s", Algorithm::HS512), claims);
    }

    #[test]
    fn builds_role_project_and_expiry() {
        let t = Claims::role("authenticated")
            .project("p1")
            .claim("sub", "u1")
            .sign("s");
        let c = claims_of(&t, "s", Algorithm::HS256);
        assert_eq!(
            (&c["role"], &c["ref"], &c["sub"]),
            (&json!("authenticated"), &json!("p1"), &json!("u1"))
        );
        let exp = c["exp"].as_i64().unwrap();
        assert!((now() + DEFAULT_LIFETIME_SECS - exp).abs() <= 2, "{exp}");
        let expired = Claims::role("anon").expires_in(-30).to_value();
        assert!(expired["exp"].as_i64().unwrap() < now());
        assert!(Claims::role("anon")
            .without_exp()
            .to_value()
            .get("exp")
            .is_none());
    }
}
