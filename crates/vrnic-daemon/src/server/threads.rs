//! Engine threads (`vrnic serve --engine-threads N`, N > 1): each shard's passes run on a thread
//! of its own, while the loop thread keeps the sockets, mailboxes and connection manager.
//!
//! A shard serves whole vRNICs (or, with `--spread-qps`, slices of them), so every check inside
//! a vRNIC (PD, MR, window, CQ, SRQ, XRC domain) stays in one engine. A work request whose
//! destination QP is on another shard is executed by the thread that took it, inside that
//! shard's engine, which its pass holds for the purpose (`shard/siblings.rs`): one copy per byte,
//! the same checks as on one engine, no frame between threads.
//!
//! Peer links stay the loop's: the frames a pass makes for another host leave an engine thread
//! through one channel to the loop as a queue of their own (headers as bytes, large reliable
//! payloads as ranges of their region, which the kernel reads when the link writes them, as
//! on one thread), which the loop appends to the link's. A frame from another host is taken by
//! the loop itself, under the lock of the shard its destination QP number names (each shard's
//! engine gives out the numbers of its own class, `qpn_shard`), its large payloads read from
//! the socket straight into place, as with one thread (`peers/`, `inbound.rs`): no queue
//! between the loop and a shard, no copy of a frame; the shard's thread is then woken to send
//! what its engine answers.
//!
//! An engine thread is driven as the loop drives the one shard (`shard/pacer.rs`): it spins
//! (yielding the CPU each idle pass) while it has traffic, then sets its regions'
//! engine-sleeping words, looks once more, and parks until the loop wakes it (a doorbell, a control call or a segment from a peer host for one of its
//! vRNICs), another thread leaves it work, or its engine's next timer is due. What its passes
//! produce for contexts (events, wake-ups) waits in its outbox, and a mio `Waker` tells the
//! loop thread to hand it on.

use super::*;

use std::sync::mpsc::Receiver;
use std::thread::JoinHandle;

use vrnic_proto::HostId;

use super::outqueue::OutQueue;
use super::peers::enqueue;
use super::shard::host_shard;
use super::shard::{Frames, Mem};
use super::shard::{Pacer, SiblingShards, Wait};

/// Frames from a shard for a peer host, as one pass queued them: the host, and the frames as
/// its link queues them (headers and small payloads as bytes, large reliable payloads as
/// ranges of their region, read by the kernel when the link writes: no copy in the daemon).
pub(super) type PeerFrame = (HostId, OutQueue);

/// Engine threads by default: 1, the daemon's loop thread running the engine itself. More
/// threads serve more busy pairs at once; a pair whose two vRNICs are on different threads
/// costs what a pair on one does (`shard/siblings.rs`), but a vRNIC is served by one thread, so
/// threads are a capacity choice (docs/performance.md, "Engine threads").
pub fn default_engine_threads() -> usize {
    1
}

/// What the loop holds of the engine threads: the channel their passes' frames for peer hosts
/// come through (a control call's pass puts its frames there too, whoever drives the shard),
/// and the threads, none when the loop drives the one shard itself.
pub(super) struct Threads {
    /// Frames the shards made for peer hosts, and the loop's end of that channel.
    pub(super) to_peers: std::sync::mpsc::Sender<PeerFrame>,
    pub(super) from_shards: Receiver<PeerFrame>,
    handles: Vec<JoinHandle<()>>,
}

/// Where a pass of a shard puts its frames: onto the channel to the loop, which is then woken
/// unless the loop is the thread that runs the pass (its link's queue bounds it: what an
/// engine sends is bounded by its QPs' windows). Frames go to peer hosts only: another shard
/// is reached by a call (`shard/siblings.rs`).
pub(super) struct ShardFrames<'a> {
    to_peers: &'a std::sync::mpsc::Sender<PeerFrame>,
    waker: Option<&'a mio::Waker>,
}

impl ShardFrames<'_> {
    /// The sink of a pass the loop thread runs for a control call: the loop takes the frames
    /// off the channel itself before it next waits.
    pub(super) fn of_loop(t: &Threads) -> ShardFrames<'_> {
        ShardFrames {
            to_peers: &t.to_peers,
            waker: None,
        }
    }
}

impl Frames for ShardFrames<'_> {
    fn send(&mut self, engine: &mut Engine, mem: &mut Mem<'_>) -> bool {
        // One queue per peer host this pass sends to (almost always one).
        let mut batches: Vec<PeerFrame> = Vec::new();
        while let Some(t) = engine.poll_transmit() {
            if host_shard(t.host).is_some() {
                // An engine never makes one for a sibling (it calls it instead).
                warn!("a frame for another engine thread was dropped");
                continue;
            }
            let i = match batches.iter().position(|(h, _)| *h == t.host) {
                Some(i) => i,
                None => {
                    batches.push((t.host, OutQueue::default()));
                    batches.len() - 1
                }
            };
            if !enqueue(&t, mem, &mut batches[i].1) {
                warn!("an inconsistent frame was not sent");
            }
        }
        let mut sent = false;
        for batch in batches {
            // The loop appends it to the link's queue (or drops it, the link down).
            sent |= self.to_peers.send(batch).is_ok();
        }
        if sent && let Some(w) = self.waker {
            let _ = w.wake();
        }
        sent
    }
}

impl Threads {
    /// Starts one engine thread per shard when there are several (with one, the loop drives
    /// it and none is started); `waker` tells the loop that an outbox has something.
    pub(super) fn start(cells: &[Arc<ShardCell>], waker: Arc<mio::Waker>) -> Result<Threads> {
        let (to_peers, from_shards) = std::sync::mpsc::channel();
        let mut handles = Vec::new();
        for cell in cells.iter().filter(|_| cells.len() > 1) {
            let cell = cell.clone();
            let cells = cells.to_vec();
            let to_peers = to_peers.clone();
            let waker = waker.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vrnic-engine-{}", cell.index))
                .spawn(move || {
                    let frames = ShardFrames {
                        to_peers: &to_peers,
                        waker: Some(&waker),
                    };
                    engine_thread(&cell, &cells, frames, &waker)
                })
                .context("start an engine thread")?;
            handles.push(handle);
        }
        // Every thread has its handle before any is woken by another's frame.
        for (cell, h) in cells.iter().zip(&handles) {
            let _ = cell.thread.set(h.thread().clone());
        }
        Ok(Threads {
            to_peers,
            from_shards,
            handles,
        })
    }

    /// Whether engine threads drive the shards (else the loop drives the one shard).
    pub(super) fn running(&self) -> bool {
        !self.handles.is_empty()
    }

    /// Stops and joins every engine thread.
    pub(super) fn stop(&mut self, cells: &[Arc<ShardCell>]) {
        for cell in cells {
            cell.stop.store(true, Ordering::SeqCst);
            cell.wake();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// An engine thread: its shard's passes (with the siblings it reaches, `shard/siblings.rs`), driven
/// as every shard is (`shard/pacer.rs`), parked while it sleeps.
fn engine_thread(
    cell: &ShardCell,
    cells: &[Arc<ShardCell>],
    mut frames: ShardFrames,
    waker: &mio::Waker,
) {
    let mut pacer = Pacer::new();
    let mut sibs = SiblingShards::new(cells, cell.index, waker);
    while !cell.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let wait = {
            let mut guard = sibs.lock(now);
            let sh = &mut *guard;
            let guests = cell.guests.load(Ordering::Acquire) != 0;
            let wait = pacer.pass(now, sh, &mut frames, Some(&mut sibs), guests);
            if !sh.out.is_empty() && !sh.out.told {
                sh.out.told = true;
                let _ = waker.wake();
            }
            sibs.release();
            wait
        };
        match wait {
            Wait::Sleep(t) => std::thread::park_timeout(t),
            w => pacer.settle(w, now),
        }
    }
}
