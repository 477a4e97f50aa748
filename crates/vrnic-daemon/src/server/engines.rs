//! The loop's side of the shards: which shard serves a vRNIC (or, with `--spread-qps`, which
//! serve its slices, and which one a QP), the passes the loop runs itself (the one shard's,
//! when it drives it; a shard's for a control call), and what the shards' passes produced for
//! contexts (events, wake-ups), handed on to them.
//!
//! With `--spread-qps` every vRNIC has a *slice* in every shard: the same vRNIC (LID, GID,
//! group) in each shard's engine, its lane on the same region. Its home shard (picked as
//! without spreading) makes its PDs, MRs, CQs and address handles, which are then made in the
//! other slices with the same ids and keys ([`Engine::mirrored`]; ids are of the maker's class,
//! so they are free everywhere); its plain QPs go to the slice with the fewest, and QPs with an
//! SRQ, XRC QPs, SRQs and XRC domains stay home. A QP's id and number are of its shard's
//! class, so both name its shard. QPs of two slices reach each other as QPs of two shards do
//! (a request executed inside the other shard's engine, `shard/siblings.rs`; engines route by the
//! destination QP number's class, [`Engine::set_siblings`]). A CQ's slot is shared by the slices under a mutex. The home
//! lane alone takes the region's doorbell bits and hands a slice's on to it
//! ([`super::shard::BellInbox`]). Its memory windows are one table that every slice shares
//! ([`vrnic_proto::Windows`]): they are allocated and deallocated by the home, bound and
//! invalidated by a work request on any slice's QP, and used by a request to any.

use super::*;

use super::shard::{BellInbox, Lane, Slice};
use super::shard::{Frames, Mem, NoFrames, Wait};
use super::shard::{host_shard, qpn_shard, shard_host};
use super::threads::ShardFrames;
use vrnic_proto::HostId;

/// How often the shards' activity is looked at, and the window it is counted over.
pub(super) const ACTIVITY_WINDOW: Duration = Duration::from_millis(200);
/// Work requests in a window below which a shard counts as idle (about 5,000 a second):
/// placement by activity weighs floods, not a trickle of control traffic.
const ACTIVE_WRS: u64 = 1024;

/// The shards' recent activity, for placing new vRNICs ([`Server::pick_shard`]).
#[derive(Debug)]
pub(super) struct Activity {
    /// Each shard's work-request count at the last look, and its growth over the window
    /// before it.
    mark: Vec<u64>,
    recent: Vec<u64>,
    at: Instant,
}

impl Default for Activity {
    fn default() -> Self {
        Activity {
            mark: Vec::new(),
            recent: Vec::new(),
            at: Instant::now(),
        }
    }
}

impl Server {
    /// The shard serving `vnic`.
    pub(super) fn cell_of(&self, vnic: VnicId) -> Option<Arc<ShardCell>> {
        let v = self.vnics.get(&vnic)?;
        self.shards.get(v.shard).cloned()
    }

    /// The shard whose engine serves the QP numbered `qpn` (its number's class, whatever the
    /// vRNIC: a number that names no QP there is that engine's to refuse).
    pub(super) fn cell_of_qpn(&self, qpn: u32) -> Arc<ShardCell> {
        self.shards[qpn_shard(qpn, self.shards.len())].clone()
    }

    /// The shard for a new vRNIC: the one whose passes executed the fewest work requests
    /// in the last [`ACTIVITY_WINDOW`] (counted in units of [`ACTIVE_WRS`], so that a
    /// trickle of work does not count), then the one serving the fewest, ties taken in turn
    /// (so that vRNICs that come and go in pairs still reach every shard). A new busy pair
    /// so goes to threads that have room, not beside a flood on the thread with fewest
    /// vRNICs.
    pub(super) fn pick_shard(&self) -> usize {
        let n = self.shards.len();
        let mut load = vec![0usize; n];
        for v in self.vnics.values() {
            load[v.shard] += 1;
        }
        // A look older than two windows (the loop slept: no traffic woke it) says nothing.
        let fresh = self.activity.at.elapsed() < 2 * ACTIVITY_WINDOW;
        let busy = |i: usize| match self.activity.recent.get(i) {
            Some(w) if fresh => w / ACTIVE_WRS,
            _ => 0,
        };
        let first = self.next_vnic as usize % n;
        (0..n)
            .map(|k| (first + k) % n)
            .min_by_key(|&i| (busy(i), load[i]))
            .unwrap_or(0)
    }

    /// Every [`ACTIVITY_WINDOW`], with engine threads: the work requests each shard's passes
    /// executed since the last look.
    pub(super) fn sample_activity(&mut self, now: Instant) {
        if self.shards.len() < 2 || now.duration_since(self.activity.at) < ACTIVITY_WINDOW {
            return;
        }
        self.activity.at = now;
        let a = &mut self.activity;
        a.mark.resize(self.shards.len(), 0);
        a.recent.resize(self.shards.len(), 0);
        for (i, cell) in self.shards.iter().enumerate() {
            let wrs = cell.lock().wrs;
            a.recent[i] = wrs.saturating_sub(a.mark[i]);
            a.mark[i] = wrs;
        }
    }

    /// The shards holding a slice of `vnic`: its home shard first, then, with `--spread-qps`,
    /// the others in order.
    pub(super) fn slices_of(&self, vnic: VnicId) -> Vec<Arc<ShardCell>> {
        let Some(home) = self.vnics.get(&vnic).map(|v| v.shard) else {
            return Vec::new();
        };
        let mut cells = vec![self.shards[home].clone()];
        if self.spread {
            cells.extend(self.shards.iter().filter(|c| c.index != home).cloned());
        }
        cells
    }

    /// The shard serving QP `qp` of `vnic`: the one whose class its id is of when the vRNIC's
    /// QPs spread (a tenant's id naming no QP there is refused by that shard's engine), else
    /// the vRNIC's.
    pub(super) fn cell_of_qp(&self, vnic: VnicId, qp: QpId) -> Option<Arc<ShardCell>> {
        if self.spread {
            self.vnics.get(&vnic)?;
            return self.shards.get(qp.0 as usize % self.shards.len()).cloned();
        }
        self.cell_of(vnic)
    }

    /// Gives vRNIC `id` (with its region) to shard `shard`'s engine, and, with `--spread-qps`,
    /// a slice of it to every other shard's (see the module docs); without, the other shards
    /// know it as a host of its own.
    pub(super) fn add_to_shard(
        &mut self,
        shard: usize,
        id: VnicId,
        region: &Arc<Region>,
        identity: (u16, [u8; 16]),
        group: GroupId,
        limit: &Arc<vrnic_proto::Limit>,
    ) {
        let (lid, gid) = identity;
        let mut slices = Vec::new();
        // One window table for every slice: a window bound in one is used in another.
        let windows = vrnic_proto::Windows::new();
        for (k, cell) in self.shards.iter().enumerate() {
            if k == shard {
                continue;
            }
            let mut sh = cell.lock();
            if self.spread {
                let inbox = BellInbox::new();
                sh.engine.add_vnic_in_group(id, lid, gid, group);
                sh.engine.set_vnic_limit(id, limit.clone());
                sh.engine.set_vnic_windows(id, windows.clone());
                sh.lanes
                    .insert(id, Lane::slice(region.clone(), inbox.clone()));
                slices.push(Slice {
                    shard: k,
                    inbox,
                    cell: Arc::downgrade(cell),
                });
            } else {
                sh.engine
                    .add_remote_vnic_in_group(shard_host(shard), lid, gid, group);
            }
        }
        let mut sh = self.shards[shard].lock();
        sh.engine.add_vnic_in_group(id, lid, gid, group);
        sh.engine.set_vnic_limit(id, limit.clone());
        sh.engine.set_vnic_windows(id, windows);
        let mut lane = Lane::new(region.clone());
        lane.slices = slices;
        sh.lanes.insert(id, lane);
    }

    /// Takes vRNIC `id` out of its shard's engine (and its slices out of the others').
    pub(super) fn remove_from_shard(&mut self, id: VnicId) {
        let Some((lid, gid)) = self.vnics.get(&id).map(|v| (v.lid, v.gid)) else {
            return;
        };
        let cells = self.slices_of(id);
        for cell in &cells {
            let mut sh = cell.lock();
            sh.engine.remove_vnic(Instant::now(), id);
            sh.lanes.remove(&id);
            let died = sh.engine.take_died_remote();
            drop(sh);
            self.tell_died(cell.index, died);
        }
        if !self.spread
            && let Some(home) = cells.first()
        {
            for other in &self.shards {
                if other.index != home.index {
                    other.lock().engine.remove_remote_vnic(lid, gid);
                }
            }
        }
        for cell in &cells {
            self.drain_outbox(cell);
        }
    }

    /// `made`, an object `vnic`'s home shard just made (its id given by `id`), made by `make`
    /// in every other slice too, with that id ([`Engine::mirrored`]). If a slice cannot, the
    /// copies made and the home's object are undone by `undo` and the error returned.
    pub(super) fn mirror_made<I: Copy>(
        &self,
        vnic: VnicId,
        made: Result<I, vrnic_proto::Errno>,
        id: impl Fn(I) -> u32,
        make: impl Fn(&mut Engine) -> Result<I, vrnic_proto::Errno>,
        undo: impl Fn(&mut Engine, I),
    ) -> Result<I, vrnic_proto::Errno> {
        let obj = made?;
        let cells = self.slices_of(vnic);
        for (n, cell) in cells.iter().enumerate().skip(1) {
            let r = cell.lock().engine.mirrored(id(obj), None, &make);
            if let Err(e) = r {
                warn!(
                    vnic = vnic.0,
                    id = id(obj),
                    "an object could not be made in a slice: {e}"
                );
                for c in &cells[..n] {
                    undo(&mut c.lock().engine, obj);
                }
                return Err(e);
            }
        }
        Ok(obj)
    }

    /// Runs `f` on the engine of every slice of `vnic` but its home.
    pub(super) fn on_slices(&self, vnic: VnicId, f: impl Fn(&mut Engine)) {
        for cell in self.slices_of(vnic).iter().skip(1) {
            f(&mut cell.lock().engine);
        }
    }

    /// Whether `busy` holds in any slice of `vnic` (an object in use there).
    pub(super) fn busy_in_slices(&self, vnic: VnicId, busy: impl Fn(&Engine) -> bool) -> bool {
        self.slices_of(vnic)
            .iter()
            .any(|cell| busy(&cell.lock().engine))
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

    /// A pass of the one shard, run by the loop thread, which drives it as an engine thread
    /// drives its own (`shard/pacer.rs`): its frames for peer hosts written to the links, then what
    /// it produced handed on to contexts (only when there is something: an idle pass, which
    /// takes the shard's lock once, is what a new request waits for). `None` with engine
    /// threads: they drive the shards.
    pub(super) fn drive(&mut self, now: Instant) -> Option<Wait> {
        let pacer = self.pacer.as_mut()?;
        let cell = &self.shards[0];
        let (wait, produced) = {
            let mut sh = cell.lock_for_loop_pass();
            let guests = cell.guests.load(Ordering::Acquire) != 0;
            let wait = match &mut self.peers {
                Some(p) => pacer.pass(now, &mut sh, &mut p.frames(now), None, guests),
                None => pacer.pass(now, &mut sh, &mut NoFrames, None, guests),
            };
            (wait, !sh.out.is_empty())
        };
        if produced {
            let cell = cell.clone();
            self.drain_outbox(&cell);
        }
        Some(wait)
    }

    /// A pass of `cell`'s shard now, run by the loop thread for a control call whose reply
    /// must find its effects published (a QP destroyed or reset: its completions in its CQs).
    /// Its frames for peer hosts go through the engine threads' channel, which the loop
    /// empties before it next waits ([`Server::flush_peers`]).
    pub(super) fn pass_now(&mut self, cell: &Arc<ShardCell>, now: Instant) {
        {
            let mut guard = cell.lock();
            let sh = &mut *guard;
            let mut frames = ShardFrames::of_loop(&self.threads);
            // Without its siblings: a request for one waits for the engine thread's pass.
            sh.engine_pass(now, &mut frames, None);
            if sh.engine.has_transmit() {
                frames.send(&mut sh.engine, &mut Mem::new(&sh.lanes));
            }
            if sh.engine.has_deferred() {
                cell.wake();
            }
        }
        self.drain_outbox(cell);
    }

    /// Wakes every shard serving `vnic` (a doorbell on its socket, a guest come or gone).
    pub(super) fn wake_slices(&self, vnic: VnicId) {
        for cell in self.slices_of(vnic) {
            cell.wake();
        }
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
        if out.refused_n > 0 {
            self.log_refusals(&out.refused, out.refused_n);
        }
        // The buffers go back for the next passes (no allocation per pass).
        let mut sh = cell.lock();
        if sh.out.is_empty() && !sh.out.told {
            let mut out = out;
            out.events.clear();
            out.wakes.clear();
            out.refused.clear();
            out.refused_n = 0;
            out.told = false;
            sh.out = out;
        }
    }
}
