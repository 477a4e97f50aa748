//! A shard of the data path: one engine with the vRNICs it serves, the data-path slots of their
//! queues (rings, fetched and retired indices, doorbells), and what its passes produced for the
//! contexts (events, wake-ups) until the loop hands them on.
//!
//! A shard lives in a [`ShardCell`]: behind a mutex that whoever runs its passes holds for a
//! whole pass (one uncontended acquisition per pass of up to
//! [`PASS_WRS`](vrnic_proto::PASS_WRS) work requests, never one per work request), and that the
//! loop thread takes only to serve a control call on one of the shard's vRNICs. A control call
//! announces itself first ([`ShardCell::lock`]), and an engine thread lets it in before its
//! next pass ([`ShardCell::lock_for_pass`]), so a busy shard delays a control call by one pass
//! at most. With one shard (`--engine-threads 1`, the default) the loop thread runs the
//! passes itself and the lock is never contended; with more, each shard has an engine thread
//! of its own (`../threads.rs`).
//!
//! The files beside this one: `pass.rs` (the engine pass: work requests from the rings into
//! the engine, turns, looks between them), `publish.rs` (retired indices and completions back
//! into the rings), `mem.rs` (region memory as the engine sees it), `pacer.rs` (pass again,
//! spin or sleep: the same whoever runs the passes), `siblings.rs` (the other shards as an
//! engine thread's pass reaches them).
//!
//! The concurrency contract, in one table (each rule is what makes the row below it sound):
//!
//! | what | who touches it | holding |
//! |---|---|---|
//! | a shard's engine, lanes, slots, outbox | its pass; a control call; another shard's pass executing a request for one of its QPs (`siblings.rs`) | that shard's mutex |
//! | a vRNIC's region mapping (the daemon's addresses into it) | anyone reading or writing its pages | the mutex of the shard serving the vRNIC (each slice's with `--spread-qps`) |
//! | growing a region's mapping (`pages.rs` `cover`, which may move it) | the loop, for a control call | the mutex of every shard serving the vRNIC, so no one holds an address into it: `cover` takes a [`Grow`], which only a [`Slices`] of that vRNIC gives |
//! | several shards' mutexes at once | a control call ([`Slices::lock`]); a pass reaching its siblings | taken in shard index order (a vRNIC's slices too, though named home first), or *tried* (a pass's sibling: never waited for while it holds another, `siblings.rs`) |
//! | the rings' producer/consumer words, doorbells, the engine-sleeping word | the apps and the passes | atomics with their fences (`vrnic-shm`) |
//! | the outbox's hand-off to contexts | the loop (`engines.rs` `drain_outbox`) | the shard's mutex for the take; contexts are the loop's alone |

mod mem;
mod pacer;
mod pass;
mod publish;
mod siblings;

pub(super) use mem::Mem;
pub(super) use pacer::{Pacer, Wait};
pub(super) use pass::{Frames, NoFrames, RING_BATCH};
pub(super) use siblings::SiblingShards;

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use vrnic_proto::{CqId, CtxId, Engine, HostId, QpId, SrqId, VnicId};
use vrnic_shm::{Region, Ring};

/// What a doorbell index names.
#[derive(Debug, Clone, Copy)]
pub(super) enum Bell {
    /// Reserved for a queue being created.
    Pending,
    Qp(QpId),
    Srq(SrqId),
    /// A QP of this vRNIC served by shard `k` (a vRNIC with slices): its bell is handed on.
    Elsewhere(usize),
}

/// Doorbell indices handed on to a slice of a vRNIC by the vRNIC's home shard, which alone
/// takes the region's doorbell bits (they are taken by swaps, so one taker): a bit per index
/// and a flag saying that some are set. Written by the home's engine thread, taken by the
/// slice's; lock-free.
pub(super) struct BellInbox {
    any: AtomicBool,
    words: Box<[AtomicU64]>,
}

impl BellInbox {
    pub(super) fn new() -> Arc<BellInbox> {
        let n = (vrnic_shm::bell::BELLS as usize).div_ceil(64);
        Arc::new(BellInbox {
            any: AtomicBool::new(false),
            words: (0..n).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    /// Hands doorbell `i` on (the slice's thread is then woken by the caller).
    pub(super) fn put(&self, i: u32) {
        if let Some(w) = self.words.get(i as usize / 64) {
            w.fetch_or(1 << (i % 64), Ordering::SeqCst);
            self.any.store(true, Ordering::SeqCst);
        }
    }

    /// Takes every index handed on, calling `f` with each.
    pub(super) fn drain(&self, mut f: impl FnMut(u32)) {
        if !self.any.load(Ordering::Relaxed) || !self.any.swap(false, Ordering::SeqCst) {
            return;
        }
        for (k, w) in self.words.iter().enumerate() {
            if w.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = w.swap(0, Ordering::SeqCst);
            while bits != 0 {
                f(k as u32 * 64 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
    }
}

/// A slice of a vRNIC in another shard, as its home lane knows it.
pub(super) struct Slice {
    pub(super) shard: usize,
    pub(super) inbox: Arc<BellInbox>,
    pub(super) cell: Weak<ShardCell>,
}

/// A vRNIC as its shard sees it: its region, and what its doorbell indices name.
pub(super) struct Lane {
    /// Shared with frames queued on peer links that send straight from it.
    pub(super) region: Arc<Region>,
    /// Doorbell index -> the queue it names (`None`: free).
    pub(super) bells: Vec<Option<Bell>>,
    /// Free doorbell indices below `bells.len()` (the home lane gives them out).
    pub(super) free_bells: Vec<u32>,
    /// The home lane of a vRNIC whose QPs spread over shards (`vrnic serve --spread-qps`):
    /// its slices in the other shards, to hand their doorbells on.
    pub(super) slices: Vec<Slice>,
    /// A slice (not the home lane): its doorbells come handed on here; it never takes the
    /// region's bits, nor sets its engine-sleeping word.
    pub(super) inbox: Option<Arc<BellInbox>>,
    /// Bytes the engine copied into the region (or read out of it, into a frame): one count
    /// per copy, so a byte that moves twice counts twice (`vrnic stats`: `copied`). A plain
    /// cell: only the holder of the shard's lock touches it.
    copied: Cell<u64>,
}

impl Lane {
    pub(super) fn new(region: Arc<Region>) -> Lane {
        Lane {
            region,
            bells: Vec::new(),
            free_bells: Vec::new(),
            slices: Vec::new(),
            inbox: None,
            copied: Cell::new(0),
        }
    }

    /// Counts a copy of `len` bytes into (or out of) the region.
    pub(super) fn count_copy(&self, len: usize) {
        self.copied.set(self.copied.get().wrapping_add(len as u64));
    }

    /// Bytes copied so far (see [`Lane::copied`]).
    pub(super) fn copied(&self) -> u64 {
        self.copied.get()
    }

    /// A slice's lane: see [`Lane::inbox`].
    pub(super) fn slice(region: Arc<Region>, inbox: Arc<BellInbox>) -> Lane {
        Lane {
            inbox: Some(inbox),
            ..Lane::new(region)
        }
    }

    /// Names the queue behind doorbell `i` in a slice (the home lane gave `i` out).
    pub(super) fn put_bell(&mut self, i: u32, b: Bell) {
        let i = i as usize;
        if i >= self.bells.len() {
            self.bells.resize(i + 1, None);
        }
        self.bells[i] = Some(b);
    }

    /// Forgets doorbell `i` in a slice (the home lane frees it).
    pub(super) fn clear_bell(&mut self, i: u32) {
        if let Some(slot) = self.bells.get_mut(i as usize) {
            *slot = None;
        }
    }

    /// Reserves a doorbell index (named by [`Lane::set_bell`] once the queue exists).
    pub(super) fn alloc_bell(&mut self) -> Option<u32> {
        if let Some(i) = self.free_bells.pop() {
            self.set_bell(i, Bell::Pending);
            return Some(i);
        }
        let i = u32::try_from(self.bells.len()).ok()?;
        if i >= vrnic_shm::bell::BELLS {
            return None;
        }
        self.bells.push(Some(Bell::Pending));
        Some(i)
    }

    /// Names the queue behind doorbell `i`.
    pub(super) fn set_bell(&mut self, i: u32, b: Bell) {
        if let Some(slot) = self.bells.get_mut(i as usize) {
            *slot = Some(b);
        }
    }

    /// Frees doorbell `i` (a bit the tenant still rings for it names nothing).
    pub(super) fn free_bell(&mut self, i: u32) {
        if let Some(slot) = self.bells.get_mut(i as usize)
            && slot.take().is_some()
        {
            self.free_bells.push(i);
        }
    }
}

/// A CQ's slot as the shards that complete into it hold it: its own (a vRNIC in one shard: no
/// lock), or shared by the slices of a vRNIC whose QPs spread, under a mutex taken once per
/// completion (the driver's ring stays single-consumer).
pub(super) enum CqCell {
    Own(CqSlot),
    Shared(Arc<Mutex<CqSlot>>),
}

impl CqCell {
    /// Runs `f` on the slot (under its mutex when shared).
    pub(super) fn with<R>(&mut self, f: impl FnOnce(&mut CqSlot) -> R) -> R {
        match self {
            CqCell::Own(s) => f(s),
            CqCell::Shared(m) => {
                f(&mut m.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
            }
        }
    }
}

pub(super) struct CqSlot {
    pub(super) vnic: VnicId,
    pub(super) ctx: CtxId,
    pub(super) ring: Ring,
    pub(super) prod: u32,
    /// The driver's consumer index as last read from the region: read again only when the
    /// ring looks full by it, so a completion does not take the cache line the driver
    /// writes on every poll. Never ahead of the driver's (it only ever came from there).
    pub(super) cons_seen: u32,
    pub(super) broken: bool,
}

pub(super) struct QpSlot {
    pub(super) vnic: VnicId,
    /// Its doorbell index in the vRNIC's region.
    pub(super) bell: u32,
    pub(super) sq: Ring,
    pub(super) rq: Ring,
    pub(super) sq_fetched: u32,
    pub(super) rq_fetched: u32,
    pub(super) sq_cons: u32,
    pub(super) rq_cons: u32,
    pub(super) broken: bool,
    /// In the engine pass's carry list.
    pub(super) carried: bool,
    /// In the engine's watch list (its rings' `POLLED` words set: no doorbells), since it
    /// last had new work at this time.
    pub(super) watched: Option<Instant>,
}

impl QpSlot {
    pub(super) fn new(vnic: VnicId, bell: u32, sq: Ring, rq: Ring) -> QpSlot {
        QpSlot {
            vnic,
            bell,
            sq,
            rq,
            sq_fetched: 0,
            rq_fetched: 0,
            sq_cons: 0,
            rq_cons: 0,
            broken: false,
            carried: false,
            watched: None,
        }
    }
}

pub(super) struct SrqSlot {
    pub(super) vnic: VnicId,
    pub(super) bell: u32,
    pub(super) ring: Ring,
    pub(super) fetched: u32,
    pub(super) cons: u32,
    pub(super) broken: bool,
    pub(super) carried: bool,
}

/// What a shard's passes produced for contexts, which the loop thread (owner of the contexts'
/// event rings and sockets) hands on.
#[derive(Default)]
pub(super) struct Outbox {
    /// Async events: context, kind, object handle.
    pub(super) events: Vec<(CtxId, u32, u32)>,
    /// Contexts to wake (a CQ they armed has a completion).
    pub(super) wakes: Vec<CtxId>,
    /// Routes the engine refused across groups (the first few of them) and how many in all:
    /// the loop logs them with names it alone knows, without locking the shard to ask.
    pub(super) refused: Vec<vrnic_proto::Refusal>,
    pub(super) refused_n: u64,
    /// The loop was told that there is something here (an engine thread tells it once).
    pub(super) told: bool,
}

impl Outbox {
    pub(super) fn is_empty(&self) -> bool {
        self.events.is_empty() && self.wakes.is_empty() && self.refused_n == 0
    }
}

/// One shard's state: see the module docs.
pub(super) struct Shard {
    pub(super) engine: Engine,
    /// Its vRNICs.
    pub(super) lanes: FxHashMap<VnicId, Lane>,
    /// The data path's slots of the engine's queues, looked up for every batch of work
    /// requests and completions: Fx-hashed, as the engine's own maps, since their keys are ids
    /// the engine assigns (no tenant chooses them to collide).
    pub(super) cqs: FxHashMap<CqId, CqCell>,
    pub(super) qps: FxHashMap<QpId, QpSlot>,
    pub(super) srqs: FxHashMap<SrqId, SrqSlot>,
    /// Queues to look at in the next engine pass: their doorbells rang, or they had more
    /// work than one pass takes (reused buffers: no allocation per pass).
    pub(super) dirty: Vec<Bell>,
    pub(super) carry: Vec<Bell>,
    /// QPs whose rings the engine looks at every pass without a doorbell (recently busy
    /// ones; at most [`pass::WATCH_MAX`]).
    pub(super) watched: Vec<QpId>,
    /// The light tenants' home lanes and watched QPs ([`vrnic_proto::Engine::is_light`]),
    /// listed at the start of a pass: what the engine has looked at between the steps of
    /// others' turns ([`pass::Peek`]).
    pub(super) light_lanes: Vec<VnicId>,
    pub(super) light_qps: Vec<QpId>,
    /// Its regions' engine-sleeping words are set.
    pub(super) sleeping: bool,
    pub(super) out: Outbox,
    /// Work requests its passes executed (its own QPs', each to its end, wherever the
    /// responder is): the activity new vRNICs are placed by (`engines.rs`).
    pub(super) wrs: u64,
    /// What the last timed look at the rings cost, and the passes with turns since it was
    /// timed (`pass.rs`: looks are timed every [`pass::LOOK_RETIME`] such
    /// passes, not on each: a clock read is a good part of a short pass).
    pub(super) look_cost: Duration,
    pub(super) look_age: u32,
}

impl Shard {
    pub(super) fn new(seed: u64) -> Shard {
        Shard {
            engine: Engine::new(seed),
            lanes: FxHashMap::default(),
            cqs: FxHashMap::default(),
            qps: FxHashMap::default(),
            srqs: FxHashMap::default(),
            dirty: Vec::new(),
            carry: Vec::new(),
            watched: Vec::new(),
            light_lanes: Vec::new(),
            light_qps: Vec::new(),
            sleeping: false,
            out: Outbox::default(),
            wrs: 0,
            look_cost: Duration::ZERO,
            look_age: 0,
        }
    }

    /// The lane of `vnic`.
    pub(super) fn lane(&mut self, vnic: VnicId) -> Option<&mut Lane> {
        self.lanes.get_mut(&vnic)
    }
}

/// A shard and what its engine thread and the loop thread share about it.
pub(super) struct ShardCell {
    state: Mutex<Shard>,
    /// Control calls (and other engine threads, in their ordered phase) waiting for the lock:
    /// the engine thread lets them in before its next pass.
    want: AtomicU32,
    /// Its engine thread waits for the lock: other threads' passes do not try to take it
    /// meanwhile (`siblings.rs`), so they cannot starve it.
    owner_waiting: AtomicBool,
    /// The engine thread, once started (none: the loop thread runs the passes).
    pub(super) thread: OnceLock<Thread>,
    /// Tells the engine thread to return.
    pub(super) stop: AtomicBool,
    /// Region-only contexts (VM guests) on its vRNICs: they cannot ring a doorbell, so the
    /// engine thread never sleeps long while there are any.
    pub(super) guests: AtomicU32,
    /// Its index: its vRNICs are on host [`shard_host`]`(index)` for the other shards'
    /// engines, and its QP numbers are `index` modulo the number of shards.
    pub(super) index: usize,
}

/// The shards serving one vRNIC (its home and, with `--spread-qps`, its other slices, named
/// home first as `Server::slices_of` gives them), every one locked by the loop for a control
/// call, in shard index order whatever the order they are named in: an engine thread starting
/// a pass takes the siblings it wants in index order while it holds its own shard, so a loop
/// that held a higher shard while it waited for a lower one could wait for a thread that waits
/// for it. While one is held no engine thread is in a pass over the vRNIC's region, so nothing
/// holds an address into it and its mapping may move: growing the mapping takes the [`Grow`]
/// it gives ([`crate::sys::grow_region`]). It derefs to the guards, in the order named.
pub(super) struct Slices<'a> {
    vnic: VnicId,
    guards: Vec<MutexGuard<'a, Shard>>,
}

impl<'a> Slices<'a> {
    /// Locks `cells`, the shards serving `vnic`, in index order.
    pub(super) fn lock(vnic: VnicId, cells: &'a [Arc<ShardCell>]) -> Slices<'a> {
        let mut order: Vec<usize> = (0..cells.len()).collect();
        order.sort_by_key(|&i| cells[i].index);
        let mut taken: Vec<Option<MutexGuard<'a, Shard>>> = cells.iter().map(|_| None).collect();
        for i in order {
            taken[i] = Some(cells[i].lock());
        }
        Slices {
            vnic,
            guards: taken.into_iter().flatten().collect(),
        }
    }

    /// Leave to grow the vRNIC's region mapping, for as long as this is borrowed.
    pub(super) fn grow(&self) -> Grow<'_> {
        Grow {
            vnic: self.vnic,
            held: std::marker::PhantomData,
        }
    }

    /// [`Slices::grow`] beside the guards themselves (a slot inside a shard changed while the
    /// region grows).
    pub(super) fn split(&mut self) -> (Grow<'_>, &mut [MutexGuard<'a, Shard>]) {
        let grow = Grow {
            vnic: self.vnic,
            held: std::marker::PhantomData,
        };
        (grow, &mut self.guards)
    }
}

/// Leave to grow vRNIC `vnic`'s region mapping (it may move): made only by a [`Slices`] of
/// that vRNIC and living no longer than its borrow, so the shards serving it are held.
#[derive(Clone, Copy)]
pub(crate) struct Grow<'b> {
    vnic: VnicId,
    held: std::marker::PhantomData<&'b ()>,
}

impl Grow<'_> {
    /// The vRNIC whose shards are held.
    pub(crate) fn vnic(self) -> VnicId {
        self.vnic
    }
}

impl<'a> std::ops::Deref for Slices<'a> {
    type Target = [MutexGuard<'a, Shard>];
    fn deref(&self) -> &Self::Target {
        &self.guards
    }
}

impl std::ops::DerefMut for Slices<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.guards
    }
}

/// Where the shards' host ids begin: far above any peer host's index, so that an engine tells
/// a segment for another shard from one for another host.
const SHARD_HOSTS: u32 = 0x8000_0000;

/// The host id the engines know shard `index` by.
pub(super) fn shard_host(index: usize) -> HostId {
    HostId(SHARD_HOSTS + index as u32)
}

/// The shard a host id names, if it names one.
pub(super) fn host_shard(host: HostId) -> Option<usize> {
    host.0.checked_sub(SHARD_HOSTS).map(|i| i as usize)
}

/// The shard serving the QP numbered `qpn`, of `shards` shards (see [`ShardCell::new`]).
pub(super) fn qpn_shard(qpn: u32, shards: usize) -> usize {
    qpn as usize % shards.max(1)
}

impl ShardCell {
    /// Shard `index` of `shards`: its engine gives out the QP numbers (and object ids) that are
    /// `index` modulo `shards`, so a segment's destination QP number names its shard
    /// ([`qpn_shard`]). With `spread` (`--spread-qps`), its engine routes a destination by
    /// its QP number's class (a vRNIC's QPs are in several shards).
    pub(super) fn new(index: usize, shards: usize, seed: u64, spread: bool) -> Arc<ShardCell> {
        let mut shard = Shard::new(seed);
        shard
            .engine
            .set_qpn_space(index as u32, shards.max(1) as u32);
        if spread || shards > 1 {
            shard.engine.set_siblings(shard_host(0));
        }
        Arc::new(ShardCell {
            state: Mutex::new(shard),
            want: AtomicU32::new(0),
            owner_waiting: AtomicBool::new(false),
            thread: OnceLock::new(),
            stop: AtomicBool::new(false),
            guests: AtomicU32::new(0),
            index,
        })
    }

    /// The shard, for a control call: announced first, so that a busy engine thread lets it in
    /// at its next pass boundary. (A panic while it was held leaves state that every check
    /// still guards: the lock is taken anyway.)
    pub(super) fn lock(&self) -> MutexGuard<'_, Shard> {
        self.want.fetch_add(1, Ordering::SeqCst);
        let g = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.want.fetch_sub(1, Ordering::SeqCst);
        g
    }

    /// The shard, for a pass the loop thread runs itself (one shard, no engine thread): with
    /// no engine thread there is nobody to let in first, so the waiting count that
    /// [`ShardCell::lock`] keeps is left alone (two atomic operations on every idle pass).
    pub(super) fn lock_for_loop_pass(&self) -> MutexGuard<'_, Shard> {
        debug_assert!(
            self.thread.get().is_none(),
            "an engine thread runs this shard"
        );
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The shard, for the engine thread's next pass: after any control call waiting.
    pub(super) fn lock_for_pass(&self) -> MutexGuard<'_, Shard> {
        while self.want.load(Ordering::SeqCst) != 0 {
            std::thread::yield_now();
        }
        self.owner_waiting.store(true, Ordering::SeqCst);
        let g = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        self.owner_waiting.store(false, Ordering::Relaxed);
        g
    }

    /// The shard, for another engine thread's pass that executes a request on it, if it can
    /// be had now: not while it is held, nor while a control call or its own engine thread
    /// waits for it (they go first).
    pub(super) fn try_lock_for_sibling(&self) -> Option<MutexGuard<'_, Shard>> {
        if self.want.load(Ordering::SeqCst) != 0 || self.owner_waiting.load(Ordering::SeqCst) {
            return None;
        }
        match self.state.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Wakes its engine thread if it sleeps (nothing if the loop runs its passes).
    pub(super) fn wake(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The loop takes a vRNIC's shards in index order, not in the order they are named (home
    /// first): while another thread holds shard 0, a control call on a vRNIC whose home is
    /// shard 2 waits for shard 0 holding nothing, so shard 2 stays free for an engine thread
    /// that holds shard 0 and wants it.
    #[test]
    fn a_vrnics_shards_are_locked_in_index_order_whatever_their_order() {
        let cells: Vec<Arc<ShardCell>> = (0..3).map(|i| ShardCell::new(i, 3, 1, true)).collect();
        // Each shard marked with its index, to tell the guards apart.
        for (i, c) in cells.iter().enumerate() {
            c.lock().wrs = i as u64;
        }
        let named = vec![cells[2].clone(), cells[0].clone(), cells[1].clone()];
        let zero = cells[0].lock();
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let held = Slices::lock(VnicId(7), &named);
            let order: Vec<u64> = held.iter().map(|g| g.wrs).collect();
            tx.send((held.grow().vnic(), held.len(), order)).unwrap();
        });
        // The other thread is blocked on shard 0 (or not started): shard 2 is not held.
        std::thread::sleep(Duration::from_millis(50));
        assert!(rx.try_recv().is_err(), "locked while shard 0 was held");
        assert!(
            cells[2].try_lock_for_sibling().is_some(),
            "shard 2 was taken before shard 0"
        );
        drop(zero);
        t.join().unwrap();
        let (vnic, n, order) = rx.recv().unwrap();
        assert_eq!((vnic, n), (VnicId(7), 3));
        assert_eq!(order, vec![2, 0, 1], "the guards in the order named");
    }
}
