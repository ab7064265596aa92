//! How the management API (and `walcast project …`) shows a project: never its secrets,
//! except in the answer of a create or a rotate, which also carries the keys signed
//! with the new secret.

use serde_json::{json, Value};
use walcast_bus::admin::{ProjectLimits, ProjectRecord};

/// Lifetime of the anon and service_role keys minted for a project: ten years.
pub const KEY_LIFETIME_SECS: u64 = 10 * 365 * 24 * 3600;

/// A project without its secrets, with its own limits (each `null`: the default).
pub fn project_view(p: &ProjectRecord) -> Value {
    let mut v = json!({
        "id": p.id,
        "name": p.name,
        "schema": p.schema,
        "created_at": p.created_at,
        "suspended": p.suspended,
        "private_only": p.private_only,
        "previous_secret_valid_until_ms": p
            .jwt_secret_previous
            .as_ref()
            .and(p.jwt_secret_previous_until_ms),
        "previous_secret": p.jwt_secret_previous.is_some(),
        "jwks": p.jwks.is_some(),
        "source": p.source,
    });
    for (k, n) in ProjectLimits::FIELDS.into_iter().zip(p.limits.to_array()) {
        v[k] = json!(n);
    }
    v
}

/// `view` of `p` with `effective_<limit>` for each limit: the one its users meet on a
/// front whose defaults are `defaults` (`PROJECT_MAX_USERS`, …; see
/// [`crate::FrontConfig::project_defaults`]).
pub fn with_effective_limits(
    mut view: Value,
    p: &ProjectRecord,
    defaults: &ProjectLimits,
) -> Value {
    let effective = p.limits.or(defaults).to_array();
    for (k, n) in ProjectLimits::FIELDS.into_iter().zip(effective) {
        view[format!("effective_{k}")] = json!(n);
    }
    view
}

/// A project with its secret and its anon and service_role keys (create, rotate).
pub fn created_view(p: &ProjectRecord) -> Result<Value, jsonwebtoken::errors::Error> {
    let (anon, service) = mint_keys(&p.id, &p.jwt_secret)?;
    let mut v = project_view(p);
    v["jwt_secret"] = p.jwt_secret.clone().into();
    v["anon_key"] = anon.into();
    v["service_role_key"] = service.into();
    Ok(v)
}

/// A project's `(anon, service_role)` keys: HS256, `ref` = its id, `iss` = `walcast`,
/// valid [`KEY_LIFETIME_SECS`].
pub fn mint_keys(id: &str, secret: &str) -> Result<(String, String), jsonwebtoken::errors::Error> {
    let now = crate::auth::now_secs().max(0) as u64;
    let key = |role: &str| {
        let claims = json!({
            "role": role,
            "ref": id,
            "iss": "walcast",
            "iat": now,
            "exp": now.saturating_add(KEY_LIFETIME_SECS),
        });
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes())?,
        )
    };
    Ok((key("anon")?, key("service_role")?))
}
