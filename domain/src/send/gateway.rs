//! The gateway's credits of SENDs in flight, sans-IO (step 1 of a SEND).
//!
//! Each SEND a gateway hands to a commit shard holds two credits until its SENDACK
//! comes back: one of its connection (`per_conn_max`: one client cannot fill the
//! node) and one towards that commit shard (`per_shard_max`: the SENDACKs on their
//! way back never exceed the room the commit shard reserves for them, so a full
//! ring never has to drop one). Out of either, the SEND is answered at once with
//! SENDACK 22 (RateLimit) and the client retries. A SEND to this shard itself needs
//! no shard credit (no ring between them).
//!
//! The connection's count lives with the connection (it dies with it; a SENDACK for
//! a closed connection returns only the shard credit).

use slots::{HashSlot, ShardId, SlotMap};

use crate::cluster::{ClusterView, NodeId};

/// Where a SEND goes from its gateway: to the commit shard of its channel's hash
/// slot on this node, or to the channel's home, another node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendRoute {
    /// The channel's home is this node: this commit shard commits it.
    Local(ShardId),
    /// The channel's home is another node: the SEND is forwarded there.
    Remote(NodeId),
}

impl SendRoute {
    /// The route of a SEND to the channel of `hash_slot`, from a gateway of
    /// `local_node`.
    pub fn of(
        view: &ClusterView,
        slot_map: &SlotMap,
        local_node: NodeId,
        hash_slot: HashSlot,
    ) -> Self {
        let home = view.home_node(hash_slot);
        if home == local_node {
            SendRoute::Local(slot_map.shard_of(hash_slot))
        } else {
            SendRoute::Remote(home)
        }
    }

    /// The shard the SEND's credit is taken towards ([`SendCredits::take`]): its
    /// commit shard; for another node, this gateway shard `me` itself, so only the
    /// connection's credit is held (the link's in-flight table bounds the rest).
    pub fn credit_shard(self, me: ShardId) -> ShardId {
        match self {
            SendRoute::Local(shard) => shard,
            SendRoute::Remote(_) => me,
        }
    }
}

/// The credits of one gateway shard.
#[derive(Clone, Debug)]
pub struct SendCredits {
    me: ShardId,
    per_shard_max: usize,
    per_conn_max: u32,
    /// Per commit shard: this gateway's SENDs in flight there.
    in_flight_to: Vec<usize>,
}

impl SendCredits {
    /// Credits of shard `me` of `shard_count`.
    pub fn new(me: ShardId, shard_count: usize, per_shard_max: usize, per_conn_max: u32) -> Self {
        SendCredits {
            me,
            per_shard_max,
            per_conn_max,
            in_flight_to: vec![0; shard_count],
        }
    }

    /// Takes the credits of one SEND of a connection with `conn_in_flight` SENDs in
    /// flight, to commit shard `to`; false (nothing taken): out of credit, SENDACK 22.
    pub fn take(&mut self, conn_in_flight: &mut u32, to: ShardId) -> bool {
        let remote = to != self.me;
        if *conn_in_flight >= self.per_conn_max
            || (remote && self.in_flight_to[to as usize] >= self.per_shard_max)
        {
            return false;
        }
        *conn_in_flight += 1;
        if remote {
            self.in_flight_to[to as usize] += 1;
        }
        true
    }

    /// A SENDACK came back from commit shard `from` (over the ring): its shard credit
    /// returns, whether or not the connection is still there.
    pub fn returned_from(&mut self, from: ShardId) {
        if from != self.me {
            let c = &mut self.in_flight_to[from as usize];
            debug_assert!(*c > 0, "a SENDACK from shard {from} without a credit");
            *c = c.saturating_sub(1);
        }
    }

    /// The SENDACK reached its connection: the connection's credit returns.
    pub fn answered(conn_in_flight: &mut u32) {
        *conn_in_flight = conn_in_flight.saturating_sub(1);
    }

    /// This gateway's SENDs in flight to commit shard `to`.
    pub fn in_flight_to(&self, to: ShardId) -> usize {
        self.in_flight_to[to as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_and_a_peer_shard_each_hold_at_most_their_credits() {
        let mut c = SendCredits::new(0, 2, 3, 2);
        let (mut conn_a, mut conn_b) = (0u32, 0u32);
        assert!(c.take(&mut conn_a, 1));
        assert!(c.take(&mut conn_a, 1));
        assert!(!c.take(&mut conn_a, 1), "the connection is out of credit");
        assert!(c.take(&mut conn_b, 1));
        assert!(!c.take(&mut conn_b, 1), "the shard is out of credit");
        assert_eq!(
            (conn_b, c.in_flight_to(1)),
            (1, 3),
            "a refusal takes nothing"
        );
        // SENDs to this shard itself need no shard credit.
        assert!(c.take(&mut conn_b, 0));
        assert_eq!(c.in_flight_to(0), 0);
        // A SENDACK back: both credits return, and the next SEND passes.
        c.returned_from(1);
        SendCredits::answered(&mut conn_a);
        assert!(c.take(&mut conn_a, 1));
    }

    #[test]
    fn a_sendack_for_a_closed_connection_still_returns_the_shard_credit() {
        let mut c = SendCredits::new(1, 2, 1, 10);
        {
            // The connection closes with its SEND in flight: its count goes with it.
            let mut conn = 0u32;
            assert!(c.take(&mut conn, 0));
        }
        c.returned_from(0);
        let mut other = 0u32;
        assert!(c.take(&mut other, 0));
    }
}

#[cfg(test)]
mod route_tests {
    use super::*;

    #[test]
    fn a_send_goes_to_its_commit_shard_here_or_to_its_home() {
        // Slot id i of 4 is homed on nodes[i % 2]; hash slots 0..64 are slot id 0.
        let view = ClusterView::initial(&[1, 2], 4).unwrap();
        let map = SlotMap::modulo(3).unwrap();
        let (here, there) = (5, 70);
        assert_eq!(view.home_node(here), 1);
        assert_eq!(view.home_node(there), 2);
        let local = SendRoute::of(&view, &map, 1, here);
        assert_eq!(local, SendRoute::Local(map.shard_of(here)));
        assert_eq!(local.credit_shard(0), map.shard_of(here));
        let remote = SendRoute::of(&view, &map, 1, there);
        assert_eq!(remote, SendRoute::Remote(2));
        assert_eq!(remote.credit_shard(1), 1, "held towards the gateway itself");
        // Node 2 sees them the other way round.
        assert_eq!(SendRoute::of(&view, &map, 2, here), SendRoute::Remote(1));
    }
}
