//! The fixtures: Postgres instances holding several databases each, one source (with its
//! project and one table) per database, registered in the control database as
//! `tests/e2e/many_sources.rs` does it by SQL.

use anyhow::Context;
use walcast_testkit::Postgres;

/// The table every source's project writes to: a row id and the commit-side timestamp.
pub(super) const TABLE_DDL: &str = "(id int8 PRIMARY KEY, at timestamptz NOT NULL)";

/// The default source's table, in the control database's `public` schema.
pub(super) const DEFAULT_TABLE: &str = "src_lat";

/// One source as the benchmark sees it.
#[derive(Clone, Debug)]
pub(super) struct Src {
    pub name: String,
    pub project: String,
    /// The Postgres instance of its database (`None`: the control instance).
    pub instance: Option<usize>,
    pub url: String,
    /// The table written to, schema-qualified.
    pub table: String,
}

impl Src {
    /// The default source: the control database and its default project.
    pub fn default_of(control_url: &str) -> Src {
        Src {
            name: "default".into(),
            project: "default".into(),
            instance: None,
            url: control_url.to_string(),
            table: format!("public.{DEFAULT_TABLE}"),
        }
    }

    pub fn slot(&self) -> String {
        format!("walcast_src_{}", self.name)
    }
}

/// Start `n` Postgres instances in parallel, each with room for `per_instance` slots.
pub(super) async fn start_instances(
    n: usize,
    per_instance: usize,
) -> anyhow::Result<Vec<Postgres>> {
    // Headroom over the sources: the default settings allow 16 of each.
    let room = (per_instance + 4).max(16).to_string();
    let starts: Vec<_> = (0..n)
        .map(|_| {
            let room = room.clone();
            tokio::task::spawn_blocking(move || {
                Postgres::builder()
                    .setting("max_replication_slots", &room)
                    .setting("max_wal_senders", &room)
                    .start()
            })
        })
        .collect();
    let mut out = Vec::with_capacity(n);
    for (i, s) in starts.into_iter().enumerate() {
        out.push(
            s.await?
                .with_context(|| format!("starting postgres instance {i}"))?,
        );
    }
    Ok(out)
}

/// Create `n` databases spread round robin over `instances`, each migrated and with its
/// project's schema and table enabled for realtime; not registered yet.
pub(super) async fn create_sources(instances: &[Postgres], n: usize) -> anyhow::Result<Vec<Src>> {
    let mut admins = Vec::with_capacity(instances.len());
    for pg in instances {
        admins.push(walcast_pipeline::connect(&pg.url()).await?);
    }
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let inst = i % instances.len();
        let db = format!("src{i}");
        admins[inst]
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .with_context(|| format!("creating database {db}"))?;
        let src = Src {
            name: format!("s{i}"),
            project: format!("p{i}"),
            instance: Some(inst),
            url: instances[inst].url_for("postgres", &db),
            table: format!("project_p{i}.t"),
        };
        prepare(&src)
            .await
            .with_context(|| format!("preparing {db}"))?;
        out.push(src);
    }
    Ok(out)
}

/// Migrate a source's database and create and enable its project's table there.
async fn prepare(src: &Src) -> anyhow::Result<()> {
    let mut db = walcast_pipeline::connect(&src.url).await?;
    walcast_control::migrate::migrate(&mut db).await?;
    let schema = format!("project_{}", src.project);
    db.batch_execute(&format!(
        "CREATE SCHEMA {schema};
         GRANT USAGE ON SCHEMA {schema} TO anon, authenticated, service_role;
         CREATE TABLE {schema}.t {TABLE_DDL};
         GRANT SELECT ON {schema}.t TO anon, authenticated, service_role;
         ALTER TABLE {schema}.t REPLICA IDENTITY FULL;
         INSERT INTO walcast.realtime_tables (project_id, schema_name, table_name)
         VALUES ('{}', '{schema}', 't');",
        src.project
    ))
    .await?;
    Ok(())
}

/// Register the sources and their projects in the control database, in one transaction,
/// their URLs and secrets encrypted with the key the workers are given.
pub(super) async fn register(control: &tokio_postgres::Client, srcs: &[Src]) -> anyhow::Result<()> {
    use walcast_control::secrets::Place;
    let keys = crate::env::secret_keys()?;
    control.batch_execute("BEGIN").await?;
    for s in srcs {
        let check = walcast_testkit::as_check_login(&s.url);
        let db = keys.seal(Place::source("database_url", &s.name), &s.url)?;
        let check = keys.seal(Place::source("check_url", &s.name), &check)?;
        let secret = format!("secret-{}", s.project);
        let secret = keys.seal(Place::project("jwt_secret", &s.project), &secret)?;
        control
            .execute(
                "INSERT INTO walcast.sources (name, database_url, slot_name, check_url)
                 VALUES ($1, $2, $3, $4)",
                &[&s.name, &db, &s.slot(), &check],
            )
            .await
            .context("registering a source")?;
        control
            .execute(
                "INSERT INTO walcast.projects (id, name, schema_name, jwt_secret, source)
                 VALUES ($1, $1, 'project_' || $1, $2, $3)",
                &[&s.project, &secret, &s.name],
            )
            .await
            .context("registering a project")?;
    }
    control.batch_execute("COMMIT").await?;
    Ok(())
}
