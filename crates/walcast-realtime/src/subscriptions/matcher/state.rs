//! The matcher's index: the classes by table, their subscriptions per front, and the
//! counts the class limits are checked against.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use walcast_bus::subs::SubscriptionSpec;
use walcast_protocol::filter::CompiledFilter;

use super::class::{Bucket, Class, Sub};
use super::{ClassLimits, Refusal, COLLISION};

/// Index key: (project, schema or "*", table or "").
pub(super) type Key = (String, String, String);

pub(super) struct ClassEntry {
    pub(super) class: Arc<Class>,
    pub(super) fronts: BTreeMap<String, Bucket>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) by_key: HashMap<Key, Vec<String>>,
    pub(super) classes: HashMap<String, ClassEntry>,
    pub(super) by_id: HashMap<String, Arc<Sub>>,
    pub(super) fronts: HashMap<String, Instant>,
    pub(super) limits: ClassLimits,
    /// Classes per project, and classes with a subscription of each front.
    pub(super) per_project: HashMap<String, usize>,
    pub(super) per_front: HashMap<String, usize>,
    /// Memory of the compiled patterns, per project and in all.
    pub(super) filter_bytes: HashMap<String, usize>,
    pub(super) filter_bytes_total: usize,
}

pub(super) fn key_of(spec: &SubscriptionSpec) -> Key {
    (
        spec.project.clone(),
        spec.schema.clone(),
        spec.table.clone().unwrap_or_default(),
    )
}

impl State {
    /// Remove `gone` and add `new` (replacing subscriptions of the same id), rebuilding
    /// each touched bucket once. Returns those of `new` refused (see [`State::admit`]);
    /// they are not added.
    pub(super) fn apply(&mut self, gone: &[String], new: Vec<Sub>) -> Vec<Refusal> {
        let mut removed: HashMap<(String, String), HashSet<*const Sub>> = HashMap::new();
        let mut added: HashMap<(String, String), Vec<Arc<Sub>>> = HashMap::new();
        let new: Vec<Arc<Sub>> = new.into_iter().map(Arc::new).collect();
        let replaced = new.iter().map(|s| &s.spec.id);
        for id in gone.iter().chain(replaced) {
            if let Some(old) = self.by_id.remove(id) {
                removed
                    .entry((old.class.clone(), old.spec.front.clone()))
                    .or_default()
                    .insert(Arc::as_ptr(&old));
            }
        }
        let mut refused = Vec::new();
        for sub in new {
            if let Err(why) = self.admit(&sub, &added) {
                refused.push((sub.spec.id.clone(), why));
                continue;
            }
            self.fronts.insert(sub.spec.front.clone(), Instant::now());
            self.by_id.insert(sub.spec.id.clone(), sub.clone());
            if !self.classes.contains_key(&sub.class) {
                let entry = ClassEntry {
                    class: Arc::new(Class::of(&sub)),
                    fronts: BTreeMap::new(),
                };
                let heap = entry.class.heap;
                *self
                    .filter_bytes
                    .entry(sub.spec.project.clone())
                    .or_default() += heap;
                self.filter_bytes_total += heap;
                self.classes.insert(sub.class.clone(), entry);
                *self
                    .per_project
                    .entry(sub.spec.project.clone())
                    .or_default() += 1;
                self.by_key
                    .entry(key_of(&sub.spec))
                    .or_default()
                    .push(sub.class.clone());
            }
            let pair = (sub.class.clone(), sub.spec.front.clone());
            let has_front = self.classes[&sub.class].fronts.contains_key(&pair.1);
            if !has_front && !added.contains_key(&pair) {
                *self.per_front.entry(pair.1.clone()).or_default() += 1;
            }
            added
                .entry((sub.class.clone(), sub.spec.front.clone()))
                .or_default()
                .push(sub);
        }
        let touched: HashSet<(String, String)> =
            removed.keys().chain(added.keys()).cloned().collect();
        for (class, front) in touched {
            let gone = removed.remove(&(class.clone(), front.clone()));
            let new = added.remove(&(class.clone(), front.clone()));
            self.rebuild(
                &class,
                &front,
                gone.unwrap_or_default(),
                new.unwrap_or_default(),
            );
        }
        metrics::gauge!(crate::telemetry::SUBSCRIPTIONS).set(self.by_id.len() as f64);
        metrics::gauge!(crate::telemetry::FILTER_BYTES).set(self.filter_bytes_total as f64);
        refused
    }

    /// Whether `sub` may be added (`added`: the (class, front) pairs this edit adds so
    /// far): its key must not name a class of other fields, and a new class must fit the
    /// [`ClassLimits`] of its project and front.
    pub(super) fn admit(
        &self,
        sub: &Sub,
        added: &HashMap<(String, String), Vec<Arc<Sub>>>,
    ) -> Result<(), String> {
        if self.collides(sub) {
            return Err(COLLISION.to_string());
        }
        let (project, front) = (&sub.spec.project, &sub.spec.front);
        let entry = self.classes.get(&sub.class);
        let count = |m: &HashMap<String, usize>, k: &str| m.get(k).copied().unwrap_or(0);
        let full = |limit: &'static str, max: usize, what: String| {
            metrics::counter!(crate::telemetry::CLASSES_REFUSED, "limit" => limit).increment(1);
            tracing::warn!(id = %sub.spec.id, limit, max, "subscription refused: too many classes");
            Err(format!(
                "Unable to subscribe to changes: {what} has {max} distinct subscriptions \
                 (classes: table, event, filter, columns and role) already, the most allowed"
            ))
        };
        if entry.is_none() && count(&self.per_project, project) >= self.limits.per_project {
            return full(
                "project",
                self.limits.per_project,
                format!("project {project:?}"),
            );
        }
        if entry.is_none() {
            self.admit_filter(sub)?;
        }
        let pair = (sub.class.clone(), front.clone());
        let new_for_front =
            entry.is_none_or(|e| !e.fronts.contains_key(front)) && !added.contains_key(&pair);
        if new_for_front && count(&self.per_front, front) >= self.limits.per_front {
            return full("front", self.limits.per_front, "this front".to_string());
        }
        Ok(())
    }

    /// Whether the compiled patterns of `sub`'s filter (a new class's) fit what its project
    /// and the worker may hold: every change of its table runs them, on the project's lane.
    pub(super) fn admit_filter(&self, sub: &Sub) -> Result<(), String> {
        let heap = sub.filter.as_ref().map_or(0, CompiledFilter::heap_bytes);
        if heap == 0 {
            return Ok(());
        }
        let project = &sub.spec.project;
        let used = self.filter_bytes.get(project).copied().unwrap_or(0);
        let (limit, max, what) = if used + heap > self.limits.filter_bytes_per_project {
            (
                "filter_bytes_project",
                self.limits.filter_bytes_per_project,
                format!("project {project:?}"),
            )
        } else if self.filter_bytes_total + heap > self.limits.filter_bytes {
            (
                "filter_bytes",
                self.limits.filter_bytes,
                "this worker".to_string(),
            )
        } else {
            return Ok(());
        };
        metrics::counter!(crate::telemetry::CLASSES_REFUSED, "limit" => limit).increment(1);
        tracing::warn!(id = %sub.spec.id, limit, max, heap, "subscription refused: its filter's patterns do not fit");
        Err(format!(
            "Unable to subscribe to changes: the patterns of {what}'s filters would hold more than {} KiB (this filter's: {} KiB); use fewer or simpler like/match patterns",
            max / 1024,
            heap.div_ceil(1024)
        ))
    }

    /// Whether `sub`'s key names a class whose fields are not `sub`'s (a collision, or a
    /// forged key): such a subscription must never be merged into it, or it would get
    /// what that class's role, filter and columns allow. Counted and logged.
    pub(super) fn collides(&self, sub: &Sub) -> bool {
        let Some(entry) = self.classes.get(&sub.class) else {
            return false;
        };
        if entry.class.fields == sub.fields {
            return false;
        }
        metrics::counter!(crate::telemetry::CLASS_COLLISIONS).increment(1);
        tracing::error!(
            class = %sub.class,
            id = %sub.spec.id,
            "a subscription's class key names a class with other fields: refused"
        );
        true
    }

    pub(super) fn rebuild(
        &mut self,
        class: &str,
        front: &str,
        gone: HashSet<*const Sub>,
        new: Vec<Arc<Sub>>,
    ) {
        let Some(entry) = self.classes.get_mut(class) else {
            return;
        };
        let had = entry.fronts.remove(front);
        let old = had.clone().unwrap_or_default();
        let bucket: Vec<Arc<Sub>> = old
            .iter()
            .filter(|s| !gone.contains(&Arc::as_ptr(s)))
            .cloned()
            .chain(new)
            .collect();
        if !bucket.is_empty() {
            entry.fronts.insert(front.to_string(), Arc::new(bucket));
            return;
        }
        if had.is_some() {
            decrement(&mut self.per_front, front);
        }
        if entry.fronts.is_empty() {
            // The class's last subscription went away.
            let Some(entry) = self.classes.remove(class) else {
                return;
            };
            decrement(&mut self.per_project, &entry.class.fields.project);
            let heap = entry.class.heap;
            if let Some(n) = self.filter_bytes.get_mut(&entry.class.fields.project) {
                *n = n.saturating_sub(heap);
                if *n == 0 {
                    self.filter_bytes.remove(&entry.class.fields.project);
                }
            }
            self.filter_bytes_total = self.filter_bytes_total.saturating_sub(heap);
            for keys in self.by_key.values_mut() {
                keys.retain(|k| k != class);
            }
            self.by_key.retain(|_, v| !v.is_empty());
        }
    }
}

fn decrement(counts: &mut HashMap<String, usize>, key: &str) {
    if let Some(n) = counts.get_mut(key) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            counts.remove(key);
        }
    }
}
