//! The idempotent-send window (flow 7, `docs/flows.md`): `(sender uid, client_msg_no)` → the first
//! SENDACK's `(message_id, message_seq)`, for the last sends no older than `ttl_s`, at
//! most `entries_max` of them taking at most `budget_bytes` (keys counted with their
//! length: one key may be 128 KiB, so the count alone bounds nothing useful). A SEND found here is answered with the stored ids and neither committed nor
//! delivered again.
//!
//! One window per commit shard: a resent SEND names the same channel, so it reaches
//! the same shard as the first one. Time (whole seconds) is passed in. An empty
//! `client_msg_no` identifies nothing: such sends are never recorded nor matched.
//! After a restart, the store refills the window ([`IdempotencyWindow::refill`]) from the
//! records still in its log (their timestamps stand for the insertion time).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Bounds of the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IdempotencyConfig {
    /// Most remembered sends; the oldest is evicted first. At least 1.
    pub entries_max: usize,
    /// A send is forgotten once `now_s >= inserted_s + ttl_s`.
    pub ttl_s: u64,
    /// Memory the window may hold, in bytes: each entry counts its key (sender uid +
    /// client_msg_no, up to 2 × 65535 bytes) plus [`ENTRY_OVERHEAD_BYTES`]; the oldest
    /// are evicted first. This, not `entries_max`, is the worst case (per shard).
    pub budget_bytes: usize,
}

/// Bytes one entry costs besides its key: the key's allocation header, the map slot
/// (key pointer, ids, control byte, load factor) and the insertion-order slot.
pub const ENTRY_OVERHEAD_BYTES: usize = 112;

impl Default for IdempotencyConfig {
    fn default() -> Self {
        IdempotencyConfig {
            entries_max: 100_000,
            ttl_s: 600,
            budget_bytes: 32 << 20,
        }
    }
}

/// The ids the first SENDACK carried.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SentIds {
    /// The first copy's message id.
    pub message_id: i64,
    /// The first copy's seq in its channel (0 for a NoPersist message).
    pub message_seq: u64,
}

/// What the window knows of an earlier send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstSend {
    /// The ids a resend is answered with.
    pub ids: SentIds,
    /// Refilled from the log at start and not yet delivered by this process: its
    /// first copy may never have been answered with success (a failed sync, a crash
    /// before the answer), so no RECV may have gone out. The caller delivers it with
    /// the resend and then calls [`IdempotencyWindow::delivered`].
    pub recovered: bool,
}

/// See the module docs.
#[derive(Debug)]
pub struct IdempotencyWindow {
    config: IdempotencyConfig,
    map: HashMap<Arc<[u8]>, FirstSend>,
    /// Keys in insertion order with their insertion second.
    order: VecDeque<(Arc<[u8]>, u64)>,
    /// What the entries cost, as [`IdempotencyConfig::budget_bytes`] counts it.
    bytes: usize,
    scratch: Vec<u8>,
}

impl IdempotencyWindow {
    /// `None` when `entries_max` or `budget_bytes` is 0.
    pub fn new(config: IdempotencyConfig) -> Option<IdempotencyWindow> {
        (config.entries_max > 0 && config.budget_bytes > 0).then(|| IdempotencyWindow {
            config,
            map: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            scratch: Vec::new(),
        })
    }

    fn key<'s>(scratch: &'s mut Vec<u8>, uid: &str, client_msg_no: &str) -> &'s [u8] {
        scratch.clear();
        scratch.extend_from_slice(&(uid.len() as u32).to_le_bytes());
        scratch.extend_from_slice(uid.as_bytes());
        scratch.extend_from_slice(client_msg_no.as_bytes());
        scratch
    }

    fn expire(&mut self, now_s: u64) {
        while let Some((key, at)) = self.order.front() {
            if now_s < at.saturating_add(self.config.ttl_s) {
                break;
            }
            self.bytes -= key.len() + ENTRY_OVERHEAD_BYTES;
            self.map.remove(key);
            self.order.pop_front();
        }
    }

    /// The ids of an earlier send of `(uid, client_msg_no)` still in the window.
    pub fn get(&mut self, uid: &str, client_msg_no: &str, now_s: u64) -> Option<SentIds> {
        self.first_send(uid, client_msg_no, now_s).map(|f| f.ids)
    }

    /// What the window knows of an earlier send of `(uid, client_msg_no)`: its ids,
    /// and whether it was recovered from the log.
    pub fn first_send(&mut self, uid: &str, client_msg_no: &str, now_s: u64) -> Option<FirstSend> {
        if client_msg_no.is_empty() {
            return None;
        }
        self.expire(now_s);
        let key = Self::key(&mut self.scratch, uid, client_msg_no);
        self.map.get(key).copied()
    }

    /// A recovered send was delivered (with a resend of it): later resends are plain
    /// duplicates.
    pub fn delivered(&mut self, uid: &str, client_msg_no: &str) {
        let key = Self::key(&mut self.scratch, uid, client_msg_no);
        if let Some(f) = self.map.get_mut(key) {
            f.recovered = false;
        }
    }

    /// Remembers a committed send. If the pair is already in the window, the first ids
    /// are kept and returned (`Some`); otherwise `None`. Evicts the oldest entries
    /// beyond `entries_max` or `budget_bytes`; an entry costing more than
    /// `budget_bytes` on its own is not remembered.
    pub fn insert(
        &mut self,
        uid: &str,
        client_msg_no: &str,
        ids: SentIds,
        now_s: u64,
    ) -> Option<SentIds> {
        let first = FirstSend {
            ids,
            recovered: false,
        };
        self.remember(uid, client_msg_no, first, now_s)
    }

    /// [`insert`](Self::insert), with the entry's `recovered` mark.
    fn remember(
        &mut self,
        uid: &str,
        client_msg_no: &str,
        entry: FirstSend,
        now_s: u64,
    ) -> Option<SentIds> {
        if client_msg_no.is_empty() {
            return None;
        }
        self.expire(now_s);
        let key = Self::key(&mut self.scratch, uid, client_msg_no);
        let cost = key.len() + ENTRY_OVERHEAD_BYTES;
        if cost > self.config.budget_bytes {
            // Larger than the whole window: not remembered (a resend of it commits
            // again; it was never in the window either), and nothing else is
            // evicted for it.
            return None;
        }
        // One hash of the key: a committed send is almost never in the window
        // already (the commit core asked `first_send` first), so the key is
        // allocated up front and the rare hit drops it.
        let key: Arc<[u8]> = Arc::from(key);
        match self.map.entry(key.clone()) {
            Entry::Occupied(first) => return Some(first.get().ids),
            Entry::Vacant(slot) => {
                slot.insert(entry);
            }
        }
        self.order.push_back((key, now_s));
        self.bytes += cost;
        while self.order.len() > self.config.entries_max || self.bytes > self.config.budget_bytes {
            let (old, _) = self.order.pop_front().expect("an entry is over a bound");
            self.bytes -= old.len() + ENTRY_OVERHEAD_BYTES;
            self.map.remove(&old);
        }
        debug_assert_eq!(self.map.len(), self.order.len());
        None
    }

    /// Sends remembered, including any past `ttl_s` that no call has expired yet
    /// (expiry runs on lookups and inserts).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The bytes the entries are accounted for (at most `budget_bytes`).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// What an entry for `(uid, client_msg_no)` is accounted for.
    pub fn entry_bytes(uid: &str, client_msg_no: &str) -> usize {
        4 + uid.len() + client_msg_no.len() + ENTRY_OVERHEAD_BYTES
    }

    /// Whether no send is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Refills the window with one retained record of the log (the store's rebuild
    /// at start feeds them oldest first), its `timestamp_s` standing for the
    /// insertion time; a record already past `ttl_s` at `now_s` is skipped.
    pub fn refill(
        &mut self,
        uid: &str,
        client_msg_no: &str,
        ids: SentIds,
        timestamp_s: u32,
        now_s: u64,
    ) {
        let at = u64::from(timestamp_s);
        if now_s < at.saturating_add(self.config.ttl_s) {
            let entry = FirstSend {
                ids,
                recovered: true,
            };
            self.remember(uid, client_msg_no, entry, at);
        }
    }

    /// Ends a refill: forgets what is past `ttl_s` at `now_s`; returns how many
    /// entries the window holds.
    pub fn refill_done(&mut self, now_s: u64) -> usize {
        self.expire(now_s);
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    fn ids(n: u64) -> SentIds {
        SentIds {
            message_id: n as i64 * 10,
            message_seq: n,
        }
    }

    /// The keys are chosen by clients (`client_msg_no`, up to 64 KiB): the table
    /// hashes them with a keyed hasher, its key random per window (std's
    /// `RandomState`: SipHash-1-3 keyed from the OS), so no one can precompute keys
    /// that collide. An unkeyed hasher (FxHash, a fixed seed) fails this test: two
    /// windows would hash every key alike.
    #[test]
    fn client_chosen_keys_are_hashed_with_a_random_key_per_window() {
        let window = || IdempotencyWindow::new(IdempotencyConfig::default()).unwrap();
        let (a, b) = (window(), window());
        let keyed: &std::collections::hash_map::RandomState = a.map.hasher();
        let differ = (0..8u64)
            .filter(|i| {
                let key: &[u8] = &i.to_le_bytes();
                keyed.hash_one(key) != b.map.hasher().hash_one(key)
            })
            .count();
        assert_eq!(differ, 8, "two windows hash alike: the hasher is not keyed");
    }

    /// Expiry gives an entry's bytes back: the accounted bytes fall with each
    /// forgotten entry, and a window whose budget was full takes new entries without
    /// evicting live ones.
    #[test]
    fn expiry_gives_back_the_bytes_of_what_it_forgets() {
        let one = IdempotencyWindow::entry_bytes("u", "c1");
        let mut w = IdempotencyWindow::new(IdempotencyConfig {
            entries_max: 100,
            ttl_s: 10,
            budget_bytes: 2 * one,
        })
        .unwrap();
        assert_eq!(w.insert("u", "c1", ids(1), 0), None);
        assert_eq!(w.bytes(), one);
        assert_eq!(w.insert("u", "c2", ids(2), 5), None);
        assert_eq!(w.bytes(), 2 * one);
        // c1 expires at 10: its bytes are given back, c2's stay
        assert_eq!(w.get("u", "c2", 10), Some(ids(2)));
        assert_eq!((w.len(), w.bytes()), (1, one));
        // room for c3 without evicting c2
        assert_eq!(w.insert("u", "c3", ids(3), 10), None);
        assert_eq!(w.get("u", "c2", 10), Some(ids(2)));
        assert_eq!((w.len(), w.bytes()), (2, 2 * one));
        // everything past its ttl: nothing is accounted
        assert_eq!(w.refill_done(100), 0);
        assert_eq!(w.bytes(), 0);
    }

    /// An entry costing the whole budget fits (alone); one costing more is not
    /// remembered and evicts nothing for its sake.
    #[test]
    fn an_entry_over_the_budget_is_not_remembered_and_evicts_nothing() {
        let budget = IdempotencyWindow::entry_bytes("u", "c1");
        assert_eq!(
            budget,
            4 + 1 + 2 + ENTRY_OVERHEAD_BYTES,
            "length prefix, uid, key"
        );
        let mut w = IdempotencyWindow::new(IdempotencyConfig {
            entries_max: 100,
            ttl_s: 10,
            budget_bytes: budget,
        })
        .unwrap();
        assert_eq!(w.insert("u", "c1", ids(1), 0), None);
        assert_eq!((w.len(), w.bytes()), (1, budget), "exactly the budget fits");
        assert_eq!(w.insert("u", "c1", ids(9), 0), Some(ids(1)));
        // one byte more than the whole window
        assert_eq!(w.insert("u", "c22", ids(2), 0), None);
        assert_eq!(w.get("u", "c22", 0), None, "not remembered");
        assert_eq!(
            w.insert("u", "c22", ids(3), 0),
            None,
            "a resend commits again"
        );
        assert_eq!(w.get("u", "c1", 0), Some(ids(1)), "nothing evicted for it");
        assert_eq!((w.len(), w.bytes()), (1, budget));
        // an entry of the same cost replaces the oldest
        assert_eq!(w.insert("u", "c3", ids(3), 0), None);
        assert_eq!(w.get("u", "c1", 0), None);
        assert_eq!((w.len(), w.bytes()), (1, budget));
    }

    /// A refill keeps the log's records younger than `ttl_s` at `now_s` (a record
    /// exactly `ttl_s` old is not taken), marked recovered until delivered;
    /// `refill_done` expires what aged meanwhile and counts what is left.
    #[test]
    fn refill_keeps_the_young_records_marked_recovered() {
        let mut w = IdempotencyWindow::new(IdempotencyConfig {
            entries_max: 100,
            ttl_s: 10,
            budget_bytes: 1 << 20,
        })
        .unwrap();
        assert!(w.is_empty());
        w.refill("u", "old", ids(1), 10, 20);
        assert_eq!((w.len(), w.bytes()), (0, 0), "exactly ttl_s old: skipped");
        w.refill("u", "c1", ids(2), 11, 20);
        w.refill("u", "c2", ids(3), 15, 20);
        assert!(!w.is_empty());
        assert_eq!(w.len(), 2);
        assert_eq!(
            w.bytes(),
            IdempotencyWindow::entry_bytes("u", "c1") + IdempotencyWindow::entry_bytes("u", "c2")
        );
        assert_eq!(w.refill_done(20), 2);
        let recovered = |ids| FirstSend {
            ids,
            recovered: true,
        };
        assert_eq!(w.first_send("u", "c1", 20), Some(recovered(ids(2))));
        w.delivered("u", "c1");
        assert_eq!(
            w.first_send("u", "c1", 20),
            Some(FirstSend {
                ids: ids(2),
                recovered: false
            })
        );
        assert_eq!(w.first_send("u", "c2", 20), Some(recovered(ids(3))));
        // c1 (at 11) is past ttl_s at 21, c2 (at 15) at 25
        assert_eq!(w.refill_done(21), 1);
        assert_eq!(w.refill_done(25), 0);
        assert!(w.is_empty());
    }

    #[test]
    fn evicts_oldest_beyond_max_entries_and_by_ttl() {
        let mut w = IdempotencyWindow::new(IdempotencyConfig {
            entries_max: 3,
            ttl_s: 100,
            budget_bytes: 1 << 20,
        })
        .unwrap();
        for n in 1..=4u64 {
            assert_eq!(w.insert("u", &format!("c{n}"), ids(n), 10), None);
        }
        assert_eq!(w.len(), 3);
        assert_eq!(w.get("u", "c1", 10), None, "oldest evicted");
        assert_eq!(w.get("u", "c2", 10), Some(ids(2)));
        // a resend keeps the first ids
        assert_eq!(w.insert("u", "c2", ids(99), 10), Some(ids(2)));
        // (uid, client_msg_no) is the key: another sender's c2 is distinct
        assert_eq!(w.get("v", "c2", 10), None);
        // the length prefix keeps ("ab","c") apart from ("a","bc")
        w.insert("ab", "c", ids(7), 50);
        assert_eq!(w.get("a", "bc", 50), None);
        assert_eq!(w.get("u", "c4", 109), Some(ids(4)));
        assert_eq!(w.get("u", "c4", 110), None, "expired at 10 + 100");
        assert_eq!(w.get("ab", "c", 149), Some(ids(7)));
        assert_eq!(w.get("ab", "c", 150), None);
        assert!(w.is_empty());
        assert_eq!(w.insert("u", "", ids(1), 0), None);
        assert_eq!(w.get("u", "", 0), None);
        assert!(IdempotencyWindow::new(IdempotencyConfig {
            entries_max: 0,
            ttl_s: 1,
            budget_bytes: 1 << 20,
        })
        .is_none());
    }
}
