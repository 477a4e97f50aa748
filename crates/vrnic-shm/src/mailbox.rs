//! Control mailboxes: the control path of API remoting, over nothing but the shared region.
//!
//! Each attached context (one `ibv_open_device`) owns one mailbox. The driver writes a request
//! and moves the state word to `Request`; the daemon takes it (`Busy`), answers in place and
//! moves it to `Response`, then wakes a futex on the state word. A VM guest, which cannot share
//! a futex with the host, just polls the word. The mailbox also carries a small ring of
//! asynchronous events from the daemon (QP fatal, CQ error, port active).
//!
//! A host process gets its mailbox from the daemon over the vRNIC's socket. A context with
//! nothing but the region (a VM guest) claims a free one itself: it moves the state word from
//! `Free` to `Attach` (a compare-and-swap, so the daemon and other guests never get the same
//! mailbox), advances the mailbox's heartbeat while it lives, waits for the daemon to accept
//! (`Idle`), and leaves by moving `Idle` to `Detach`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::layout::{self, mbox};
use crate::map::{Region, RegionError};

/// Values of a mailbox's state word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum MailboxState {
    /// Not owned by any context.
    Free = 0,
    /// Owned, nothing in flight.
    Idle = 1,
    /// A request waits for the daemon.
    Request = 2,
    /// The daemon is serving the request.
    Busy = 3,
    /// The response is ready.
    Response = 4,
    /// A region-only context claimed the mailbox and waits for the daemon to accept it.
    Attach = 5,
    /// A region-only context is leaving; the daemon reclaims its objects and frees it.
    Detach = 6,
}

/// Why a call did not get its response.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitError {
    /// The daemon is gone.
    #[error("the vrnic daemon is gone")]
    DaemonGone,
    /// No answer in time.
    #[error("no answer from the vrnic daemon in {0:?}")]
    Timeout(Duration),
    /// The request does not fit a mailbox.
    #[error("control message of {0} bytes exceeds the mailbox")]
    TooLarge(usize),
    /// The response was malformed.
    #[error("malformed response")]
    Malformed,
}

/// Mailbox number `index` of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mailbox {
    index: u32,
}

impl Mailbox {
    /// Mailbox `index`, or `None` past the last one.
    pub fn new(index: u32) -> Option<Mailbox> {
        (index < layout::CTRL_SLOTS).then_some(Mailbox { index })
    }

    /// Its number.
    pub fn index(&self) -> u32 {
        self.index
    }

    fn off(&self, field: u64) -> u64 {
        layout::CTRL_OFF + u64::from(self.index) * u64::from(layout::CTRL_SLOT_SIZE) + field
    }

    fn state<'r>(&self, region: &'r Region) -> &'r std::sync::atomic::AtomicU32 {
        // Invariant: `new` bounds the index; every region has all mailboxes (MIN_REGION_SIZE).
        region
            .atomic_u32(self.off(mbox::STATE))
            .expect("mailbox inside the region")
    }

    /// Reads the state word (garbage reads as `None`).
    pub fn load_state(&self, region: &Region) -> Option<MailboxState> {
        Some(match self.state(region).load(Ordering::Acquire) {
            0 => MailboxState::Free,
            1 => MailboxState::Idle,
            2 => MailboxState::Request,
            3 => MailboxState::Busy,
            4 => MailboxState::Response,
            5 => MailboxState::Attach,
            6 => MailboxState::Detach,
            _ => return None,
        })
    }

    /// Daemon: sets the state (claim as `Idle`, release as `Free`) and clears the event ring.
    pub fn reset(&self, region: &Region, state: MailboxState) {
        // Invariant: as in `state`.
        region
            .atomic_u32(self.off(mbox::EV_PROD))
            .expect("mailbox")
            .store(0, Ordering::Release);
        region
            .atomic_u32(self.off(mbox::EV_CONS))
            .expect("mailbox")
            .store(0, Ordering::Release);
        self.state(region).store(state as u32, Ordering::Release);
    }

    /// Daemon: takes the mailbox for a context if it is in state `from` (`Free` for a socket
    /// context, `Attach` for a guest that claimed it): clears the event ring, then publishes
    /// `Idle`. Fails, changing nothing, if the state is anything else.
    pub fn accept(&self, region: &Region, from: MailboxState) -> bool {
        let state = self.state(region);
        if state
            .compare_exchange(
                from as u32,
                MailboxState::Busy as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return false;
        }
        self.reset(region, MailboxState::Idle);
        true
    }

    /// Region-only driver: claims the first free mailbox (`Free` -> `Attach`) and starts its
    /// heartbeat. The daemon accepts it by moving it to `Idle` ([`accepted`](Self::accepted)).
    pub fn claim(region: &Region) -> Option<Mailbox> {
        (0..layout::CTRL_SLOTS).find_map(|i| {
            let m = Mailbox { index: i };
            m.state(region)
                .compare_exchange(
                    MailboxState::Free as u32,
                    MailboxState::Attach as u32,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .ok()?;
            m.beat(region);
            if let Ok(w) = region.atomic_u32(layout::hdr::CLAIMS) {
                w.fetch_add(1, Ordering::AcqRel);
            }
            Some(m)
        })
    }

    /// Daemon: the count of claims made so far (see [`claim`](Self::claim)); the mailboxes
    /// need a look only when it changed.
    pub fn claims(region: &Region) -> u32 {
        region
            .atomic_u32(layout::hdr::CLAIMS)
            .map(|w| w.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// Region-only driver: whether the daemon accepted the claim.
    pub fn accepted(&self, region: &Region) -> bool {
        self.load_state(region) == Some(MailboxState::Idle)
    }

    /// Region-only driver: gives the mailbox back (`Idle` or `Attach` -> `Detach` or `Free`).
    /// An accepted context announces `Detach` so the daemon reclaims its objects; an
    /// unanswered claim is withdrawn to `Free` (if the daemon took it meanwhile, `Detach`).
    pub fn leave(&self, region: &Region) {
        let state = self.state(region);
        if state
            .compare_exchange(
                MailboxState::Attach as u32,
                MailboxState::Free as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_ok()
        {
            return;
        }
        let _ = state.compare_exchange(
            MailboxState::Idle as u32,
            MailboxState::Detach as u32,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    /// Region-only driver: advances the heartbeat that tells the daemon this context lives.
    pub fn beat(&self, region: &Region) {
        if let Ok(w) = region.atomic_u32(self.off(mbox::HEARTBEAT)) {
            w.fetch_add(1, Ordering::Release);
        }
    }

    /// Daemon: the heartbeat's current value.
    pub fn heartbeat(&self, region: &Region) -> u32 {
        region
            .atomic_u32(self.off(mbox::HEARTBEAT))
            .map(|w| w.load(Ordering::Acquire))
            .unwrap_or(0)
    }

    /// Driver: sends `request` and waits for the response. `doorbell` is called once after
    /// the request is published (a host process pokes the daemon's socket; a guest does
    /// nothing); `alive` is asked while waiting and ends the wait when it says no.
    pub fn call(
        &self,
        region: &Region,
        seq: u32,
        request: &[u8],
        doorbell: &mut dyn FnMut(),
        alive: &mut dyn FnMut() -> bool,
        timeout: Duration,
    ) -> Result<Vec<u8>, WaitError> {
        if request.len() > layout::CTRL_PAYLOAD_MAX {
            return Err(WaitError::TooLarge(request.len()));
        }
        let bounds = |_: RegionError| WaitError::Malformed;
        region
            .write_bytes(self.off(mbox::PAYLOAD), request)
            .map_err(bounds)?;
        region
            .write_bytes(self.off(mbox::LEN), &(request.len() as u32).to_le_bytes())
            .map_err(bounds)?;
        region
            .write_bytes(self.off(mbox::SEQ), &seq.to_le_bytes())
            .map_err(bounds)?;
        let state = self.state(region);
        state.store(MailboxState::Request as u32, Ordering::Release);
        doorbell();
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let s = state.load(Ordering::Acquire);
            if s == MailboxState::Response as u32 {
                break;
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
                continue;
            }
            if !alive() {
                return Err(WaitError::DaemonGone);
            }
            if start.elapsed() > timeout {
                return Err(WaitError::Timeout(timeout));
            }
            // A guest's mapping of the PCI BAR cannot hold a futex: then sleep briefly instead.
            if !crate::map::futex_wait(state, s, 20) {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let len = region.read_u32(self.off(mbox::LEN)).map_err(bounds)? as usize;
        let got_seq = region.read_u32(self.off(mbox::SEQ)).map_err(bounds)?;
        if len > layout::CTRL_PAYLOAD_MAX || got_seq != seq {
            state.store(MailboxState::Idle as u32, Ordering::Release);
            return Err(WaitError::Malformed);
        }
        let mut out = vec![0u8; len];
        region
            .read_bytes(self.off(mbox::PAYLOAD), &mut out)
            .map_err(bounds)?;
        state.store(MailboxState::Idle as u32, Ordering::Release);
        Ok(out)
    }

    /// Daemon: takes a pending request, if any: `Some((seq, bytes))`, or `Some((seq, Err))` when
    /// the request is malformed (its length is out of range). The copy is private.
    #[allow(clippy::type_complexity)]
    pub fn take(&self, region: &Region) -> Option<(u32, Result<Vec<u8>, usize>)> {
        let state = self.state(region);
        state
            .compare_exchange(
                MailboxState::Request as u32,
                MailboxState::Busy as u32,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()?;
        let seq = region.read_u32(self.off(mbox::SEQ)).ok()?;
        let len = region.read_u32(self.off(mbox::LEN)).ok()? as usize;
        if len > layout::CTRL_PAYLOAD_MAX {
            return Some((seq, Err(len)));
        }
        let mut out = vec![0u8; len];
        region.read_bytes(self.off(mbox::PAYLOAD), &mut out).ok()?;
        Some((seq, Ok(out)))
    }

    /// Daemon: publishes the response to the request `seq` and wakes the waiter.
    pub fn respond(&self, region: &Region, seq: u32, response: &[u8]) -> Result<(), RegionError> {
        let n = response.len().min(layout::CTRL_PAYLOAD_MAX);
        region.write_bytes(self.off(mbox::PAYLOAD), &response[..n])?;
        region.write_bytes(self.off(mbox::LEN), &(n as u32).to_le_bytes())?;
        region.write_bytes(self.off(mbox::SEQ), &seq.to_le_bytes())?;
        let state = self.state(region);
        state.store(MailboxState::Response as u32, Ordering::Release);
        crate::map::futex_wake(state);
        Ok(())
    }

    /// Daemon: appends an async event record if the ring has room (`prod` is the daemon's
    /// private producer index, advanced on success). Returns whether it was queued.
    pub fn push_event(&self, region: &Region, prod: &mut u32, kind: u32, handle: u32) -> bool {
        let Ok(cons) = region.atomic_u32(self.off(mbox::EV_CONS)) else {
            return false;
        };
        let cons = cons.load(Ordering::Acquire);
        if prod.wrapping_sub(cons) >= mbox::EV_SLOTS {
            return false;
        }
        let at = self.off(mbox::EV_RING) + u64::from(*prod % mbox::EV_SLOTS) * mbox::EV_SIZE;
        let mut rec = [0u8; 16];
        rec[..4].copy_from_slice(&kind.to_le_bytes());
        rec[4..8].copy_from_slice(&handle.to_le_bytes());
        if region.write_bytes(at, &rec).is_err() {
            return false;
        }
        *prod = prod.wrapping_add(1);
        if let Ok(p) = region.atomic_u32(self.off(mbox::EV_PROD)) {
            p.store(*prod, Ordering::Release);
        }
        true
    }

    /// Driver: takes the next async event `(kind, handle)`, if any.
    pub fn pop_event(&self, region: &Region) -> Option<(u32, u32)> {
        let prod = region
            .atomic_u32(self.off(mbox::EV_PROD))
            .ok()?
            .load(Ordering::Acquire);
        let cons_w = region.atomic_u32(self.off(mbox::EV_CONS)).ok()?;
        let cons = cons_w.load(Ordering::Acquire);
        if prod == cons || prod.wrapping_sub(cons) > mbox::EV_SLOTS {
            return None;
        }
        let at = self.off(mbox::EV_RING) + u64::from(cons % mbox::EV_SLOTS) * mbox::EV_SIZE;
        let mut rec = [0u8; 16];
        region.read_bytes(at, &mut rec).ok()?;
        cons_w.store(cons.wrapping_add(1), Ordering::Release);
        Some((
            u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]),
            u32::from_le_bytes([rec[4], rec[5], rec[6], rec[7]]),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_response_round_trip_across_threads() {
        let p = std::env::temp_dir().join(format!("vrnic-mbox-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = std::sync::Arc::new(Region::create(&p, 0, "m", 1, [0; 16], 1).unwrap());
        let mb = Mailbox::new(3).unwrap();
        mb.reset(&r, MailboxState::Idle);
        let r2 = r.clone();
        let server = std::thread::spawn(move || {
            loop {
                if let Some((seq, Ok(req))) = mb.take(&r2) {
                    let mut resp = req.clone();
                    resp.reverse();
                    mb.respond(&r2, seq, &resp).unwrap();
                    return;
                }
                std::thread::yield_now();
            }
        });
        let resp = mb
            .call(
                &r,
                9,
                b"abc",
                &mut || {},
                &mut || true,
                Duration::from_secs(10),
            )
            .unwrap();
        assert_eq!(resp, b"cba");
        server.join().unwrap();
        let mut prod = 0;
        assert!(mb.push_event(&r, &mut prod, 1, 77));
        assert_eq!(mb.pop_event(&r), Some((1, 77)));
        assert_eq!(mb.pop_event(&r), None);
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn a_dead_daemon_ends_the_wait() {
        let p = std::env::temp_dir().join(format!("vrnic-mbox-dead-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = Region::create(&p, 0, "m", 1, [0; 16], 1).unwrap();
        let mb = Mailbox::new(0).unwrap();
        let e = mb.call(
            &r,
            1,
            b"x",
            &mut || {},
            &mut || false,
            Duration::from_secs(10),
        );
        assert_eq!(e, Err(WaitError::DaemonGone));
        std::fs::remove_file(p).unwrap();
    }
}
