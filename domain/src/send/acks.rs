//! The owner side's unacknowledged RECVs of one session, as a sans-IO machine
//! (inputs and `now` in, decisions out; no clock, timer or socket inside):
//!
//! - [`PendingAcks::track`]: a RECV was written; keep it until its RECVACK, or say why
//!   not (the session's count limit, the shard's byte budget);
//! - [`PendingAcks::ack`]: a RECVACK arrived;
//! - [`PendingAcks::on_timeout`]: the session's ack timer fired at `now`: every RECV
//!   now due is handed back to be re-sent with DUP, up to `resends_max` times, then
//!   expires (the client recovers it by sync); the next deadline comes back;
//! - [`PendingAcks::clear`]: the session went.
//!
//! One timer per session, not per RECV: every entry gets the same timeout when
//! (re-)sent, so the queue is ordered by deadline and its front names the only
//! deadline that matters. The machine says when the driver must arm the timer
//! ([`Tracked::arm_timer_at`], [`Timeout::next_deadline_ms`]); the timer stays armed
//! while RECVs flow and fires at most once per timeout (an ack does not cancel it:
//! when it fires with nothing due it re-arms for the front or disarms). RECVACKs come
//! back mostly in order, so a match is found at or near the front.
//!
//! Memory: each entry is charged to the shard's total (`shard_bytes`, owned by the
//! driver because it spans every session of the shard) by [`AckMessage::charge_bytes`]
//! of its message, whether or not other sessions share the message: an upper bound of
//! what the entries keep alive.

use std::collections::VecDeque;

/// What a pending entry needs to know of its message.
pub trait AckMessage: Clone {
    /// The id a RECVACK names.
    fn message_id(&self) -> i64;
    /// What the entry is charged against the shard's byte budget (without the
    /// entry's own overhead, [`ENTRY_OVERHEAD_BYTES`]).
    fn charge_bytes(&self) -> usize;
}

/// The fixed part of an entry's charge: the entry, the message's header and
/// allocation overheads.
pub const ENTRY_OVERHEAD_BYTES: usize = 192;

/// The limits the machine applies (from `[session]`).
#[derive(Clone, Copy, Debug)]
pub struct AckLimits {
    /// Entries per session (`pending_acks_per_session_max`).
    pub per_session_max: usize,
    /// All entries of a shard, charged in bytes (`pending_acks_budget_bytes_per_shard`).
    pub shard_budget_bytes: usize,
    /// A RECV without RECVACK after this long is re-sent (`ack_timeout_ms`).
    pub timeout_ms: u64,
    /// Re-sends of one RECV before it expires (`ack_resends_max`).
    pub resends_max: u8,
}

struct Entry<M> {
    message: M,
    /// When it is due (shard clock, ms).
    deadline_ms: u64,
    resends: u8,
}

impl<M: AckMessage> Entry<M> {
    fn bytes(&self) -> usize {
        ENTRY_OVERHEAD_BYTES + self.message.charge_bytes()
    }
}

/// What [`PendingAcks::track`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tracked {
    /// Kept; `arm_timer_at`: the session had no timer armed, arm one for then.
    Yes {
        /// The entry's deadline (shard clock, ms) when the session's timer must be
        /// armed now; `None` when it is already armed.
        arm_timer_at: Option<u64>,
    },
    /// Not kept (sent untracked): the session holds `per_session_max` entries.
    SessionFull,
    /// Not kept: the shard's entries would pass `shard_budget_bytes`.
    OverBudget,
}

/// What [`PendingAcks::on_timeout`] decided (the RECVs to re-send go to the caller's
/// buffer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeout {
    /// Entries dropped after their last re-send.
    pub expired: u64,
    /// Arm the session's timer for then (`None`: nothing pending, no timer).
    pub next_deadline_ms: Option<u64>,
}

/// The unacknowledged RECVs of one session, oldest first.
pub struct PendingAcks<M> {
    entries: VecDeque<Entry<M>>,
    /// Whether the driver holds an armed timer for this session.
    timer_armed: bool,
}

impl<M> Default for PendingAcks<M> {
    fn default() -> Self {
        PendingAcks {
            entries: VecDeque::new(),
            timer_armed: false,
        }
    }
}

impl<M: AckMessage> PendingAcks<M> {
    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// A RECV of `message` was written at `now_ms`: keep it until its RECVACK.
    pub fn track(
        &mut self,
        message: M,
        now_ms: u64,
        limits: &AckLimits,
        shard_bytes: &mut usize,
    ) -> Tracked {
        let entry = Entry {
            message,
            deadline_ms: now_ms + limits.timeout_ms,
            resends: 0,
        };
        if *shard_bytes + entry.bytes() > limits.shard_budget_bytes {
            return Tracked::OverBudget;
        }
        if self.entries.len() >= limits.per_session_max {
            return Tracked::SessionFull;
        }
        debug_assert!(self
            .entries
            .back()
            .is_none_or(|last| last.deadline_ms <= entry.deadline_ms));
        let arm_timer_at = (!self.timer_armed).then_some(entry.deadline_ms);
        self.timer_armed = true;
        self.push(entry, shard_bytes);
        Tracked::Yes { arm_timer_at }
    }

    /// The driver could not arm the timer [`PendingAcks::track`] or
    /// [`PendingAcks::on_timeout`] asked for: nothing can time out, so nothing is
    /// kept (the client recovers by sync). Returns how many entries were dropped.
    pub fn timer_refused(&mut self, shard_bytes: &mut usize) -> usize {
        self.timer_armed = false;
        self.clear(shard_bytes)
    }

    /// A RECVACK for `message_id`; whether it matched an entry.
    pub fn ack(&mut self, message_id: i64, shard_bytes: &mut usize) -> bool {
        let Some(i) = self
            .entries
            .iter()
            .position(|e| e.message.message_id() == message_id)
        else {
            return false;
        };
        if let Some(entry) = self.entries.remove(i) {
            *shard_bytes -= entry.bytes();
        }
        true
    }

    /// The session's timer fired at `now_ms`: every entry now due goes to `resend`
    /// (re-sent with DUP, due again a timeout later) or expires after
    /// `resends_max` re-sends. Each entry is looked at once.
    pub fn on_timeout(
        &mut self,
        now_ms: u64,
        limits: &AckLimits,
        shard_bytes: &mut usize,
        resend: &mut Vec<M>,
    ) -> Timeout {
        let mut expired = 0;
        for _ in 0..self.entries.len() {
            if self.entries.front().is_none_or(|e| e.deadline_ms > now_ms) {
                break;
            }
            let Some(mut entry) = self.pop_front(shard_bytes) else {
                break;
            };
            if entry.resends >= limits.resends_max {
                expired += 1;
                continue;
            }
            entry.resends += 1;
            entry.deadline_ms = now_ms + limits.timeout_ms;
            resend.push(entry.message.clone());
            self.push(entry, shard_bytes);
        }
        let next_deadline_ms = self.entries.front().map(|e| e.deadline_ms);
        self.timer_armed = next_deadline_ms.is_some();
        Timeout {
            expired,
            next_deadline_ms,
        }
    }

    /// Forgets every entry (the session went); returns how many there were.
    pub fn clear(&mut self, shard_bytes: &mut usize) -> usize {
        let n = self.entries.len();
        while self.pop_front(shard_bytes).is_some() {}
        n
    }

    fn push(&mut self, entry: Entry<M>, shard_bytes: &mut usize) {
        *shard_bytes += entry.bytes();
        self.entries.push_back(entry);
    }

    fn pop_front(&mut self, shard_bytes: &mut usize) -> Option<Entry<M>> {
        let entry = self.entries.pop_front()?;
        *shard_bytes -= entry.bytes();
        Some(entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Debug, PartialEq)]
    struct Msg(i64, usize);

    impl AckMessage for Msg {
        fn message_id(&self) -> i64 {
            self.0
        }
        fn charge_bytes(&self) -> usize {
            self.1
        }
    }

    const LIMITS: AckLimits = AckLimits {
        per_session_max: 3,
        shard_budget_bytes: 10_000,
        timeout_ms: 100,
        resends_max: 2,
    };

    #[test]
    fn one_timer_per_session_resends_then_expiry() {
        let mut p = PendingAcks::default();
        let mut bytes = 0;
        let t =
            |p: &mut PendingAcks<Msg>, id, now, b: &mut usize| p.track(Msg(id, 8), now, &LIMITS, b);
        assert_eq!(
            t(&mut p, 1, 0, &mut bytes),
            Tracked::Yes {
                arm_timer_at: Some(100)
            }
        );
        // The timer is armed: later RECVs ask for none.
        assert_eq!(
            t(&mut p, 2, 50, &mut bytes),
            Tracked::Yes { arm_timer_at: None }
        );
        assert_eq!(bytes, 2 * (ENTRY_OVERHEAD_BYTES + 8));
        assert_eq!((p.len(), p.is_empty()), (2, false));
        let mut resend = Vec::new();
        // At 100 only the first is due: re-sent, due again at 200; next is 150.
        let out = p.on_timeout(100, &LIMITS, &mut bytes, &mut resend);
        assert_eq!(resend, vec![Msg(1, 8)]);
        assert_eq!(
            out,
            Timeout {
                expired: 0,
                next_deadline_ms: Some(150)
            }
        );
        assert!(p.ack(2, &mut bytes), "RECVACK matches");
        assert!(!p.ack(2, &mut bytes), "once");
        // Resent twice (at 100 and 200), then expired at 300.
        resend.clear();
        let out = p.on_timeout(200, &LIMITS, &mut bytes, &mut resend);
        assert_eq!((resend.len(), out.next_deadline_ms), (1, Some(300)));
        resend.clear();
        let out = p.on_timeout(300, &LIMITS, &mut bytes, &mut resend);
        assert_eq!(
            (resend.len(), out),
            (
                0,
                Timeout {
                    expired: 1,
                    next_deadline_ms: None
                }
            )
        );
        assert_eq!((p.len(), p.is_empty(), bytes), (0, true, 0));
        // Disarmed: the next RECV asks for a timer again.
        assert_eq!(
            t(&mut p, 3, 400, &mut bytes),
            Tracked::Yes {
                arm_timer_at: Some(500)
            }
        );
    }

    #[test]
    fn limits_by_count_and_by_shard_bytes() {
        let mut p = PendingAcks::default();
        let mut bytes = 0;
        for id in 0..3 {
            assert!(matches!(
                p.track(Msg(id, 1), 0, &LIMITS, &mut bytes),
                Tracked::Yes { .. }
            ));
        }
        assert_eq!(
            p.track(Msg(9, 1), 0, &LIMITS, &mut bytes),
            Tracked::SessionFull
        );
        // Another session of the same shard: the shard's bytes bind.
        let mut q = PendingAcks::default();
        let big = LIMITS.shard_budget_bytes - bytes - ENTRY_OVERHEAD_BYTES + 1;
        assert_eq!(
            q.track(Msg(10, big), 0, &LIMITS, &mut bytes),
            Tracked::OverBudget
        );
        assert!(matches!(
            q.track(Msg(10, big - 1), 0, &LIMITS, &mut bytes),
            Tracked::Yes { .. }
        ));
        assert_eq!(bytes, LIMITS.shard_budget_bytes);
        // Gone sessions give their bytes back.
        assert_eq!(p.clear(&mut bytes), 3);
        assert_eq!(q.timer_refused(&mut bytes), 1);
        assert_eq!(bytes, 0);
    }
}
