//! How a poller of a region's rings gives its CPU away when it finds nothing: the driver
//! polling a completion queue, the daemon's loop or an engine thread between passes.
//!
//! On a host with a core for each spinning thread, giving the CPU away is pure cost: a
//! `sched_yield` is a system call (about 0.5 us in a VM, 0.1-0.2 us on bare metal), and a
//! completion or a doorbell that arrives meanwhile waits for it to return. With more
//! spinning threads than cores (an app, the engine and the app's peer on two cores), it is
//! what lets the one that has work run: without it, the engine may wait for the app's whole
//! time slice (milliseconds) to fill the completion the app spins on.
//!
//! [`Spin`] tells the two apart by what its yields cost: a yield that returns at once gave
//! the CPU to nobody; one that took much longer than the fastest seen ran someone else. After
//! [`STREAK`] yields in a row that ran nobody, the next come after twice as many empty polls
//! (up to a ceiling); one that ran someone brings them back to every few polls (the floor).
//! A poller alone on its core soon spins without system calls; one that shares its core keeps
//! yielding as before. There a yield often returns at once too (the scheduler keeps the
//! poller on), so quick yields prove nothing alone: before spacing them out, the poller also
//! asks the kernel whether it was switched out since the last time it asked (its thread's
//! involuntary context switches, `getrusage`: a yield that runs another thread counts as
//! one, and so does a preemption by one), and if it was, yields come every few polls again.
//!
//! A yield can also cost a whole time slice: the thread it ran may spin without yielding
//! back (perftest's latency tests poll their buffer, not the driver), and then the poller
//! waits for the scheduler's tick (milliseconds here) before it runs again. On two cores with
//! the daemon and two such apps, that is what happens when the daemon yields right after
//! executing one app's request, before the other app's answer (a microsecond later) has
//! arrived: the app that got the CPU spins on the answer, which the daemon, off the CPU, has
//! not executed. A poller that knows how long it has been idle ([`Spin::idle_for`]) so
//! keeps its CPU for a while after its last work before it yields ([`Spin::hold`]): none at
//! first, [`HOLD_MIN`] after a yield that took a time slice, twice as long after each further
//! one (up to [`HOLD_MAX`]), half as long after [`STREAK`] yields in a row that did not.

#![allow(unsafe_code)]

use std::time::{Duration, Instant};

/// Extra time over twice the fastest yield seen that makes a yield count as having run
/// another thread (a switch there and back costs several microseconds; a bare system call,
/// a fraction of one).
const SWITCH_MARGIN: Duration = Duration::from_nanos(500);

/// Yields in a row that ran nobody before yields are spaced out twice as far.
pub const STREAK: u32 = 16;
/// A yield that took this long gave the CPU to a thread that kept it for a time slice.
pub const SLICE: Duration = Duration::from_micros(500);
/// The first hold after such a yield: longer than an app on another core takes to see an
/// answer and post its next request.
pub const HOLD_MIN: Duration = Duration::from_micros(4);
/// The longest hold: a few round trips, small beside a time slice.
pub const HOLD_MAX: Duration = Duration::from_micros(64);

/// The empty-poll policy of one poller (see the module docs).
#[derive(Debug, Clone)]
pub struct Spin {
    /// Empty polls since the last work or the last yield.
    empty: u32,
    /// Empty polls between yields now: between `floor` and `ceiling`, a power of two apart.
    every: u32,
    /// Yields in a row that ran nobody, since `every` last changed.
    streak: u32,
    floor: u32,
    ceiling: u32,
    /// This thread's involuntary context switches when last asked.
    switched: u64,
    /// The fastest yield seen: what a yield that runs nobody else costs here.
    fastest: Duration,
    /// How long after its last work the poller keeps its CPU ([`Spin::idle_for`]).
    hold: Duration,
    /// Yields in a row that did not take a time slice, since `hold` last changed.
    short: u32,
}

impl Spin {
    /// A poller that yields every `floor` empty polls while that gives the CPU to someone,
    /// and at most every `ceiling` while it does not (`1 <= floor <= ceiling`).
    pub const fn new(floor: u32, ceiling: u32) -> Spin {
        let floor = if floor == 0 { 1 } else { floor };
        Spin {
            empty: 0,
            every: floor,
            streak: 0,
            switched: 0,
            floor,
            ceiling: if ceiling < floor { floor } else { ceiling },
            fastest: Duration::MAX,
            hold: Duration::ZERO,
            short: 0,
        }
    }

    /// The poll found work: empty polls count from zero again.
    pub fn worked(&mut self) {
        self.empty = 0;
    }

    /// An empty poll: yields the CPU when due. Returns whether it yielded.
    pub fn idle(&mut self) -> bool {
        self.empty = self.empty.saturating_add(1);
        if self.empty < self.every {
            return false;
        }
        self.empty = 0;
        let start = Instant::now();
        std::thread::yield_now();
        let took = start.elapsed();
        self.yielded(took, involuntary_switches);
        self.held(took);
        true
    }

    /// An empty poll `idle` after the poller's last work (by the caller's clock): as
    /// [`Spin::idle`], but not within [`Spin::hold`] of that work.
    pub fn idle_for(&mut self, idle: Duration) -> bool {
        if idle < self.hold {
            return false;
        }
        self.idle()
    }

    /// How long after its last work the poller keeps its CPU now.
    pub fn hold(&self) -> Duration {
        self.hold
    }

    /// Adapts the hold to a yield that took `took` (see the module docs).
    fn held(&mut self, took: Duration) {
        if took >= SLICE {
            self.hold = self.hold.saturating_mul(2).clamp(HOLD_MIN, HOLD_MAX);
            self.short = 0;
        } else if !self.hold.is_zero() {
            self.short += 1;
            if self.short >= STREAK {
                self.short = 0;
                self.hold /= 2;
                if self.hold < HOLD_MIN {
                    self.hold = Duration::ZERO;
                }
            }
        }
    }

    /// Adapts to a yield that took `took`; `switches` counts this thread's involuntary
    /// context switches so far.
    fn yielded(&mut self, took: Duration, switches: impl FnOnce() -> u64) {
        self.fastest = self.fastest.min(took);
        let ran_another = took > self.fastest.saturating_mul(2).saturating_add(SWITCH_MARGIN);
        if ran_another {
            self.every = self.floor;
            self.streak = 0;
        } else {
            self.streak += 1;
            if self.streak >= STREAK {
                self.streak = 0;
                let switched = switches();
                self.every = if switched != self.switched {
                    // Switched out meanwhile: the core is shared after all.
                    self.floor
                } else {
                    self.every.saturating_mul(2).min(self.ceiling)
                };
                self.switched = switched;
            }
        }
    }

    /// Empty polls between yields now (for tests and logs).
    pub fn every(&self) -> u32 {
        self.every
    }
}

/// The calling thread's involuntary context switches so far (0 if the kernel cannot say).
fn involuntary_switches() -> u64 {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `u` is a valid, writable `rusage`; RUSAGE_THREAD asks about this thread only.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, u.as_mut_ptr()) };
    if rc != 0 {
        return 0;
    }
    // SAFETY: getrusage succeeded and filled `u` (it was zeroed before anyway).
    let u = unsafe { u.assume_init() };
    u.ru_nivcsw as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Streaks of yields that return at once space them out to the ceiling; one that ran
    /// another thread brings them back to the floor at once, and breaks the streak.
    #[test]
    fn quick_yields_space_out_and_a_slow_one_brings_them_back() {
        let mut s = Spin::new(8, 1024);
        assert_eq!(s.every(), 8);
        let quick = Duration::from_nanos(500);
        let switch = Duration::from_micros(3);
        for _ in 0..STREAK - 1 {
            s.yielded(quick, || 0);
        }
        assert_eq!(s.every(), 8, "one short of a streak");
        s.yielded(switch, || 0);
        for _ in 0..STREAK - 1 {
            s.yielded(quick, || 0);
        }
        assert_eq!(s.every(), 8, "the streak started again after the switch");
        s.yielded(quick, || 0);
        assert_eq!(s.every(), 16);
        for want in [32, 64, 128, 256, 512, 1024, 1024] {
            for _ in 0..STREAK {
                s.yielded(quick, || 0);
            }
            assert_eq!(s.every(), want);
        }
        // Slightly slower than the fastest: still nobody else.
        s.yielded(Duration::from_nanos(900), || 0);
        assert_eq!(s.every(), 1024);
        // A switch there and back.
        s.yielded(switch, || 0);
        assert_eq!(s.every(), 8);
        // A streak of quick yields, but the thread was switched out meanwhile (preempted, or
        // a quick yield that still ran someone): back to the floor, not spaced out.
        for _ in 0..STREAK {
            s.yielded(quick, || 0);
        }
        assert_eq!(s.every(), 16);
        for _ in 0..STREAK {
            s.yielded(quick, || 7);
        }
        assert_eq!(s.every(), 8, "switched out during the streak");
        for _ in 0..STREAK {
            s.yielded(quick, || 7);
        }
        assert_eq!(s.every(), 16, "not since");
    }

    /// A yield that took a time slice makes the poller keep its CPU after its work, longer
    /// after each such yield up to the most; a streak of yields that did not shortens it,
    /// down to none.
    #[test]
    fn a_yield_that_took_a_slice_holds_the_cpu_after_work_and_short_ones_release_it() {
        let mut s = Spin::new(1, 1);
        let quick = Duration::from_micros(1);
        s.held(quick);
        assert_eq!(s.hold(), Duration::ZERO, "no slice lost: no hold");
        s.held(SLICE);
        assert_eq!(s.hold(), HOLD_MIN);
        s.held(Duration::from_millis(4));
        assert_eq!(s.hold(), HOLD_MIN * 2);
        for _ in 0..10 {
            s.held(SLICE);
        }
        assert_eq!(s.hold(), HOLD_MAX);
        for _ in 0..STREAK - 1 {
            s.held(quick);
        }
        assert_eq!(s.hold(), HOLD_MAX, "one short of a streak");
        s.held(quick);
        assert_eq!(s.hold(), HOLD_MAX / 2);
        let mut streaks = 0;
        while !s.hold().is_zero() {
            for _ in 0..STREAK {
                s.held(quick);
            }
            streaks += 1;
        }
        assert_eq!(streaks, 4, "32, 16, 8, 4 us, then none");
        // Within the hold of the last work, an empty poll does not yield; past it, it does.
        s.held(SLICE);
        s.worked();
        assert!(!s.idle_for(HOLD_MIN / 2));
        assert!(
            s.idle_for(HOLD_MIN),
            "a floor of 1 yields once the hold is over"
        );
    }

    /// `idle` yields on the `every`-th empty poll in a row, and work restarts the count.
    #[test]
    fn idle_yields_on_the_every_th_empty_poll_and_work_restarts_the_count() {
        let mut s = Spin::new(4, 4);
        assert!(!s.idle() && !s.idle() && !s.idle());
        s.worked();
        assert!(!s.idle() && !s.idle() && !s.idle());
        assert!(s.idle(), "the fourth empty poll in a row");
        assert!(!s.idle());
        let mut one = Spin::new(0, 0);
        assert_eq!(one.every(), 1);
        assert!(one.idle(), "a floor of 1 yields on every empty poll");
    }
}
