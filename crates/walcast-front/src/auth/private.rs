//! Private channels (`config.private: true`): who may join (read) and send or track
//! presence (write) is decided by the app's policies on `realtime.messages`, as with
//! Supabase. A front has no database: it asks the cdc-worker
//! ([`walcast_bus::admin::AdminRequest::AuthorizeChannel`]), which evaluates them as the
//! subscriber; each decision is kept for the channel's life (a token refresh asks
//! again), never asked per message.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use walcast_bus::admin::{AdminClient, AdminError, AdminErrorKind};

use crate::telemetry;

/// The source (database) a project is on, as the project directory knows it (`None`:
/// unknown project).
pub(crate) type SourceOf = Arc<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// The join refusal's text, as Supabase words it.
pub(crate) fn read_refused(name: &str) -> String {
    format!("You do not have permissions to read from this Channel topic: {name}")
}

/// The app's policies, as the cdc-worker evaluates them (through the project
/// directory's admin client, each question waiting at most `timeout`).
#[derive(Clone)]
pub(crate) struct Policies {
    /// `None`: this front has no way to the worker (no project directory).
    admin: Option<AdminClient>,
    source_of: SourceOf,
    timeout: Duration,
}

impl Policies {
    pub(crate) fn new(
        admin: Option<AdminClient>,
        source_of: SourceOf,
        timeout: Duration,
    ) -> Policies {
        Policies {
            admin,
            source_of,
            timeout,
        }
    }

    /// Whether `claims` may read (`write` false) or write the private channel `name` of
    /// `project`. `Err`: the worker could not be asked (`Unavailable`: none leads,
    /// NATS is down, or this front has no way to it); the caller refuses, never allows.
    pub(crate) async fn may(
        &self,
        project: &str,
        name: &str,
        claims: &Value,
        write: bool,
    ) -> Result<bool, AdminError> {
        let Some(admin) = &self.admin else {
            return Err(AdminError::new(
                AdminErrorKind::Unavailable,
                "private channels need the cdc-worker, which this front cannot reach",
            ));
        };
        // The leader of the project's source reads its policies.
        let Some(source) = (self.source_of)(project) else {
            return Err(AdminError::new(
                AdminErrorKind::UnknownProject,
                format!("unknown project {project:?}"),
            ));
        };
        let allowed = admin
            .authorize_channel(&source, project, name, claims, write, self.timeout)
            .await?;
        if !allowed {
            let what = if write {
                "private_write_denied"
            } else {
                "private_read_denied"
            };
            telemetry::error(what);
        }
        Ok(allowed)
    }
}
