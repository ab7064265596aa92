//! How the elector reaches the API server: the standard client (`kube`, rustls) made from
//! an explicit URL, a kubeconfig, or the pod's service account.
//!
//! * An explicit URL (`http://127.0.0.1:8001` through `kubectl proxy`, a test's fake):
//!   no credentials, the system's roots for `https`.
//! * Otherwise, as `kube::Config::infer` and kubectl: the kubeconfig (the files of
//!   `KUBECONFIG`, merged, else `~/.kube/config`) with its current context or the one
//!   named, with every authentication it describes (token or token file, client
//!   certificate, exec plugin); when there is none, the in-cluster configuration (the
//!   service account's token and CA, both re-read as they rotate). A kubeconfig or
//!   context named explicitly must load: no fallback hides a mistake in it.
//!
//! Each call is tried once (the elector has its own turns and deadline), and an answer
//! larger than [`MAX_BODY`] is refused.

use std::ffi::OsStr;
use std::path::PathBuf;

use http_body_util::Limited;
use kube::client::ClientBuilder;
use kube::config::{Config, InClusterError, KubeConfigOptions, Kubeconfig, KubeconfigError};
use tower::util::MapResponseLayer;

use super::KubeLeaseConfig;

/// The largest answer read (a Lease is a few hundred bytes).
pub const MAX_BODY: usize = 1 << 20;

/// Why the Kubernetes elector cannot start. Retrying does not help: the configuration
/// (or the files it names) must change.
#[derive(Debug, thiserror::Error)]
pub enum KubeLeaseError {
    #[error("invalid Kubernetes API URL {url:?}: {reason}")]
    Url { url: String, reason: String },
    /// The Lease's namespace or name is not one the API server accepts.
    #[error("invalid Lease {what} {value:?}: {rule}")]
    Name {
        what: &'static str,
        value: String,
        rule: &'static str,
    },
    #[error("the kubeconfig: {0}")]
    Kubeconfig(#[source] KubeconfigError),
    #[error("no Kubernetes configuration: no kubeconfig ({kubeconfig}), and not in a pod ({in_cluster})")]
    NoConfig {
        #[source]
        kubeconfig: KubeconfigError,
        in_cluster: InClusterError,
    },
    /// The configuration cannot make a client (a bad CA, client certificate or key).
    #[error("the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// The client for `cfg`: its URL, else its kubeconfig, else the pod's service account.
pub async fn client(cfg: &KubeLeaseConfig) -> Result<kube::Client, KubeLeaseError> {
    check_names(&cfg.namespace, &cfg.name)?;
    let mut config = match &cfg.api_url {
        Some(url) => for_url(url)?,
        None => from_environment(cfg.kubeconfig.as_deref(), cfg.context.as_deref()).await?,
    };
    // One attempt per call: a retried write could outlive the term's deadline.
    config.default_retry = false;
    let builder = ClientBuilder::try_from(config).map_err(KubeLeaseError::Client)?;
    let limit = MapResponseLayer::new(|res: http::Response<_>| {
        res.map(|body| Limited::new(body, MAX_BODY))
    });
    Ok(builder.with_layer(&limit).build())
}

/// An explicit `http://` or `https://` URL, without credentials.
fn for_url(url: &str) -> Result<Config, KubeLeaseError> {
    let bad = |reason: &str| KubeLeaseError::Url {
        url: walcast_core::redact::redact_url(url),
        reason: reason.to_string(),
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| bad(&e.to_string()))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(bad("not an http:// or https:// URL"));
    }
    match uri.authority() {
        None => return Err(bad("no host")),
        Some(a) if a.as_str().contains('@') => {
            return Err(bad(
                "credentials do not belong in the URL: use a kubeconfig",
            ))
        }
        Some(a) if a.host().is_empty() => return Err(bad("no host")),
        Some(a) => {
            // `Authority::port` is `None` for a port that is not a number.
            let after_host = a.as_str().rsplit_once(']').map_or(a.as_str(), |(_, r)| r);
            if after_host.contains(':') && a.port_u16().is_none() {
                return Err(bad("bad port"));
            }
        }
    }
    if uri.query().is_some() {
        return Err(bad("a query has no meaning here"));
    }
    Ok(Config::new(uri))
}

/// The kubeconfig (`kubeconfig`: a list of files as in `KUBECONFIG`; none: the default
/// file) with `context`, else, when neither was named, the in-cluster configuration.
async fn from_environment(
    kubeconfig: Option<&OsStr>,
    context: Option<&str>,
) -> Result<Config, KubeLeaseError> {
    let options = KubeConfigOptions {
        context: context.map(str::to_owned),
        ..KubeConfigOptions::default()
    };
    let paths: Vec<PathBuf> = kubeconfig
        .map(|k| {
            let all = std::env::split_paths(k);
            all.filter(|p| !p.as_os_str().is_empty()).collect()
        })
        .unwrap_or_default();
    let named = !paths.is_empty() || context.is_some();
    let loaded = match paths.is_empty() {
        true => Config::from_kubeconfig(&options).await,
        false => match merged(&paths) {
            Ok(k) => Config::from_custom_kubeconfig(k, &options).await,
            Err(e) => Err(e),
        },
    };
    match loaded {
        Ok(config) => Ok(config),
        Err(e) if named => Err(KubeLeaseError::Kubeconfig(e)),
        Err(kubeconfig) => Config::incluster().map_err(|in_cluster| KubeLeaseError::NoConfig {
            kubeconfig,
            in_cluster,
        }),
    }
}

/// The files merged as kubectl does (the first to set a value wins).
fn merged(paths: &[PathBuf]) -> Result<Kubeconfig, KubeconfigError> {
    paths.iter().try_fold(Kubeconfig::default(), |all, p| {
        Kubeconfig::read_from(p).and_then(|k| all.merge(k))
    })
}

/// The namespace must be a DNS label and the name a DNS subdomain (RFC 1123), as the API
/// server requires: checked once at start, so that a bad one is a clear error instead of
/// a refusal at every turn, and so that neither can ever change a request's path.
fn check_names(namespace: &str, name: &str) -> Result<(), KubeLeaseError> {
    let bad = |what, value: &str, rule| KubeLeaseError::Name {
        what,
        value: value.to_string(),
        rule,
    };
    if !is_dns_name(namespace, 63, false) {
        return Err(bad("namespace", namespace, "lower case letters, digits and '-', starting and ending with a letter or digit, at most 63"));
    }
    if !is_dns_name(name, 253, true) {
        return Err(bad("name", name, "lower case letters, digits, '-' and '.', starting and ending with a letter or digit, at most 253"));
    }
    Ok(())
}

fn is_dns_name(s: &str, max: usize, dots: bool) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let inner = |c: u8| alnum(c) || c == b'-' || (dots && c == b'.');
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter().all(|&c| inner(c))
        && alnum(b[0])
        && alnum(b[b.len() - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        for good in [
            "http://127.0.0.1:8080",
            "http://[::1]:81/",
            "https://api.example",
            "https://proxy.example/k8s/clusters/c-1",
        ] {
            let c = for_url(good).unwrap_or_else(|e| panic!("{good}: {e}"));
            let a = &c.auth_info;
            let none = a.token.is_none()
                && a.token_file.is_none()
                && a.client_certificate_data.is_none()
                && a.exec.is_none()
                && a.username.is_none();
            assert!(none, "{good}: no credentials");
        }
        for bad in [
            "ftp://x",
            "http://u:secret@x",
            "http://x:port",
            "x:80",
            "/path",
            "http://x/?a=b",
        ] {
            let e = for_url(bad).expect_err(bad).to_string();
            assert!(!e.contains("secret"), "{e}");
        }
    }

    #[test]
    fn names_that_could_change_the_path_are_refused() {
        assert!(check_names("walcast", "walcast-cdc-slot").is_ok());
        assert!(check_names("ns-1", "a.b-c.0").is_ok());
        for (ns, name) in [
            ("ns", "a/../b"),
            ("ns", "a%2Fb"),
            ("ns", "A"),
            ("ns", ""),
            ("ns", "-a"),
            ("n s", "a"),
            ("a.b", "a"),
            ("", "a"),
            ("ns", "a?x=1"),
        ] {
            assert!(check_names(ns, name).is_err(), "{ns:?} {name:?}");
        }
        assert!(check_names(&"a".repeat(64), "a").is_err());
        assert!(check_names("a", &"a".repeat(254)).is_err());
    }

    #[test]
    fn a_named_kubeconfig_that_cannot_be_read_is_an_error() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let missing = OsStr::new("/nonexistent/walcast-kubeconfig");
        let e = rt
            .block_on(from_environment(Some(missing), None))
            .expect_err("no such file");
        assert!(matches!(e, KubeLeaseError::Kubeconfig(_)), "{e}");
    }
}
