//! A project's own limits by name ([`ProjectLimits::FIELDS`]): the one table the worker,
//! the management API and the CLI go through, and the changes an update makes to them
//! ([`LimitChanges`]).

use serde::{Deserialize, Serialize};

use super::ProjectLimits;

/// How many limits a project has.
pub const LIMITS: usize = 7;

/// The largest value of any per-project limit (each column is an `integer`).
pub const MAX_LIMIT: u64 = i32::MAX as u64;

impl ProjectLimits {
    /// The limits' names (their JSON keys, their columns and, with `-` for `_`, the CLI's
    /// options), in the order of [`ProjectLimits::to_array`].
    pub const FIELDS: [&'static str; LIMITS] = [
        "max_concurrent_users",
        "max_joins_per_second",
        "max_channels_per_client",
        "max_events_per_second",
        "max_bytes_per_second",
        "max_presence_events_per_second",
        "max_payload_size_in_kb",
    ];

    /// The limits in the order of [`ProjectLimits::FIELDS`].
    pub fn to_array(&self) -> [Option<u32>; LIMITS] {
        [
            self.max_concurrent_users,
            self.max_joins_per_second,
            self.max_channels_per_client,
            self.max_events_per_second,
            self.max_bytes_per_second,
            self.max_presence_events_per_second,
            self.max_payload_size_in_kb,
        ]
    }

    /// Limits from values in the order of [`ProjectLimits::FIELDS`].
    pub fn from_array(a: [Option<u32>; LIMITS]) -> ProjectLimits {
        let [max_concurrent_users, max_joins_per_second, max_channels_per_client, max_events_per_second, max_bytes_per_second, max_presence_events_per_second, max_payload_size_in_kb] =
            a;
        ProjectLimits {
            max_concurrent_users,
            max_joins_per_second,
            max_channels_per_client,
            max_events_per_second,
            max_bytes_per_second,
            max_presence_events_per_second,
            max_payload_size_in_kb,
        }
    }

    /// The limits in force: each own one, else that of `defaults`.
    pub fn or(&self, defaults: &ProjectLimits) -> ProjectLimits {
        let d = defaults.to_array();
        let mut own = self.to_array();
        for (v, d) in own.iter_mut().zip(d) {
            *v = v.or(d);
        }
        ProjectLimits::from_array(own)
    }

    /// The name of the first limit above [`MAX_LIMIT`], if any.
    pub fn too_large(&self) -> Option<&'static str> {
        Self::FIELDS
            .into_iter()
            .zip(self.to_array())
            .find(|(_, v)| v.is_some_and(|n| u64::from(n) > MAX_LIMIT))
            .map(|(k, _)| k)
    }
}

/// A field that is present, `null` included (`Some(None)`); absent is `None` (by
/// `#[serde(default)]`).
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// What an update does to each limit: absent (`None`) leaves it, `null` (`Some(None)`)
/// returns it to the fronts' default, a number (`Some(Some(n))`) sets it. Flattened into
/// [`super::AdminRequest::ProjectUpdate`].
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitChanges {
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_concurrent_users: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_joins_per_second: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_channels_per_client: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_events_per_second: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_bytes_per_second: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_presence_events_per_second: Option<Option<u32>>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub max_payload_size_in_kb: Option<Option<u32>>,
}

impl LimitChanges {
    /// The changes in the order of [`ProjectLimits::FIELDS`].
    pub fn to_array(&self) -> [Option<Option<u32>>; LIMITS] {
        [
            self.max_concurrent_users,
            self.max_joins_per_second,
            self.max_channels_per_client,
            self.max_events_per_second,
            self.max_bytes_per_second,
            self.max_presence_events_per_second,
            self.max_payload_size_in_kb,
        ]
    }

    /// Changes from values in the order of [`ProjectLimits::FIELDS`].
    pub fn from_array(a: [Option<Option<u32>>; LIMITS]) -> LimitChanges {
        let [max_concurrent_users, max_joins_per_second, max_channels_per_client, max_events_per_second, max_bytes_per_second, max_presence_events_per_second, max_payload_size_in_kb] =
            a;
        LimitChanges {
            max_concurrent_users,
            max_joins_per_second,
            max_channels_per_client,
            max_events_per_second,
            max_bytes_per_second,
            max_presence_events_per_second,
            max_payload_size_in_kb,
        }
    }

    /// Set each limit a project is created with (the others stay the default).
    pub fn set(limits: &ProjectLimits) -> LimitChanges {
        LimitChanges::from_array(limits.to_array().map(|v| v.map(Some)))
    }

    /// `current` changed.
    pub fn apply(&self, current: &ProjectLimits) -> ProjectLimits {
        let mut out = current.to_array();
        for (v, change) in out.iter_mut().zip(self.to_array()) {
            if let Some(c) = change {
                *v = c;
            }
        }
        ProjectLimits::from_array(out)
    }

    /// Nothing changes.
    pub fn is_empty(&self) -> bool {
        self.to_array().iter().all(Option::is_none)
    }

    /// The name of the first limit set above [`MAX_LIMIT`], if any.
    pub fn too_large(&self) -> Option<&'static str> {
        ProjectLimits::from_array(self.to_array().map(Option::flatten)).too_large()
    }
}
