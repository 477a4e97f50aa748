//! Engine threads (`vrnic serve --engine-threads N`, N > 1): each shard's passes run on a thread
//! of its own, while the loop thread keeps the sockets, mailboxes and connection manager.
//!
//! A shard serves whole vRNICs, so every check inside a vRNIC (PD, MR, window, CQ, SRQ, XRC
//! domain) stays in one thread. The shards see each other as hosts: a vRNIC of another shard is
//! known to a shard's engine as a remote vRNIC on host id = that shard's index, and a segment
//! to it leaves as a frame, as over a peer link (PSNs, ACKs, NAK and RNR rewind: the engine's
//! remote path), through a bounded lock-free channel into that shard's inbox. Nothing is
//! shared for writing between engine threads.
//!
//! An engine thread spins (yielding the CPU each idle pass) while it has traffic, then, after
//! [`SPIN_QUIET`], sets its regions' engine-sleeping words, looks once more, and parks until
//! the loop wakes it (a doorbell or a control call on one of its vRNICs), another shard sends
//! it a frame, or its engine's next timer is due. What its passes produce for contexts (events,
//! wake-ups) waits in its outbox, and a mio `Waker` tells the loop thread to hand it on.

use super::*;

use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::thread::JoinHandle;

use vrnic_proto::{HostId, Sender};
use vrnic_wire::frame::{Frame, FrameRepr};

use super::datapath::{Frames, Mem};
use super::shard::Shard;

/// A frame from one shard to another: the sender's shard, and the frame's bytes.
pub(super) type ShardFrame = (HostId, Vec<u8>);

/// Frames an engine thread takes from its inbox per pass at most (the rest wait for the next).
const INBOX_BATCH: usize = 256;
/// Frames an inbox holds at most. A sender that finds it full drops the frame, as a congested
/// link would: RC sends it again when its ACK does not come, UC and UD are unreliable. So a
/// tenant flooding a slower shard costs that shard a bounded queue, never the daemon's memory.
const INBOX_CAP: usize = 4096;

/// Engine threads by default: a quarter of the cores, at least 1 (the loop thread and the
/// apps need the rest; on a 2-core machine the loop runs the engine itself).
pub fn default_engine_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    (cores / 4).max(1)
}

/// What the loop holds of the engine threads.
pub(super) struct Threads {
    /// Each shard's inbox.
    pub(super) inboxes: Vec<SyncSender<ShardFrame>>,
    handles: Vec<JoinHandle<()>>,
}

/// The other shards as where a pass puts its frames: each into its destination shard's inbox,
/// which is then woken.
pub(super) struct ShardFrames<'a> {
    pub(super) me: HostId,
    pub(super) inboxes: &'a [SyncSender<ShardFrame>],
    pub(super) cells: &'a [Arc<ShardCell>],
}

impl Frames for ShardFrames<'_> {
    fn send(&mut self, engine: &mut Engine, mem: &mut Mem<'_>) -> bool {
        let mut sent = false;
        while let Some(t) = engine.poll_transmit() {
            let to = t.host.0 as usize;
            let (Some(inbox), Some(cell)) = (self.inboxes.get(to), self.cells.get(to)) else {
                continue;
            };
            let mut bytes = Vec::with_capacity(t.frame_len());
            if !t.encode(mem, &mut bytes) {
                warn!("an inconsistent frame was not sent");
                continue;
            }
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
        let Ok(repr @ FrameRepr::Segment { slid, grh, segment }) = FrameRepr::parse(&frame) else {
            continue;
        };
        let body = &bytes[repr.payload_range()];
        sh.engine.handle_segment(
            now,
            from,
            Sender {
                slid,
                grh: grh.as_ref(),
            },
            &segment,
            body,
            &mut Mem::new(&sh.lanes),
        );
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
        let mut handles = Vec::new();
        for (cell, inbox) in cells.iter().zip(receivers) {
            let cell = cell.clone();
            let cells = cells.to_vec();
            let senders = inboxes.clone();
            let waker = waker.clone();
            let handle = std::thread::Builder::new()
                .name(format!("vrnic-engine-{}", cell.index))
                .spawn(move || engine_thread(&cell, &cells, &senders, &inbox, &waker))
                .context("start an engine thread")?;
            handles.push(handle);
        }
        // Every thread has its handle before any is woken by another's frame.
        for (cell, h) in cells.iter().zip(&handles) {
            let _ = cell.thread.set(h.thread().clone());
        }
        Ok(Threads { inboxes, handles })
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
    cells: &[Arc<ShardCell>],
    inboxes: &[SyncSender<ShardFrame>],
    inbox: &Receiver<ShardFrame>,
    waker: &mio::Waker,
) {
    let me = HostId(cell.index as u32);
    let mut last_work = Instant::now();
    let mut asleep = false;
    while !cell.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let mut frames = ShardFrames { me, inboxes, cells };
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
