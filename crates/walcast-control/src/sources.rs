//! The sources registry: the databases walcast reads, rows of the control database's
//! `walcast.sources` (`sql/0020_sources.sql`). The default source ([`DEFAULT_SOURCE`]) is
//! the deployment's own `DATABASE_URL`: its row has no URLs nor slot name (they come from
//! the configuration, see [`Source::urls`]). Every other row names a database, the
//! replication URL to read it with and its slot.
//!
//! The table holds credentials: only walcast's own role may read it (the migration
//! revokes it from `PUBLIC`), its URLs are stored encrypted ([`crate::secrets`]: every
//! function that reads or writes them takes the keys), and what is shown of a source goes
//! through [`redact_url`].

use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, GenericClient, Row};
use walcast_bus::source::{check_name, SourceNameError, DEFAULT_SOURCE};

use crate::secrets::{Place, SecretError, SecretKeys};

/// Prefix of a source's default slot name ([`default_slot_name`]).
pub const SLOT_PREFIX: &str = "walcast_src_";

/// Longest slot name (Postgres' `NAMEDATALEN - 1`).
pub const MAX_SLOT_LEN: usize = 63;

/// A row of `walcast.sources`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    pub name: String,
    /// `None` for the default source only (its URL is `DATABASE_URL`).
    pub database_url: Option<String>,
    /// `None`: the database URL (or, for the default, `POSTGRES_REPLICATION_URL`).
    pub replication_url: Option<String>,
    /// `None` for the default source only (its slot is `CDC_SLOT_NAME`).
    pub slot_name: Option<String>,
    /// The check login's URL on its database (the default source's is
    /// `CHECK_DATABASE_URL`; `None` for a source added before there was one: its worker
    /// then refuses to read it until it is set).
    pub check_url: Option<String>,
    /// RFC 3339, UTC, milliseconds.
    pub created_at: String,
}

/// A source to add ([`add`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NewSource {
    pub name: String,
    pub database_url: String,
    /// `None`: the database URL.
    pub replication_url: Option<String>,
    /// `None`: [`default_slot_name`].
    pub slot_name: Option<String>,
    /// The URL of its check login (see [`crate::check_login`]).
    pub check_url: Option<String>,
}

/// The URLs a source is read with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceUrls {
    /// Tables, catalog, RLS checks, the realtime registry.
    pub database_url: String,
    /// The replication slot.
    pub replication_url: String,
    /// The check login's (`None`: not set).
    pub check_url: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("source name {name:?}: {error}")]
    Name {
        name: String,
        #[source]
        error: SourceNameError,
    },
    #[error(
        "the default source is the deployment's own DATABASE_URL: it is neither added nor removed"
    )]
    Default,
    #[error("slot name {0:?}: a slot name is 1 to 63 characters among lower-case letters, digits and '_'")]
    SlotName(String),
    #[error("source {0:?}: a database URL is required")]
    NoDatabaseUrl(String),
    #[error("source {0:?}: a check login URL is required (SOURCE_CHECK_URL: a login of its own with no privileges, see docs/security.md)")]
    NoCheckUrl(String),
    #[error("a source named {0:?} already exists")]
    DuplicateName(String),
    #[error("replication slot {0:?} is already the slot of another source (two sources on one server need different slot names: pass another --slot-name)")]
    DuplicateSlot(String),
    #[error("no source named {0:?}")]
    Unknown(String),
    #[error(
        "source {name:?} still has {projects} project(s): delete them (or leave the source) first"
    )]
    InUse { name: String, projects: i64 },
    #[error("{0}")]
    Secret(#[from] SecretError),
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

/// Whether `slot` is a usable slot name: `^[a-z0-9_]{1,63}$`.
pub fn check_slot_name(slot: &str) -> Result<&str, SourceError> {
    let ok = !slot.is_empty()
        && slot.len() <= MAX_SLOT_LEN
        && slot
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    ok.then_some(slot)
        .ok_or_else(|| SourceError::SlotName(slot.to_string()))
}

/// The slot of source `name` unless told otherwise: `walcast_src_<name>`, each `-` as `_`.
pub fn default_slot_name(name: &str) -> String {
    format!("{SLOT_PREFIX}{}", name.replace('-', "_"))
}

/// A name that may be added: a valid source name, not the default's.
pub fn check_new_name(name: &str) -> Result<&str, SourceError> {
    let name = check_name(name).map_err(|error| SourceError::Name {
        name: name.to_string(),
        error,
    })?;
    match walcast_bus::source::is_default(name) {
        true => Err(SourceError::Default),
        false => Ok(name),
    }
}

impl NewSource {
    /// Checked: the name ([`check_new_name`]), a database URL, a check login URL, the slot
    /// name (given or [`default_slot_name`]); an empty replication URL is none.
    pub fn checked(&self) -> Result<NewSource, SourceError> {
        let name = check_new_name(&self.name)?.to_string();
        let database_url = self.database_url.trim().to_string();
        if database_url.is_empty() {
            return Err(SourceError::NoDatabaseUrl(name));
        }
        let check_url =
            non_empty(self.check_url.as_deref()).ok_or(SourceError::NoCheckUrl(name.clone()))?;
        let slot = match &self.slot_name {
            Some(s) => s.clone(),
            None => default_slot_name(&name),
        };
        check_slot_name(&slot)?;
        Ok(NewSource {
            replication_url: non_empty(self.replication_url.as_deref()),
            check_url: Some(check_url),
            name,
            database_url,
            slot_name: Some(slot),
        })
    }
}

fn non_empty(url: Option<&str>) -> Option<String> {
    url.map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_string)
}

impl Source {
    /// Whether this is the default source.
    pub fn is_default(&self) -> bool {
        walcast_bus::source::is_default(&self.name)
    }

    /// The URLs this source is read with. The default source's are the deployment's own
    /// (`database_url`: DATABASE_URL, `replication_url`: POSTGRES_REPLICATION_URL,
    /// `check_url`: CHECK_DATABASE_URL); any other's are its row's, its replication URL
    /// defaulting to its database URL.
    pub fn urls(
        &self,
        database_url: &str,
        replication_url: Option<&str>,
        check_url: Option<&str>,
    ) -> SourceUrls {
        let (db, repl, check) = match (&self.database_url, self.is_default()) {
            (Some(db), false) => (
                db.as_str(),
                self.replication_url.as_deref(),
                self.check_url.as_deref(),
            ),
            _ => (database_url, replication_url, check_url),
        };
        SourceUrls {
            database_url: db.to_string(),
            replication_url: repl.unwrap_or(db).to_string(),
            check_url: check.map(str::to_string),
        }
    }

    /// The slot this source is read from: its own, or `default_slot` (CDC_SLOT_NAME) for
    /// the default source.
    pub fn slot<'a>(&'a self, default_slot: &'a str) -> &'a str {
        match (&self.slot_name, self.is_default()) {
            (Some(s), false) => s,
            _ => default_slot,
        }
    }

    /// What may be shown of a source (JSON): its URLs' passwords hidden.
    pub fn view(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.name,
            "database_url": self.database_url.as_deref().map(redact_url),
            "replication_url": self.replication_url.as_deref().map(redact_url),
            "slot_name": self.slot_name,
            "check_url": self.check_url.as_deref().map(redact_url),
            "created_at": self.created_at,
        })
    }
}

pub use walcast_core::redact::redact_url;

const COLUMNS: &str = "name, database_url, replication_url, slot_name,
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'), check_url";

/// A row, its URLs left encrypted.
fn sealed_row(r: &Row) -> Source {
    Source {
        name: r.get(0),
        database_url: r.get(1),
        replication_url: r.get(2),
        slot_name: r.get(3),
        created_at: r.get(4),
        check_url: r.get(5),
    }
}

/// A row, its URLs decrypted.
fn from_row(r: &Row, keys: &SecretKeys) -> Result<Source, SecretError> {
    let s = sealed_row(r);
    let open =
        |column, v: Option<String>| keys.open_opt(Place::source(column, &s.name), v.as_deref());
    Ok(Source {
        database_url: open("database_url", s.database_url.clone())?,
        replication_url: open("replication_url", s.replication_url.clone())?,
        check_url: open("check_url", s.check_url.clone())?,
        ..s
    })
}

/// Every source by name, each decrypted or why it cannot be (the default first, then by
/// name; one query: the worker calls it every few seconds to know which sources to lead).
pub async fn list_rows<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
) -> Result<Vec<(String, Result<Source, SecretError>)>, SourceError> {
    let rows = client
        .query(
            &format!(
                "SELECT {COLUMNS} FROM walcast.sources ORDER BY name <> '{DEFAULT_SOURCE}', name"
            ),
            &[],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), from_row(r, keys))).collect())
}

/// Every source whose URLs can be read (see [`crate::secrets::readable`]: one that cannot
/// is left out, counted and logged; a URL of a key not configured fails the list).
pub async fn list<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
) -> Result<Vec<Source>, SourceError> {
    let rows = list_rows(client, keys).await?;
    Ok(crate::secrets::readable(
        "sources",
        rows.into_iter().map(|(_, s)| s),
    )?)
}

/// One source; `None`: no such source.
pub async fn get<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    name: &str,
) -> Result<Option<Source>, SourceError> {
    let row = client
        .query_opt(
            &format!("SELECT {COLUMNS} FROM walcast.sources WHERE name = $1"),
            &[&name],
        )
        .await?;
    Ok(row.as_ref().map(|r| from_row(r, keys)).transpose()?)
}

/// Store a source (checked with [`NewSource::checked`]), its URLs encrypted. Its database
/// is not contacted here: `walcast source add` checks it first.
pub async fn add<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    new: &NewSource,
) -> Result<Source, SourceError> {
    let new = new.checked()?;
    let seal = |column, url: Option<&str>| keys.seal_opt(Place::source(column, &new.name), url);
    let database_url = seal("database_url", Some(&new.database_url))?;
    let replication_url = seal("replication_url", new.replication_url.as_deref())?;
    let check_url = seal("check_url", new.check_url.as_deref())?;
    let row = client
        .query_one(
            &format!(
                "INSERT INTO walcast.sources (name, database_url, replication_url, slot_name, check_url)
                 VALUES ($1, $2, $3, $4, $5) RETURNING {COLUMNS}"
            ),
            &[
                &new.name,
                &database_url,
                &replication_url,
                &new.slot_name,
                &check_url,
            ],
        )
        .await
        .map_err(|e| duplicate(e, &new))?;
    Ok(from_row(&row, keys)?)
}

/// A unique violation as the duplicate it is.
fn duplicate(e: tokio_postgres::Error, new: &NewSource) -> SourceError {
    let Some(db) = e.as_db_error() else {
        return SourceError::Db(e);
    };
    if db.code() != &SqlState::UNIQUE_VIOLATION {
        return SourceError::Db(e);
    }
    match db.constraint() {
        Some(c) if c.contains("slot") => {
            SourceError::DuplicateSlot(new.slot_name.clone().unwrap_or_default())
        }
        _ => SourceError::DuplicateName(new.name.clone()),
    }
}

/// Set the check login's URL of source `name` (not the default's: that is
/// `CHECK_DATABASE_URL`); its worker reads it at its next start of the source.
pub async fn set_check_url<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    name: &str,
    check_url: &str,
) -> Result<Source, SourceError> {
    if walcast_bus::source::is_default(name) {
        return Err(SourceError::Default);
    }
    let check_url =
        non_empty(Some(check_url)).ok_or_else(|| SourceError::NoCheckUrl(name.to_string()))?;
    let check_url = keys.seal(Place::source("check_url", name), &check_url)?;
    let row = client
        .query_opt(
            &format!(
                "UPDATE walcast.sources SET check_url = $2 WHERE name = $1 RETURNING {COLUMNS}"
            ),
            &[&name, &check_url],
        )
        .await?;
    let row = row.ok_or_else(|| SourceError::Unknown(name.to_string()))?;
    Ok(from_row(&row, keys)?)
}

/// Remove a source, refused while projects are on it; returns the removed row (its slot
/// is left: `walcast source remove --drop-slot` drops it once its worker let go). A row
/// whose URLs cannot be read is removed too, returned without them (logged); one of a
/// key not configured is refused.
pub async fn remove(
    client: &mut Client,
    keys: &SecretKeys,
    name: &str,
) -> Result<Source, SourceError> {
    if walcast_bus::source::is_default(name) {
        return Err(SourceError::Default);
    }
    let tx = client.transaction().await?;
    // The row lock keeps a project from being created on it meanwhile (its foreign key).
    let row = tx
        .query_opt(
            &format!("SELECT {COLUMNS} FROM walcast.sources WHERE name = $1 FOR UPDATE"),
            &[&name],
        )
        .await?;
    let row = row.ok_or_else(|| SourceError::Unknown(name.to_string()))?;
    let source = match from_row(&row, keys) {
        Ok(s) => s,
        Err(e) if e.is_unknown_key() => return Err(e.into()),
        Err(e) => {
            crate::secrets::left_out("sources", &e);
            Source {
                database_url: None,
                replication_url: None,
                check_url: None,
                ..sealed_row(&row)
            }
        }
    };
    let projects: i64 = tx
        .query_one(
            "SELECT count(*) FROM walcast.projects WHERE source = $1",
            &[&name],
        )
        .await?
        .get(0);
    if projects > 0 {
        return Err(SourceError::InUse {
            name: name.to_string(),
            projects,
        });
    }
    tx.execute("DELETE FROM walcast.sources WHERE name = $1", &[&name])
        .await?;
    tx.commit().await?;
    Ok(source)
}

#[cfg(test)]
mod tests;
