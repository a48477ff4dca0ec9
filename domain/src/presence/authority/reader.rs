//! The lock-free read side of the directory ([`AuthorityReader`]): lookups of
//! endpoints by exact target, from any thread, through the published tables and
//! their presence filters.

use super::*;

/// A lookup group whose uids' hashes ([`uid_hash`]) were computed ahead (a
/// group's subscriber list keeps them): `hashes[i]` is the hash of `uids[i]`.
#[derive(Clone, Copy, Debug)]
pub struct HashedGroup<'a> {
    /// The exact target of the hash slot all of `uids` hash to.
    pub target: Target,
    /// The uids to look up; their endpoints come back in this order (rule 25).
    pub uids: &'a [Uid],
    /// `uid_hash(uids[i])` for each `i`; as long as `uids`.
    pub hashes: &'a [u64],
}

/// Lock-free lookups of the directory, from any thread. Cheap to clone (a clone
/// starts its own filter counts).
#[derive(Clone)]
pub struct AuthorityReader {
    dir: Arc<Directory>,
    /// What this reader's lookups' presence filters saved, so far.
    counts: std::cell::Cell<FilterCounts>,
}

impl AuthorityReader {
    /// A reader of `dir`.
    pub fn new(dir: &Arc<Directory>) -> AuthorityReader {
        AuthorityReader {
            dir: dir.clone(),
            counts: std::cell::Cell::default(),
        }
    }

    /// The presence filter counts of this reader's lookups so far (cumulative).
    pub fn filter_counts(&self) -> FilterCounts {
        self.counts.get()
    }

    /// The identity currently published for `hash_slot`.
    pub fn identity(&self, hash_slot: HashSlot) -> Option<Target> {
        let guard = crossbeam_epoch::pin();
        self.dir.state(hash_slot as usize, &guard).map(|v| v.target)
    }

    /// Looks up the active endpoints of each group's uids (rules 24–26), appending
    /// them to `out` and one entry per group to `results`, in input order: the range
    /// of `out` holding the group's endpoints, or the group's error (`NotLeader`: no
    /// identity; `StaleTarget`: a different one; `Full`: the group would pass
    /// `lookup_uids_max` for this call). Endpoints come in the order of the input
    /// uids, and within a uid ordered by (node_id, boot_id, session_id); each names
    /// its uid by `uid_index`, the uid's position in the group's slice. One pin for
    /// the whole call; never blocks or waits for the writers; allocates only when
    /// `out` or `results` grows. The fast form: no uid reference count touched.
    /// A uid its slot's presence filter says is absent is not probed.
    pub fn endpoints_by_targets_compact_into(
        &self,
        groups: &[(Target, &[Uid])],
        out: &mut Vec<CompactEndpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.0, g.1.len()),
            results,
            |view, g| {
                let start = out.len();
                let c = view.lookup(g.1, |e| out.push(e));
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_compact_into`](Self::endpoints_by_targets_compact_into)
    /// with full [`Endpoint`]s (each clones its uid's `Arc`).
    pub fn endpoints_by_targets_into(
        &self,
        groups: &[(Target, &[Uid])],
        out: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.0, g.1.len()),
            results,
            |view, g| {
                let uids = g.1;
                let start = out.len();
                let c = view.lookup(uids, |e| out.push(e.endpoint(&uids[e.uid_index as usize])));
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_into`](Self::endpoints_by_targets_into) of groups
    /// whose uids' hashes are given: a uid its filter says is absent costs its
    /// hash's filter word, its bytes are not read.
    pub fn endpoints_by_hashed_groups_into(
        &self,
        groups: &[HashedGroup<'_>],
        out: &mut Vec<Endpoint>,
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
    ) {
        self.for_each_group(
            groups,
            |g| (g.target, g.uids.len()),
            results,
            |view, g| {
                let uids = g.uids;
                let start = out.len();
                let push = |e: CompactEndpoint| out.push(e.endpoint(&uids[e.uid_index as usize]));
                let c = view.lookup_hashed(uids, g.hashes, push);
                (start..out.len(), c)
            },
        );
    }

    /// [`endpoints_by_targets_into`](Self::endpoints_by_targets_into) with one owned
    /// vector per group.
    pub fn endpoints_by_targets(
        &self,
        groups: &[(Target, &[Uid])],
    ) -> Vec<Result<Vec<Endpoint>, AuthorityError>> {
        let mut out = Vec::new();
        let mut results = Vec::with_capacity(groups.len());
        self.endpoints_by_targets_into(groups, &mut out, &mut results);
        results
            .into_iter()
            .map(|r| r.map(|range| out[range].to_vec()))
            .collect()
    }

    /// Checks each group's budget and target under one pin (`shape`: a group's
    /// target and uid count), pushing its error or the range `lookup` returns for
    /// it; adds up the filter counts.
    #[inline]
    pub(super) fn for_each_group<G>(
        &self,
        groups: &[G],
        shape: impl Fn(&G) -> (Target, usize),
        results: &mut Vec<Result<Range<usize>, AuthorityError>>,
        mut lookup: impl FnMut(&SlotView<'_>, &G) -> (Range<usize>, FilterCounts),
    ) {
        let guard = crossbeam_epoch::pin();
        let mut budget = self.dir.lookup_uids_max;
        let mut counts = self.counts.get();
        results.reserve(groups.len());
        for g in groups {
            let (target, n) = shape(g);
            // `uid_index` is a u32: a larger group cannot be named (and would pass
            // any sane `lookup_uids_max`).
            if n > budget || n > u32::MAX as usize {
                results.push(Err(AuthorityError::Full));
                continue;
            }
            budget -= n;
            let Some(view) = self.dir.state(target.hash_slot as usize, &guard) else {
                results.push(Err(AuthorityError::NotLeader));
                continue;
            };
            if view.target != target {
                results.push(Err(AuthorityError::StaleTarget));
                continue;
            }
            if view.rebuilding {
                results.push(Err(AuthorityError::Rebuilding));
                continue;
            }
            let (range, c) = lookup(&view, g);
            counts.add(c);
            results.push(Ok(range));
        }
        self.counts.set(counts);
    }
}
