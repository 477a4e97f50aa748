//! The loop's side of the shards: which shard serves a vRNIC, the passes the loop runs itself
//! when there is one shard, and what the shards' passes produced for contexts (events,
//! wake-ups), handed on to them.

use super::*;

use super::datapath::{Frames, Mem, NoFrames};
use super::shard::Lane;
use super::shard::{host_shard, shard_host};
use super::threads::ShardFrames;
use vrnic_proto::HostId;

impl Server {
    /// The shard serving `vnic`.
    pub(super) fn cell_of(&self, vnic: VnicId) -> Option<Arc<ShardCell>> {
        let v = self.vnics.get(&vnic)?;
        self.shards.get(v.shard).cloned()
    }

    /// The one shard, which the loop runs itself (peer links exist only then).
    pub(super) fn shard0(&self) -> Arc<ShardCell> {
        self.shards[0].clone()
    }

    /// The shard for a new vRNIC: the one serving the fewest, ties taken in turn (so that
    /// vRNICs that come and go in pairs still reach every shard).
    pub(super) fn pick_shard(&self) -> usize {
        let n = self.shards.len();
        let mut load = vec![0usize; n];
        for v in self.vnics.values() {
            load[v.shard] += 1;
        }
        let first = self.next_vnic as usize % n;
        (0..n)
            .map(|k| (first + k) % n)
            .min_by_key(|&i| load[i])
            .unwrap_or(0)
    }

    /// Gives vRNIC `id` (with its region) to shard `shard`'s engine.
    pub(super) fn add_to_shard(
        &mut self,
        shard: usize,
        id: VnicId,
        region: &Arc<Region>,
        identity: (u16, [u8; 16]),
        group: GroupId,
    ) {
        let (lid, gid) = identity;
        for (k, cell) in self.shards.iter().enumerate() {
            let mut sh = cell.lock();
            if k == shard {
                sh.engine.add_vnic_in_group(id, lid, gid, group);
                sh.lanes.insert(id, Lane::new(region.clone()));
            } else {
                // The other shards reach it as a host of its own.
                sh.engine
                    .add_remote_vnic_in_group(shard_host(shard), lid, gid, group);
            }
        }
    }

    /// Takes vRNIC `id` out of its shard's engine.
    pub(super) fn remove_from_shard(&mut self, id: VnicId) {
        let Some(cell) = self.cell_of(id) else { return };
        let Some((lid, gid)) = self.vnics.get(&id).map(|v| (v.lid, v.gid)) else {
            return;
        };
        let mut sh = cell.lock();
        sh.engine.remove_vnic(Instant::now(), id);
        sh.lanes.remove(&id);
        let died = sh.engine.take_died_remote();
        drop(sh);
        self.tell_died(cell.index, died);
        for other in &self.shards {
            if other.index != cell.index {
                other.lock().engine.remove_remote_vnic(lid, gid);
            }
        }
        self.drain_outbox(&cell);
    }

    /// Tells the shards whose QPs were connected to QPs of shard `from` that died with their
    /// context, so that those fail at once, as a local peer's do. A QP of another host finds
    /// out by its retry timer, as over a fabric.
    pub(super) fn tell_died(&self, from: usize, died: Vec<(HostId, u32)>) {
        for (host, qpn) in died {
            let Some(cell) = host_shard(host).and_then(|k| self.shards.get(k)) else {
                continue;
            };
            cell.lock().engine.peer_died(shard_host(from), qpn);
            cell.wake();
        }
    }

    /// One engine pass run by the loop itself (one shard), frames to the peer links, then what
    /// it produced handed on to contexts. Returns whether anything happened.
    pub(super) fn engine_pass(&mut self, now: Instant) -> bool {
        let cell = self.shard0();
        let mut sh = cell.lock();
        let worked = match &mut self.peers {
            Some(p) => sh.engine_pass(now, &mut p.frames(now)),
            None => sh.engine_pass(now, &mut NoFrames),
        };
        drop(sh);
        self.drain_outbox(&cell);
        worked
    }

    /// A pass of `cell`'s shard now, run by the loop thread for a control call whose reply
    /// must find its effects published (a QP destroyed or reset: its completions in its CQs).
    pub(super) fn pass_now(&mut self, cell: &Arc<ShardCell>, now: Instant) {
        let Some(t) = &self.threads else {
            self.engine_pass(now);
            return;
        };
        {
            let mut guard = cell.lock();
            let sh = &mut *guard;
            let mut frames = ShardFrames::of(cell, t, &self.shards);
            sh.engine_pass(now, &mut frames);
            if sh.engine.has_transmit() {
                frames.send(&mut sh.engine, &mut Mem::new(&sh.lanes));
            }
        }
        self.drain_outbox(cell);
    }

    /// Whether an engine refused routes across groups since the refusals were last logged.
    pub(super) fn shards_refused(&self) -> bool {
        self.shards
            .iter()
            .any(|cell| cell.lock().engine.has_refusals())
    }

    /// Sets or clears the engine-sleeping word of the one shard's regions.
    pub(super) fn set_sleeping(&mut self, on: bool) {
        self.shard0().lock().set_sleeping(on);
    }

    /// Hands on what every shard's passes produced (an engine thread told the loop).
    pub(super) fn drain_outboxes(&mut self) {
        for i in 0..self.shards.len() {
            let cell = self.shards[i].clone();
            self.drain_outbox(&cell);
        }
    }

    /// Hands on what `cell`'s passes produced: events onto contexts' event rings, wake-ups.
    pub(super) fn drain_outbox(&mut self, cell: &ShardCell) {
        let mut sh = cell.lock();
        if sh.out.is_empty() {
            return;
        }
        let out = std::mem::take(&mut sh.out);
        drop(sh);
        for &(ctx, kind, handle) in &out.events {
            self.push_event(ctx, kind, handle);
        }
        for &ctx in &out.wakes {
            self.notify_ctx(ctx);
        }
        self.flush_wakes();
        // The buffers go back for the next passes (no allocation per pass).
        let mut sh = cell.lock();
        if sh.out.is_empty() && !sh.out.told {
            let mut out = out;
            out.events.clear();
            out.wakes.clear();
            out.told = false;
            sh.out = out;
        }
    }
}
