//! Every stored secret at once: what is still plain text encrypted (the migration of a
//! database written before there was a key), what the previous key made rewritten under
//! the current one (a rotation), and the values counted by the key that made them.
//!
//! A pass runs in one transaction with the rows locked, so passes of several processes
//! starting together follow each other; it is idempotent (a value already under the
//! current key is left as it is). A value made with a key that is not configured stops
//! it before anything is written: that is a configuration to fix, and the error names
//! the key. A value that does not decrypt with its key (altered, moved) is left as it is
//! and reported.

use std::collections::BTreeMap;

use serde::Serialize;
use tokio_postgres::{Client, GenericClient};

use super::{Place, SecretError, SecretKeys, Stored};

/// The secret columns of `walcast.projects`.
pub const PROJECT_COLUMNS: &[&str] = &["jwt_secret", "jwt_secret_previous"];
/// The secret columns of `walcast.sources`.
pub const SOURCE_COLUMNS: &[&str] = &["database_url", "replication_url", "check_url"];

/// A table with secret columns: its name in the `walcast` schema, its key column.
struct Table {
    name: &'static str,
    key: &'static str,
    columns: &'static [&'static str],
}

const TABLES: [Table; 2] = [
    Table {
        name: "projects",
        key: "id",
        columns: PROJECT_COLUMNS,
    },
    Table {
        name: "sources",
        key: "name",
        columns: SOURCE_COLUMNS,
    },
];

/// One stored value (not NULL).
struct Value {
    table: &'static str,
    key: &'static str,
    column: &'static str,
    row: String,
    stored: String,
}

impl Value {
    fn place(&self) -> Place<'_> {
        Place {
            table: self.table,
            column: self.column,
            row: &self.row,
        }
    }
}

/// What a pass did, or what a look found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Report {
    /// The current key's id.
    pub key_id: String,
    /// The previous key's id, if configured.
    pub previous_key_id: Option<String>,
    /// Stored values (not NULL).
    pub values: usize,
    /// Values by the id of the key that made them (after the pass).
    pub by_key: BTreeMap<String, usize>,
    /// Values in plain text (after a pass: none).
    pub plain_text: usize,
    /// Plain-text values encrypted by the pass.
    pub encrypted: usize,
    /// Values of the previous key rewritten under the current one by the pass.
    pub reencrypted: usize,
    /// Values that cannot be read (each with why), left as they are.
    pub unreadable: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum AtRestError {
    #[error("{first}{}", match more { 0 => String::new(), n => format!(" (and {n} more value(s) of keys not configured)") })]
    UnknownKey {
        #[source]
        first: SecretError,
        more: usize,
    },
    #[error("{0}")]
    Secret(#[from] SecretError),
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

/// Every stored value of the secret columns (`lock`: the rows locked for update).
async fn read_all<C: GenericClient>(client: &C, lock: bool) -> Result<Vec<Value>, AtRestError> {
    let mut values = Vec::new();
    for t in &TABLES {
        let sql = format!(
            "SELECT {}, {} FROM walcast.{} ORDER BY 1{}",
            t.key,
            t.columns.join(", "),
            t.name,
            if lock { " FOR UPDATE" } else { "" }
        );
        for r in client.query(&sql, &[]).await? {
            let row: String = r.get(0);
            for (i, column) in t.columns.iter().enumerate() {
                if let Some(stored) = r.get::<_, Option<String>>(i + 1) {
                    values.push(Value {
                        table: t.name,
                        key: t.key,
                        column,
                        row: row.clone(),
                        stored,
                    });
                }
            }
        }
    }
    Ok(values)
}

/// Refuse values of keys not configured, naming the first.
fn known_keys(values: &[Value], keys: &SecretKeys) -> Result<(), AtRestError> {
    let mut unknown = values
        .iter()
        .filter(|v| matches!(keys.classify(&v.stored), Stored::Unknown(_)))
        .filter_map(|v| keys.open(v.place(), &v.stored).err());
    match unknown.next() {
        Some(first) => Err(AtRestError::UnknownKey {
            first,
            more: unknown.count(),
        }),
        None => Ok(()),
    }
}

impl Report {
    fn new(keys: &SecretKeys) -> Report {
        Report {
            key_id: keys.key_id().to_string(),
            previous_key_id: keys.previous_key_id().map(str::to_string),
            ..Report::default()
        }
    }

    /// Count a value as it is stored (after the pass).
    fn count(&mut self, keys: &SecretKeys, stored: &str) {
        self.values += 1;
        match keys.classify(stored) {
            Stored::Plain => self.plain_text += 1,
            Stored::Current => *self.by_key.entry(keys.key_id().to_string()).or_default() += 1,
            Stored::Previous => {
                let id = keys.previous_key_id().unwrap_or_default().to_string();
                *self.by_key.entry(id).or_default() += 1
            }
            Stored::Unknown(id) => *self.by_key.entry(id).or_default() += 1,
            Stored::Malformed(_) => {}
        }
    }
}

/// Count the stored values by key (nothing written). Values that cannot be read are
/// listed; values of keys not configured are counted under their key id.
pub async fn status<C: GenericClient>(
    client: &C,
    keys: &SecretKeys,
) -> Result<Report, AtRestError> {
    let mut report = Report::new(keys);
    for v in read_all(client, false).await? {
        report.count(keys, &v.stored);
        match keys.classify(&v.stored) {
            Stored::Plain | Stored::Unknown(_) => {}
            _ => {
                if let Err(e) = keys.open(v.place(), &v.stored) {
                    report.unreadable.push(e.to_string());
                }
            }
        }
    }
    Ok(report)
}

/// Encrypt every plain-text value and rewrite every value of the previous key under the
/// current one, in one transaction. Refused, with nothing written, when a value was made
/// with a key not configured.
pub async fn seal_all(client: &mut Client, keys: &SecretKeys) -> Result<Report, AtRestError> {
    let tx = client.transaction().await?;
    let values = read_all(&tx, true).await?;
    known_keys(&values, keys)?;
    let mut report = Report::new(keys);
    for v in &values {
        let place = v.place();
        let new = match keys.classify(&v.stored) {
            Stored::Plain => Some((keys.seal(place, &v.stored)?, false)),
            Stored::Previous => match keys.open(place, &v.stored) {
                Ok(plain) => Some((keys.seal(place, &plain)?, true)),
                Err(e) => {
                    report.unreadable.push(e.to_string());
                    None
                }
            },
            _ => {
                if let Err(e) = keys.open(place, &v.stored) {
                    report.unreadable.push(e.to_string());
                }
                None
            }
        };
        let Some((sealed, rotated)) = new else {
            report.count(keys, &v.stored);
            continue;
        };
        let sql = format!(
            "UPDATE walcast.{} SET {col} = $2 WHERE {} = $1 AND {col} = $3",
            v.table,
            v.key,
            col = v.column
        );
        tx.execute(&sql, &[&v.row, &sealed, &v.stored]).await?;
        match rotated {
            true => report.reencrypted += 1,
            false => report.encrypted += 1,
        }
        report.count(keys, &sealed);
    }
    tx.commit().await?;
    Ok(report)
}

/// How many values are stored in plain text (for a migration without a key).
pub async fn plain_text<C: GenericClient>(client: &C) -> Result<usize, AtRestError> {
    let values = read_all(client, false).await?;
    Ok(values
        .iter()
        .filter(|v| !v.stored.starts_with("enc:"))
        .count())
}
