//! How a shard's passes are paced: one after another while there is work, and when to spin,
//! give the CPU away or sleep between them. The same for every shard, whoever runs it: an
//! engine thread (`threads.rs`) or, with one shard (`--engine-threads 1`, the default), the
//! loop thread between its looks at the sockets (`mod.rs`). They differ only in how they lock
//! the shard (an engine thread takes the siblings it wants first, `siblings.rs`), where a
//! pass's frames for other hosts go (the loop writes them to the links itself; an engine
//! thread hands them to the loop, `threads.rs`) and how they wait (the loop in `epoll`, an
//! engine thread parked).
//!
//! A pacer keeps its thread spinning while the shard has traffic and for [`SPIN_QUIET`] after,
//! the CPU given away each idle pass as its `Spin` allows; then it sets the shard's regions'
//! engine-sleeping words, looks once more, and says how long its thread may wait: until the
//! engine's next timer, at most [`MAX_SLEEP`] ([`GUEST_SLEEP`] while a VM guest, which cannot
//! ring a doorbell, is attached). A driver library that publishes a work request and then
//! reads that word is never missed (brief §9, lost wake-ups); the next pass clears it.

use crate::server::*;

use super::{Frames, Mem, Shard, SiblingShards};

/// How long a shard's thread keeps spinning after the shard's last work before it sleeps.
const SPIN_QUIET: Duration = Duration::from_millis(2);

/// The empty-pass policy of a shard's thread: while spinning, the CPU is given away after every empty
/// pass as long as that lets another thread run (an app on the same core), and at most every
/// 32nd while it does not (a core of its own), so that a doorbell is not left waiting for a
/// system call.
fn idle_spin() -> vrnic_shm::Spin {
    vrnic_shm::Spin::new(1, 32)
}

/// What a shard's thread does after a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum Wait {
    /// Pass again at once: there was work, or a sibling's lock is wanted.
    Now,
    /// Nothing to do: spin (the CPU given away when due, [`Pacer::settle`]).
    Spin,
    /// Quiet for [`SPIN_QUIET`]: the regions say the engine sleeps; wait for a wake-up at
    /// most this long.
    Sleep(Duration),
}

/// The state that paces a shard's passes: when the last did work and the spin's count of empty
/// passes (whether its regions say the engine sleeps is the shard's own `sleeping`).
pub(in crate::server) struct Pacer {
    last_work: Instant,
    spin: vrnic_shm::Spin,
}

impl Pacer {
    pub(in crate::server) fn new() -> Pacer {
        Pacer {
            last_work: Instant::now(),
            spin: idle_spin(),
        }
    }

    /// Work its thread did besides the passes (the loop's sockets and links): the shard does
    /// not go to sleep while its thread is busy.
    pub(in crate::server) fn worked(&mut self, at: Instant) {
        self.last_work = at;
    }

    /// One pass of `sh` at `now` (its frames for other hosts to `frames`, its requests for
    /// other shards through `sibs`), then what to do next: see [`Wait`]. `guests`: region-only
    /// contexts are attached to the shard's vRNICs.
    pub(in crate::server) fn pass(
        &mut self,
        now: Instant,
        sh: &mut Shard,
        frames: &mut dyn Frames,
        mut sibs: Option<&mut SiblingShards<'_>>,
        guests: bool,
    ) -> Wait {
        if sh.sleeping {
            sh.set_sleeping(false);
        }
        let mut worked = sh.engine_pass(now, frames, sibs.as_deref_mut());
        // Frames the pass made after its last turn (a timer's resend, an ACK due).
        if sh.engine.has_transmit() {
            worked |= frames.send(&mut sh.engine, &mut Mem::new(&sh.lanes));
        }
        let pending = |sh: &Shard, sibs: &Option<&mut SiblingShards<'_>>| {
            sh.engine.has_deferred() || sibs.as_ref().is_some_and(|s| s.any_busy())
        };
        if worked || pending(sh, &sibs) {
            self.last_work = now;
            return Wait::Now;
        }
        if now.duration_since(self.last_work) < SPIN_QUIET {
            return Wait::Spin;
        }
        // Sleep: announce it, then look once more before really waiting.
        sh.set_sleeping(true);
        let again = Instant::now();
        if sh.engine_pass(again, frames, sibs.as_deref_mut()) || pending(sh, &sibs) {
            self.last_work = again;
            return Wait::Now;
        }
        let cap = if guests { GUEST_SLEEP } else { MAX_SLEEP };
        Wait::Sleep(sh.engine.poll_timeout().map_or(cap, |t| {
            t.saturating_duration_since(Instant::now())
                .min(cap)
                .max(Duration::from_micros(1))
        }))
    }

    /// Between two passes that did not sleep: counts the pass that worked, or gives the CPU
    /// away after an empty one when due (`now`: when that pass began).
    pub(in crate::server) fn settle(&mut self, wait: Wait, now: Instant) {
        match wait {
            Wait::Now => self.spin.worked(),
            Wait::Spin => {
                self.spin
                    .idle_for(now.saturating_duration_since(self.last_work));
            }
            Wait::Sleep(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::NoFrames;
    use super::*;

    /// A moment past the quiet time after now.
    fn quiet() -> Instant {
        Instant::now() + SPIN_QUIET + Duration::from_millis(1)
    }

    /// A shard without work spins until [`SPIN_QUIET`] after its last work, then its regions
    /// say the engine sleeps and its thread may wait up to [`MAX_SLEEP`] (with no timer due),
    /// [`GUEST_SLEEP`] while a guest that cannot ring is attached; each pass first clears the
    /// word.
    #[test]
    fn an_idle_shard_spins_then_sleeps_at_most_as_long_as_its_guests_allow() {
        let mut sh = Shard::new(1);
        let mut p = Pacer::new();
        let w = p.pass(Instant::now(), &mut sh, &mut NoFrames, None, false);
        assert_eq!(w, Wait::Spin);
        assert!(!sh.sleeping, "asleep while spinning");
        let w = p.pass(quiet(), &mut sh, &mut NoFrames, None, false);
        assert_eq!(w, Wait::Sleep(MAX_SLEEP));
        assert!(sh.sleeping, "sleeping without saying so");
        let w = p.pass(quiet(), &mut sh, &mut NoFrames, None, true);
        assert!(
            matches!(w, Wait::Sleep(t) if t <= GUEST_SLEEP),
            "a guest attached: {w:?}"
        );
        assert!(sh.sleeping);
        // Work elsewhere (below), then a pass: the word is cleared and the thread spins.
        let at = quiet();
        p.worked(at);
        assert_eq!(p.pass(at, &mut sh, &mut NoFrames, None, false), Wait::Spin);
        assert!(!sh.sleeping, "the pass after a sleep left the word set");
    }

    /// Work its thread did besides the passes (the loop's sockets and links) keeps the shard
    /// from sleeping until [`SPIN_QUIET`] after it.
    #[test]
    fn work_besides_the_passes_keeps_the_shard_awake_for_the_quiet_time() {
        let mut sh = Shard::new(1);
        let mut p = Pacer::new();
        let at = quiet();
        p.worked(at);
        let soon = at + SPIN_QUIET / 2;
        assert_eq!(
            p.pass(soon, &mut sh, &mut NoFrames, None, false),
            Wait::Spin
        );
        assert!(!sh.sleeping);
        let late = at + SPIN_QUIET + Duration::from_millis(1);
        assert!(matches!(
            p.pass(late, &mut sh, &mut NoFrames, None, false),
            Wait::Sleep(_)
        ));
        assert!(sh.sleeping);
    }
}
