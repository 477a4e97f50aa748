//! Engine threads (`vrnic serve --engine-threads N`, N > 1): each shard's passes run on a thread
//! of its own, while the loop thread keeps the sockets, mailboxes and connection manager.
//!
//! A shard serves whole vRNICs, so every check inside a vRNIC (PD, MR, window, CQ, SRQ, XRC
//! domain) stays in one thread. The shards see each other as hosts: a vRNIC of another shard is
//! known to a shard's engine as a remote vRNIC on that shard's host id ([`shard_host`]), and a
//! segment to it leaves as a frame, as over a peer link (PSNs, ACKs, NAK and RNR rewind: the
//! engine's remote path), through a bounded lock-free channel into that shard's inbox. Nothing
//! is shared for writing between engine threads.
//!
//! Peer links stay the loop's: a frame for another host leaves an engine thread through one
//! channel to the loop, which queues it on its link; a frame from another host goes from the
//! loop into the inbox of the shard its destination QP number names (each shard's engine
//! gives out the numbers of its own class, [`qpn_shard`]).
//!
//! An engine thread spins (yielding the CPU each idle pass) while it has traffic, then, after
//! [`SPIN_QUIET`], sets its regions' engine-sleeping words, looks once more, and parks until
//! the loop wakes it (a doorbell or a control call on one of its vRNICs), another shard sends
//! it a frame, or its engine's next timer is due. What its passes produce for contexts (events,
//! wake-ups) waits in its outbox, and a mio `Waker` tells the loop thread to hand it on.

use super::*;

use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::thread::JoinHandle;

use vrnic_proto::HostId;
use vrnic_wire::frame::{Frame, FrameRepr};

use super::datapath::{Frames, Mem};
use super::shard::{Shard, host_shard, qpn_shard, shard_host};

/// A frame into a shard: where it comes from (another shard's host id, or a peer host's), and
/// its bytes.
pub(super) type ShardFrame = (HostId, Vec<u8>);

/// A frame from a shard for a peer host: the host, and the frame's bytes.
pub(super) type PeerFrame = (HostId, Vec<u8>);

/// Frames an engine thread takes from its inbox per pass at most (the rest wait for the next).
const INBOX_BATCH: usize = 256;
/// Frames an inbox holds at most. A sender that finds it full drops the frame, as a congested
/// link would: RC sends it again when its ACK does not come, UC and UD are unreliable. So a
/// tenant flooding a slower shard costs that shard a bounded queue, never the daemon's memory.
const INBOX_CAP: usize = 4096;

/// Engine threads by default: 1, the daemon's loop thread running the engine itself. Two
/// vRNICs on different engine threads talk as two hosts do (frames, PSNs and ACKs, a copy into
/// a frame and out), which costs a pair more than a second core gives it (issue "One host is
/// one RNIC on every core", docs/performance.md): until the threads share one data path, more
/// threads are a choice for many busy pairs, not a default.
pub fn default_engine_threads() -> usize {
    1
}

/// What the loop holds of the engine threads.
pub(super) struct Threads {
    /// Each shard's inbox.
    pub(super) inboxes: Vec<SyncSender<ShardFrame>>,
    /// Frames the shards made for peer hosts, and the loop's end of that channel.
    pub(super) to_peers: std::sync::mpsc::Sender<PeerFrame>,
    pub(super) from_shards: Receiver<PeerFrame>,
    /// Tells the loop that an outbox or the peer channel has something.
    pub(super) waker: Arc<mio::Waker>,
    handles: Vec<JoinHandle<()>>,
}

/// Where a pass of a shard puts its frames: a frame for another shard into that shard's inbox,
/// which is then woken; a frame for a peer host onto the channel to the loop, which is then
/// woken (its link's queue bounds it: what an engine sends is bounded by its QPs' windows).
pub(super) struct ShardFrames<'a> {
    pub(super) me: HostId,
    pub(super) inboxes: &'a [SyncSender<ShardFrame>],
    pub(super) cells: &'a [Arc<ShardCell>],
    pub(super) to_peers: &'a std::sync::mpsc::Sender<PeerFrame>,
    pub(super) waker: &'a mio::Waker,
}

impl ShardFrames<'_> {
    /// The sink of shard `cell`'s passes.
    pub(super) fn of<'a>(
        cell: &ShardCell,
        t: &'a Threads,
        cells: &'a [Arc<ShardCell>],
    ) -> ShardFrames<'a> {
        ShardFrames {
            me: shard_host(cell.index),
            inboxes: &t.inboxes,
            cells,
            to_peers: &t.to_peers,
            waker: &t.waker,
        }
    }
}

impl Frames for ShardFrames<'_> {
    fn send(&mut self, engine: &mut Engine, mem: &mut Mem<'_>) -> bool {
        let mut sent = false;
        let mut to_loop = false;
        while let Some(t) = engine.poll_transmit() {
            let mut bytes = Vec::with_capacity(t.frame_len());
            if !t.encode(mem, &mut bytes) {
                warn!("an inconsistent frame was not sent");
                continue;
            }
            let Some(to) = host_shard(t.host) else {
                // A peer host's: the loop queues it on the link (or drops it, the link down).
                to_loop |= self.to_peers.send((t.host, bytes)).is_ok();
                sent = true;
                continue;
            };
            let (Some(inbox), Some(cell)) = (self.inboxes.get(to), self.cells.get(to)) else {
                continue;
            };
            // A full inbox drops it, as a congested link; a shard that is gone (the daemon
            // stopping), as a link that is down.
            match inbox.try_send((self.me, bytes)) {
                Ok(()) => sent = true,
                Err(TrySendError::Full(_)) => {
                    tracing::trace!(to, "shard inbox full; frame dropped")
                }
                Err(TrySendError::Disconnected(_)) => {}
            }
            cell.wake();
        }
        if to_loop {
            let _ = self.waker.wake();
        }
        sent
    }
}

/// Hands the frames waiting in `inbox` (at most [`INBOX_BATCH`]) to the shard's engine.
/// Returns whether there were any.
fn take_inbox(sh: &mut Shard, inbox: &Receiver<ShardFrame>, now: Instant) -> bool {
    let mut any = false;
    for _ in 0..INBOX_BATCH {
        let (from, bytes) = match inbox.try_recv() {
            Ok(f) => f,
            Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
        };
        any = true;
        // Our own engines made them; decoded strictly all the same.
        let Ok(frame) = Frame::new_checked(&bytes[..]) else {
            continue;
        };
        let Ok(repr) = FrameRepr::parse(&frame) else {
            continue;
        };
        sh.take_segment(now, from, repr, &bytes[repr.payload_range()]);
    }
    any
}

impl Threads {
    /// Starts one engine thread per shard; `waker` tells the loop that an outbox has something.
    pub(super) fn start(cells: &[Arc<ShardCell>], waker: Arc<mio::Waker>) -> Result<Threads> {
        let (inboxes, receivers): (Vec<_>, Vec<_>) = cells
            .iter()
            .map(|_| std::sync::mpsc::sync_channel(INBOX_CAP))
            .unzip();
        let (to_peers, from_shards) = std::sync::mpsc::channel();
        let mut handles = Vec::new();
        for (cell, inbox) in cells.iter().zip(receivers) {
            let cell = cell.clone();
            let cells = cells.to_vec();
            let senders = inboxes.clone();
            let to_peers = to_peers.clone();
            let waker = waker.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vrnic-engine-{}", cell.index))
                .spawn(move || {
                    let frames = ShardFrames {
                        me: shard_host(cell.index),
                        inboxes: &senders,
                        cells: &cells,
                        to_peers: &to_peers,
                        waker: &waker,
                    };
                    engine_thread(&cell, frames, &inbox, &waker)
                })
                .context("start an engine thread")?;
            handles.push(handle);
        }
        // Every thread has its handle before any is woken by another's frame.
        for (cell, h) in cells.iter().zip(&handles) {
            let _ = cell.thread.set(h.thread().clone());
        }
        Ok(Threads {
            inboxes,
            to_peers,
            from_shards,
            waker,
            handles,
        })
    }

    /// Hands a frame that came from peer host `from` to the shard of its destination QP
    /// (dropped when that shard's inbox is full, as a congested link: RC sends it again).
    pub(super) fn to_shard(&self, cells: &[Arc<ShardCell>], from: HostId, qpn: u32, frame: &[u8]) {
        let to = qpn_shard(qpn, cells.len());
        let (Some(inbox), Some(cell)) = (self.inboxes.get(to), cells.get(to)) else {
            return;
        };
        if inbox.try_send((from, frame.to_vec())).is_ok() {
            cell.wake();
        }
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

/// An engine thread: its shard's passes, the frames other shards sent it, its sleep.
fn engine_thread(
    cell: &ShardCell,
    mut frames: ShardFrames,
    inbox: &Receiver<ShardFrame>,
    waker: &mio::Waker,
) {
    let mut last_work = Instant::now();
    let mut asleep = false;
    while !cell.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        // How long to wait before the next pass: `None` none, zero a yield.
        let wait = {
            let mut guard = cell.lock_for_pass();
            let sh = &mut *guard;
            if asleep {
                sh.set_sleeping(false);
                asleep = false;
            }
            let mut worked = take_inbox(sh, inbox, now);
            worked |= sh.engine_pass(now, &mut frames);
            if sh.engine.has_transmit() {
                worked |= frames.send(&mut sh.engine, &mut Mem::new(&sh.lanes));
            }
            if !sh.out.is_empty() && !sh.out.told {
                sh.out.told = true;
                let _ = waker.wake();
            }
            if worked {
                last_work = now;
                None
            } else if now.duration_since(last_work) < SPIN_QUIET {
                Some(Duration::ZERO)
            } else {
                // Sleep: announce it, then look once more before really waiting.
                sh.set_sleeping(true);
                asleep = true;
                if sh.engine_pass(Instant::now(), &mut frames) {
                    last_work = Instant::now();
                    None
                } else {
                    let cap = if cell.guests.load(Ordering::Acquire) == 0 {
                        MAX_SLEEP
                    } else {
                        GUEST_SLEEP
                    };
                    Some(sh.engine.poll_timeout().map_or(cap, |t| {
                        t.saturating_duration_since(Instant::now())
                            .min(cap)
                            .max(Duration::from_micros(1))
                    }))
                }
            }
        };
        match wait {
            None => {}
            Some(Duration::ZERO) => std::thread::yield_now(),
            Some(t) => std::thread::park_timeout(t),
        }
    }
}
