//! The serving side of a hop from another node: whether a request is still worth
//! running and its reply still worth sending (its deadline), and the replies held
//! while the link back to their requester is not up.
//!
//! A request frame carries a relative deadline (the time it had left when it was
//! sent); the node that reads it turns it into one on its own clock
//! (`proto::rpc::link::deadline_at_ms`). Past it the requester has given the
//! request up (its own deadline passed first: the transit counts against it), so
//! running it, or sending its answer, only spends work on an answer nobody reads:
//! a request is run, and its reply sent, only while [`in_time`].
//!
//! Replies to another node travel on this node's own link to it (the link that
//! node's requests came on carries nothing back). A peer that restarted dials this
//! node and asks at once, before this node has dialed it back: its replies wait in
//! [`HeldReplies`], bounded in count and bytes, until the link comes up with the
//! very process that asked (a reply for an older process of the peer is dropped),
//! or until their deadline.

/// Whether a request with deadline `deadline_at_ms` (on this node's clock; `None`:
/// none) can still be answered at `now_ms`: its reply needs `margin_ms` to get
/// back before the deadline. Neither run nor answered otherwise.
pub fn in_time(deadline_at_ms: Option<u64>, now_ms: u64, margin_ms: u64) -> bool {
    deadline_at_ms.is_none_or(|at| now_ms.saturating_add(margin_ms) < at)
}

/// The last moment before which a reply to a request with deadline
/// `deadline_at_ms` can still be sent (see [`in_time`]): sent while `now_ms <` it.
pub fn send_by_ms(deadline_at_ms: Option<u64>, margin_ms: u64) -> u64 {
    deadline_at_ms.map_or(u64::MAX, |at| at.saturating_sub(margin_ms))
}

/// How a reply in time goes to the requesting process `requester` of a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyWay {
    /// On the link, up with that very process.
    Send,
    /// Held until the link comes up with it: the link is not up, or up with an
    /// older process of the peer (about to close as stale and dial back).
    Hold,
    /// Dropped: the peer has a newer process than the one that asked.
    Drop,
}

/// The way of a reply to process `requester`, given the process the link to that
/// peer is up with (`None`: not up) and the peer's newest process this node knows.
pub fn reply_way(link_up_with: Option<u64>, requester: u64, newest: Option<u64>) -> ReplyWay {
    if link_up_with == Some(requester) {
        ReplyWay::Send
    } else if newest.is_some_and(|b| b != requester) {
        ReplyWay::Drop
    } else {
        ReplyWay::Hold
    }
}

/// The bounds of one [`HeldReplies`] (`[rpc] rpc_replies_held_max`,
/// `rpc_replies_held_bytes_max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldLimits {
    /// Replies held at once.
    pub replies_max: usize,
    /// Their bodies' bytes.
    pub bytes_max: usize,
}

/// Why a reply was not held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotHeld {
    /// Its request's deadline has passed (or would before it got back).
    Expired,
    /// The table is at its count or bytes limit.
    Full,
}

/// A reply waiting for the link to its requester.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldReply {
    /// The requesting process (the peer's boot id): the reply goes to it only.
    pub boot: u64,
    /// The request it answers.
    pub request_id: u64,
    /// The encoded reply.
    pub body: Vec<u8>,
    /// Sent only while `now <` this ([`send_by_ms`]).
    pub send_by_ms: u64,
}

/// What [`HeldReplies::release`] gives: every reply held leaves the table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// To send now, in the order they were held.
    pub send: Vec<HeldReply>,
    /// Dropped: their deadline had passed.
    pub expired: u64,
    /// Dropped: for another process of the peer than the one the link is up with.
    pub gone: u64,
}

/// The replies held for one peer node while the link to it is not up (sans-IO:
/// time passed in).
#[derive(Clone, Debug)]
pub struct HeldReplies {
    limits: HeldLimits,
    held: Vec<HeldReply>,
    bytes: usize,
    /// The earliest `send_by_ms` held (`u64::MAX`: none).
    next_expiry_ms: u64,
}

impl HeldReplies {
    /// An empty table within `limits`.
    pub fn new(limits: HeldLimits) -> HeldReplies {
        HeldReplies {
            limits,
            held: Vec::new(),
            bytes: 0,
            next_expiry_ms: u64::MAX,
        }
    }

    /// Replies held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Their bodies' bytes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds the reply `body` to request `request_id` of process `boot`, to be sent
    /// while `now <` `send_by_ms`; refused when already too late or past a limit.
    pub fn hold(
        &mut self,
        boot: u64,
        request_id: u64,
        body: &[u8],
        send_by_ms: u64,
        now_ms: u64,
    ) -> Result<(), NotHeld> {
        if now_ms >= send_by_ms {
            return Err(NotHeld::Expired);
        }
        let fits = self.held.len() < self.limits.replies_max
            && self.bytes + body.len() <= self.limits.bytes_max;
        if !fits {
            return Err(NotHeld::Full);
        }
        self.bytes += body.len();
        self.next_expiry_ms = self.next_expiry_ms.min(send_by_ms);
        self.held.push(HeldReply {
            boot,
            request_id,
            body: body.to_vec(),
            send_by_ms,
        });
        Ok(())
    }

    /// The link came up with process `boot` of the peer at `now_ms`: every reply
    /// leaves, those for `boot` within their deadline to be sent.
    pub fn release(&mut self, boot: u64, now_ms: u64) -> Released {
        let mut released = Released::default();
        for reply in self.held.drain(..) {
            if reply.boot != boot {
                released.gone += 1;
            } else if now_ms >= reply.send_by_ms {
                released.expired += 1;
            } else {
                released.send.push(reply);
            }
        }
        self.bytes = 0;
        self.next_expiry_ms = u64::MAX;
        released
    }

    /// Drops the replies whose deadline passed at `now_ms`; returns how many. Costs
    /// nothing until the earliest one is due.
    pub fn expire(&mut self, now_ms: u64) -> u64 {
        if now_ms < self.next_expiry_ms {
            return 0;
        }
        let before = self.held.len();
        let mut bytes = self.bytes;
        self.held.retain(|r| {
            let keep = now_ms < r.send_by_ms;
            if !keep {
                bytes -= r.body.len();
            }
            keep
        });
        self.bytes = bytes;
        self.next_expiry_ms = self
            .held
            .iter()
            .map(|r| r.send_by_ms)
            .min()
            .unwrap_or(u64::MAX);
        (before - self.held.len()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: HeldLimits = HeldLimits {
        replies_max: 3,
        bytes_max: 10,
    };

    #[test]
    fn a_request_is_in_time_until_its_answer_could_no_longer_get_back() {
        // Read at 100 with 50 ms left: deadline 150; the answer needs 1 ms back.
        assert!(in_time(Some(150), 100, 1));
        assert!(in_time(Some(150), 148, 1));
        assert!(!in_time(Some(150), 149, 1), "149 + 1 reaches the deadline");
        assert!(!in_time(Some(150), 400, 1));
        // A request read with no more than the margin left is never run.
        assert!(!in_time(Some(101), 100, 1));
        assert!(in_time(Some(101), 100, 0));
        assert!(in_time(None, u64::MAX, 1), "no deadline");
        assert_eq!(send_by_ms(Some(150), 1), 149);
        assert_eq!(send_by_ms(Some(0), 1), 0);
        assert_eq!(send_by_ms(None, 1), u64::MAX);
    }

    #[test]
    fn a_reply_goes_to_the_process_that_asked_or_waits_for_it() {
        assert_eq!(reply_way(Some(7), 7, Some(7)), ReplyWay::Send);
        assert_eq!(reply_way(None, 7, Some(7)), ReplyWay::Hold, "link down");
        assert_eq!(reply_way(None, 7, None), ReplyWay::Hold, "no process seen");
        // Up with an older process that restarted as 7: the link is about to close.
        assert_eq!(reply_way(Some(6), 7, Some(7)), ReplyWay::Hold);
        // 7 restarted as 8: nobody reads 7's replies.
        assert_eq!(reply_way(None, 7, Some(8)), ReplyWay::Drop);
        assert_eq!(reply_way(Some(8), 7, Some(8)), ReplyWay::Drop);
    }

    #[test]
    fn held_replies_go_to_the_process_that_asked_within_their_deadline() {
        let mut h = HeldReplies::new(LIMITS);
        h.hold(7, 1, b"ab", 100, 0).unwrap();
        h.hold(8, 2, b"cd", 100, 0).unwrap(); // an older process of the peer
        h.hold(7, 3, b"ef", 50, 0).unwrap();
        assert_eq!((h.len(), h.bytes()), (3, 6));
        let r = h.release(7, 60);
        let sent: Vec<u64> = r.send.iter().map(|r| r.request_id).collect();
        assert_eq!(sent, vec![1]);
        assert_eq!(r.send[0].body, b"ab");
        assert_eq!((r.expired, r.gone), (1, 1));
        assert!(h.is_empty());
        assert_eq!(h.bytes(), 0);
    }

    #[test]
    fn held_replies_are_bounded_in_count_and_bytes() {
        let mut h = HeldReplies::new(LIMITS);
        h.hold(7, 1, b"0123", 100, 0).unwrap();
        h.hold(7, 2, b"0123", 100, 0).unwrap();
        assert_eq!(h.hold(7, 3, b"012", 100, 0), Err(NotHeld::Full), "bytes");
        h.hold(7, 4, b"01", 100, 0).unwrap();
        assert_eq!(h.hold(7, 5, b"", 100, 0), Err(NotHeld::Full), "count");
        assert_eq!((h.len(), h.bytes()), (3, 10));
        // Room again once they leave.
        assert_eq!(h.release(7, 1).send.len(), 3);
        h.hold(7, 6, b"0123456789", 100, 1).unwrap();
    }

    #[test]
    fn a_held_reply_is_dropped_at_its_deadline() {
        let mut h = HeldReplies::new(LIMITS);
        assert_eq!(h.hold(7, 1, b"a", 10, 10), Err(NotHeld::Expired));
        h.hold(7, 2, b"ab", 30, 0).unwrap();
        h.hold(7, 3, b"abc", 20, 0).unwrap();
        assert_eq!(h.expire(19), 0);
        assert_eq!(h.expire(20), 1);
        assert_eq!((h.len(), h.bytes()), (1, 2));
        assert_eq!(h.expire(29), 0);
        assert!(!h.is_empty());
        assert_eq!(h.expire(30), 1);
        assert!(h.is_empty());
        assert_eq!(h.bytes(), 0);
    }

    #[test]
    fn a_held_reply_found_past_its_deadline_is_dropped_too() {
        // The expiry timer may fire late: a reply long past its deadline goes.
        let mut h = HeldReplies::new(LIMITS);
        h.hold(7, 1, b"ab", 30, 0).unwrap();
        assert_eq!(h.expire(500), 1);
        assert!(h.is_empty());
    }
}
