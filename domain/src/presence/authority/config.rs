//! The authority's limits and timeouts (`[authority]`), checked where they are
//! made.

/// The limits and timeouts of the authority. Units are in the names.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AuthorityConfig {
    /// A route expires when its last activity second plus this is before `now_s`.
    pub route_ttl_s: u64,
    /// A pending candidate not committed or aborted within this is dropped.
    pub pending_ttl_s: u64,
    /// How long an identity's fence record (last owner_seq, tombstone) is kept once
    /// it has neither route nor candidate. At least 1.
    pub fence_retention_s: u64,
    /// Active routes per hash slot.
    pub routes_per_slot_max: usize,
    /// Pending candidates per hash slot.
    pub pending_per_slot_max: usize,
    /// Identity records (with or without route) per hash slot.
    pub fence_records_per_slot_max: usize,
    /// Identity records per uid (bounds the per-uid conflict scans).
    pub records_per_uid_max: usize,
    /// Uids per `endpoints_by_targets` call; groups past the limit fail with `Full`.
    pub lookup_uids_max: usize,
    /// Routes per `touch_routes` call.
    pub touch_batch_routes_max: usize,
    /// Initial entry count of a slot's published table (one cache line per uid with
    /// routes; a new table is built as uids come, up to twice `routes_per_slot_max`
    /// entries).
    pub initial_buckets_per_slot: usize,
    /// Bits per route of each slot's presence filter (a lookup skips a uid the
    /// filter says is absent, without probing the table): sized for the slot's
    /// routes at this many bits (up to twice as many), 4 bits set per uid in one
    /// 64-bit word. 16: about 0.5% false positives at worst.
    pub presence_filter_bits_per_route: usize,
    /// Bits of one slot's presence filter at most (past its routes × bits per
    /// route, false positives rise; the lookup stays exact).
    pub presence_filter_bits_per_slot_max: usize,
    /// Uids that lost their last endpoint since a slot's filter was built (their
    /// bits stay set), in percent of the routes it was sized for, that make its
    /// writer rebuild it from the table.
    pub presence_filter_stale_percent: usize,
    /// How long a hash slot gained from another node waits for that node's
    /// handover of its routes, its lookups answering `Rebuilding` meanwhile
    /// (`handover` module). 0: no wait (lookups answer from the table at once,
    /// "offline" until the gateways' rebuild reaches it), and a move of a slot to
    /// the node that leads it starts it empty: the node before handovers.
    pub handover_wait_s: u64,
    /// Routes and tombstones of handover batches kept for identities not
    /// installed yet.
    pub handover_stash_routes_max: usize,
}

impl Default for AuthorityConfig {
    fn default() -> Self {
        AuthorityConfig {
            route_ttl_s: 120,
            pending_ttl_s: 30,
            fence_retention_s: 600,
            routes_per_slot_max: 1 << 16,
            pending_per_slot_max: 1 << 12,
            fence_records_per_slot_max: 1 << 18,
            records_per_uid_max: 64,
            lookup_uids_max: 1 << 16,
            touch_batch_routes_max: 4096,
            initial_buckets_per_slot: 64,
            presence_filter_bits_per_route: 16,
            presence_filter_bits_per_slot_max: 1 << 21,
            presence_filter_stale_percent: 50,
            handover_wait_s: 2,
            handover_stash_routes_max: 1 << 16,
        }
    }
}

/// An [`AuthorityConfig`] that cannot work.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ConfigError {
    /// A limit or timeout that must be at least 1 is 0 (the field's name).
    Zero(&'static str),
    /// `fence_records_per_slot_max` is below `routes_per_slot_max + pending_per_slot_max`.
    FenceRecordsBelowRoutes,
}

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConfigError::Zero(name) => write!(f, "authority config: {name} must be at least 1"),
            ConfigError::FenceRecordsBelowRoutes => f.write_str(
                "authority config: fence_records_per_slot_max must be at least routes_per_slot_max + pending_per_slot_max",
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

impl AuthorityConfig {
    /// Checks that the limits can work together.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("route_ttl_s", self.route_ttl_s as usize),
            ("pending_ttl_s", self.pending_ttl_s as usize),
            ("fence_retention_s", self.fence_retention_s as usize),
            ("routes_per_slot_max", self.routes_per_slot_max),
            ("pending_per_slot_max", self.pending_per_slot_max),
            ("records_per_uid_max", self.records_per_uid_max),
            ("lookup_uids_max", self.lookup_uids_max),
            ("touch_batch_routes_max", self.touch_batch_routes_max),
            ("initial_buckets_per_slot", self.initial_buckets_per_slot),
            (
                "presence_filter_bits_per_route",
                self.presence_filter_bits_per_route,
            ),
            (
                "presence_filter_bits_per_slot_max",
                self.presence_filter_bits_per_slot_max,
            ),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.fence_records_per_slot_max
            < self
                .routes_per_slot_max
                .saturating_add(self.pending_per_slot_max)
        {
            return Err(ConfigError::FenceRecordsBelowRoutes);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every limit that must be at least 1 is refused at 0, by its name; the
    /// defaults pass.
    #[test]
    fn each_zero_limit_is_refused_by_name() {
        assert_eq!(AuthorityConfig::default().validate(), Ok(()));
        type Zero = (&'static str, fn(&mut AuthorityConfig));
        let zeroed: [Zero; 11] = [
            ("route_ttl_s", |c| c.route_ttl_s = 0),
            ("pending_ttl_s", |c| c.pending_ttl_s = 0),
            ("fence_retention_s", |c| c.fence_retention_s = 0),
            ("routes_per_slot_max", |c| c.routes_per_slot_max = 0),
            ("pending_per_slot_max", |c| c.pending_per_slot_max = 0),
            ("records_per_uid_max", |c| c.records_per_uid_max = 0),
            ("lookup_uids_max", |c| c.lookup_uids_max = 0),
            ("touch_batch_routes_max", |c| c.touch_batch_routes_max = 0),
            ("initial_buckets_per_slot", |c| {
                c.initial_buckets_per_slot = 0
            }),
            ("presence_filter_bits_per_route", |c| {
                c.presence_filter_bits_per_route = 0
            }),
            ("presence_filter_bits_per_slot_max", |c| {
                c.presence_filter_bits_per_slot_max = 0
            }),
        ];
        for (name, zero) in zeroed {
            let mut c = AuthorityConfig::default();
            zero(&mut c);
            assert_eq!(c.validate(), Err(ConfigError::Zero(name)));
        }
        // 0 is a working value of these.
        let c = AuthorityConfig {
            presence_filter_stale_percent: 0,
            handover_wait_s: 0,
            handover_stash_routes_max: 0,
            ..AuthorityConfig::default()
        };
        assert_eq!(c.validate(), Ok(()));
    }

    /// The fence records must hold every route and candidate: at their sum and
    /// above it passes, one below is refused.
    #[test]
    fn fence_records_cover_routes_and_candidates() {
        let with = |fence| AuthorityConfig {
            routes_per_slot_max: 5,
            pending_per_slot_max: 3,
            fence_records_per_slot_max: fence,
            ..AuthorityConfig::default()
        };
        assert_eq!(with(8).validate(), Ok(()));
        assert_eq!(with(9).validate(), Ok(()));
        assert_eq!(
            with(7).validate(),
            Err(ConfigError::FenceRecordsBelowRoutes)
        );
        // A sum past usize::MAX saturates rather than wrapping to a small one.
        let huge = AuthorityConfig {
            routes_per_slot_max: usize::MAX,
            ..with(usize::MAX - 1)
        };
        assert_eq!(huge.validate(), Err(ConfigError::FenceRecordsBelowRoutes));
    }

    #[test]
    fn errors_name_what_to_fix() {
        assert_eq!(
            ConfigError::Zero("lookup_uids_max").to_string(),
            "authority config: lookup_uids_max must be at least 1"
        );
        assert_eq!(
            ConfigError::FenceRecordsBelowRoutes.to_string(),
            "authority config: fence_records_per_slot_max must be at least \
             routes_per_slot_max + pending_per_slot_max"
        );
    }
}
