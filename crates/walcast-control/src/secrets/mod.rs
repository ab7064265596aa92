//! Secrets at rest: the projects' JWT secrets and the sources' connection URLs are stored
//! encrypted with a key of the configuration (`SECRETS_KEY`), so a copy of the control
//! database (a dump, a backup, a replica, a role granted `SELECT` by mistake) holds none
//! of them.
//!
//! A stored value is `enc:v1:<key id>:<base64url(nonce ‖ ciphertext ‖ tag)>`: AES-256-GCM
//! (ring) with a random 96-bit nonce per value, under a key derived from the configured
//! string by HKDF-SHA256. The associated data names the value's table, column and row,
//! so a ciphertext copied to another row or column does not decrypt. The key id (the
//! first 4 bytes of another HKDF output of the same key, as hex) names the key a value
//! was made with: a value of a key that is not configured is an error naming that id,
//! never garbage. During a rotation the previous key (`SECRETS_KEY_PREVIOUS`) still
//! decrypts, and [`at_rest`] rewrites every value under the current one.

use std::fmt;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use ring::hkdf::{KeyType, Salt, HKDF_SHA256};
use ring::rand::{SecureRandom, SystemRandom};

pub mod at_rest;

/// The prefix of every stored value (format version 1).
pub const PREFIX: &str = "enc:v1:";
/// The shortest key accepted, in bytes.
pub const MIN_KEY_BYTES: usize = 32;
/// The configuration names of the keys (in errors: what to set).
pub const KEY_OPTION: &str = "SECRETS_KEY";
pub const PREVIOUS_KEY_OPTION: &str = "SECRETS_KEY_PREVIOUS";

/// The salt of the key derivation: fixed, so one string always makes the same key.
const SALT: &[u8] = b"walcast secrets at rest";
/// Bytes of a key id (shown as twice as many hex digits).
const KEY_ID_BYTES: usize = 4;
/// Bytes of the authentication tag.
const TAG_BYTES: usize = 16;

/// Where a stored value lives: its table of the `walcast` schema, its column, its row's
/// key (a project id, a source name). Bound to the ciphertext as associated data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place<'a> {
    pub table: &'static str,
    pub column: &'static str,
    pub row: &'a str,
}

impl<'a> Place<'a> {
    /// A column of `walcast.projects`, row `id`.
    pub fn project(column: &'static str, id: &'a str) -> Place<'a> {
        Place {
            table: "projects",
            column,
            row: id,
        }
    }

    /// A column of `walcast.sources`, row `name`.
    pub fn source(column: &'static str, name: &'a str) -> Place<'a> {
        Place {
            table: "sources",
            column,
            row: name,
        }
    }

    /// The associated data: the format, table, column and row, each ended by NUL (which
    /// Postgres text cannot hold, so no two places make the same bytes).
    fn aad(&self) -> Vec<u8> {
        let mut a = Vec::with_capacity(64 + self.row.len());
        for part in ["walcast secret v1", self.table, self.column, self.row] {
            a.extend_from_slice(part.as_bytes());
            a.push(0);
        }
        a
    }
}

impl fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "walcast.{}.{} of {:?}",
            self.table, self.column, self.row
        )
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("{KEY_OPTION} is not set: the key that encrypts the projects' secrets and the sources' URLs in the database (at least {MIN_KEY_BYTES} bytes, e.g. `openssl rand -hex 32`; see docs/security.md)")]
    NoKey,
    #[error(
        "{option} is shorter than {MIN_KEY_BYTES} bytes (generate one with `openssl rand -hex 32`)"
    )]
    ShortKey { option: &'static str },
    #[error("{PREVIOUS_KEY_OPTION} is the same key as {KEY_OPTION}")]
    SameKey,
    #[error("{place} is stored in plain text: `walcast secrets rotate` (or the next start of a cdc-worker) encrypts it")]
    Plain { place: String },
    #[error("{place} was encrypted with key {key_id}, which is not configured ({KEY_OPTION} is key {current}, {PREVIOUS_KEY_OPTION} {previous}): set {PREVIOUS_KEY_OPTION} (or {KEY_OPTION}) to the key whose id is {key_id}")]
    UnknownKey {
        place: String,
        key_id: String,
        current: String,
        previous: String,
    },
    #[error("{place} does not decrypt with key {key_id}: it was altered, or copied from another row or column")]
    Corrupt { place: String, key_id: String },
    #[error("{place} is not a value walcast stored: {why}")]
    Malformed { place: String, why: String },
    #[error("the system's random number generator failed")]
    Random,
}

impl SecretError {
    /// Whether the value needs a key that is not configured (a configuration to fix, not
    /// a value to skip).
    pub fn is_unknown_key(&self) -> bool {
        matches!(self, SecretError::UnknownKey { .. })
    }
}

/// One key: its id and its AEAD key.
struct Key {
    id: String,
    aead: LessSafeKey,
}

/// A length for HKDF's output.
struct Len(usize);

impl KeyType for Len {
    fn len(&self) -> usize {
        self.0
    }
}

impl Key {
    fn derive(material: &str, option: &'static str) -> Result<Key, SecretError> {
        if material.len() < MIN_KEY_BYTES {
            return Err(SecretError::ShortKey { option });
        }
        let prk = Salt::new(HKDF_SHA256, SALT).extract(material.as_bytes());
        let okm = prk
            .expand(&[b"aes-256-gcm key"], &AES_256_GCM)
            .map_err(|_| SecretError::Random)?;
        let aead = LessSafeKey::new(UnboundKey::from(okm));
        let mut id = [0u8; KEY_ID_BYTES];
        prk.expand(&[b"key id"], Len(KEY_ID_BYTES))
            .and_then(|okm| okm.fill(&mut id))
            .map_err(|_| SecretError::Random)?;
        let id = id.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Key { id, aead })
    }
}

/// The configured keys: the current one (every value is written with it) and, during a
/// rotation, the previous one (still read).
pub struct SecretKeys {
    current: Key,
    previous: Option<Key>,
    random: SystemRandom,
}

impl fmt::Debug for SecretKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SecretKeys")
            .field("key_id", &self.current.id)
            .field("previous_key_id", &self.previous.as_ref().map(|k| &k.id))
            .finish()
    }
}

/// What a stored value is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stored {
    /// Not an envelope: plain text (stored before encryption, or by an older walcast).
    Plain,
    /// Made with the current key.
    Current,
    /// Made with the previous key.
    Previous,
    /// Made with a key not configured (its id).
    Unknown(String),
    /// Claims to be an envelope but is not one.
    Malformed(String),
}

impl SecretKeys {
    /// The keys from their configured strings (each at least [`MIN_KEY_BYTES`] bytes;
    /// the previous one, when given, another key).
    pub fn new(current: &str, previous: Option<&str>) -> Result<SecretKeys, SecretError> {
        let current = Key::derive(current, KEY_OPTION)?;
        let previous = previous
            .filter(|p| !p.is_empty())
            .map(|p| Key::derive(p, PREVIOUS_KEY_OPTION))
            .transpose()?;
        if previous.as_ref().is_some_and(|p| p.id == current.id) {
            return Err(SecretError::SameKey);
        }
        Ok(SecretKeys {
            current,
            previous,
            random: SystemRandom::new(),
        })
    }

    /// The current key's id.
    pub fn key_id(&self) -> &str {
        &self.current.id
    }

    /// The previous key's id, if one is configured.
    pub fn previous_key_id(&self) -> Option<&str> {
        self.previous.as_ref().map(|k| k.id.as_str())
    }

    /// `plain` encrypted for `place` with the current key.
    pub fn seal(&self, place: Place<'_>, plain: &str) -> Result<String, SecretError> {
        let mut nonce = [0u8; NONCE_LEN];
        self.random
            .fill(&mut nonce)
            .map_err(|_| SecretError::Random)?;
        let mut body = Vec::with_capacity(NONCE_LEN + plain.len() + TAG_BYTES);
        body.extend_from_slice(&nonce);
        let mut sealed = plain.as_bytes().to_vec();
        self.current
            .aead
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(place.aad()),
                &mut sealed,
            )
            .map_err(|_| SecretError::Random)?;
        body.extend_from_slice(&sealed);
        Ok(format!(
            "{PREFIX}{}:{}",
            self.current.id,
            URL_SAFE_NO_PAD.encode(body)
        ))
    }

    /// [`SecretKeys::seal`] of an optional value.
    pub fn seal_opt(
        &self,
        place: Place<'_>,
        plain: Option<&str>,
    ) -> Result<Option<String>, SecretError> {
        plain.map(|p| self.seal(place, p)).transpose()
    }

    /// The plain text of `stored`, read from `place`.
    pub fn open(&self, place: Place<'_>, stored: &str) -> Result<String, SecretError> {
        let (key_id, body) = envelope(stored).map_err(|e| e.at(place))?;
        let key = self.key(key_id).ok_or_else(|| SecretError::UnknownKey {
            place: place.to_string(),
            key_id: key_id.to_string(),
            current: self.current.id.clone(),
            previous: self
                .previous_key_id()
                .map_or_else(|| "is unset".to_string(), |id| format!("is key {id}")),
        })?;
        let corrupt = || SecretError::Corrupt {
            place: place.to_string(),
            key_id: key_id.to_string(),
        };
        let mut bytes = URL_SAFE_NO_PAD.decode(body).map_err(|_| corrupt())?;
        if bytes.len() < NONCE_LEN + TAG_BYTES {
            return Err(corrupt());
        }
        let mut sealed = bytes.split_off(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(&bytes).map_err(|_| corrupt())?;
        let plain = key
            .aead
            .open_in_place(nonce, Aad::from(place.aad()), &mut sealed)
            .map_err(|_| corrupt())?;
        String::from_utf8(plain.to_vec()).map_err(|_| corrupt())
    }

    /// [`SecretKeys::open`] of an optional value.
    pub fn open_opt(
        &self,
        place: Place<'_>,
        stored: Option<&str>,
    ) -> Result<Option<String>, SecretError> {
        stored.map(|s| self.open(place, s)).transpose()
    }

    /// What `stored` is (which key made it), without decrypting it.
    pub fn classify(&self, stored: &str) -> Stored {
        match envelope(stored) {
            Err(Bad::Plain) => Stored::Plain,
            Err(Bad::Malformed(why)) => Stored::Malformed(why),
            Ok((id, _)) if id == self.current.id => Stored::Current,
            Ok((id, _)) if self.previous_key_id() == Some(id) => Stored::Previous,
            Ok((id, _)) => Stored::Unknown(id.to_string()),
        }
    }

    fn key(&self, id: &str) -> Option<&Key> {
        std::iter::once(&self.current)
            .chain(&self.previous)
            .find(|k| k.id == id)
    }
}

/// `bytes` random bytes as lower-case hex (a new project secret: 32 bytes, 64 digits).
pub fn random_hex(bytes: usize) -> Result<String, SecretError> {
    let mut b = vec![0u8; bytes];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| SecretError::Random)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// Count and log a stored value that cannot be read, whose row is left out of what was
/// read (`table`: projects, sources).
pub fn left_out(table: &'static str, e: &SecretError) {
    metrics::counter!(crate::telemetry::SECRETS_UNREADABLE, "table" => table).increment(1);
    tracing::error!(error = %e, table, "a stored secret cannot be read: its row is left out");
}

/// Rows read with their secrets: each opened, a row whose value cannot be read left out
/// (counted, logged), and the whole read refused when a value needs a key that is not
/// configured (a configuration to fix: leaving every row out would end every session).
pub fn readable<T>(
    table: &'static str,
    rows: impl IntoIterator<Item = Result<T, SecretError>>,
) -> Result<Vec<T>, SecretError> {
    let mut out = Vec::new();
    for r in rows {
        match r {
            Ok(v) => out.push(v),
            Err(e) if e.is_unknown_key() => return Err(e),
            Err(e) => left_out(table, &e),
        }
    }
    Ok(out)
}

/// Why a stored value is not an envelope.
enum Bad {
    Plain,
    Malformed(String),
}

impl Bad {
    fn at(self, place: Place<'_>) -> SecretError {
        match self {
            Bad::Plain => SecretError::Plain {
                place: place.to_string(),
            },
            Bad::Malformed(why) => SecretError::Malformed {
                place: place.to_string(),
                why,
            },
        }
    }
}

/// The key id and body of an envelope.
fn envelope(stored: &str) -> Result<(&str, &str), Bad> {
    let Some(rest) = stored.strip_prefix("enc:") else {
        return Err(Bad::Plain);
    };
    let Some(rest) = rest.strip_prefix("v1:") else {
        let version = rest.split(':').next().unwrap_or_default();
        return Err(Bad::Malformed(format!(
            "unknown format {:?} (written by a newer walcast?)",
            version.chars().take(16).collect::<String>()
        )));
    };
    match rest.split_once(':') {
        Some((id, body))
            if id.len() == 2 * KEY_ID_BYTES && id.bytes().all(|b| b.is_ascii_hexdigit()) =>
        {
            Ok((id, body))
        }
        _ => Err(Bad::Malformed("no key id".to_string())),
    }
}

#[cfg(test)]
mod tests;
