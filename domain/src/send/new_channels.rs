//! How fast one connection may start sending to new channels (issue 11.3).
//!
//! Every SEND to a person channel names a channel the log may not know yet, and each
//! new channel costs the commit shard an index entry (and, at `channels_max`,
//! retention). The gateway cannot ask the log whether a channel exists without a
//! round trip, so it uses a conservative stand-in: a SEND to a channel this
//! connection sent to recently (one of its last `recent_channels_per_conn` admitted
//! channels) is free; any other takes a token from a bucket of
//! `new_channels_per_conn_burst` tokens refilled at `new_channels_per_conn_per_s`.
//! Without a token the SEND is answered with SENDACK 22 (RateLimit) and counted in
//! `sends_rate_limited`; a refused channel is not remembered (a retry pays again).
//! A client rotating among more channels than it remembers pays for known channels
//! too, and is still allowed `per_s` of them a second.
//!
//! Sans-IO: the caller passes its monotonic clock in ms. State per connection:
//! `recent_channels_per_conn` × 8 bytes, allocated at the first SEND.

use std::hash::{Hash, Hasher};

/// The limits (`[session] new_channels_per_conn_*` and `recent_channels_per_conn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewChannelLimits {
    /// 0: no limit.
    pub per_s: u32,
    /// Tokens the bucket holds (at least 1 when `per_s` > 0).
    pub burst: u32,
    /// How many recently admitted channels a connection remembers (sends to them take
    /// no token); 0: none is remembered.
    pub recent: usize,
}

/// A stable 64-bit hash of a channel (`DefaultHasher`, SipHash-1-3: finding another
/// channel id with the hash of a given one costs about 2^64 tries).
pub fn channel_hash(channel_type: u8, channel_key: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    channel_type.hash(&mut h);
    channel_key.hash(&mut h);
    h.finish()
}

/// One connection's gate (see the module docs).
#[derive(Debug, Default)]
pub struct NewChannelGate {
    /// Hashes of the channels admitted last, a ring of at most `recent` entries.
    recent: Vec<u64>,
    next: usize,
    /// Tokens × 1000.
    milli_tokens: u64,
    /// The clock at the last call (`None`: never called; the bucket starts full).
    last_ms: Option<u64>,
}

impl NewChannelGate {
    /// Whether a SEND to `channel` ([`channel_hash`]) may go at `now_ms`.
    pub fn admit(&mut self, limits: NewChannelLimits, channel: u64, now_ms: u64) -> bool {
        if limits.per_s == 0 {
            return true;
        }
        let cap = u64::from(limits.burst.max(1)) * 1000;
        self.milli_tokens = match self.last_ms {
            None => cap,
            Some(last) => {
                let elapsed = now_ms.saturating_sub(last);
                let refill = elapsed.saturating_mul(u64::from(limits.per_s));
                self.milli_tokens.saturating_add(refill).min(cap)
            }
        };
        self.last_ms = Some(self.last_ms.map_or(now_ms, |l| l.max(now_ms)));
        if self.recent.contains(&channel) {
            return true;
        }
        if self.milli_tokens < 1000 {
            return false;
        }
        self.milli_tokens -= 1000;
        if limits.recent > 0 {
            if self.recent.len() < limits.recent {
                self.recent.push(channel);
            } else {
                let at = self.next % self.recent.len();
                self.recent[at] = channel;
                self.next = at + 1;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: NewChannelLimits = NewChannelLimits {
        per_s: 2,
        burst: 3,
        recent: 2,
    };

    #[test]
    fn burst_then_rate_and_recent_channels_are_free() {
        let mut g = NewChannelGate::default();
        // a full bucket: 3 new channels at once, the 4th is refused
        assert!(g.admit(LIMITS, 1, 1000));
        assert!(g.admit(LIMITS, 2, 1000));
        assert!(g.admit(LIMITS, 3, 1000));
        assert!(!g.admit(LIMITS, 4, 1000));
        // a refused channel is not remembered
        assert!(!g.admit(LIMITS, 4, 1000));
        // the last 2 admitted (2, 3) are free, 1 fell out of the ring
        for _ in 0..100 {
            assert!(g.admit(LIMITS, 3, 1000));
            assert!(g.admit(LIMITS, 2, 1000));
        }
        assert!(!g.admit(LIMITS, 1, 1000));
        // 2 per second: one token after 500 ms, not before
        assert!(!g.admit(LIMITS, 5, 1499));
        assert!(g.admit(LIMITS, 5, 1500));
        assert!(!g.admit(LIMITS, 6, 1500));
        // a clock going back refills nothing and breaks nothing
        assert!(!g.admit(LIMITS, 6, 0));
        assert!(g.admit(LIMITS, 6, 2000));
        // a long pause refills up to the burst only
        for c in 10..13 {
            assert!(g.admit(LIMITS, c, 1_000_000));
        }
        assert!(!g.admit(LIMITS, 13, 1_000_000));
        assert!(g.recent.len() <= 2);
        // extreme values neither overflow nor give more than the burst
        let wide = NewChannelLimits {
            per_s: u32::MAX,
            ..LIMITS
        };
        assert!((20..23).all(|c| g.admit(wide, c, u64::MAX)));
        assert!(!g.admit(wide, 23, u64::MAX));
    }

    /// Once the ring is full, each newly admitted channel replaces the oldest one it
    /// remembers, slot after slot.
    #[test]
    fn the_ring_forgets_the_oldest_channel_first() {
        let limits = NewChannelLimits {
            per_s: 1,
            burst: 5,
            recent: 2,
        };
        let mut g = NewChannelGate::default();
        assert!((1..=5).all(|c| g.admit(limits, c, 0)), "the whole burst");
        // the bucket is empty: only the last two (4, 5) are free
        assert!(g.admit(limits, 4, 0));
        assert!(g.admit(limits, 5, 0));
        assert!(!g.admit(limits, 3, 0));
        assert!(!g.admit(limits, 2, 0));
    }

    #[test]
    fn zero_rate_means_no_limit_and_zero_recent_remembers_nothing() {
        let mut g = NewChannelGate::default();
        let off = NewChannelLimits { per_s: 0, ..LIMITS };
        assert!((0..1000).all(|c| g.admit(off, c, 0)));
        let forgetful = NewChannelLimits {
            recent: 0,
            burst: 1,
            ..LIMITS
        };
        let mut g = NewChannelGate::default();
        assert!(g.admit(forgetful, 7, 0));
        assert!(!g.admit(forgetful, 7, 0), "not remembered: pays again");
        assert!(g.recent.is_empty());
    }

    #[test]
    fn channel_hash_tells_types_and_ids_apart() {
        assert_eq!(channel_hash(1, "a@b"), channel_hash(1, "a@b"));
        assert_ne!(channel_hash(1, "a@b"), channel_hash(2, "a@b"));
        assert_ne!(channel_hash(1, "a@b"), channel_hash(1, "a@c"));
    }
}
