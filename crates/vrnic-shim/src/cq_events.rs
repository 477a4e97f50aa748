//! A CQ's completion events on their way to its completion channel: shared by the CQ (polled
//! by the app) and the notifier thread (which forwards what the daemon raised).
//!
//! An event in a channel always has a completion behind it. The daemon raises an event when a
//! completion lands on an armed CQ; by the time the notifier forwards it, the app may already
//! have polled that completion (it armed, then polled once more, as every event loop does to
//! close the race with the arm). A device would still deliver such an event, and some apps
//! treat the empty poll after it as fatal (`ibv_rc_pingpong -e -t`). So:
//!
//! - the notifier queues an event only while the CQ holds a completion; otherwise it drops the
//!   event and arms the CQ again in the app's last mode (the dropped event used that arm up,
//!   and the app, which never saw it, still counts on it);
//! - a poll that empties the CQ withdraws the events of that CQ still queued (not yet taken by
//!   `ibv_get_cq_event`), taking them off the channel's fd, and arms the CQ again likewise.
//!
//! Each of those hides **one** event per arm of the app's (`ibv_req_notify_cq`): a second
//! event in a row whose completion the app polled first is delivered, as a device delivers it,
//! and the CQ is not armed again. An app that arms once and then busy-polls (UCX arms its CQs
//! now and then and keeps polling) would otherwise keep its CQ armed for ever, each of its
//! completions costing the daemon a wake-up on the socket and the notifier a pass: UCX's
//! `tag_lat` took 10-20 us instead of 2.8 on 2 cores, and 8 us instead of ib_send_lat's 2.7 on
//! 16. A device raises one event per arm; so does this, at most one arm later.
//!
//! Both run under [`CqEvents`]'s lock, with the emptiness read from the ring's published
//! indices, so that an event is never queued behind the poll that would have withdrawn it. The
//! poll takes the lock only when events are counted: the notifier counts its events before it
//! reads the indices and the poll publishes its index before it reads the count (a fence on
//! each side), so one of the two always sees the other.
//! `ibv_get_cq_event` then returns every event it finds, as a device does: an app that saw
//! the fd readable (rsocket's `rpoll` polls it, then calls a blocking `ibv_get_cq_event`) is
//! never left blocking on an event that vanished. What is lost is only the readiness of an
//! event another thread's poll withdrew before this thread read it (that thread then waits for
//! the next completion).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};

use vrnic_shm::{Region, Ring};

use crate::client::Channel;

/// Arm word values (the daemon's): any next completion, or the next solicited one.
const ARM_ANY: u32 = 1;
const ARM_SOLICITED: u32 = 2;

/// The events of one CQ that has a completion channel.
#[derive(Debug)]
pub struct CqEvents {
    /// Held while an event is queued or withdrawn.
    lock: Mutex<()>,
    /// Events of this CQ in the channel's queue or about to be (a hint read without the lock
    /// by the poll's fast path; the entries in the queue are what counts under the lock).
    queued: AtomicU32,
    /// The arm word of the app's last `ibv_req_notify_cq`.
    mode: AtomicU32,
    /// An event with no completion behind it may still be hidden (and the CQ armed again in
    /// its place) under the app's last arm: set by each arm, spent by the first hiding.
    may_hide: AtomicBool,
}

impl Default for CqEvents {
    fn default() -> CqEvents {
        CqEvents {
            lock: Mutex::new(()),
            queued: AtomicU32::new(0),
            mode: AtomicU32::new(ARM_ANY),
            may_hide: AtomicBool::new(true),
        }
    }
}

/// Whether every completion the daemon published has been polled (and the consumer index
/// published).
fn drained(ring: &Ring, region: &Region) -> bool {
    ring.prod(region).load(Ordering::Acquire) == ring.cons(region).load(Ordering::Acquire)
}

impl CqEvents {
    /// Records the mode of the app's arm (`ibv_req_notify_cq`), restored when an event that
    /// used it is dropped.
    pub fn set_mode(&self, solicited_only: bool) {
        let m = if solicited_only {
            ARM_SOLICITED
        } else {
            ARM_ANY
        };
        self.mode.store(m, Ordering::Relaxed);
        self.may_hide.store(true, Ordering::Relaxed);
    }

    /// Whether the CQ is still empty once armed again: then an event raised for it has no
    /// completion behind it. A completion that lands while the arm is restored may have raised
    /// no event of its own, so the CQ then counts as not empty.
    fn empty_after_rearm(&self, ring: &Ring, region: &Region) -> bool {
        if !drained(ring, region) {
            return false;
        }
        ring.arm(region)
            .store(self.mode.load(Ordering::Relaxed), Ordering::SeqCst);
        // Pairs with the daemon's fence between publishing a completion and reading the arm.
        fence(Ordering::SeqCst);
        drained(ring, region)
    }

    /// Queues one event, counted already.
    fn push(&self, cq: usize, channel: &Channel) {
        match channel.queue.lock() {
            Ok(mut q) => q.push_back(cq),
            Err(_) => {
                self.uncount(1);
                return;
            }
        }
        channel.efd.signal();
    }

    fn uncount(&self, n: u32) {
        let _ = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                Some(q.saturating_sub(n))
            });
    }

    /// The notifier: `n` events the daemon raised for CQ `cq` (an `ibv_cq` address) go to
    /// `channel`, unless the app has already polled everything they announce.
    pub fn forward(&self, cq: usize, n: u32, ring: &Ring, region: &Region, channel: &Channel) {
        if n == 0 {
            return;
        }
        let _held = self.lock.lock();
        // Counted before the indices are read: a poll that publishes its index after this
        // read sees the count and comes for the lock (see the module docs).
        self.queued.fetch_add(n, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        // Hidden only once per arm of the app's: a second one is delivered (module docs).
        if drained(ring, region)
            && self.may_hide.swap(false, Ordering::Relaxed)
            && self.empty_after_rearm(ring, region)
        {
            self.uncount(n);
            return;
        }
        for _ in 0..n {
            self.push(cq, channel);
        }
    }

    /// After a poll of CQ `cq`: if it left the CQ empty, withdraws its events still waiting in
    /// `channel`. Costs a fence and an atomic load when none waits.
    pub fn after_poll(&self, cq: usize, ring: &Ring, region: &Region, channel: &Channel) {
        // The poll published its consumer index before this: pairs with the fence in
        // `forward`.
        fence(Ordering::SeqCst);
        if self.queued.load(Ordering::SeqCst) == 0 || !drained(ring, region) {
            return;
        }
        let _held = self.lock.lock();
        // Withdrawn only once per arm of the app's; after that they stay, as on a device.
        if !self.may_hide.swap(false, Ordering::Relaxed) {
            return;
        }
        let removed = match channel.queue.lock() {
            Ok(mut q) => {
                let before = q.len();
                q.retain(|&p| p != cq);
                let removed = before - q.len();
                self.uncount(u32::try_from(removed).unwrap_or(u32::MAX));
                removed
            }
            Err(_) => return,
        };
        if removed == 0 {
            // Nothing was hidden: the arm's one hiding is still to come.
            self.may_hide.store(true, Ordering::Relaxed);
            return;
        }
        channel.efd.take_nowait(removed);
        if !self.empty_after_rearm(ring, region) {
            // A completion landed meanwhile: one event stands for it.
            self.queued.fetch_add(1, Ordering::SeqCst);
            self.push(cq, channel);
        }
    }

    /// `ibv_get_cq_event` took one event of this CQ off the channel's queue.
    pub fn taken(&self) {
        self.uncount(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::EventFd;
    use vrnic_shm::layout;
    use vrnic_wire::CQ_SLOT;

    struct Fixture {
        path: std::path::PathBuf,
        region: Region,
        ring: Ring,
        channel: Channel,
        ev: CqEvents,
    }

    impl Fixture {
        fn new(name: &str) -> Fixture {
            let path =
                std::env::temp_dir().join(format!("vrnic-cqev-{name}-{}", std::process::id()));
            let _ = std::fs::remove_file(&path);
            let region = Region::create(&path, 0, "r", 1, [0; 16], 1).unwrap();
            let ring = Ring::new(&region, layout::HEAP_OFF, 8, CQ_SLOT).unwrap();
            ring.reset(&region);
            let channel = Channel {
                efd: EventFd::new().unwrap(),
                queue: Mutex::new(Default::default()),
            };
            Fixture {
                path,
                region,
                ring,
                channel,
                ev: CqEvents::default(),
            }
        }

        /// The daemon publishes a completion and consumes the arm, as `post_cqe` does.
        fn complete(&self) -> bool {
            let p = self.ring.prod(&self.region);
            p.store(p.load(Ordering::Acquire) + 1, Ordering::Release);
            self.ring.arm(&self.region).swap(0, Ordering::AcqRel) != 0
        }

        /// The app polls everything and publishes its consumer index.
        fn drain(&self) {
            let p = self.ring.prod(&self.region).load(Ordering::Acquire);
            self.ring.cons(&self.region).store(p, Ordering::Release);
        }

        fn queued(&self) -> usize {
            self.channel.queue.lock().unwrap().len()
        }

        fn armed(&self) -> u32 {
            self.ring.arm(&self.region).load(Ordering::Acquire)
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.path);
        }
    }

    #[test]
    fn an_event_whose_completion_is_still_there_is_queued() {
        let f = Fixture::new("queued");
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        assert!(f.complete());
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 1);
        assert!(!f.channel.efd.nonblocking());
    }

    #[test]
    fn an_event_whose_completion_was_polled_is_dropped_and_the_cq_armed_again() {
        let f = Fixture::new("dropped");
        f.ev.set_mode(true);
        f.ring
            .arm(&f.region)
            .store(ARM_SOLICITED, Ordering::Release);
        assert!(f.complete());
        f.drain();
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 0);
        assert_eq!(f.armed(), ARM_SOLICITED, "armed again in the app's mode");
    }

    #[test]
    fn a_poll_that_empties_the_cq_withdraws_its_queued_events() {
        let f = Fixture::new("withdrawn");
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        assert!(f.complete());
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        // Another CQ's event on the same channel.
        f.channel.queue.lock().unwrap().push_front(9);
        f.channel.efd.signal();
        assert_eq!(f.queued(), 2);
        // A poll that leaves a completion behind withdraws nothing.
        f.ev.after_poll(7, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 2);
        f.drain();
        f.ev.after_poll(7, &f.ring, &f.region, &f.channel);
        assert_eq!(
            *f.channel.queue.lock().unwrap(),
            [9],
            "another CQ's event stays"
        );
        assert_eq!(f.armed(), ARM_ANY, "armed again");
        // The fd holds one event less: the other CQ's is left.
        let fd = f.channel.efd.fd();
        assert!(crate::sys::poll_in(fd, 0).0);
        f.channel.efd.take_nowait(1);
        assert!(
            !crate::sys::poll_in(fd, 0).0,
            "exactly one event was left on the fd"
        );
    }

    #[test]
    fn a_completion_landing_while_the_arm_is_restored_keeps_one_event() {
        let f = Fixture::new("raced");
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        assert!(f.complete());
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        f.drain();
        // The daemon publishes another completion before the app's check: the CQ is not
        // empty, so the queued event stays for it.
        f.complete();
        f.ev.after_poll(7, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 1);
    }

    #[test]
    fn one_event_per_arm_is_hidden_the_next_is_delivered_and_the_cq_left_unarmed() {
        let f = Fixture::new("once");
        f.ev.set_mode(false);
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        // The app busy-polls: every completion is polled before the notifier looks.
        assert!(f.complete());
        f.drain();
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 0, "the first is hidden");
        assert_eq!(f.armed(), ARM_ANY, "and the CQ armed again in its place");
        assert!(f.complete());
        f.drain();
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(
            f.queued(),
            1,
            "the second is delivered, as a device delivers it"
        );
        assert_eq!(
            f.armed(),
            0,
            "and the CQ stays unarmed: no wake-up per completion"
        );
        // A poll that empties the CQ leaves it queued now.
        f.ev.after_poll(7, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 1);
        assert!(!f.complete(), "later completions raise nothing");
        // The app's next arm may hide one again.
        f.ev.set_mode(false);
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        f.ev.taken();
        f.channel.queue.lock().unwrap().clear();
        assert!(f.complete());
        f.drain();
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 0);
        assert_eq!(f.armed(), ARM_ANY);
    }

    #[test]
    fn a_withdrawal_spends_the_arm_s_one_hiding() {
        let f = Fixture::new("withdrawn-once");
        f.ev.set_mode(false);
        f.ring.arm(&f.region).store(ARM_ANY, Ordering::Release);
        assert!(f.complete());
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        f.drain();
        f.ev.after_poll(7, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 0, "withdrawn");
        assert_eq!(f.armed(), ARM_ANY, "armed again");
        assert!(f.complete());
        f.drain();
        f.ev.forward(7, 1, &f.ring, &f.region, &f.channel);
        assert_eq!(f.queued(), 1, "the next stale one is delivered");
        assert_eq!(f.armed(), 0);
    }

    #[test]
    fn taking_an_event_never_underflows_the_count() {
        let ev = CqEvents::default();
        ev.taken();
        assert_eq!(ev.queued.load(Ordering::Acquire), 0);
    }
}
