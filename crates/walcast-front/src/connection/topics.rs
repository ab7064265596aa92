//! Which channels of this front joined which topic (for broadcast and presence).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

use super::gate::ChanOut;

/// A topic in one project's public or private namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TopicKey {
    /// Project id.
    pub project: String,
    /// Private (RLS-authorised) namespace.
    pub private: bool,
    /// Full topic, `realtime:<name>`.
    pub topic: String,
}

/// A topic's channels by channel id (join order). Keyed, so that a leave does not scan
/// the topic: 10,000 sockets of one topic going away would otherwise read 50 million
/// channels under the write lock.
type Members = BTreeMap<u64, Arc<ChanOut>>;

#[derive(Default)]
pub(crate) struct Topics {
    map: RwLock<HashMap<TopicKey, Members>>,
}

impl Topics {
    pub(crate) fn add(&self, key: &TopicKey, chan: Arc<ChanOut>) {
        let mut g = self.map.write().unwrap_or_else(|p| p.into_inner());
        g.entry(key.clone()).or_default().insert(chan.id, chan);
    }

    pub(crate) fn remove(&self, key: &TopicKey, chan_id: u64) {
        let mut g = self.map.write().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = g.get_mut(key) {
            v.remove(&chan_id);
            if v.is_empty() {
                g.remove(key);
            }
        }
    }

    pub(crate) fn members(&self, key: &TopicKey) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        g.get(key)
            .map(|v| v.values().cloned().collect())
            .unwrap_or_default()
    }

    /// The joined channels of a project (only its public ones if `public_only`).
    pub(crate) fn of_project(&self, project: &str, public_only: bool) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .filter(|(k, _)| k.project == project && !(public_only && k.private))
            .flat_map(|(_, v)| v.values().cloned())
            .collect()
    }

    /// Every joined channel, once each.
    pub(crate) fn all(&self) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        let mut seen = std::collections::HashSet::new();
        g.values()
            .flat_map(BTreeMap::values)
            .filter(|c| seen.insert(c.id))
            .cloned()
            .collect()
    }
}
