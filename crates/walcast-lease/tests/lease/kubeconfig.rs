//! The Kubernetes elector configured the way kubectl is: by a kubeconfig naming the API
//! server (HTTPS, trusting the kubeconfig's CA) and the user (a token, a token file or a
//! client certificate), or in a pod by its service account. The fake API server serves
//! HTTPS and lets in authenticated requests only, as the real one does.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use walcast_lease::kubernetes::{self, KubeLeaseConfig, KubeLeaseError};
use walcast_lease::{Fence, LeaseStatus};
use walcast_testkit::fake_kube::{FakeApi, Secure};
use walcast_testkit::tls::TestCerts;

const NS: &str = "walcast";
const NAME: &str = "cdc";
const D: Duration = Duration::from_millis(1000);

/// Set in the child process [`an_elector_in_a_pod_uses_its_service_account`] starts.
const IN_POD: &str = "WALCAST_TEST_IN_POD";

fn cfg(identity: &str, kubeconfig: Option<OsString>, context: Option<&str>) -> KubeLeaseConfig {
    KubeLeaseConfig {
        api_url: None,
        kubeconfig,
        context: context.map(str::to_owned),
        namespace: NS.into(),
        name: NAME.into(),
        identity: identity.into(),
        duration: D,
    }
}

struct Running {
    shutdown: CancellationToken,
    task: JoinHandle<Result<(), KubeLeaseError>>,
}

/// Run an elector; each term it begins sends its identity on `led`.
fn spawn(cfg: KubeLeaseConfig, led: &mpsc::UnboundedSender<String>) -> Running {
    let shutdown = CancellationToken::new();
    let (sd, led) = (shutdown.clone(), led.clone());
    let who = cfg.identity.clone();
    let task = tokio::spawn(async move {
        let lead = move |fence: Fence| {
            let (led, who) = (led.clone(), who.clone());
            async move {
                let _ = led.send(who);
                fence.cancelled().await;
            }
        };
        kubernetes::run(cfg, Arc::new(LeaseStatus::default()), sd, lead).await
    });
    Running { shutdown, task }
}

async fn stop(r: Running) {
    r.shutdown.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(10), r.task).await;
    let result = ended.expect("the elector stops").expect("no panic");
    result.expect("the elector's client was made");
}

async fn next_leader(led: &mut mpsc::UnboundedReceiver<String>) -> String {
    tokio::time::timeout(10 * D, led.recv())
        .await
        .expect("a leader within ten durations")
        .expect("an elector running")
}

/// A path as a YAML scalar (JSON strings are YAML).
fn q(p: &Path) -> String {
    serde_json::to_string(&p.display().to_string()).expect("a path as text")
}

fn write(dir: &Path, file: &str, text: &str) -> PathBuf {
    let path = dir.join(file);
    std::fs::write(&path, text).expect("write a test file");
    path
}

/// A kubeconfig with one cluster, user and context per `(name, server, user)`.
fn kubeconfig(ca: &Path, current: Option<&str>, entries: &[(&str, &str, String)]) -> String {
    let mut clusters = String::new();
    let mut users = String::new();
    let mut contexts = String::new();
    for (name, server, user) in entries {
        clusters += &format!(
            "- name: {name}\n  cluster:\n    server: {server}\n    certificate-authority: {}\n",
            q(ca)
        );
        users += &format!("- name: {name}\n  user:\n{user}");
        contexts += &format!("- name: {name}\n  context:\n    cluster: {name}\n    user: {name}\n");
    }
    let current = current.map_or(String::new(), |c| format!("current-context: {c}\n"));
    format!("apiVersion: v1\nkind: Config\n{current}clusters:\n{clusters}users:\n{users}contexts:\n{contexts}")
}

fn secure(certs: &TestCerts, token: Option<&str>, client_ca: bool) -> Secure {
    Secure {
        cert: certs.server_cert.clone(),
        key: certs.server_key.clone(),
        client_ca: client_ca.then(|| certs.ca.clone()),
        token: token.map(str::to_owned),
    }
}

/// Three electors, each authenticated another way (a token, a token file, a client
/// certificate), from a kubeconfig of two files merged as kubectl merges `KUBECONFIG`
/// (the first sets the current context): each leads in turn as the others stop, and the
/// API server refused none of their requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn electors_configured_by_a_kubeconfig_take_turns_over_tls() {
    let certs = TestCerts::generate().expect("test certificates");
    let (crt, key) = certs
        .client("walcast-worker")
        .expect("a client certificate");
    let dir = tempfile::tempdir().expect("a temp dir");
    let token_file = write(dir.path(), "token", "token-b");
    let api = FakeApi::new();
    let a = api
        .secure_endpoint("a", &secure(&certs, Some("token-a"), false))
        .await;
    let b = api
        .secure_endpoint("b", &secure(&certs, Some("token-b"), false))
        .await;
    let c = api.secure_endpoint("c", &secure(&certs, None, true)).await;
    let first = kubeconfig(
        &certs.ca,
        Some("a"),
        &[("a", &a, "    token: token-a\n".to_string())],
    );
    let second = kubeconfig(
        &certs.ca,
        Some("b"),
        &[
            ("b", &b, format!("    tokenFile: {}\n", q(&token_file))),
            (
                "c",
                &c,
                format!(
                    "    client-certificate: {}\n    client-key: {}\n",
                    q(&crt),
                    q(&key)
                ),
            ),
        ],
    );
    let files = [
        write(dir.path(), "first", &first),
        write(dir.path(), "second", &second),
    ];
    let list = std::env::join_paths(&files).expect("a KUBECONFIG list");
    let (tx, mut led) = mpsc::unbounded_channel();
    let mut running: Vec<(String, Running)> = [("a", None), ("b", Some("b")), ("c", Some("c"))]
        .into_iter()
        .map(|(who, context)| {
            let r = spawn(cfg(who, Some(list.clone()), context), &tx);
            (who.to_string(), r)
        })
        .collect();
    let mut leaders = Vec::new();
    while !running.is_empty() {
        let who = next_leader(&mut led).await;
        assert!(!leaders.contains(&who), "{who} led twice: {leaders:?}");
        let i = running
            .iter()
            .position(|(n, _)| *n == who)
            .expect("a running elector");
        stop(running.remove(i).1).await;
        leaders.push(who);
    }
    leaders.sort();
    assert_eq!(leaders, ["a", "b", "c"]);
    for who in ["a", "b", "c"] {
        assert_eq!(api.unauthorized(who), 0, "{who}");
        let writes = api.writes();
        assert!(
            writes
                .iter()
                .any(|w| w.client == who && w.holder.as_deref() == Some(who)),
            "{who} never wrote the Lease as its own: {writes:?}"
        );
    }
}

/// A wrong token, no client certificate where one is needed, and a server certificate
/// the kubeconfig's CA did not sign: no such elector ever leads or writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn electors_the_api_server_does_not_authenticate_never_lead() {
    let certs = TestCerts::generate().expect("test certificates");
    let dir = tempfile::tempdir().expect("a temp dir");
    let api = FakeApi::new();
    let by_token = secure(&certs, Some("right"), false);
    let wrong = api.secure_endpoint("wrong-token", &by_token).await;
    let untrusted = api.secure_endpoint("untrusted", &by_token).await;
    let no_cert = api
        .secure_endpoint("no-cert", &secure(&certs, None, true))
        .await;
    let mut text = kubeconfig(
        &certs.ca,
        None,
        &[
            ("wrong-token", &wrong, "    token: wrong\n".to_string()),
            ("no-cert", &no_cert, "    {}\n".to_string()),
        ],
    );
    let kc = write(dir.path(), "config", &text);
    text = kubeconfig(
        &certs.other_ca,
        None,
        &[("untrusted", &untrusted, "    token: right\n".to_string())],
    );
    let other = write(dir.path(), "other", &text);
    let (tx, mut led) = mpsc::unbounded_channel();
    let running = [
        spawn(
            cfg("wrong-token", Some(kc.clone().into()), Some("wrong-token")),
            &tx,
        ),
        spawn(cfg("no-cert", Some(kc.into()), Some("no-cert")), &tx),
        spawn(cfg("untrusted", Some(other.into()), Some("untrusted")), &tx),
    ];
    // Several turns (one every third of the duration) of each.
    let got = tokio::time::timeout(3 * D, led.recv()).await;
    assert!(got.is_err(), "an unauthenticated elector led: {got:?}");
    for r in running {
        stop(r).await;
    }
    assert!(
        api.unauthorized("wrong-token") >= 2,
        "refused at every turn"
    );
    assert!(api.unauthorized("no-cert") >= 2, "refused at every turn");
    assert_eq!(
        api.unauthorized("untrusted"),
        0,
        "no request passed the handshake"
    );
    assert!(api.writes().is_empty(), "{:?}", api.writes());
}

/// A kubeconfig or context named explicitly that cannot be used is an error at start
/// (no fallback to another configuration), and so is a bad URL or Lease name.
#[tokio::test]
async fn a_configuration_that_cannot_work_fails_at_start() {
    let certs = TestCerts::generate().expect("test certificates");
    let dir = tempfile::tempdir().expect("a temp dir");
    let text = kubeconfig(
        &certs.ca,
        Some("a"),
        &[("a", "https://127.0.0.1:1", "    token: t\n".to_string())],
    );
    let kc: OsString = write(dir.path(), "config", &text).into();
    let missing: OsString = dir.path().join("missing").into();
    let mut bad_url = cfg("x", None, None);
    bad_url.api_url = Some("ftp://127.0.0.1:1".into());
    let mut bad_name = cfg("x", Some(kc.clone()), None);
    bad_name.name = "a/../b".into();
    let cases = [
        (
            cfg("x", Some(kc), Some("nope")),
            "a context that is not there",
        ),
        (cfg("x", Some(missing), None), "a file that is not there"),
        (bad_url, "not an http(s) URL"),
        (bad_name, "a name that is not a DNS subdomain"),
    ];
    for (cfg, what) in cases {
        let run = kubernetes::run(cfg, Arc::default(), CancellationToken::new(), |_| async {});
        let result = tokio::time::timeout(Duration::from_secs(10), run).await;
        let err = result.expect(what).expect_err(what);
        assert!(
            matches!(
                err,
                KubeLeaseError::Kubeconfig(_)
                    | KubeLeaseError::Url { .. }
                    | KubeLeaseError::Name { .. }
            ),
            "{what}: {err}"
        );
    }
}

/// In a pod (`KUBERNETES_SERVICE_HOST`/`_PORT` set, the service account's token, CA and
/// namespace in `/var/run/secrets/kubernetes.io/serviceaccount`, no kubeconfig), the
/// elector leads through the API server with the service account's token. The pod is a
/// child process in its own user and mount namespaces, where those files are mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_elector_in_a_pod_uses_its_service_account() {
    let certs = TestCerts::generate().expect("test certificates");
    let sa = tempfile::tempdir().expect("a temp dir");
    let home = tempfile::tempdir().expect("a temp dir");
    write(sa.path(), "token", "pod-token");
    write(sa.path(), "namespace", NS);
    std::fs::copy(&certs.ca, sa.path().join("ca.crt")).expect("copy the CA");
    let api = FakeApi::new();
    let url = api
        .secure_endpoint("pod", &secure(&certs, Some("pod-token"), false))
        .await;
    let port = url.rsplit(':').next().expect("a port").to_string();
    let exe = std::env::current_exe().expect("the test binary");
    let mount = "mount -t tmpfs tmpfs /var/run \
        && mkdir -p /var/run/secrets/kubernetes.io/serviceaccount \
        && cp \"$1\"/* /var/run/secrets/kubernetes.io/serviceaccount/ \
        && shift && exec \"$@\"";
    let child = tokio::process::Command::new("unshare")
        .args([
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            mount,
            "sh",
        ])
        .arg(sa.path())
        .arg(&exe)
        .args([
            "--exact",
            "kubeconfig::in_pod_child",
            "--ignored",
            "--nocapture",
        ])
        .env(IN_POD, "1")
        .env("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        .env("KUBERNETES_SERVICE_PORT", &port)
        .env("HOME", home.path())
        .env_remove("KUBECONFIG")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .expect("the pod ends within a minute")
        .expect("run unshare (util-linux; unprivileged user namespaces must be allowed)");
    let log = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "the pod failed: {log}");
    assert!(log.contains("1 passed"), "the pod ran no test: {log}");
    assert_eq!(api.unauthorized("pod"), 0);
    let writes = api.writes();
    assert!(
        writes
            .iter()
            .any(|w| w.client == "pod" && w.holder.as_deref() == Some("pod-0")),
        "{writes:?}"
    );
}

/// The pod's side of [`an_elector_in_a_pod_uses_its_service_account`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run inside its pod by an_elector_in_a_pod_uses_its_service_account"]
async fn in_pod_child() {
    assert!(
        std::env::var_os(IN_POD).is_some(),
        "runs only in the pod an_elector_in_a_pod_uses_its_service_account makes"
    );
    let (tx, mut led) = mpsc::unbounded_channel();
    let r = spawn(cfg("pod-0", None, None), &tx);
    assert_eq!(next_leader(&mut led).await, "pod-0");
    stop(r).await;
}
