//! `walcast probe`: a health probe for orchestrators that cannot make an HTTP request
//! themselves (the image has no curl; compose and plain Docker run a command). It asks a
//! walcast process's `/livez` (is it alive) or `/readyz` (should it get traffic, or count
//! as a healthy worker) and exits 0 when the answer is 200, 1 with the reason otherwise.

use std::time::Duration;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// How much of a refusal's body is printed with it.
const REASON_BYTES: usize = 512;

#[derive(Args, Debug, Clone)]
pub struct ProbeArgs {
    /// The process's HTTP address (`http://host:port`); default: this host's port PORT,
    /// as a container probing itself.
    #[arg(long, env = "WALCAST_PROBE_URL", hide_env_values = true)]
    pub url: Option<String>,
    /// The port asked when --url is not given.
    #[arg(long, env = "PORT", default_value_t = walcast_worker::config::DEFAULT_PORT)]
    pub port: u16,
    /// Ask `/readyz` (ready for traffic; a standby worker is ready) instead of `/livez`.
    #[arg(long)]
    pub ready: bool,
    /// Give up after this many milliseconds.
    #[arg(long, env = "WALCAST_PROBE_TIMEOUT_MS", default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout_ms: u64,
}

pub async fn probe(args: ProbeArgs) -> anyhow::Result<()> {
    let base = match &args.url {
        Some(url) => url.trim_end_matches('/').to_string(),
        None => format!("http://127.0.0.1:{}", args.port),
    };
    if !base.starts_with("http://") {
        bail!("--url must be an http:// address (the probe asks the process itself, not through a proxy): {base}");
    }
    let path = if args.ready { "/readyz" } else { "/livez" };
    let uri: hyper::Uri = format!("{base}{path}")
        .parse()
        .with_context(|| format!("{base}{path} is not a URL"))?;
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let asked = async {
        let response = client.get(uri.clone()).await?;
        let status = response.status();
        let body = Limited::new(response.into_body(), REASON_BYTES)
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        anyhow::Ok((status, body))
    };
    let (status, body) = tokio::time::timeout(Duration::from_millis(args.timeout_ms), asked)
        .await
        .map_err(|_| anyhow::anyhow!("{uri}: no answer within {} ms", args.timeout_ms))?
        .with_context(|| format!("asking {uri}"))?;
    let text = String::from_utf8_lossy(&body);
    if !status.is_success() {
        bail!("{uri}: {status}: {}", text.trim());
    }
    println!("{uri}: {status}: {}", text.trim());
    Ok(())
}
