//! Who may do what.
//!
//! * [`token`]: JWT verification (a project's secrets and JWKS keys), the verified
//!   claims ([`Verified`]) and why a token is refused ([`AuthError`]).
//! * [`keys`]: the keys that verify a project's tokens (HMAC secrets, JWKS public keys)
//!   and the values its tokens' `iss` and `aud` must have.
//! * [`remote_jwks`]: a JWKS fetched from a URL and kept current.
//! * `credentials`: where a request's project key and acting token are, one rule for
//!   every transport and API.
//! * `private`: private channels — whether a subscriber may read or write one, as the
//!   app's policies say (the cdc-worker evaluates them).
//! * [`operator`]: the operator's keys (the management API, the figures).
//!
//! Which keys verify which project's tokens is the project directory's
//! (the `projects` module).

pub(crate) mod credentials;
pub mod keys;
pub mod operator;
pub(crate) mod private;
pub mod remote_jwks;
pub mod token;

pub(crate) use token::verify_with;
pub use token::{now_secs, peek_claims, AuthError, Verified, DEFAULT_PROJECT, DEFAULT_SCHEMA};
