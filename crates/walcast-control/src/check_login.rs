//! The check login: the session user of every connection on which walcast runs SQL a
//! tenant wrote — row-level security policies (the delivery lanes' checks), the policies
//! of private channels, SSE snapshots' reads (see docs/security.md, "The two logins").
//!
//! A policy runs as the subscriber's role, switched to with `set_config('role', …)`. Any
//! SQL may switch it back: `RESET ROLE`, `SET ROLE NONE`, `set_config('role', 'none', …)`
//! return to the session user. On walcast's own login that was walcast's powers (in most
//! installs a superuser's). On the check login it is a login that may do nothing but
//! become the roles tokens act as, and only those that are subject to row-level security:
//! a role that bypasses it (`service_role`) is never reachable from tenant SQL; walcast
//! answers for such roles without running any (privileges and rows are then all there is).
//!
//! [`prepare`] checks the login at start, on walcast's own connection, and refuses one that
//! could do more: a superuser, `BYPASSRLS`, `CREATEROLE` or `REPLICATION`; one that may act
//! as such a role, or as walcast's own login; one that may read a table of the `walcast`
//! schema (where the projects' secrets are). It grants the login the allowed roles it may
//! act as (when walcast may grant them) and records it (`walcast.check_logins`), so the
//! private-channel probes it writes take the checked project and never commit.

use tokio_postgres::Client;

use crate::roles::RolePolicy;

/// Why the check login cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckLoginError {
    #[error("CHECK_DATABASE_URL is not set: walcast runs the SQL tenants write (row-level security policies, private-channel policies, SSE snapshots) on a login of its own with no privileges (for example CREATE ROLE walcast_check LOGIN NOINHERIT), never on DATABASE_URL's")]
    Missing,
    #[error("cannot connect with CHECK_DATABASE_URL: {0}")]
    Connect(#[source] walcast_pgtls::ConnectError),
    #[error("the check login {0:?} is walcast's own login: CHECK_DATABASE_URL must name a login of its own, with no privileges")]
    Walcast(String),
    #[error("the check login {login:?} {what}: it must have no privileges of its own (see docs/security.md)")]
    Powers { login: String, what: String },
    #[error("the check login {login:?} may not act as role {role:?}, and walcast cannot grant it ({reason}): run GRANT {role} TO {login}")]
    Grant {
        login: String,
        role: String,
        reason: String,
    },
    #[error("database: {}", walcast_pgtls::db_message(.0))]
    Db(#[from] tokio_postgres::Error),
}

impl CheckLoginError {
    /// Whether trying again can help: only a connection or database fault can pass.
    pub fn transient(&self) -> bool {
        matches!(self, CheckLoginError::Connect(_) | CheckLoginError::Db(_))
    }
}

/// The roles the check login may become (itself included), and what makes each
/// unacceptable, if anything. `$1`: the check login, `$2`: walcast's own login.
const REACHABLE_SQL: &str = "
SELECT r.rolname::text,
       concat_ws(', ',
         CASE WHEN r.rolsuper THEN 'is a superuser' END,
         CASE WHEN r.rolbypassrls THEN 'bypasses row-level security' END,
         CASE WHEN r.rolcreaterole THEN 'may create roles' END,
         CASE WHEN r.rolreplication THEN 'may replicate' END,
         CASE WHEN r.rolname = $2 THEN 'is walcast''s own login' END,
         CASE WHEN EXISTS (
                SELECT FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = 'walcast' AND c.relkind IN ('r', 'p', 'v', 'm')
                   AND has_table_privilege(r.oid, c.oid, 'SELECT'))
              THEN 'may read tables of the walcast schema' END)
  FROM pg_roles r
 WHERE pg_has_role($1, r.oid, 'MEMBER')
 ORDER BY r.rolname <> $1, r.rolname";

/// The allowed roles that exist and are subject to row-level security (those checks run
/// as), with whether the check login may already act as each. `$1`: the check login,
/// `$2`: the allowed roles.
const ROLES_SQL: &str = "
SELECT r.rolname::text, pg_has_role($1, r.oid, 'MEMBER')
  FROM pg_roles r
 WHERE r.rolname = ANY($2) AND NOT r.rolsuper AND NOT r.rolbypassrls
 ORDER BY r.rolname";

/// Check the login of `check_url` against walcast's own connection `own` (see the module
/// docs), grant it the allowed roles it may act as, record it, and return its name.
pub async fn prepare(
    own: &Client,
    check_url: Option<&str>,
    roles: &RolePolicy,
) -> Result<String, CheckLoginError> {
    let url = check_url
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .ok_or(CheckLoginError::Missing)?;
    let check = walcast_pgtls::connect(url)
        .await
        .map_err(CheckLoginError::Connect)?;
    let login: String = check
        .query_one("SELECT session_user::text", &[])
        .await?
        .get(0);
    drop(check);
    let walcast: String = own
        .query_one("SELECT session_user::text", &[])
        .await?
        .get(0);
    if login == walcast {
        return Err(CheckLoginError::Walcast(login));
    }
    refuse_powers(own, &login, &walcast).await?;
    grant_roles(own, &login, roles).await?;
    own.execute(
        "INSERT INTO walcast.check_logins (role) VALUES ($1)
         ON CONFLICT (role) DO UPDATE SET checked_at = now()",
        &[&login],
    )
    .await?;
    let grant = format!(
        "GRANT EXECUTE ON FUNCTION walcast.probe_message(text) TO {}",
        walcast_core::sql::quote_ident(&login)
    );
    own.batch_execute(&grant).await?;
    Ok(login)
}

/// Refuse a login that may do more than become roles subject to row-level security.
async fn refuse_powers(own: &Client, login: &str, walcast: &str) -> Result<(), CheckLoginError> {
    for row in own.query(REACHABLE_SQL, &[&login, &walcast]).await? {
        let role: String = row.get(0);
        let what: String = row.get(1);
        if what.is_empty() {
            continue;
        }
        let what = match role == login {
            true => what,
            false => format!("may act as role {role:?}, which {what}"),
        };
        return Err(CheckLoginError::Powers {
            login: login.to_string(),
            what,
        });
    }
    Ok(())
}

/// Let the login act as every allowed role checks run as (`GRANT`, when walcast may).
async fn grant_roles(own: &Client, login: &str, roles: &RolePolicy) -> Result<(), CheckLoginError> {
    let allowed: Vec<&str> = roles.allowed().iter().map(String::as_str).collect();
    for row in own.query(ROLES_SQL, &[&login, &allowed]).await? {
        let (role, member): (String, bool) = (row.get(0), row.get(1));
        if member {
            continue;
        }
        let sql = format!(
            "GRANT {} TO {}",
            walcast_core::sql::quote_ident(&role),
            walcast_core::sql::quote_ident(login)
        );
        if let Err(e) = own.batch_execute(&sql).await {
            return Err(CheckLoginError::Grant {
                login: login.to_string(),
                role,
                reason: walcast_pgtls::db_message(&e),
            });
        }
        tracing::info!(login, role, "granted the check login an allowed role");
    }
    Ok(())
}

/// Connections of the check login, made when first needed, used side by side (the admin
/// side's private-channel checks and SSE snapshot reads).
pub struct CheckSessions {
    url: String,
    /// Run on each new connection (its limits).
    setup: &'static str,
    sessions: Vec<tokio::sync::Mutex<Option<Client>>>,
    next: std::sync::atomic::AtomicUsize,
}

/// One session of [`CheckSessions`], held until dropped.
pub struct CheckSession<'a> {
    guard: tokio::sync::MutexGuard<'a, Option<Client>>,
}

impl CheckSession<'_> {
    /// Its connection.
    pub fn client(&self) -> Option<&Client> {
        self.guard.as_ref()
    }

    /// Drop the connection (it may be mid-transaction): the next use connects again.
    pub fn discard(&mut self) {
        *self.guard = None;
    }
}

impl CheckSessions {
    /// `n` sessions of `url`'s login, each set up with `setup` when connected.
    pub fn new(url: &str, setup: &'static str, n: usize) -> CheckSessions {
        CheckSessions {
            url: url.to_string(),
            setup,
            sessions: (0..n.max(1))
                .map(|_| tokio::sync::Mutex::new(None))
                .collect(),
            next: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// A free session (else the next in turn, waited for), connected.
    pub async fn session(&self) -> Result<CheckSession<'_>, crate::ControlError> {
        let free = self.sessions.iter().find_map(|m| m.try_lock().ok());
        let mut guard = match free {
            Some(g) => g,
            None => {
                let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.sessions[turn % self.sessions.len()].lock().await
            }
        };
        if guard.as_ref().is_none_or(|c| c.is_closed()) {
            let client = walcast_pgtls::connect(&self.url).await?;
            client.batch_execute(self.setup).await?;
            *guard = Some(client);
        }
        Ok(CheckSession { guard })
    }
}
