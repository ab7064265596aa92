//! Projects: tenants of one database, each with its own schema and JWT secret.
//!
//! The default project (id [`DEFAULT_PROJECT`], schema `public`, secret `JWT_SECRET`) is
//! not stored; every other one is a row of `walcast.projects` created by [`create`]. Its
//! secrets are stored encrypted ([`crate::secrets`]): every function that reads or writes
//! them takes the keys.

use tokio_postgres::{Client, GenericClient, Row};
use walcast_bus::admin::{LimitChanges, ProjectLimits, MAX_LIMIT};

use crate::secrets::{Place, SecretError, SecretKeys};
use crate::tables::DEFAULT_PROJECT;
use walcast_bus::source::DEFAULT_SOURCE;
use walcast_core::sql::quote_ident;

/// Schema of the default project.
pub use walcast_core::DEFAULT_SCHEMA;
/// Prefix of every stored project's schema (`project_<uuid hex>`).
pub const SCHEMA_PREFIX: &str = "project_";

/// A stored project.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Project {
    pub id: String,
    pub name: String,
    pub schema: String,
    pub jwt_secret: String,
    /// RFC 3339, UTC, milliseconds.
    pub created_at: String,
    /// Accepted too during a secret rotation.
    pub jwt_secret_previous: Option<String>,
    /// A JWKS (JSON text) verifying its users' public-key tokens by `kid`.
    pub jwks: Option<String>,
    /// New sockets and joins refused, open ones ended.
    pub suspended: bool,
    /// Public channels refused.
    pub private_only: bool,
    /// The previous secret is accepted until then (Unix ms); `None`: without end.
    pub jwt_secret_previous_until_ms: Option<i64>,
    /// Its own limits (each `None`: the fronts' default).
    pub limits: ProjectLimits,
    /// The source (database) its schema is in.
    pub source: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ProjectError {
    #[error("project name must not be empty")]
    EmptyName,
    #[error("project name is longer than {MAX_NAME_CHARS} characters")]
    LongName,
    #[error("project name must not contain control characters")]
    ControlInName,
    #[error("{field} must be at most {MAX_LIMIT}")]
    LimitTooLarge { field: &'static str },
    #[error("realtime tables: {0}")]
    Tables(String),
    #[error("unknown source {0:?}")]
    UnknownSource(String),
    #[error("the database of source {name:?} cannot be reached: {message}")]
    SourceUnreachable { name: String, message: String },
    #[error("sources: {0}")]
    Source(String),
    #[error("{0}")]
    Secret(#[from] SecretError),
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

const COLUMNS: &str = "id, name, schema_name, jwt_secret,
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"'),
    jwt_secret_previous, jwks::text, suspended, private_only,
    (extract(epoch FROM jwt_secret_previous_until) * 1000)::bigint,
    max_concurrent_users, max_joins_per_second, max_channels_per_client,
    max_events_per_second, max_bytes_per_second, max_presence_events_per_second,
    max_payload_size_in_kb, source";

/// The column of the first limit in [`COLUMNS`] (the others follow in the order of
/// [`ProjectLimits::FIELDS`]).
const FIRST_LIMIT: usize = 10;

/// The secret columns (see [`crate::secrets::at_rest::PROJECT_COLUMNS`]).
const SECRET: &str = "jwt_secret";
const PREVIOUS: &str = "jwt_secret_previous";

/// A project's row, its secrets decrypted.
fn from_row(r: &Row, keys: &SecretKeys) -> Result<Project, SecretError> {
    let id: String = r.get(0);
    let jwt_secret = keys.open(Place::project(SECRET, &id), r.get(3))?;
    let previous = keys.open_opt(Place::project(PREVIOUS, &id), r.get(5))?;
    Ok(Project {
        name: r.get(1),
        schema: r.get(2),
        jwt_secret,
        created_at: r.get(4),
        jwt_secret_previous: previous,
        jwks: r.get(6),
        suspended: r.get(7),
        private_only: r.get(8),
        jwt_secret_previous_until_ms: r.get(9),
        // Each column's CHECK keeps it non-negative.
        limits: ProjectLimits::from_array(std::array::from_fn(|i| {
            r.get::<_, Option<i32>>(FIRST_LIMIT + i)
                .map(|n| n.max(0) as u32)
        })),
        source: r.get(FIRST_LIMIT + ProjectLimits::FIELDS.len()),
        id,
    })
}

/// The first row of `rows`, decrypted.
fn first(rows: &[Row], keys: &SecretKeys) -> Result<Option<Project>, ProjectError> {
    Ok(rows.first().map(|r| from_row(r, keys)).transpose()?)
}

/// Set a project's previous secret and JWKS (`None` clears them). The JWKS must be a
/// JSON object with a `keys` array (the fronts check each key). `false`: no such project.
pub async fn set_keys<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    id: &str,
    previous: Option<&str>,
    jwks: Option<&str>,
) -> Result<bool, ProjectError> {
    let previous = keys.seal_opt(Place::project(PREVIOUS, id), previous)?;
    let n = client
        .execute(
            "UPDATE walcast.projects SET jwt_secret_previous = $2, jwks = $3::text::jsonb,
                    jwt_secret_previous_until = NULL, updated_at = now()
              WHERE id = $1",
            &[&id, &previous, &jwks],
        )
        .await?;
    Ok(n > 0)
}

/// Create a project of the default source: see [`create_on`].
pub async fn create(
    client: &mut Client,
    keys: &SecretKeys,
    name: &str,
) -> Result<Project, ProjectError> {
    create_on(client, keys, DEFAULT_SOURCE, name).await
}

/// The secret of a new project, or of a rotation: 32 random bytes as 64 hex digits.
fn new_secret() -> Result<String, ProjectError> {
    Ok(crate::secrets::random_hex(32)?)
}

/// Create a project on `source`: a new uuid id, its schema `project_<uuid hex>` (usable
/// by `anon`, `authenticated` and `service_role`) in the source's database, and its row
/// (a 64-hex-digit secret) in the control database (`client`'s). For the default source
/// both in one transaction; for another, the schema first (on a session of its own) and,
/// if the row cannot be stored, the schema dropped again (when still empty).
pub async fn create_on(
    client: &mut Client,
    keys: &SecretKeys,
    source: &str,
    name: &str,
) -> Result<Project, ProjectError> {
    let name = check_name(name)?;
    let db = connect_source(&*client, keys, source).await?;
    let tx = client.transaction().await?;
    let id: String = tx
        .query_one("SELECT gen_random_uuid()::text", &[])
        .await?
        .get(0);
    let secret = keys.seal(Place::project(SECRET, &id), &new_secret()?)?;
    let schema = format!("{SCHEMA_PREFIX}{}", id.replace('-', ""));
    let q = quote_ident(&schema);
    let make = format!(
        "CREATE SCHEMA {q}; GRANT USAGE ON SCHEMA {q} TO anon, authenticated, service_role;"
    );
    match &db {
        None => tx.batch_execute(&make).await?,
        Some(db) => db.batch_execute(&make).await?,
    }
    let stored: Result<Project, ProjectError> = async {
        let row = tx
            .query_one(
                &format!(
                    "INSERT INTO walcast.projects (id, name, schema_name, jwt_secret, source)
                     VALUES ($1, $2, $3, $4, $5) RETURNING {COLUMNS}"
                ),
                &[&id, &name, &schema, &secret, &source],
            )
            .await?;
        tx.commit().await?;
        Ok(from_row(&row, keys)?)
    }
    .await;
    if let (Err(e), Some(db)) = (&stored, &db) {
        // Without CASCADE: refused if anything was put in it meanwhile.
        let dropped = db.batch_execute(&format!("DROP SCHEMA {q}")).await;
        tracing::warn!(error = %e, source, %schema, dropped = dropped.is_ok(), "project row not stored: its new schema dropped");
    }
    stored
}

/// A session on the database of `source` (`None`: the default source, whose database
/// is `control`'s own), its URL read from the control database's `walcast.sources`.
pub async fn connect_source<C: GenericClient>(
    control: &C,
    keys: &SecretKeys,
    source: &str,
) -> Result<Option<Client>, ProjectError> {
    if walcast_bus::source::is_default(source) {
        return Ok(None);
    }
    let url = crate::sources::get(control, keys, source)
        .await
        .map_err(|e| match e {
            crate::sources::SourceError::Db(d) => ProjectError::Db(d),
            other => ProjectError::Source(other.to_string()),
        })?
        .and_then(|s| s.database_url)
        .ok_or_else(|| ProjectError::UnknownSource(source.to_string()))?;
    let client =
        walcast_pgtls::connect(&url)
            .await
            .map_err(|e| ProjectError::SourceUnreachable {
                name: source.to_string(),
                message: e.to_string(),
            })?;
    Ok(Some(client))
}

/// Every stored project, oldest first. A project whose secrets cannot be read (altered,
/// moved from another row, plain text) is left out, counted and logged; a secret of a
/// key that is not configured fails the whole list (the fronts keep the one they have,
/// rather than ending every session).
pub async fn list<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
) -> Result<Vec<Project>, ProjectError> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM walcast.projects ORDER BY created_at, id"),
            &[],
        )
        .await?;
    let opened = rows.iter().map(|r| from_row(r, keys));
    Ok(crate::secrets::readable("projects", opened)?)
}

/// One stored project.
pub async fn get<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    id: &str,
) -> Result<Option<Project>, ProjectError> {
    let rows = client
        .query(
            &format!("SELECT {COLUMNS} FROM walcast.projects WHERE id = $1"),
            &[&id],
        )
        .await?;
    first(&rows, keys)
}

/// The schema of a project (`public` for the default one); `None` for an unknown id.
/// Its secrets are not read.
pub async fn schema_of<C: GenericClient>(
    client: &C,
    id: &str,
) -> Result<Option<String>, ProjectError> {
    if id == DEFAULT_PROJECT {
        return Ok(Some(DEFAULT_SCHEMA.to_string()));
    }
    let row = client
        .query_opt(
            "SELECT schema_name FROM walcast.projects WHERE id = $1",
            &[&id],
        )
        .await?;
    Ok(row.map(|r| r.get(0)))
}

/// Longest project name accepted.
pub const MAX_NAME_CHARS: usize = 200;

/// A name trimmed, not empty, at most [`MAX_NAME_CHARS`] characters, none a control
/// character (Postgres text cannot hold NUL; a name is shown to people).
pub fn check_name(name: &str) -> Result<&str, ProjectError> {
    let name = name.trim();
    if name.is_empty() {
        return Err(ProjectError::EmptyName);
    }
    if name.chars().count() > MAX_NAME_CHARS {
        return Err(ProjectError::LongName);
    }
    if name.chars().any(char::is_control) {
        return Err(ProjectError::ControlInName);
    }
    Ok(name)
}

/// The largest connected-users limit a project may have (the column is an `integer`),
/// the bound of every limit.
pub use walcast_bus::admin::MAX_USERS_LIMIT;

/// What an update changes (`None`: left as it is).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProjectChanges {
    pub name: Option<String>,
    pub private_only: Option<bool>,
    pub suspended: Option<bool>,
    /// Each `Some(None)`: back to the fronts' default; `Some(Some(n))`: `n`.
    pub limits: LimitChanges,
}

/// A limit that fits its column (at most [`MAX_LIMIT`]); `field` names it in the error.
pub fn check_limit(field: &'static str, n: u32) -> Result<i32, ProjectError> {
    match u64::from(n) <= MAX_LIMIT {
        true => i32::try_from(n).map_err(|_| ProjectError::LimitTooLarge { field }),
        false => Err(ProjectError::LimitTooLarge { field }),
    }
}

/// Each limit that `changes` sets (in the order of [`ProjectLimits::FIELDS`]), and its
/// value (`None`: the default), each checked.
fn limit_params(changes: &LimitChanges) -> Result<(Vec<bool>, Vec<Option<i32>>), ProjectError> {
    let mut set = Vec::with_capacity(ProjectLimits::FIELDS.len());
    let mut values = Vec::with_capacity(ProjectLimits::FIELDS.len());
    for (field, change) in ProjectLimits::FIELDS.into_iter().zip(changes.to_array()) {
        set.push(change.is_some());
        values.push(
            change
                .flatten()
                .map(|n| check_limit(field, n))
                .transpose()?,
        );
    }
    Ok((set, values))
}

/// `SET` terms of the limits: each column from the arrays `$set` and `$values` (1-based
/// indexes), or left. The column names come from [`ProjectLimits::FIELDS`]; the values
/// are bound parameters.
fn limit_sets(set: usize, values: usize) -> String {
    ProjectLimits::FIELDS
        .iter()
        .enumerate()
        .map(|(i, col)| {
            let i = i + 1;
            format!(
                "{col} = CASE WHEN (${set}::boolean[])[{i}] THEN (${values}::integer[])[{i}] ELSE {col} END,"
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Change a project's name, private-only switch, suspension or limits; `None`: no such
/// project.
pub async fn update<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
    id: &str,
    changes: &ProjectChanges,
) -> Result<Option<Project>, ProjectError> {
    let name = changes.name.as_deref().map(check_name).transpose()?;
    let (set, values) = limit_params(&changes.limits)?;
    let rows = client
        .query(
            &format!(
                "UPDATE walcast.projects SET name = coalesce($2, name),
                        private_only = coalesce($3, private_only),
                        suspended = coalesce($4, suspended),
                        {}
                        updated_at = now()
                  WHERE id = $1 RETURNING {COLUMNS}",
                limit_sets(5, 6)
            ),
            &[
                &id,
                &name,
                &changes.private_only,
                &changes.suspended,
                &set,
                &values,
            ],
        )
        .await?;
    first(&rows, keys)
}

/// A new secret for a project; the current one is still accepted for `window_secs`
/// (0: refused at once). `None`: no such project. The current secret is read (and, kept
/// as the previous one, encrypted for its new column) with the row locked.
pub async fn rotate(
    client: &mut Client,
    keys: &SecretKeys,
    id: &str,
    window_secs: u64,
) -> Result<Option<Project>, ProjectError> {
    let window = i64::try_from(window_secs)
        .unwrap_or(i64::MAX)
        .min(MAX_WINDOW_SECS);
    let tx = client.transaction().await?;
    let Some(row) = tx
        .query_opt(
            "SELECT jwt_secret FROM walcast.projects WHERE id = $1 FOR UPDATE",
            &[&id],
        )
        .await?
    else {
        return Ok(None);
    };
    let previous = match window > 0 {
        true => {
            let current = keys.open(Place::project(SECRET, id), row.get(0))?;
            Some(keys.seal(Place::project(PREVIOUS, id), &current)?)
        }
        false => None,
    };
    let secret = keys.seal(Place::project(SECRET, id), &new_secret()?)?;
    let rows = tx
        .query(
            &format!(
                "UPDATE walcast.projects
                    SET jwt_secret_previous = $3,
                        jwt_secret_previous_until = CASE WHEN $2::bigint > 0
                            THEN now() + make_interval(secs => $2::bigint) END,
                        jwt_secret = $4,
                        updated_at = now()
                  WHERE id = $1 RETURNING {COLUMNS}"
            ),
            &[&id, &window, &previous, &secret],
        )
        .await?;
    let project = first(&rows, keys)?;
    tx.commit().await?;
    Ok(project)
}

/// Longest rotation window: ten years.
pub const MAX_WINDOW_SECS: i64 = 10 * 365 * 86_400;

/// Delete a project: realtime disabled on each of its tables (no longer streamed), in
/// its source's database (the realtime tables are in the database that has the tables),
/// then its row (its secrets: its keys and tokens are refused), in one transaction of the
/// control database (for the default source, the same one). Its schema and data are
/// kept. `None`: no such project; else the tables it streamed.
pub async fn delete(
    client: &mut Client,
    keys: &SecretKeys,
    id: &str,
) -> Result<Option<Vec<crate::tables::TableRef>>, ProjectError> {
    let tx = client.transaction().await?;
    let source: Option<String> = tx
        .query_opt(
            "SELECT source FROM walcast.projects WHERE id = $1 FOR UPDATE",
            &[&id],
        )
        .await?
        .map(|r| r.get(0));
    let Some(source) = source else {
        return Ok(None);
    };
    let streamed = match connect_source(&tx, keys, &source).await? {
        None => disable_all(&tx, id).await?,
        Some(mut db) => {
            let stx = db.transaction().await?;
            let streamed = disable_all(&stx, id).await?;
            stx.commit().await?;
            streamed
        }
    };
    tx.execute("DELETE FROM walcast.projects WHERE id = $1", &[&id])
        .await?;
    tx.commit().await?;
    Ok(Some(streamed))
}

/// Realtime disabled on every table of project `id` in `client`'s database.
async fn disable_all<C: GenericClient>(
    client: &C,
    id: &str,
) -> Result<Vec<crate::tables::TableRef>, ProjectError> {
    use crate::tables;
    let streamed = tables::list(client, Some(id)).await.map_err(table_error)?;
    for t in &streamed {
        tables::disable(client, id, &t.schema, &t.table)
            .await
            .map_err(table_error)?;
    }
    Ok(streamed)
}

fn table_error(e: crate::tables::RealtimeTablesError) -> ProjectError {
    match e {
        crate::tables::RealtimeTablesError::Db(d) => ProjectError::Db(d),
        other => ProjectError::Tables(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_columns_are_the_limits_in_order() {
        // The columns before the limits: the 10 of `from_row` (`to_char(…)` has a comma).
        let cols: Vec<&str> = COLUMNS.split(',').map(str::trim).collect();
        assert_eq!(cols.len(), FIRST_LIMIT + 2 + ProjectLimits::FIELDS.len());
        assert!(cols[FIRST_LIMIT].ends_with("::bigint"), "{cols:?}");
        let limits = FIRST_LIMIT + 1..FIRST_LIMIT + 1 + ProjectLimits::FIELDS.len();
        assert_eq!(cols[limits], ProjectLimits::FIELDS);
        assert_eq!(cols.last(), Some(&"source"));
        let sets = limit_sets(5, 6);
        assert_eq!(sets.lines().count(), ProjectLimits::FIELDS.len());
        assert!(sets.contains(
            "max_payload_size_in_kb = CASE WHEN ($5::boolean[])[7] THEN ($6::integer[])[7] ELSE max_payload_size_in_kb END,"
        ));
    }

    #[test]
    fn a_limit_too_large_names_its_field() {
        assert_eq!(
            check_limit("max_events_per_second", i32::MAX as u32).unwrap(),
            i32::MAX
        );
        let changes = LimitChanges {
            max_joins_per_second: Some(Some(3)),
            max_bytes_per_second: Some(None),
            max_payload_size_in_kb: Some(Some(i32::MAX as u32 + 1)),
            ..LimitChanges::default()
        };
        let e = limit_params(&changes).unwrap_err();
        assert!(
            matches!(
                e,
                ProjectError::LimitTooLarge {
                    field: "max_payload_size_in_kb"
                }
            ),
            "{e}"
        );
        assert_eq!(
            e.to_string(),
            "max_payload_size_in_kb must be at most 2147483647"
        );
        let changes = LimitChanges {
            max_payload_size_in_kb: None,
            ..changes
        };
        let (set, values) = limit_params(&changes).unwrap();
        assert_eq!(set, [false, true, false, false, true, false, false]);
        assert_eq!(values, [None, Some(3), None, None, None, None, None]);
    }
}
