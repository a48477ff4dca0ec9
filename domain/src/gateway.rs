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

use slots::ShardId;

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
