//! The seam between the two ends of a message: what a requester sends (a request segment)
//! and what its responder answers, in the terms of the InfiniBand transport, and the route
//! that carries them.
//!
//! A [`Request`] is what one IB request packet carries, as values rather than bytes: the BTH
//! (operation, first/last position in the message, destination QPN, PSN, solicited event),
//! the RETH (virtual address, R_Key, length; an ATOMIC WRITE's 8 bytes follow it), the AtomicETH (compare and swap/add data), the
//! ImmDt, and the DETH (Q_Key, source QPN) of a UD datagram. Its payload is memory, not a
//! buffer: the requester's region runs or its inline bytes, so same-host delivery copies each
//! byte once, straight from the requester's MR into the responder's. A [`Response`] is the
//! AETH's answer: ACK, RNR NAK (with the responder's timer), NAK (sequence, invalid request,
//! remote access, remote operational), a READ response (the responder's region runs) or an
//! atomic ACK (the original value).
//!
//! A segment moves at most [`CHUNK`](super::CHUNK) bytes and takes one PSN. The requester
//! resolves where a segment goes once, when the QP reaches RTR (or an address handle is
//! made): a [`Route`]. A route that leads nowhere (an address handle's, or a connected QP's
//! at either end) is looked up again at each send or arrival, since its destination may be
//! announced later.

use vrnic_wire::QpType;
use vrnic_wire::frame::PSN_MASK;

use super::GRH_LEN;
use crate::{HostId, Loc, VnicId};

/// Where a QP's (or an address handle's) destination is, resolved from its LID or GID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// Not resolved (before RTR), or no vRNIC here answers the address: segments are lost.
    Nowhere,
    /// A vRNIC on this daemon: segments are delivered by a call, payload copied once.
    Local(VnicId),
    /// A vRNIC behind another daemon: segments leave as frames on its peer link.
    Remote(HostId),
}

/// Who sent a request segment, as the responder checks the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Src {
    /// A QP of a vRNIC on this daemon.
    Local {
        /// Its vRNIC.
        vnic: VnicId,
        /// Its QPN.
        qpn: u32,
    },
    /// A QP behind a peer link or another engine thread: the frame's address word named it,
    /// and `Engine::admitted` checked it (its vRNIC is one that link speaks for, of the
    /// destination's group, and a connected destination's peer).
    Remote(HostId),
}

/// The operation a request segment asks of its responder (the BTH opcode's operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    /// SEND: the payload lands in the responder's receive.
    Send,
    /// SEND with Invalidate: a SEND whose last segment also invalidates, at the responder,
    /// the memory window whose R_Key is `rkey` (IETH). Same-daemon only: peer-link frames
    /// carry no IETH yet.
    SendInv,
    /// RDMA WRITE: the payload lands at `va` under `rkey`; with `imm`, the last segment also
    /// consumes a receive.
    Write,
    /// RDMA READ request for `len` bytes at `va`.
    Read,
    /// ATOMIC compare and swap of the 8 bytes at `va`.
    CmpSwap {
        /// Compared with the current value.
        compare: u64,
        /// Stored if they are equal.
        swap: u64,
    },
    /// ATOMIC fetch and add of the 8 bytes at `va`.
    FetchAdd {
        /// Added to the current value.
        add: u64,
    },
    /// ATOMIC WRITE (IBA 1.5): the payload's 8 bytes stored at `va` under `rkey` (remote
    /// write access) as one atomic store; answered by an ACK.
    AtomicWrite,
}

/// The payload of a request segment.
#[derive(Debug, Clone, Copy)]
pub(super) enum Payload<'a> {
    /// None (READ requests, compare-and-swap and fetch-and-add, zero-length messages).
    Empty,
    /// The requester's region runs.
    Runs(&'a [(Loc, u64)]),
    /// Inline data carried in the work request itself, or a frame's payload.
    Bytes(&'a [u8]),
    /// This many bytes a driver already read from a peer link into the runs that
    /// [`Engine::placement`](super::Engine::placement) named: nothing is left to copy.
    Placed(u64),
}

impl Payload<'_> {
    /// Its length in bytes.
    pub(super) fn len(&self) -> u64 {
        match self {
            Payload::Empty => 0,
            Payload::Runs(r) => r.iter().map(|&(_, n)| n).sum(),
            Payload::Bytes(b) => b.len() as u64,
            Payload::Placed(n) => *n,
        }
    }
}

/// One request segment (an IB request packet's headers, its payload as memory).
#[derive(Debug, Clone, Copy)]
pub(super) struct Request<'a> {
    /// What it asks.
    pub(super) op: Op,
    /// RC, UC or UD (the BTH opcode's transport bits), or `XrcSend` for XRC.
    pub(super) transport: QpType,
    /// XRC: the XRCETH's SRQ number (0 on other transports).
    pub(super) xrc_srqn: u32,
    /// The first segment of its message (BTH opcode FIRST or ONLY).
    pub(super) first: bool,
    /// The last segment of its message (BTH opcode LAST or ONLY).
    pub(super) last: bool,
    /// Who sent it.
    pub(super) src: Src,
    /// The requester's QPN and LID, as a receive completion reports them.
    pub(super) src_qpn: u32,
    pub(super) slid: u16,
    /// BTH destination QPN.
    pub(super) dst_qpn: u32,
    /// BTH PSN (24 bits; unused by UD).
    pub(super) psn: u32,
    /// BTH solicited event (meaningful on the last segment).
    pub(super) solicited: bool,
    /// ImmDt (meaningful on the last segment).
    pub(super) imm: Option<u32>,
    /// RETH/AtomicETH virtual address of this segment's first byte.
    pub(super) va: u64,
    /// RETH/AtomicETH R_Key.
    pub(super) rkey: u32,
    /// RETH DMA length as seen from this segment: the bytes from `va` to the end of the
    /// message (WRITE, READ); 8 for atomics.
    pub(super) len: u64,
    /// The bytes this segment moves: its payload (SEND, WRITE), or what it asks for (READ).
    pub(super) chunk: u64,
    /// DETH Q_Key (UD).
    pub(super) qkey: u32,
    /// The GRH a UD receive gets in its first [`GRH_LEN`] bytes, if the datagram was sent
    /// along a global route.
    pub(super) grh: Option<[u8; GRH_LEN as usize]>,
    /// The payload.
    pub(super) payload: Payload<'a>,
}

/// Why a responder refused a request (the AETH NAK codes). 64 bits wide, as every payload of
/// [`Response`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub(super) enum Nak {
    /// PSN sequence error: the responder expected another PSN.
    Sequence,
    /// Invalid request (a message too long for its receive, a misaligned atomic, an
    /// operation the QP does not support).
    InvalidRequest,
    /// Remote access error (R_Key, bounds, access rights).
    RemoteAccess,
    /// Remote operational error (the responder's own receive was bad).
    RemoteOperational,
}

/// A responder's answer to a request segment.
///
/// Every payload is 64 bits wide, so that a response (and an `Option` of one) is a (tag, word)
/// pair, which the Rust ABI returns in two registers. With a byte-sized payload beside the
/// atomic's `u64` it was returned through memory, written field by field and copied whole by
/// the caller at once: a store-forwarding stall on every work request (`perf annotate` of the
/// engine, 2-byte WRITEs: about 40% of `deliver`'s samples).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Response {
    /// Accepted (and for the last segment of a message, done).
    Ack,
    /// No receive posted; try again after the responder's RNR timer.
    RnrNak {
        /// The responder's `min_rnr_timer`.
        timer: RnrTimer,
    },
    /// Refused.
    Nak(Nak),
    /// READ response: the bytes are at the responder's region runs handed back.
    ReadData,
    /// Atomic ACK with the original value.
    AtomicAck(u64),
    /// UC and UD: nothing is answered (whatever the responder did).
    Unacknowledged,
}

/// An RNR timer's 5-bit code (IB spec table 45), held in 64 bits (see [`Response`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RnrTimer(u64);

impl RnrTimer {
    /// The timer whose code is `code`.
    pub(super) fn new(code: u8) -> Self {
        RnrTimer(u64::from(code))
    }

    /// Its code.
    pub(super) fn code(self) -> u8 {
        self.0 as u8
    }
}

/// Next PSN after `psn` (24 bits).
pub(super) fn psn_next(psn: u32) -> u32 {
    psn.wrapping_add(1) & PSN_MASK
}

/// The PSN before `psn` (24 bits).
pub(super) fn psn_prev(psn: u32) -> u32 {
    psn.wrapping_sub(1) & PSN_MASK
}

/// How many PSNs `psn` lies past `base`, counted forward in the 24-bit space.
pub(super) fn psn_after(psn: u32, base: u32) -> u32 {
    psn.wrapping_sub(base) & PSN_MASK
}

/// Where `psn` lies relative to the expected `epsn`: 0 equal, > 0 ahead, < 0 behind (the
/// 24-bit space split in halves, IB spec 9.7.1).
pub(super) fn psn_cmp(psn: u32, epsn: u32) -> i32 {
    let d = psn_after(psn, epsn);
    if d == 0 {
        0
    } else if d < 0x80_0000 {
        1
    } else {
        -1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_arithmetic_wraps_at_24_bits() {
        assert_eq!(psn_next(0xff_ffff), 0);
        assert_eq!(psn_prev(0), 0xff_ffff);
        assert_eq!(psn_after(1, 0xff_ffff), 2);
        assert_eq!(psn_after(0xff_ffff, 1), 0xff_fffe);
        assert_eq!(psn_cmp(5, 5), 0);
        assert_eq!(psn_cmp(0, 0xff_ffff), 1);
        assert_eq!(psn_cmp(0xff_ffff, 0), -1);
        assert_eq!(psn_cmp(0x7f_ffff, 0), 1);
        assert_eq!(psn_cmp(0x80_0000, 0), -1);
    }
}
