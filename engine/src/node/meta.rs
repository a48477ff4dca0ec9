//! Tokens and group subscribers as the shards read them: lock-free epoch tables,
//! written only by the control path (the HTTP API), read by every shard on CONNECT
//! (token check) and on SEND to a group (permission, fan-out).

use std::sync::{Arc, Mutex};

use shard::table::{epoch_map, MapReader, MapWriter, TableFull};

use crate::route::{DeviceLevel, Uid};

/// One uid's tokens, one per device flag.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UserTokens {
    pub by_flag: Vec<(u8, Box<str>, DeviceLevel)>,
}

impl UserTokens {
    /// The token and level stored for `device_flag`.
    pub fn get(&self, device_flag: u8) -> Option<(&str, DeviceLevel)> {
        self.by_flag
            .iter()
            .find(|(f, _, _)| *f == device_flag)
            .map(|(_, t, l)| (&**t, *l))
    }
}

/// A group's subscribers: sorted, without duplicates.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Subscribers {
    pub uids: Vec<Uid>,
}

impl Subscribers {
    /// Whether `uid` subscribes.
    pub fn contains(&self, uid: &str) -> bool {
        self.uids.binary_search_by(|u| (**u).cmp(uid)).is_ok()
    }
}

/// Limits of the metadata tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MetaLimits {
    pub max_users_with_tokens: usize,
    pub max_groups: usize,
    pub max_subscribers_per_group: usize,
}

impl Default for MetaLimits {
    fn default() -> Self {
        MetaLimits {
            max_users_with_tokens: 1 << 22,
            max_groups: 1 << 20,
            max_subscribers_per_group: 100_000,
        }
    }
}

/// Why a metadata write was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaError {
    /// A table is at its limit.
    Full(&'static str),
}

impl std::fmt::Display for MetaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetaError::Full(what) => write!(f, "{what} limit reached"),
        }
    }
}

struct Writers {
    tokens: MapWriter<Box<str>, UserTokens>,
    groups: MapWriter<Box<str>, Arc<Subscribers>>,
}

/// The shared metadata: readers for the shards, a mutex-guarded writer for control.
#[derive(Clone)]
pub struct Meta {
    limits: MetaLimits,
    writers: Arc<Mutex<Writers>>,
    tokens: MapReader<Box<str>, UserTokens>,
    groups: MapReader<Box<str>, Arc<Subscribers>>,
}

impl Meta {
    /// Empty tables with these limits.
    pub fn new(limits: MetaLimits) -> Meta {
        let (tw, tokens) = epoch_map(1024, limits.max_users_with_tokens);
        let (gw, groups) = epoch_map(1024, limits.max_groups);
        Meta {
            limits,
            writers: Arc::new(Mutex::new(Writers {
                tokens: tw,
                groups: gw,
            })),
            tokens,
            groups,
        }
    }

    fn writers(&self) -> std::sync::MutexGuard<'_, Writers> {
        self.writers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The token and level stored for `(uid, device_flag)`.
    pub fn token(&self, uid: &str, device_flag: u8) -> Option<(Box<str>, DeviceLevel)> {
        self.tokens
            .get_with(uid, |t| {
                t.get(device_flag).map(|(tok, l)| (Box::from(tok), l))
            })
            .flatten()
    }

    /// Stores `token` and `level` for `(uid, device_flag)`.
    pub fn set_token(
        &self,
        uid: &str,
        device_flag: u8,
        token: &str,
        level: DeviceLevel,
    ) -> Result<(), MetaError> {
        let mut w = self.writers();
        let mut entry = w.tokens.get(uid).cloned().unwrap_or_default();
        entry.by_flag.retain(|(f, _, _)| *f != device_flag);
        entry.by_flag.push((device_flag, token.into(), level));
        w.tokens
            .insert(uid.into(), entry)
            .map_err(|TableFull| MetaError::Full("tokens"))?;
        Ok(())
    }

    /// A group's subscribers, `None` if the group does not exist.
    pub fn subscribers(&self, channel_id: &str) -> Option<Arc<Subscribers>> {
        self.groups.get_with(channel_id, |s| s.clone())
    }

    /// Adds `uids` to a group (creating it), or with `reset` replaces its subscribers.
    pub fn add_subscribers(
        &self,
        channel_id: &str,
        uids: &[String],
        reset: bool,
    ) -> Result<(), MetaError> {
        let mut w = self.writers();
        let mut list: Vec<Uid> = match (reset, w.groups.get(channel_id)) {
            (false, Some(s)) => s.uids.clone(),
            _ => Vec::new(),
        };
        list.extend(uids.iter().map(|u| Uid::from(u.as_str())));
        list.sort_unstable();
        list.dedup();
        if list.len() > self.limits.max_subscribers_per_group {
            return Err(MetaError::Full("subscribers per group"));
        }
        w.groups
            .insert(channel_id.into(), Arc::new(Subscribers { uids: list }))
            .map_err(|TableFull| MetaError::Full("groups"))?;
        Ok(())
    }

    /// Removes `uids` from a group; a missing group is left missing.
    pub fn remove_subscribers(&self, channel_id: &str, uids: &[String]) {
        let mut w = self.writers();
        let Some(current) = w.groups.get(channel_id) else {
            return;
        };
        let list: Vec<Uid> = current
            .uids
            .iter()
            .filter(|u| !uids.iter().any(|r| r.as_str() == &***u))
            .cloned()
            .collect();
        // Replacing an existing key cannot pass the table limit.
        let _ = w
            .groups
            .insert(channel_id.into(), Arc::new(Subscribers { uids: list }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_per_uid_and_device_flag() {
        let meta = Meta::new(MetaLimits::default());
        meta.set_token("u1", 1, "t-web", DeviceLevel::Master)
            .unwrap();
        meta.set_token("u1", 0, "t-app", DeviceLevel::Slave)
            .unwrap();
        meta.set_token("u1", 1, "t-web2", DeviceLevel::Slave)
            .unwrap();
        assert_eq!(
            meta.token("u1", 1),
            Some(("t-web2".into(), DeviceLevel::Slave))
        );
        assert_eq!(
            meta.token("u1", 0),
            Some(("t-app".into(), DeviceLevel::Slave))
        );
        assert_eq!(meta.token("u1", 2), None);
        assert_eq!(meta.token("u2", 1), None);
    }

    #[test]
    fn subscribers_add_reset_remove() {
        let meta = Meta::new(MetaLimits {
            max_subscribers_per_group: 3,
            ..MetaLimits::default()
        });
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert!(meta.subscribers("g").is_none());
        meta.add_subscribers("g", &s(&["b", "a"]), false).unwrap();
        meta.add_subscribers("g", &s(&["c", "a"]), false).unwrap();
        let g = meta.subscribers("g").unwrap();
        assert_eq!(
            g.uids.iter().map(|u| &**u).collect::<Vec<_>>(),
            vec!["a", "b", "c"]
        );
        assert!(g.contains("b") && !g.contains("d"));
        assert_eq!(
            meta.add_subscribers("g", &s(&["d"]), false),
            Err(MetaError::Full("subscribers per group"))
        );
        meta.add_subscribers("g", &s(&["d"]), true).unwrap();
        assert_eq!(meta.subscribers("g").unwrap().uids.len(), 1);
        meta.remove_subscribers("g", &s(&["d"]));
        assert!(meta.subscribers("g").unwrap().uids.is_empty());
    }
}
