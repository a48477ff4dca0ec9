//! Tokens and group subscribers as the shards read them: lock-free epoch tables,
//! read by every shard on CONNECT (token check) and on SEND to a group (permission,
//! fan-out). Each change goes to the durable [`MetaStore`] first (journaled and
//! fsynced), then its new state is published to the tables. Without replicas the
//! control path (the HTTP API) writes them; with replicas each change is a
//! [`CatalogOp`] proposed to its slot id's group, applied by every replica at its
//! commit ([`Catalog::apply`], on the group's shard, in log order).

use std::path::Path;
use std::sync::{Arc, Mutex};

use shard::table::{epoch_map, MapReader, MapWriter};

use crate::route::DeviceLevel;
use crate::store::{MetaConfig, MetaError, MetaRecovery, MetaStore};

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

pub use domain::send::channel::Subscribers;

/// One change of the catalog, as it travels in a replicated group's entry
/// (postcard; `store::replicated::encode_catalog` tags it). Each sets its keys to
/// a value (a token, a membership), so applying the ops of a log again in order,
/// over a state that already holds them (a restart replays its group's log), ends
/// in the same state.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CatalogOp {
    /// `/user/token`.
    SetToken {
        uid: String,
        device_flag: u8,
        token: String,
        /// 0 Slave, 1 Master.
        level: u8,
    },
    /// `/channel/subscriber_add` (`reset`: the group's list replaced).
    AddSubscribers {
        channel_id: String,
        uids: Vec<String>,
        reset: bool,
    },
    /// `/channel/subscriber_remove`.
    RemoveSubscribers {
        channel_id: String,
        uids: Vec<String>,
    },
    /// `POST /cluster/slots/leader`: slot id `slot_id`'s group prefers `node_id`
    /// as its leader (its leader hands over to it once it is caught up). The
    /// group's replicas keep it (`node::raft`), the catalog's store holds nothing
    /// of it.
    PreferLeader { slot_id: u32, node_id: u64 },
}

impl CatalogOp {
    /// The op's bytes in an entry.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_stdvec(self).expect("plain fields serialize")
    }

    /// An op from an entry's bytes; `None` for bytes no replica writes.
    pub fn decode(bytes: &[u8]) -> Option<CatalogOp> {
        postcard::from_bytes(bytes).ok()
    }

    /// The slot id (and so the group) the op belongs to among `slot_ids`: its
    /// key's (a uid, a group's channel id), or the one it names.
    pub fn slot_id(&self, slot_ids: u32) -> u32 {
        let key = match self {
            CatalogOp::SetToken { uid, .. } => uid,
            CatalogOp::AddSubscribers { channel_id, .. }
            | CatalogOp::RemoveSubscribers { channel_id, .. } => channel_id,
            CatalogOp::PreferLeader { slot_id, .. } => return *slot_id,
        };
        crate::cluster::slot_id_of(slots::hash_slot(key.as_bytes()), slot_ids)
    }
}

struct Writers {
    store: MetaStore,
    tokens: MapWriter<Box<str>, UserTokens>,
    groups: MapWriter<Box<str>, Arc<Subscribers>>,
}

impl Writers {
    fn publish_tokens(&mut self, uid: &str) {
        let entry = UserTokens {
            by_flag: self
                .store
                .tokens_of(uid)
                .map(|(f, t, l)| (f, t.into(), l))
                .collect(),
        };
        // The store enforces the same limits as the table (tokens_max >= uids).
        if self.tokens.insert(uid.into(), entry).is_err() {
            tracing::error!(
                uid,
                "token table full although the store accepted the token"
            );
        }
    }

    fn publish_group(&mut self, channel_id: &str) {
        match self.store.subscribers(channel_id) {
            Some(uids) => {
                // Grouped by hash slot and hashed once here, not per SEND.
                let s = Arc::new(Subscribers::new(uids.iter().cloned()));
                if self.groups.insert(channel_id.into(), s).is_err() {
                    tracing::error!(
                        channel_id,
                        "group table full although the store accepted the group"
                    );
                }
            }
            None => {
                self.groups.remove(channel_id);
            }
        }
    }
}

/// The shared metadata: readers for the shards, a mutex-guarded writer for control.
#[derive(Clone)]
pub struct Catalog {
    writers: Arc<Mutex<Writers>>,
    tokens: MapReader<Box<str>, UserTokens>,
    groups: MapReader<Box<str>, Arc<Subscribers>>,
}

impl Catalog {
    /// Opens the store in `dir` (replaying its journal) and publishes its content.
    pub fn open(dir: &Path, config: MetaConfig) -> Result<(Catalog, MetaRecovery), MetaError> {
        let (store, recovery) = MetaStore::open(dir, config)?;
        let (tokens_w, tokens) = epoch_map(1024, config.tokens_max);
        let (groups_w, groups) = epoch_map(1024, config.groups_max);
        let mut w = Writers {
            store,
            tokens: tokens_w,
            groups: groups_w,
        };
        let uids: Vec<Box<str>> = w.store.token_uids().map(Box::from).collect();
        for uid in uids {
            w.publish_tokens(&uid);
        }
        let ids: Vec<Box<str>> = w.store.groups().map(|(id, _)| Box::from(id)).collect();
        for id in ids {
            w.publish_group(&id);
        }
        Ok((
            Catalog {
                writers: Arc::new(Mutex::new(w)),
                tokens,
                groups,
            },
            recovery,
        ))
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

    /// Stores `token` and `level` for `(uid, device_flag)`, durably.
    pub fn set_token(
        &self,
        uid: &str,
        device_flag: u8,
        token: &str,
        level: DeviceLevel,
    ) -> Result<(), MetaError> {
        let mut w = self.writers();
        w.store.set_token(uid, device_flag, token, level)?;
        w.publish_tokens(uid);
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
        let uids: Vec<&str> = uids.iter().map(String::as_str).collect();
        let mut w = self.writers();
        w.store.add_subscribers(channel_id, &uids, reset)?;
        w.publish_group(channel_id);
        Ok(())
    }

    /// Applies `op` (durably, like the calls it stands for).
    pub fn apply(&self, op: &CatalogOp) -> Result<(), MetaError> {
        match op {
            CatalogOp::SetToken {
                uid,
                device_flag,
                token,
                level,
            } => {
                let level = match level {
                    1 => DeviceLevel::Master,
                    _ => DeviceLevel::Slave,
                };
                self.set_token(uid, *device_flag, token, level)
            }
            CatalogOp::AddSubscribers {
                channel_id,
                uids,
                reset,
            } => self.add_subscribers(channel_id, uids, *reset),
            CatalogOp::RemoveSubscribers { channel_id, uids } => {
                self.remove_subscribers(channel_id, uids)
            }
            // Kept by the group's replicas, not in the catalog.
            CatalogOp::PreferLeader { .. } => Ok(()),
        }
    }

    /// Removes `uids` from a group; a missing group is left missing.
    pub fn remove_subscribers(&self, channel_id: &str, uids: &[String]) -> Result<(), MetaError> {
        let uids: Vec<&str> = uids.iter().map(String::as_str).collect();
        let mut w = self.writers();
        w.store.remove_subscribers(channel_id, &uids)?;
        w.publish_group(channel_id);
        Ok(())
    }
}

/// Whether the token a CONNECT carries is the stored one, in time independent of
/// where they differ (`subtle`), so response timing does not reveal a prefix. Only
/// the length may show (a mismatch in length is refused at once).
pub fn token_matches(stored: &str, given: &str) -> bool {
    use subtle::ConstantTimeEq;
    bool::from(stored.as_bytes().ct_eq(given.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_match_only_when_equal() {
        assert!(token_matches("tok-u1", "tok-u1"));
        assert!(!token_matches("tok-u1", "tok-u2"));
        assert!(!token_matches("tok-u1", "tok-u"));
        assert!(!token_matches("tok-u1", "tok-u12"));
        assert!(!token_matches("tok-u1", ""));
        assert!(token_matches("", ""));
    }

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn tokens_are_per_uid_and_device_flag_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (meta, _) = Catalog::open(dir.path(), MetaConfig::default()).unwrap();
            meta.set_token("u1", 1, "t-web", DeviceLevel::Master)
                .unwrap();
            meta.set_token("u1", 0, "t-app", DeviceLevel::Slave)
                .unwrap();
            meta.set_token("u1", 1, "t-web2", DeviceLevel::Slave)
                .unwrap();
            meta.add_subscribers("g", &s(&["b", "a"]), false).unwrap();
        }
        let (meta, _) = Catalog::open(dir.path(), MetaConfig::default()).unwrap();
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
        assert!(meta.subscribers("g").unwrap().contains("a"));
    }

    #[test]
    fn subscribers_add_reset_remove_within_limits() {
        let dir = tempfile::tempdir().unwrap();
        let config = MetaConfig {
            subscribers_per_group_max: 3,
            ..MetaConfig::default()
        };
        let (meta, _) = Catalog::open(dir.path(), config).unwrap();
        assert!(meta.subscribers("g").is_none());
        meta.add_subscribers("g", &s(&["b", "a"]), false).unwrap();
        meta.add_subscribers("g", &s(&["c", "a"]), false).unwrap();
        let g = meta.subscribers("g").unwrap();
        assert_eq!(
            {
                let mut v: Vec<&str> = g.uids().iter().map(|u| &**u).collect();
                v.sort_unstable();
                v
            },
            vec!["a", "b", "c"]
        );
        assert!(g.contains("b") && !g.contains("d"));
        assert!(meta.add_subscribers("g", &s(&["d"]), false).is_err());
        meta.add_subscribers("g", &s(&["d"]), true).unwrap();
        assert_eq!(meta.subscribers("g").unwrap().len(), 1);
        meta.remove_subscribers("g", &s(&["d"])).unwrap();
        assert!(meta.subscribers("g").is_none_or(|g| g.is_empty()));
    }
}
