//! The other shards as an engine thread's pass reaches them (`--engine-threads N`, N > 1).
//!
//! A work request whose destination QP is on another shard is executed by the thread that
//! took it, to the end: its engine calls the sibling's engine (`vrnic_proto::Siblings`), which
//! checks and places the request as for a QP of its own, one copy per byte straight between
//! the two regions (both mapped in this process). For that the pass holds the sibling's lock,
//! taken the first time it needs it and kept to the end of the pass (one acquisition per pass
//! and sibling, not per work request). After each turn the pass publishes what the siblings'
//! engines produced (completions into their CQ rings, retired indices, events for the loop)
//! and wakes a sibling's thread that now has work of its own.
//!
//! Deadlock-free by order: during a pass a sibling's lock is only *tried*, never waited for;
//! a sibling found busy (its own pass, a control call, another thread) is remembered, the work
//! request waits (`Engine::has_deferred`), and the next pass first takes, in shard index order
//! and holding nothing, the locks of the siblings it wanted, then its own. A sibling whose own
//! thread or a control call waits for its lock is treated as busy, so a thread that keeps
//! finding work for a sibling cannot starve that sibling's own thread.

use crate::server::*;

use std::sync::MutexGuard;

use super::{Lane, Mem, Shard, host_shard};
use vrnic_proto::HostId;

/// The sibling shards the passes of shard `me` hold, one pass at a time, and those they found
/// busy. Kept by its engine thread for its life (no allocation per pass).
pub(in crate::server) struct SiblingShards<'c> {
    cells: &'c [Arc<ShardCell>],
    me: usize,
    held: Vec<Option<MutexGuard<'c, Shard>>>,
    /// Held and touched since the last [`SiblingShards::publish`].
    touched: Vec<bool>,
    /// Found busy in this pass: locked first at the next.
    busy: Vec<bool>,
    /// Found busy in the last pass.
    want: Vec<bool>,
    now: Instant,
    waker: &'c mio::Waker,
}

impl<'c> SiblingShards<'c> {
    pub(in crate::server) fn new(
        cells: &'c [Arc<ShardCell>],
        me: usize,
        waker: &'c mio::Waker,
    ) -> Self {
        let n = cells.len();
        SiblingShards {
            cells,
            me,
            held: (0..n).map(|_| None).collect(),
            touched: vec![false; n],
            busy: vec![false; n],
            want: vec![false; n],
            now: Instant::now(),
            waker,
        }
    }

    /// Starts a pass at `now`: locks, in index order, the siblings the last pass found busy
    /// and shard `me` itself (after any control call waiting for it); returns its guard.
    pub(in crate::server) fn lock(&mut self, now: Instant) -> MutexGuard<'c, Shard> {
        self.now = now;
        let cells = self.cells;
        let mut own = None;
        for (k, cell) in cells.iter().enumerate() {
            if k == self.me {
                own = Some(cell.lock_for_pass());
            } else if std::mem::take(&mut self.want[k]) {
                self.held[k] = Some(cell.lock());
            }
        }
        own.unwrap_or_else(|| cells[self.me].lock_for_pass())
    }

    /// Ends a pass: lets every sibling go; those found busy are wanted at the next.
    pub(in crate::server) fn release(&mut self) {
        for k in 0..self.held.len() {
            self.held[k] = None;
            self.touched[k] = false;
            self.want[k] = std::mem::take(&mut self.busy[k]);
        }
    }

    /// Whether some sibling was found busy.
    pub(in crate::server) fn any_busy(&self) -> bool {
        self.busy.iter().any(|&b| b)
    }

    /// The sibling `k`, held from now to the end of the pass; `None` if it is busy.
    fn get(&mut self, k: usize) -> Option<&mut Shard> {
        if k == self.me || k >= self.cells.len() {
            return None;
        }
        if self.held[k].is_none() {
            match self.cells[k].try_lock_for_sibling() {
                Some(g) => self.held[k] = Some(g),
                None => {
                    self.busy[k] = true;
                    return None;
                }
            }
        }
        self.touched[k] = true;
        self.held[k].as_deref_mut()
    }

    /// After a turn: each sibling touched publishes what its engine produced, the loop is told
    /// of events and wake-ups for contexts, and a sibling's thread with work of its own now
    /// (receives its app posted, taken on its behalf, may carry sends too) is woken. Returns
    /// whether anything was published.
    pub(in crate::server) fn publish(&mut self) -> bool {
        let mut work = false;
        for k in 0..self.held.len() {
            if !std::mem::take(&mut self.touched[k]) {
                continue;
            }
            let Some(sh) = self.held[k].as_deref_mut() else {
                continue;
            };
            work |= sh.publish();
            if !sh.out.is_empty() && !sh.out.told {
                sh.out.told = true;
                let _ = self.waker.wake();
            }
            if sh.engine.has_turns() {
                self.cells[k].wake();
            }
        }
        work
    }

    /// What the engine of this pass reaches its siblings through, for one turn: the siblings,
    /// and this shard's regions (`lanes`), which requests executed on a sibling read from and
    /// its answers write into.
    pub(in crate::server) fn reach<'s>(
        &'s mut self,
        lanes: &'s FxHashMap<VnicId, Lane>,
    ) -> Reach<'s, 'c> {
        Reach { sibs: self, lanes }
    }
}

/// See [`SiblingShards::reach`].
pub(in crate::server) struct Reach<'s, 'c> {
    sibs: &'s mut SiblingShards<'c>,
    lanes: &'s FxHashMap<VnicId, Lane>,
}

impl vrnic_proto::Siblings for Reach<'_, '_> {
    fn with<R>(
        &mut self,
        host: HostId,
        recv_for: Option<u32>,
        f: impl FnOnce(&mut Engine, &mut dyn Memory) -> R,
    ) -> Option<R> {
        let now = self.sibs.now;
        let sh = host_shard(host).and_then(|k| self.sibs.get(k))?;
        if let Some(qpn) = recv_for {
            sh.fetch_receives(now, qpn);
        }
        let Shard { engine, lanes, .. } = sh;
        Some(f(engine, &mut Mem::pair(self.lanes, lanes)))
    }
}
