//! Metering: what each vRNIC moved and how its work requests ended, counted exactly by the
//! engine that executes them. The counters are plain integers in each QP's engine state (one
//! thread owns an engine, so there is no atomic on the data path, and an event costs no lookup
//! beyond its QP's); a vRNIC's meter is the sum of its QPs', those destroyed folded into the
//! vRNIC's own ([`Engine::meter`](super::Engine::meter)), and a vRNIC served by several engines
//! (`--spread-qps`) is the sum of its slices' meters ([`Meter::add`]).

use vrnic_wire::{SendOpcode, WcStatus};

use super::segment::Op;

/// Opcode classes, as the meter counts them.
pub const CLASSES: [&str; 4] = ["send", "write", "read", "atomic"];

/// Work requests (or messages) and their bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    /// Work requests (requester) or messages (responder).
    pub wrs: u64,
    /// Their bytes.
    pub bytes: u64,
}

impl Flow {
    fn count(&mut self, wrs: u64, bytes: u64) {
        self.wrs = self.wrs.wrapping_add(wrs);
        self.bytes = self.bytes.wrapping_add(bytes);
    }
}

/// One vRNIC's counters since it was made (they reset only when it goes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meter {
    /// As requester: work requests that completed successfully and their bytes, by class
    /// ([`CLASSES`]: SEND with or without immediate or invalidate; RDMA WRITE with or without
    /// immediate; RDMA READ; atomics, 8 bytes each). Memory-window binds and local
    /// invalidations move nothing and are not counted here.
    pub sent: [Flow; 4],
    /// As responder: what other QPs' requests did here, by class: messages received into a
    /// receive (SEND; for UD the payload without the GRH), WRITE messages placed, READ
    /// requests served (counted once the last byte asked for is served), atomics executed.
    pub received: [Flow; 4],
    /// Completions posted to its CQs, by status (index: `ibv_wc_status`, 0 success to 21).
    pub completions: [u64; 22],
    /// RNR NAKs it sent as responder (no receive posted when a SEND came).
    pub rnr_naks: u64,
    /// Requests it refused as responder with a NAK (PSN sequence, invalid request, remote
    /// access, remote operational).
    pub naks: u64,
    /// UD datagrams that reached one of its QPs and were dropped: wrong Q_Key, or no receive.
    pub ud_dropped: u64,
}

impl Meter {
    /// Adds `o`'s counts (another slice of the same vRNIC).
    pub fn add(&mut self, o: &Meter) {
        for (a, b) in self.sent.iter_mut().zip(&o.sent) {
            a.count(b.wrs, b.bytes);
        }
        for (a, b) in self.received.iter_mut().zip(&o.received) {
            a.count(b.wrs, b.bytes);
        }
        for (a, b) in self.completions.iter_mut().zip(&o.completions) {
            *a = a.wrapping_add(*b);
        }
        self.rnr_naks = self.rnr_naks.wrapping_add(o.rnr_naks);
        self.naks = self.naks.wrapping_add(o.naks);
        self.ud_dropped = self.ud_dropped.wrapping_add(o.ud_dropped);
    }

    /// A requester's work request that completed successfully, `bytes` long.
    pub(super) fn sent(&mut self, op: SendOpcode, bytes: u64) {
        if let Some(c) = send_class(op) {
            self.sent[c].count(1, bytes);
        }
    }

    /// A responder's request segment of `op` that moved `bytes`, the last of its message if
    /// `last`.
    pub(super) fn received(&mut self, op: Op, last: bool, bytes: u64) {
        let c = match op {
            Op::Send | Op::SendInv => 0,
            Op::Write => 1,
            Op::Read => 2,
            Op::CmpSwap { .. } | Op::FetchAdd { .. } | Op::AtomicWrite => 3,
        };
        self.received[c].count(u64::from(last), bytes);
    }

    /// A completion posted with `status`.
    pub(super) fn completed(&mut self, status: WcStatus) {
        if let Some(n) = self.completions.get_mut(status as usize) {
            *n = n.wrapping_add(1);
        }
    }
}

/// The class of a requester's opcode (`None`: a local operation).
fn send_class(op: SendOpcode) -> Option<usize> {
    match op {
        SendOpcode::Send | SendOpcode::SendWithImm | SendOpcode::SendWithInv => Some(0),
        SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => Some(1),
        SendOpcode::RdmaRead => Some(2),
        SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd | SendOpcode::AtomicWrite => {
            Some(3)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_and_sums() {
        let mut m = Meter::default();
        m.sent(SendOpcode::RdmaWrite, 100);
        m.sent(SendOpcode::RdmaWriteWithImm, 28);
        m.sent(SendOpcode::AtomicFetchAndAdd, 8);
        m.received(Op::Send, false, 4096);
        m.received(Op::Send, true, 10);
        m.completed(WcStatus::Success);
        m.completed(WcStatus::RemAccessErr);
        assert_eq!(m.sent[1], Flow { wrs: 2, bytes: 128 });
        assert_eq!(m.sent[3], Flow { wrs: 1, bytes: 8 });
        assert_eq!(
            m.received[0],
            Flow {
                wrs: 1,
                bytes: 4106
            }
        );
        let mut all = m;
        all.add(&m);
        assert_eq!(all.sent[1], Flow { wrs: 4, bytes: 256 });
        assert_eq!(all.completions[0], 2);
        assert_eq!(all.completions[WcStatus::RemAccessErr as usize], 2);
    }
}
