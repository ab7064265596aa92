//! JWT verification (HS256 only) and the project → secret map.
//!
//! A token selects its project through its `ref` claim (absent = the default project);
//! it is then verified with that project's secret. `alg: none`, every algorithm other than
//! HS256, bad signatures and expired tokens are refused.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

/// Id of the default project.
pub const DEFAULT_PROJECT: &str = "default";

/// Project id → HS256 secret. Cheap to clone; projects can be added at run time.
#[derive(Clone)]
pub struct Projects {
    inner: Arc<RwLock<Inner>>,
}

struct Inner {
    default_id: String,
    secrets: HashMap<String, Arc<[u8]>>,
}

/// A verified token.
#[derive(Clone, Debug)]
pub struct Verified {
    /// The project the token belongs to.
    pub project: String,
    /// All claims.
    pub claims: Map<String, Value>,
}

impl Verified {
    /// The `role` claim.
    pub fn role(&self) -> Option<&str> {
        self.claims.get("role").and_then(Value::as_str)
    }

    /// The `exp` claim (seconds since the epoch).
    pub fn exp(&self) -> Option<i64> {
        self.claims.get("exp").and_then(|v| {
            v.as_i64()
                .or_else(|| v.as_f64().filter(|f| f.is_finite()).map(|f| f as i64))
        })
    }

    /// Channel tokens must carry `role` and `exp`.
    pub fn require_role_and_exp(&self) -> Result<(), AuthError> {
        match (self.role(), self.exp()) {
            (Some(_), Some(_)) => Ok(()),
            _ => Err(AuthError::MissingClaims),
        }
    }
}

/// Why a token was refused. `Display` is the text sent to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No token at all.
    #[error("apikey is required")]
    Missing,
    /// Not a JWT, or a header with an algorithm other than HS256 (including `none`).
    #[error("Invalid token: {0}")]
    Malformed(String),
    /// The signature does not verify with the project's secret.
    #[error("Invalid token: signature verification failed")]
    Signature,
    /// `exp` is in the past.
    #[error("Token has expired {0} seconds ago")]
    Expired(i64),
    /// The `ref` claim names no known project.
    #[error("Invalid token: unknown project {0:?}")]
    UnknownProject(String),
    /// The token belongs to another project than the socket.
    #[error("Invalid token: the token belongs to project {token:?}, not {socket:?}")]
    WrongProject {
        /// Project of the token.
        token: String,
        /// Project of the socket.
        socket: String,
    },
    /// `role` or `exp` is missing.
    #[error("Fields `role` and `exp` are required in JWT")]
    MissingClaims,
}

impl AuthError {
    /// The error code used in `{"reason":"<Code>: <text>"}` replies.
    pub fn code(&self) -> &'static str {
        "InvalidJWTToken"
    }
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

impl Projects {
    /// Only the default project (id [`DEFAULT_PROJECT`]) with this secret.
    pub fn new(default_secret: impl AsRef<[u8]>) -> Projects {
        let mut secrets = HashMap::new();
        secrets.insert(
            DEFAULT_PROJECT.to_string(),
            Arc::<[u8]>::from(default_secret.as_ref()),
        );
        Projects {
            inner: Arc::new(RwLock::new(Inner {
                default_id: DEFAULT_PROJECT.to_string(),
                secrets,
            })),
        }
    }

    /// Add (or replace) a project.
    pub fn insert(&self, id: impl Into<String>, secret: impl AsRef<[u8]>) {
        let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
        g.secrets
            .insert(id.into(), Arc::<[u8]>::from(secret.as_ref()));
    }

    /// Remove a project (the default one cannot be removed).
    pub fn remove(&self, id: &str) -> bool {
        let mut g = self.inner.write().unwrap_or_else(|p| p.into_inner());
        if id == g.default_id {
            return false;
        }
        g.secrets.remove(id).is_some()
    }

    /// Whether a project exists.
    pub fn contains(&self, id: &str) -> bool {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.secrets.contains_key(id)
    }

    fn secret(&self, id: &str) -> Option<Arc<[u8]>> {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.secrets.get(id).cloned()
    }

    fn default_id(&self) -> String {
        let g = self.inner.read().unwrap_or_else(|p| p.into_inner());
        g.default_id.clone()
    }

    /// Verify a token, choosing the project by its `ref` claim (absent = default).
    pub fn verify(&self, token: &str) -> Result<Verified, AuthError> {
        let unverified = peek_claims(token)?;
        let project = match unverified.get("ref") {
            None | Some(Value::Null) => self.default_id(),
            Some(Value::String(r)) => r.clone(),
            Some(_) => return Err(AuthError::Malformed("`ref` must be a string".into())),
        };
        self.verify_with(&project, token)
    }

    /// Verify a token for a known project: its `ref` claim, if any, must name it.
    pub fn verify_for(&self, project: &str, token: &str) -> Result<Verified, AuthError> {
        let v = self.verify(token)?;
        if v.project != project {
            return Err(AuthError::WrongProject {
                token: v.project,
                socket: project.to_string(),
            });
        }
        Ok(v)
    }

    fn verify_with(&self, project: &str, token: &str) -> Result<Verified, AuthError> {
        let secret = self
            .secret(project)
            .ok_or_else(|| AuthError::UnknownProject(project.to_string()))?;
        let mut validation = Validation::new(Algorithm::HS256);
        validation.required_spec_claims.clear();
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        let data = jsonwebtoken::decode::<Map<String, Value>>(
            token,
            &DecodingKey::from_secret(&secret),
            &validation,
        )
        .map_err(map_jwt_error)?;
        let v = Verified {
            project: project.to_string(),
            claims: data.claims,
        };
        if let Some(exp) = v.exp() {
            let now = now_secs();
            if exp <= now {
                return Err(AuthError::Expired(now - exp));
            }
        } else if v.claims.contains_key("exp") {
            return Err(AuthError::Malformed("`exp` must be a number".into()));
        }
        Ok(v)
    }
}

/// Decode the claims without checking anything but the header (HS256 only).
fn peek_claims(token: &str) -> Result<Map<String, Value>, AuthError> {
    if token.is_empty() {
        return Err(AuthError::Missing);
    }
    let header = jsonwebtoken::decode_header(token).map_err(|_| {
        AuthError::Malformed("not a JWT with an HS256 header (alg none is refused)".into())
    })?;
    if header.alg != Algorithm::HS256 {
        return Err(AuthError::Malformed(format!(
            "algorithm {:?} is not accepted (only HS256)",
            header.alg
        )));
    }
    let mut validation = Validation::new(Algorithm::HS256);
    validation.insecure_disable_signature_validation();
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = false;
    jsonwebtoken::decode::<Map<String, Value>>(token, &DecodingKey::from_secret(&[]), &validation)
        .map(|d| d.claims)
        .map_err(map_jwt_error)
}

fn map_jwt_error(e: jsonwebtoken::errors::Error) -> AuthError {
    use jsonwebtoken::errors::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidSignature => AuthError::Signature,
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidAlgorithmName => {
            AuthError::Malformed("algorithm is not accepted (only HS256)".into())
        }
        _ => AuthError::Malformed(format!("{e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{encode, EncodingKey, Header};
    use serde_json::json;

    fn token(secret: &str, claims: Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(secret.as_bytes()),
        )
        .unwrap()
    }

    #[test]
    fn verifies_and_selects_project() {
        let p = Projects::new("s1");
        p.insert("p2", "s2");
        let exp = now_secs() + 60;
        let v = p
            .verify(&token("s1", json!({"role":"anon","exp":exp})))
            .unwrap();
        assert_eq!(v.project, "default");
        assert_eq!(v.role(), Some("anon"));
        let v = p
            .verify(&token("s2", json!({"role":"anon","exp":exp,"ref":"p2"})))
            .unwrap();
        assert_eq!(v.project, "p2");
        assert_eq!(
            p.verify(&token("s1", json!({"role":"anon","exp":exp,"ref":"p2"})))
                .unwrap_err(),
            AuthError::Signature
        );
        assert!(matches!(
            p.verify(&token("s1", json!({"ref":"nope"}))),
            Err(AuthError::UnknownProject(_))
        ));
        assert!(matches!(
            p.verify_for("default", &token("s2", json!({"ref":"p2"}))),
            Err(AuthError::WrongProject { .. })
        ));
    }

    #[test]
    fn refuses_expired_none_and_other_algorithms() {
        let p = Projects::new("s1");
        let e = p
            .verify(&token("s1", json!({"role":"anon","exp":now_secs() - 12})))
            .unwrap_err();
        assert!(matches!(e, AuthError::Expired(n) if (12..=14).contains(&n)));
        // alg none: header {"alg":"none","typ":"JWT"}, claims {"role":"anon"}
        let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJyb2xlIjoiYW5vbiJ9.";
        assert!(matches!(p.verify(none), Err(AuthError::Malformed(_))));
        let hs512 = encode(
            &Header::new(Algorithm::HS512),
            &json!({"role":"anon"}),
            &EncodingKey::from_secret(b"s1"),
        )
        .unwrap();
        assert!(matches!(p.verify(&hs512), Err(AuthError::Malformed(_))));
        assert!(matches!(p.verify("garbage"), Err(AuthError::Malformed(_))));
        assert_eq!(p.verify("").unwrap_err(), AuthError::Missing);
        let no_role = p
            .verify(&token("s1", json!({"exp": now_secs() + 10})))
            .unwrap();
        assert_eq!(
            no_role.require_role_and_exp(),
            Err(AuthError::MissingClaims)
        );
    }
}
