//! Which channels of this front joined which topic (for broadcast and presence).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use crate::outbound::ChanOut;

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

#[derive(Default)]
pub(crate) struct Topics {
    map: RwLock<HashMap<TopicKey, Vec<Arc<ChanOut>>>>,
}

impl Topics {
    pub(crate) fn add(&self, key: &TopicKey, chan: Arc<ChanOut>) {
        let mut g = self.map.write().unwrap_or_else(|p| p.into_inner());
        g.entry(key.clone()).or_default().push(chan);
    }

    pub(crate) fn remove(&self, key: &TopicKey, chan_id: u64) {
        let mut g = self.map.write().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = g.get_mut(key) {
            v.retain(|c| c.id != chan_id);
            if v.is_empty() {
                g.remove(key);
            }
        }
    }

    pub(crate) fn members(&self, key: &TopicKey) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        g.get(key).cloned().unwrap_or_default()
    }

    /// The joined channels of a project (only its public ones if `public_only`).
    pub(crate) fn of_project(&self, project: &str, public_only: bool) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        g.iter()
            .filter(|(k, _)| k.project == project && !(public_only && k.private))
            .flat_map(|(_, v)| v.iter().cloned())
            .collect()
    }

    /// Every joined channel, once each.
    pub(crate) fn all(&self) -> Vec<Arc<ChanOut>> {
        let g = self.map.read().unwrap_or_else(|p| p.into_inner());
        let mut seen = std::collections::HashSet::new();
        g.values()
            .flatten()
            .filter(|c| seen.insert(c.id))
            .cloned()
            .collect()
    }
}
