//! A throwaway cluster of `nats-server`s with JetStream, routed to each other on
//! loopback ports: each node's client, route and monitoring ports are free ports, its
//! store a directory of its own. A node can be killed (SIGKILL) and started again on the
//! same ports and store, as an operator's node that crashed and came back.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::nats::{banner_ok, find_binary};
use crate::process::Supervised;
use crate::{free_port, KitError};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// The cluster's name (every node's `cluster { name }`).
const CLUSTER: &str = "walcast-test";

/// One node's ports.
#[derive(Clone, Copy, Debug)]
struct Ports {
    client: u16,
    route: u16,
    http: u16,
}

/// A node: its ports, and its process while it runs.
struct Node {
    name: String,
    ports: Ports,
    process: Option<Supervised>,
}

/// `n` nats-servers forming one JetStream cluster; every node stopped and every store
/// deleted on drop.
pub struct NatsCluster {
    binary: std::path::PathBuf,
    nodes: Vec<Node>,
    dir: TempDir,
}

impl NatsCluster {
    /// Start `n` nodes (3 for a JetStream quorum that survives one loss) and wait until
    /// each answers; [`NatsCluster::wait_meta_leader`] waits for the cluster to form.
    pub fn start(n: usize) -> Result<NatsCluster, KitError> {
        let binary = find_binary()?;
        let mut last = None;
        for _ in 0..3 {
            let dir = tempfile::Builder::new()
                .prefix("walcast-nats-cluster-")
                .tempdir()
                .map_err(|e| KitError::io("creating temp dir", e))?;
            let mut cluster = NatsCluster {
                binary: binary.clone(),
                nodes: Vec::new(),
                dir,
            };
            for i in 0..n {
                let port = || free_port().map_err(|e| KitError::io("finding a free port", e));
                let ports = Ports {
                    client: port()?,
                    route: port()?,
                    http: port()?,
                };
                let name = format!("n{}", i + 1);
                cluster.nodes.push(Node {
                    name,
                    ports,
                    process: None,
                });
            }
            match (0..n).try_for_each(|i| cluster.boot(i)) {
                Ok(()) => return Ok(cluster),
                // A port taken meanwhile: again, with other ports.
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            KitError::io("starting nats-server", std::io::ErrorKind::Other.into())
        }))
    }

    /// Node `i`'s configuration file text: its ports and store, routes to every node.
    fn conf(&self, i: usize) -> String {
        let node = &self.nodes[i];
        let routes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("\"nats-route://127.0.0.1:{}\"", n.ports.route))
            .collect();
        let store = self.dir.path().join(&node.name).join("store");
        format!(
            "server_name: {name}\nlisten: \"127.0.0.1:{client}\"\nhttp: \"127.0.0.1:{http}\"\n\
             jetstream {{ store_dir: {store:?} }}\n\
             cluster {{\n  name: {CLUSTER}\n  listen: \"127.0.0.1:{route}\"\n  \
             routes: [{routes}]\n  connect_retries: 120\n}}\n",
            name = node.name,
            client = node.ports.client,
            http = node.ports.http,
            route = node.ports.route,
            store = store.display().to_string(),
            routes = routes.join(", "),
        )
    }

    fn boot(&mut self, i: usize) -> Result<(), KitError> {
        let dir = self.dir.path().join(&self.nodes[i].name);
        std::fs::create_dir_all(&dir).map_err(|e| KitError::io("creating node dir", e))?;
        let conf = dir.join("nats.conf");
        std::fs::write(&conf, self.conf(i)).map_err(|e| KitError::io("writing nats.conf", e))?;
        let args = vec!["-c".to_string(), conf.display().to_string()];
        let log = dir.join("nats.log");
        let mut proc = Supervised::spawn(&self.binary, &args, log, "KILL", None, &dir)?;
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if banner_ok(self.nodes[i].ports.client) {
                self.nodes[i].process = Some(proc);
                return Ok(());
            }
            if !proc.is_running() || Instant::now() > deadline {
                return Err(KitError::NotReady {
                    service: "nats-server (cluster node)",
                    seconds: READY_TIMEOUT.as_secs(),
                    log: proc.log.clone(),
                    tail: proc.log_tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s client URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].ports.client)
    }

    /// Every node's client URL.
    pub fn urls(&self) -> Vec<String> {
        (0..self.nodes.len()).map(|i| self.url(i)).collect()
    }

    /// Node `i`'s `server_name`.
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    /// Kill node `i` (SIGKILL), keeping its store.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut p) = self.nodes[i].process.take() {
            p.stop();
        }
    }

    /// Start node `i` again on the same ports and store.
    pub fn restart(&mut self, i: usize) -> Result<(), KitError> {
        self.kill(i);
        self.boot(i)
    }

    pub fn is_running(&mut self, i: usize) -> bool {
        self.nodes[i]
            .process
            .as_mut()
            .is_some_and(Supervised::is_running)
    }

    /// Node `i`'s monitoring `/jsz` (JetStream): `None` if it does not answer.
    pub fn jsz(&self, i: usize) -> Option<serde_json::Value> {
        let body = http_get(self.nodes[i].ports.http, "/jsz")?;
        serde_json::from_str(&body).ok()
    }

    /// The JetStream meta leader's name as node `i` sees it (`None`: no leader, no quorum).
    pub fn meta_leader(&self, i: usize) -> Option<String> {
        let jsz = self.jsz(i)?;
        let leader = jsz["meta_cluster"]["leader"].as_str()?;
        (!leader.is_empty()).then(|| leader.to_string())
    }

    /// Wait until every running node sees the same JetStream meta leader, one of them
    /// (the cluster formed and has a quorum); its name.
    pub fn wait_meta_leader(&mut self, timeout: Duration) -> Result<String, KitError> {
        let deadline = Instant::now() + timeout;
        loop {
            let running: Vec<usize> = (0..self.nodes.len())
                .filter(|&i| self.is_running(i))
                .collect();
            let leaders: Vec<Option<String>> =
                running.iter().map(|&i| self.meta_leader(i)).collect();
            if let Some(Some(first)) = leaders.first() {
                // The same leader everywhere, and a node that runs (a killed leader is
                // still named for a moment).
                let alive = running.iter().any(|&i| self.nodes[i].name == *first);
                if alive && leaders.iter().all(|l| l.as_deref() == Some(first.as_str())) {
                    return Ok(first.clone());
                }
            }
            if Instant::now() > deadline {
                let i = running.first().copied().unwrap_or(0);
                return Err(KitError::NotReady {
                    service: "nats cluster (JetStream meta leader)",
                    seconds: timeout.as_secs(),
                    log: self.dir.path().join(&self.nodes[i].name).join("nats.log"),
                    tail: self.log_tail(i),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_tail(&self, i: usize) -> String {
        let log = self.dir.path().join(&self.nodes[i].name).join("nats.log");
        crate::process::log_tail(&log)
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }
}

/// One HTTP/1.0 GET on loopback: the body.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").as_bytes())
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_nodes_elect_a_meta_leader_lose_it_without_quorum_and_elect_again() {
        let mut c = NatsCluster::start(3).expect("start the cluster");
        let leader = c
            .wait_meta_leader(Duration::from_secs(60))
            .expect("a meta leader");
        let i = (0..3).find(|&i| c.name(i) == leader).expect("a node");
        c.kill(i);
        // Two of three: a quorum still, a new leader.
        let next = c
            .wait_meta_leader(Duration::from_secs(60))
            .expect("a new meta leader");
        assert_ne!(next, leader);
        // One of three: no quorum; the last leader steps down (after some 20 s).
        let other = (0..3)
            .find(|&j| j != i && c.name(j) != next)
            .expect("a node");
        let survivor = 3 - i - other;
        c.kill(other);
        let deadline = Instant::now() + Duration::from_secs(60);
        while c.meta_leader(survivor).is_some() {
            assert!(Instant::now() < deadline, "a meta leader without a quorum");
            std::thread::sleep(Duration::from_millis(200));
        }
        c.restart(i).expect("restart");
        c.restart(other).expect("restart");
        c.wait_meta_leader(Duration::from_secs(60))
            .expect("a meta leader after the restarts");
    }
}
