//! JWT verification: HS256/384/512 with the project's secrets, and RS/PS/ES/EdDSA with
//! its JWKS keys chosen by `kid` (see [`super::keys`]). `alg: none`, algorithm confusion,
//! bad signatures, expired and not-yet-valid (`nbf`) tokens are refused, and so are tokens
//! whose `iss` or `aud` the project's rules do not accept. Which keys verify a token is the
//! business of the project directory (`projects::Projects`: its `ref` claim names the project).

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde_json::{Map, Value};

use super::keys::{is_hmac, ClaimRules, ProjectKeys};

pub use walcast_core::{DEFAULT_PROJECT, DEFAULT_SCHEMA};

/// A verified token.
#[derive(Clone, Debug)]
pub struct Verified {
    /// The project the token belongs to.
    pub project: String,
    /// That project's schema.
    pub schema: String,
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

    /// Whether this project's subscribers may ask for changes of `schema`: its own schema
    /// or `*`. The default project may also use any schema except the other projects'
    /// (`project_<hex>`), as tables of any schema can be enabled for it.
    pub fn allows_schema(&self, schema: &str) -> bool {
        schema == "*"
            || schema == self.schema
            || (self.project == DEFAULT_PROJECT && !is_project_schema(schema))
    }

    /// [`AuthError::SchemaNotAllowed`] unless [`Verified::allows_schema`].
    pub fn check_schema(&self, schema: &str) -> Result<(), AuthError> {
        if self.allows_schema(schema) {
            return Ok(());
        }
        Err(AuthError::SchemaNotAllowed {
            schema: schema.to_string(),
            project: self.project.clone(),
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
    /// Signed with a public-key algorithm, and the project's JWKS has no key with its
    /// `kid` for that algorithm.
    #[error("Invalid token: no key {kid:?} for {alg}")]
    UnknownKey {
        /// The token's `kid` (empty: none).
        kid: String,
        /// The token's algorithm.
        alg: String,
    },
    /// `iss` or `aud` (named) is missing or not among the values the project accepts.
    #[error("Invalid token: its `{0}` claim is not accepted here")]
    ClaimNotAccepted(&'static str),
    /// `exp` is in the past.
    #[error("Token has expired {0} seconds ago")]
    Expired(i64),
    /// `nbf` is in the future (beyond [`NBF_LEEWAY_SECS`]).
    #[error("Token is not valid yet: valid in {0} seconds")]
    NotYetValid(i64),
    /// The `role` claim names a role tokens may not act as (`ALLOWED_ROLES`).
    #[error("Invalid token: the role {0:?} is not allowed")]
    RoleNotAllowed(String),
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
    /// The `ref` claim names a project this front does not know, and the cdc-worker
    /// could not be asked.
    #[error("Project directory unavailable: {0}")]
    DirectoryUnavailable(String),
    /// The project is suspended (the management API).
    #[error("Realtime disabled for this tenant")]
    Suspended(String),
    /// A `postgres_changes` binding on a schema of another project.
    #[error("You do not have permissions to read from schema {schema:?}: it does not belong to project {project:?}")]
    SchemaNotAllowed {
        /// The schema asked for.
        schema: String,
        /// The subscriber's project.
        project: String,
    },
}

impl AuthError {
    /// The error code used in `{"reason":"<Code>: <text>"}` replies.
    pub fn code(&self) -> &'static str {
        match self {
            AuthError::SchemaNotAllowed { .. } => "Unauthorized",
            AuthError::DirectoryUnavailable(_) => "UnableToConnectToProject",
            AuthError::Suspended(_) => "RealtimeDisabledForTenant",
            _ => "InvalidJWTToken",
        }
    }

    /// Its HTTP status: 503 when the project directory could not be asked, 403 for a
    /// suspended project, else 401.
    pub(crate) fn http_status(&self) -> StatusCode {
        match self {
            AuthError::DirectoryUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            AuthError::Suspended(_) => StatusCode::FORBIDDEN,
            _ => StatusCode::UNAUTHORIZED,
        }
    }
}

/// A token whose `nbf` is at most this many seconds ahead is accepted (clocks differ).
pub const NBF_LEEWAY_SECS: i64 = 30;

/// A numeric date claim (`exp`, `nbf`): `Ok(None)` when absent, `Err` when not a number.
fn numeric_date(claims: &Map<String, Value>, name: &str) -> Result<Option<i64>, AuthError> {
    let Some(v) = claims.get(name) else {
        return Ok(None);
    };
    v.as_i64()
        .or_else(|| v.as_f64().filter(|f| f.is_finite()).map(|f| f as i64))
        .map(Some)
        .ok_or_else(|| AuthError::Malformed(format!("`{name}` must be a number")))
}

/// `exp` not passed and `nbf` not ahead (beyond the leeway) at `now`.
pub(crate) fn check_times(claims: &Map<String, Value>, now: i64) -> Result<(), AuthError> {
    if let Some(exp) = numeric_date(claims, "exp")? {
        if exp <= now {
            return Err(AuthError::Expired(now.saturating_sub(exp)));
        }
    }
    if let Some(nbf) = numeric_date(claims, "nbf")? {
        if nbf > now.saturating_add(NBF_LEEWAY_SECS) {
            return Err(AuthError::NotYetValid(nbf.saturating_sub(now)));
        }
    }
    Ok(())
}

/// Seconds since the Unix epoch.
pub fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Whether `schema` has the shape of a stored project's schema (`project_<32 hex>`).
pub fn is_project_schema(schema: &str) -> bool {
    schema.strip_prefix("project_").is_some_and(|hex| {
        hex.len() == 32 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// Signature and, when the project has rules, `iss` and `aud` (required then); times
/// are checked by [`check_times`].
fn validation(alg: Algorithm, rules: &ClaimRules) -> Validation {
    let mut validation = Validation::new(alg);
    validation.required_spec_claims.clear();
    validation.validate_exp = false;
    validation.validate_nbf = false;
    validation.validate_aud = !rules.audiences.is_empty();
    if validation.validate_aud {
        validation.set_audience(&rules.audiences);
        validation.required_spec_claims.insert("aud".into());
    }
    if !rules.issuers.is_empty() {
        validation.set_issuer(&rules.issuers);
        validation.required_spec_claims.insert("iss".into());
    }
    validation
}

/// The token's header (any algorithm jsonwebtoken knows; `none` is not one of them).
fn header_of(token: &str) -> Result<jsonwebtoken::Header, AuthError> {
    if token.is_empty() {
        return Err(AuthError::Missing);
    }
    jsonwebtoken::decode_header(token).map_err(|_| {
        AuthError::Malformed("not a JWT with a known algorithm (alg none is refused)".into())
    })
}

/// The claims of `token` if one of `keys` verifies it (see [`super::keys`]).
fn verified_claims(keys: &ProjectKeys, token: &str) -> Result<Map<String, Value>, AuthError> {
    let header = header_of(token)?;
    let decode = |key: &DecodingKey| {
        jsonwebtoken::decode::<Map<String, Value>>(token, key, &validation(header.alg, &keys.rules))
            .map(|d| d.claims)
            .map_err(map_jwt_error)
    };
    if !is_hmac(header.alg) {
        let kid = header.kid.clone().unwrap_or_default();
        let key = keys
            .public_key(&kid, header.alg)
            .ok_or(AuthError::UnknownKey {
                kid,
                alg: format!("{:?}", header.alg),
            })?;
        return decode(&key.key);
    }
    let mut result = Err(AuthError::Signature);
    for secret in keys.secrets.iter() {
        // An empty secret (refused by jsonwebtoken) verifies nothing.
        result = DecodingKey::from_secret(secret)
            .map_err(|_| AuthError::Signature)
            .and_then(|key| decode(&key));
        if !matches!(result, Err(AuthError::Signature)) {
            break;
        }
    }
    result
}

/// Verify `token` with `keys` as a token of `project` (whose schema is `schema`).
pub(crate) fn verify_with(
    project: String,
    schema: &str,
    keys: &ProjectKeys,
    token: &str,
) -> Result<Verified, AuthError> {
    let v = Verified {
        project,
        schema: schema.to_string(),
        claims: verified_claims(keys, token)?,
    };
    check_times(&v.claims, now_secs())?;
    Ok(v)
}

/// Decode the claims without checking anything but the header.
pub fn peek_claims(token: &str) -> Result<Map<String, Value>, AuthError> {
    header_of(token)?;
    jsonwebtoken::dangerous::insecure_decode_claims::<Map<String, Value>>(token)
        .map_err(map_jwt_error)
}

fn map_jwt_error(e: jsonwebtoken::errors::Error) -> AuthError {
    use jsonwebtoken::errors::ErrorKind;
    match e.kind() {
        ErrorKind::InvalidSignature => AuthError::Signature,
        ErrorKind::InvalidAlgorithm | ErrorKind::InvalidAlgorithmName => {
            AuthError::Malformed("the algorithm does not match the key".into())
        }
        ErrorKind::InvalidAudience => AuthError::ClaimNotAccepted("aud"),
        ErrorKind::InvalidIssuer => AuthError::ClaimNotAccepted("iss"),
        ErrorKind::MissingRequiredClaim(c) if c == "aud" => AuthError::ClaimNotAccepted("aud"),
        ErrorKind::MissingRequiredClaim(c) if c == "iss" => AuthError::ClaimNotAccepted("iss"),
        _ => AuthError::Malformed(format!("{e}")),
    }
}

#[cfg(test)]
mod tests;
