//! Formats shared by every part of vrnic: identifiers, the verbs enums as numbers, and the
//! fixed-size work-queue and completion slots that live in a vRNIC's shared rings.
//!
//! This crate is deliberately only formats. It holds no state, touches no memory it was not
//! handed as a byte array, and never trusts a byte: [`SendWqe::parse`], [`RecvWqe::parse`] and
//! [`Cqe::parse`] take a private copy of a slot and either return a value that is valid by
//! construction or a [`ParseError`]. The driver library encodes with `encode`, the engine side
//! decodes with `parse`; both sides share the constants below, pinned by compile-time checks.
//!
//! Numeric values of opcodes, statuses and flags are rdma-core's (`infiniband/verbs.h`), so the
//! driver library can pass them through without tables.
//!
//! [`frame`] holds the other format: the frames daemons exchange over TCP peer links
//! (InfiniBand transport headers behind a small link header), decoded as strictly.
//!
//! ```
//! use vrnic_wire::{SendWqe, SendOpcode, Sge, SendFlags, SQ_SLOT};
//! let wqe = SendWqe {
//!     wr_id: 7,
//!     opcode: SendOpcode::Send,
//!     flags: SendFlags::SIGNALED,
//!     imm_data: 0,
//!     remote_addr: 0,
//!     rkey: 0,
//!     compare_add: 0,
//!     swap: 0,
//!     ud: Default::default(),
//!     xrc_srqn: 0,
//!     payload: vrnic_wire::SendPayload::Sges([Sge { addr: 0x1000, length: 64, lkey: 3 }].into_iter().collect()),
//! };
//! let mut slot = [0u8; SQ_SLOT];
//! wqe.encode(&mut slot);
//! assert_eq!(SendWqe::parse(&slot).unwrap(), wqe);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

pub mod frame;

/// Size of one send-queue slot in bytes.
pub const SQ_SLOT: usize = 512;
/// Size of one receive-queue slot in bytes.
pub const RQ_SLOT: usize = 512;
/// Size of one completion-queue slot in bytes.
pub const CQ_SLOT: usize = 64;
/// Byte offset in a completion slot of its sequence word (64 bits): the ring index the
/// completion was written at, plus one (as a `u64`: never 0, so a zeroed slot never reads as
/// written, and never the same for two laps of a slot). The daemon stores it (Release) after
/// the rest of the slot ([`Cqe::encode`] leaves it out); the driver polls a CQ by this word
/// of the slot at its consumer index, not by the ring's producer index, so a completion costs
/// the polling core one cache line (the slot) instead of two (the index, then the slot).
pub const CQE_SEQ: usize = 56;

/// The sequence word of a completion written at ring index `index` (see [`CQE_SEQ`]).
pub fn cqe_seq(index: u32) -> u64 {
    u64::from(index) + 1
}
/// Bytes of a send slot before its SGE list or inline data.
pub const SQ_HEADER: usize = 64;
/// Bytes of a receive slot before its SGE list.
pub const RQ_HEADER: usize = 16;
/// Bytes of one scatter/gather element in a slot.
pub const SGE_SIZE: usize = 16;
/// Most SGEs a work request may carry (send and receive), as reported in `max_sge`.
pub const MAX_SGE: usize = 16;
/// Most inline bytes a send work request may carry, as reported in `max_inline_data`.
pub const MAX_INLINE: usize = 256;
/// Largest message, as reported in `max_msg_sz` (2 GiB, as RC allows).
pub const MAX_MSG_SIZE: u32 = 1 << 31;

const _: () = assert!(SQ_HEADER + MAX_SGE * SGE_SIZE <= SQ_SLOT);
const _: () = assert!(SQ_HEADER + MAX_INLINE <= SQ_SLOT);
const _: () = assert!(RQ_HEADER + MAX_SGE * SGE_SIZE <= RQ_SLOT);
const _: () = assert!(SQ_SLOT.is_power_of_two() && RQ_SLOT.is_power_of_two());
const _: () = assert!(CQ_SLOT.is_power_of_two());
const _: () = assert!(CQE_SEQ.is_multiple_of(8) && CQE_SEQ + 8 <= CQ_SLOT);

/// A decoding failure: the slot bytes describe no valid work request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ParseError {
    /// The opcode byte names no operation we implement.
    #[error("unknown opcode {0}")]
    Opcode(u8),
    /// More SGEs than [`MAX_SGE`].
    #[error("{0} sges exceed the limit of {MAX_SGE}")]
    TooManySges(u8),
    /// Inline length above [`MAX_INLINE`].
    #[error("inline length {0} exceeds the limit of {MAX_INLINE}")]
    InlineTooLong(u32),
    /// A status or opcode byte in a completion is out of range.
    #[error("bad completion field {0}")]
    Completion(&'static str),
    /// The ring's producer index claims more entries than the ring holds.
    #[error("producer index {0} out of range")]
    ProducerIndex(u32),
}

fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// One scatter/gather element: `length` bytes at virtual address `addr` of the MR `lkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Sge {
    /// Start address in the registering process's address space (or the MR's iova).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// Local key of the MR holding the range.
    pub lkey: u32,
}

impl Sge {
    /// Inlined into the WQE's decoding, so the fields go straight into the list: returned
    /// through memory, an element stored field by field and then copied whole stalled store
    /// forwarding on every SGE of every work request (`perf annotate` of the engine's fetch).
    #[inline(always)]
    fn parse(b: &[u8]) -> Sge {
        Sge {
            addr: get_u64(b, 0),
            length: get_u32(b, 8),
            lkey: get_u32(b, 12),
        }
    }
    fn encode(&self, b: &mut [u8]) {
        put_u64(b, 0, self.addr);
        put_u32(b, 8, self.length);
        put_u32(b, 12, self.lkey);
    }
}

/// Send-queue operations, numbered as `enum ibv_wr_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
pub enum SendOpcode {
    /// `IBV_WR_RDMA_WRITE`
    RdmaWrite = 0,
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`
    RdmaWriteWithImm = 1,
    /// `IBV_WR_SEND`
    Send = 2,
    /// `IBV_WR_SEND_WITH_IMM`
    SendWithImm = 3,
    /// `IBV_WR_RDMA_READ`
    RdmaRead = 4,
    /// `IBV_WR_ATOMIC_CMP_AND_SWP`
    AtomicCmpAndSwp = 5,
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD`
    AtomicFetchAndAdd = 6,
    /// `IBV_WR_LOCAL_INV`: invalidates the type 2 memory window whose R_Key is `imm_data`
    /// (the `invalidate_rkey` member of the same union in `ibv_send_wr`).
    LocalInv = 7,
    /// `IBV_WR_BIND_MW`: binds memory window `swap >> 32` (the handle the daemon gave out)
    /// to `[remote_addr, remote_addr + compare_add)` of the MR whose L_Key is `swap as u32`
    /// (length 0: unbinds a type 1 window), with access flags `imm_data` and the new R_Key
    /// `rkey` (its low 8 bits are the consumer's key; the rest must be the window's).
    BindMw = 8,
    /// `IBV_WR_SEND_WITH_INV`: a SEND that also invalidates, at the responder, the type 2
    /// window whose R_Key is `imm_data`.
    SendWithInv = 9,
    /// `IBV_WR_ATOMIC_WRITE` (IBA 1.5): the 8 bytes of its payload, which is inline and
    /// exactly 8 bytes long (what `ibv_wr_atomic_write` copies), stored at `remote_addr`
    /// (8-aligned) under `rkey` as one atomic write.
    AtomicWrite = 15,
}

impl SendOpcode {
    /// Decodes an `ibv_wr_opcode` value.
    pub fn from_u8(v: u8) -> Result<Self, ParseError> {
        Ok(match v {
            0 => Self::RdmaWrite,
            1 => Self::RdmaWriteWithImm,
            2 => Self::Send,
            3 => Self::SendWithImm,
            4 => Self::RdmaRead,
            5 => Self::AtomicCmpAndSwp,
            6 => Self::AtomicFetchAndAdd,
            7 => Self::LocalInv,
            8 => Self::BindMw,
            9 => Self::SendWithInv,
            15 => Self::AtomicWrite,
            other => return Err(ParseError::Opcode(other)),
        })
    }

    /// The `ibv_wc_opcode` a successful send-side completion reports.
    pub fn wc_opcode(self) -> WcOpcode {
        match self {
            Self::RdmaWrite | Self::RdmaWriteWithImm => WcOpcode::RdmaWrite,
            Self::Send | Self::SendWithImm | Self::SendWithInv => WcOpcode::Send,
            Self::RdmaRead => WcOpcode::RdmaRead,
            Self::AtomicCmpAndSwp => WcOpcode::CompSwap,
            Self::AtomicFetchAndAdd => WcOpcode::FetchAdd,
            Self::AtomicWrite => WcOpcode::AtomicWrite,
            Self::LocalInv => WcOpcode::LocalInv,
            Self::BindMw => WcOpcode::BindMw,
        }
    }

    /// Whether the operation is local to the requester (a memory-window bind or a local
    /// invalidation): nothing is sent for it.
    pub fn is_local(self) -> bool {
        matches!(self, Self::LocalInv | Self::BindMw)
    }

    /// Whether the responder answers the operation with data (a READ's bytes, an atomic's
    /// original value) that lands in the requester's SGEs.
    pub fn reads_back(self) -> bool {
        matches!(
            self,
            Self::RdmaRead | Self::AtomicCmpAndSwp | Self::AtomicFetchAndAdd
        )
    }

    /// Whether the operation needs an answer the IB spec gives only on reliable transports
    /// (RC, XRC): READ, the atomics and ATOMIC WRITE. UC and UD have none of them.
    pub fn needs_reliable(self) -> bool {
        self.reads_back() || self == Self::AtomicWrite
    }

    /// Whether the operation carries immediate data to the responder.
    pub fn has_imm(self) -> bool {
        matches!(self, Self::RdmaWriteWithImm | Self::SendWithImm)
    }
}

/// Flags of a send work request, bit for bit `enum ibv_send_flags`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct SendFlags(pub u8);

impl SendFlags {
    /// `IBV_SEND_FENCE`
    pub const FENCE: SendFlags = SendFlags(1);
    /// `IBV_SEND_SIGNALED`
    pub const SIGNALED: SendFlags = SendFlags(2);
    /// `IBV_SEND_SOLICITED`
    pub const SOLICITED: SendFlags = SendFlags(4);
    /// `IBV_SEND_INLINE`
    pub const INLINE: SendFlags = SendFlags(8);
    /// All flags this format knows.
    pub const ALL: u8 = 0xf;

    /// Whether every bit of `other` is set.
    pub fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl std::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        SendFlags(self.0 | rhs.0)
    }
}

/// A work request's scatter/gather list: up to [`INLINE_SGES`] entries are held in place, so
/// the common work request costs the engine no allocation; more spill to the heap.
pub type SgeList = SmallVec<[Sge; INLINE_SGES]>;

/// Inline payload bytes: up to [`INLINE_BYTES`] held in place, more on the heap.
pub type InlineData = SmallVec<[u8; INLINE_BYTES]>;

/// SGEs a work request holds without allocating.
pub const INLINE_SGES: usize = 2;
/// Inline payload bytes a work request holds without allocating.
pub const INLINE_BYTES: usize = 32;

/// Where a send work request's payload comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum SendPayload {
    /// Gathered from registered memory.
    Sges(SgeList),
    /// Carried in the slot itself (`IBV_SEND_INLINE`); no lkey is checked.
    Inline(InlineData),
}

impl SendPayload {
    /// Total payload length in bytes (saturating; the engine checks the limit).
    pub fn len(&self) -> u64 {
        match self {
            SendPayload::Sges(s) => s.iter().map(|s| u64::from(s.length)).sum(),
            SendPayload::Inline(d) => d.len() as u64,
        }
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A send work request, decoded from a [`SQ_SLOT`]-byte slot.
///
/// Slot layout (little endian): `wr_id` u64 @0, opcode u8 @8, flags u8 @9, `num_sge` u8 @10,
/// `imm_data` u32 @12 (kept as the app wrote it, big endian on the wire), `remote_addr` u64 @16,
/// `rkey` u32 @24, `inline_len` u32 @28, `compare_add` u64 @32, `swap` u64 @40, UD address
/// handle u32 @48, remote QPN u32 @52, remote Q_Key u32 @56, XRC SRQ number u32 @60, then SGEs
/// or inline bytes from @64.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SendWqe {
    /// The app's identifier, echoed in the completion.
    pub wr_id: u64,
    /// What to do.
    pub opcode: SendOpcode,
    /// Signaled, solicited, fence, inline.
    pub flags: SendFlags,
    /// Immediate data (network byte order as the app gave it).
    pub imm_data: u32,
    /// Remote address for RDMA and atomic operations.
    pub remote_addr: u64,
    /// Remote key for RDMA and atomic operations.
    pub rkey: u32,
    /// Compare (CMP_AND_SWP) or add (FETCH_AND_ADD) operand.
    pub compare_add: u64,
    /// Swap operand (CMP_AND_SWP).
    pub swap: u64,
    /// Destination of a UD send (unused on connected QPs).
    pub ud: UdAddr,
    /// The XRC SRQ number at the target of an XRC send (`qp_type.xrc.remote_srqn`; unused on
    /// other QPs).
    pub xrc_srqn: u32,
    /// The data.
    pub payload: SendPayload,
}

/// Where a UD send goes: an address handle of the sender's PD, a QP number and a Q_Key (one
/// with the high bit set means "the sending QP's own Q_Key", as in the IB spec).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UdAddr {
    /// Address handle (a handle the daemon gave out for `ibv_create_ah`).
    pub ah: u32,
    /// Destination QP number.
    pub remote_qpn: u32,
    /// Q_Key.
    pub remote_qkey: u32,
}

impl SendWqe {
    /// How many bytes of its slot the send WQE whose first [`SQ_HEADER`] bytes are `head`
    /// uses: the header, then its SGEs or its inline bytes (the whole slot when the header
    /// claims more, which [`SendWqe::parse`] then refuses). A reader copies only these into
    /// the buffer it parses, header first: what the header says is what the parse sees.
    pub fn used(head: &[u8; SQ_HEADER]) -> usize {
        let body = if head[9] & SendFlags::INLINE.0 != 0 {
            get_u32(head, 28) as usize
        } else {
            usize::from(head[10]) * SGE_SIZE
        };
        SQ_HEADER.saturating_add(body).min(SQ_SLOT)
    }

    /// Decodes a slot copied out of a send ring.
    pub fn parse(slot: &[u8; SQ_SLOT]) -> Result<Self, ParseError> {
        let opcode = SendOpcode::from_u8(slot[8])?;
        let flags = SendFlags(slot[9] & SendFlags::ALL);
        let num_sge = slot[10];
        let payload = if flags.contains(SendFlags::INLINE) {
            let len = get_u32(slot, 28);
            if len as usize > MAX_INLINE {
                return Err(ParseError::InlineTooLong(len));
            }
            SendPayload::Inline(InlineData::from_slice(
                &slot[SQ_HEADER..SQ_HEADER + len as usize],
            ))
        } else {
            if num_sge as usize > MAX_SGE {
                return Err(ParseError::TooManySges(num_sge));
            }
            SendPayload::Sges(
                (0..num_sge as usize)
                    .map(|i| Sge::parse(&slot[SQ_HEADER + i * SGE_SIZE..]))
                    .collect(),
            )
        };
        Ok(SendWqe {
            wr_id: get_u64(slot, 0),
            opcode,
            flags,
            imm_data: get_u32(slot, 12),
            remote_addr: get_u64(slot, 16),
            rkey: get_u32(slot, 24),
            compare_add: get_u64(slot, 32),
            swap: get_u64(slot, 40),
            ud: UdAddr {
                ah: get_u32(slot, 48),
                remote_qpn: get_u32(slot, 52),
                remote_qkey: get_u32(slot, 56),
            },
            xrc_srqn: get_u32(slot, 60),
            payload,
        })
    }

    /// Encodes into a slot. Panics if the payload exceeds the slot's limits, which the caller
    /// checks first (the driver library returns `EINVAL`/`ENOMEM` to the app instead).
    pub fn encode(&self, slot: &mut [u8; SQ_SLOT]) {
        slot[..SQ_HEADER].fill(0);
        put_u64(slot, 0, self.wr_id);
        slot[8] = self.opcode as u8;
        slot[9] = self.flags.0;
        put_u32(slot, 12, self.imm_data);
        put_u64(slot, 16, self.remote_addr);
        put_u32(slot, 24, self.rkey);
        put_u64(slot, 32, self.compare_add);
        put_u64(slot, 40, self.swap);
        put_u32(slot, 48, self.ud.ah);
        put_u32(slot, 52, self.ud.remote_qpn);
        put_u32(slot, 56, self.ud.remote_qkey);
        put_u32(slot, 60, self.xrc_srqn);
        match &self.payload {
            SendPayload::Sges(sges) => {
                assert!(sges.len() <= MAX_SGE, "caller checks the SGE limit");
                slot[10] = sges.len() as u8;
                for (i, s) in sges.iter().enumerate() {
                    s.encode(&mut slot[SQ_HEADER + i * SGE_SIZE..]);
                }
            }
            SendPayload::Inline(data) => {
                assert!(data.len() <= MAX_INLINE, "caller checks the inline limit");
                put_u32(slot, 28, data.len() as u32);
                slot[SQ_HEADER..SQ_HEADER + data.len()].copy_from_slice(data);
            }
        }
    }
}

/// A receive work request, decoded from a [`RQ_SLOT`]-byte slot.
///
/// Slot layout: `wr_id` u64 @0, `num_sge` u32 @8, SGEs from @16.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecvWqe {
    /// The app's identifier, echoed in the completion.
    pub wr_id: u64,
    /// Where incoming data is scattered.
    pub sges: SgeList,
}

impl RecvWqe {
    /// How many bytes of its slot the receive WQE whose first [`RQ_HEADER`] bytes are `head`
    /// uses (the whole slot when the header claims more; see [`SendWqe::used`]).
    pub fn used(head: &[u8; RQ_HEADER]) -> usize {
        let n = usize::try_from(get_u32(head, 8)).unwrap_or(usize::MAX);
        RQ_HEADER
            .saturating_add(n.saturating_mul(SGE_SIZE))
            .min(RQ_SLOT)
    }

    /// Decodes a slot copied out of a receive ring.
    pub fn parse(slot: &[u8; RQ_SLOT]) -> Result<Self, ParseError> {
        let n = get_u32(slot, 8);
        if n as usize > MAX_SGE {
            return Err(ParseError::TooManySges(n.min(255) as u8));
        }
        let sges = (0..n as usize)
            .map(|i| Sge::parse(&slot[RQ_HEADER + i * SGE_SIZE..]))
            .collect();
        Ok(RecvWqe {
            wr_id: get_u64(slot, 0),
            sges,
        })
    }

    /// Encodes into a slot; panics above [`MAX_SGE`] SGEs (the caller checks first).
    pub fn encode(&self, slot: &mut [u8; RQ_SLOT]) {
        assert!(self.sges.len() <= MAX_SGE, "caller checks the SGE limit");
        slot[..RQ_HEADER].fill(0);
        put_u64(slot, 0, self.wr_id);
        put_u32(slot, 8, self.sges.len() as u32);
        for (i, s) in self.sges.iter().enumerate() {
            s.encode(&mut slot[RQ_HEADER + i * SGE_SIZE..]);
        }
    }
}

/// Completion status, numbered as `enum ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
}

impl WcStatus {
    /// Decodes an `ibv_wc_status` value.
    pub fn from_u8(v: u8) -> Option<Self> {
        use WcStatus::*;
        const ALL: [WcStatus; 22] = [
            Success,
            LocLenErr,
            LocQpOpErr,
            LocEecOpErr,
            LocProtErr,
            WrFlushErr,
            MwBindErr,
            BadRespErr,
            LocAccessErr,
            RemInvReqErr,
            RemAccessErr,
            RemOpErr,
            RetryExcErr,
            RnrRetryExcErr,
            LocRddViolErr,
            RemInvRdReqErr,
            RemAbortErr,
            InvEecnErr,
            InvEecStateErr,
            FatalErr,
            RespTimeoutErr,
            GeneralErr,
        ];
        ALL.get(v as usize).copied()
    }
}

/// Completion opcode, numbered as `enum ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum WcOpcode {
    Send = 0,
    RdmaWrite = 1,
    RdmaRead = 2,
    CompSwap = 3,
    FetchAdd = 4,
    BindMw = 5,
    LocalInv = 6,
    AtomicWrite = 9,
    Recv = 128,
    RecvRdmaWithImm = 129,
}

impl WcOpcode {
    /// Decodes an `ibv_wc_opcode` value.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => Self::Send,
            1 => Self::RdmaWrite,
            2 => Self::RdmaRead,
            3 => Self::CompSwap,
            4 => Self::FetchAdd,
            5 => Self::BindMw,
            6 => Self::LocalInv,
            9 => Self::AtomicWrite,
            128 => Self::Recv,
            129 => Self::RecvRdmaWithImm,
            _ => return None,
        })
    }
}

/// `IBV_WC_GRH`: a GRH occupies the first 40 bytes of the receive buffer.
pub const WC_GRH: u8 = 1;
/// `IBV_WC_WITH_IMM`: `imm_data` is valid.
pub const WC_WITH_IMM: u8 = 2;
/// `IBV_WC_WITH_INV`: the message invalidated the R_Key in `imm_data` (`invalidated_rkey`).
pub const WC_WITH_INV: u8 = 8;

/// A completion as the engine produces it and the driver library reports it in `struct ibv_wc`.
///
/// Slot layout: `wr_id` u64 @0, status u8 @8, opcode u8 @9, `wc_flags` u8 @10, `sl` u8 @11,
/// `byte_len` u32 @12, `imm_data` u32 @16, `qp_num` u32 @20, `src_qp` u32 @24, `slid` u16 @28,
/// `dlid_path_bits` u8 @30, `pkey_index` u16 @32, `vendor_err` u32 @36, timestamp u64 @40.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cqe {
    /// The work request's identifier.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Operation (only meaningful on success, as with rdma-core).
    pub opcode: WcOpcode,
    /// `IBV_WC_*` flags.
    pub wc_flags: u8,
    /// Bytes received (receive completions) or read.
    pub byte_len: u32,
    /// Immediate data, as sent.
    pub imm_data: u32,
    /// The local QP number.
    pub qp_num: u32,
    /// The remote QP number (UD).
    pub src_qp: u32,
    /// The source LID.
    pub slid: u16,
    /// Service level.
    pub sl: u8,
    /// Vendor error syndrome: nonzero only on errors, a hint for logs.
    pub vendor_err: u32,
    /// Completion time in nanoseconds of the daemon's monotonic clock, 0 if not kept.
    pub timestamp_ns: u64,
}

impl Cqe {
    /// Decodes a slot copied out of a completion ring.
    pub fn parse(slot: &[u8; CQ_SLOT]) -> Result<Self, ParseError> {
        Ok(Cqe {
            wr_id: get_u64(slot, 0),
            status: WcStatus::from_u8(slot[8]).ok_or(ParseError::Completion("status"))?,
            opcode: WcOpcode::from_u8(slot[9]).ok_or(ParseError::Completion("opcode"))?,
            wc_flags: slot[10],
            sl: slot[11],
            byte_len: get_u32(slot, 12),
            imm_data: get_u32(slot, 16),
            qp_num: get_u32(slot, 20),
            src_qp: get_u32(slot, 24),
            slid: get_u16(slot, 28),
            vendor_err: get_u32(slot, 36),
            timestamp_ns: get_u64(slot, 40),
        })
    }

    /// Encodes into a slot (its sequence word, at [`CQE_SEQ`], left zero: the producer
    /// stores it on its own, last).
    pub fn encode(&self, slot: &mut [u8; CQ_SLOT]) {
        slot.fill(0);
        put_u64(slot, 0, self.wr_id);
        slot[8] = self.status as u8;
        slot[9] = self.opcode as u8;
        slot[10] = self.wc_flags;
        slot[11] = self.sl;
        put_u32(slot, 12, self.byte_len);
        put_u32(slot, 16, self.imm_data);
        put_u32(slot, 20, self.qp_num);
        put_u32(slot, 24, self.src_qp);
        put_u16(slot, 28, self.slid);
        put_u32(slot, 36, self.vendor_err);
        put_u64(slot, 40, self.timestamp_ns);
    }
}

/// QP states, numbered as `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum QpState {
    #[default]
    Reset = 0,
    Init = 1,
    Rtr = 2,
    Rts = 3,
    Sqd = 4,
    Sqe = 5,
    Err = 6,
}

impl QpState {
    /// Decodes an `ibv_qp_state` value.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::Sqd,
            5 => Self::Sqe,
            6 => Self::Err,
            _ => return None,
        })
    }
}

/// QP transport types, numbered as `enum ibv_qp_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[repr(u8)]
#[allow(missing_docs)]
pub enum QpType {
    Rc = 2,
    Uc = 3,
    Ud = 4,
    /// `IBV_QPT_XRC_SEND` (the XRC initiator): a send queue only; each work request names
    /// the XRC SRQ that receives it at the target.
    XrcSend = 9,
    /// `IBV_QPT_XRC_RECV` (the XRC target): no queues of its own; a message lands in the XRC
    /// SRQ its requester names, of the same XRC domain.
    XrcRecv = 10,
}

impl QpType {
    /// Whether it is reliable and connected (RC and both XRC halves): acknowledged, with RDMA
    /// READ and atomics.
    pub const fn is_reliable(self) -> bool {
        matches!(self, QpType::Rc | QpType::XrcSend | QpType::XrcRecv)
    }
}

/// Capacities of a QP (`struct ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// SGEs per send work request.
    pub max_send_sge: u32,
    /// SGEs per receive work request.
    pub max_recv_sge: u32,
    /// Inline bytes per send work request.
    pub max_inline_data: u32,
}

/// Global route header fields of an address vector (`struct ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct GlobalRoute {
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Flow label.
    pub flow_label: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// An address vector (`struct ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AhAttr {
    /// Global routing (used when `is_global`).
    pub grh: GlobalRoute,
    /// Destination LID.
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Source path bits.
    pub src_path_bits: u8,
    /// Static rate.
    pub static_rate: u8,
    /// Whether `grh` is valid: the destination is found by GID instead of LID.
    pub is_global: bool,
    /// Local port number.
    pub port_num: u8,
}

/// QP attributes (`struct ibv_qp_attr`), used by modify and query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct QpAttr {
    /// `qp_state`: the state to move to (modify) or the current one (query).
    pub qp_state: QpState,
    /// `cur_qp_state`.
    pub cur_qp_state: QpState,
    /// `path_mtu` as `enum ibv_mtu` (1 = 256 ... 5 = 4096).
    pub path_mtu: u8,
    /// `path_mig_state`.
    pub path_mig_state: u8,
    /// Q_Key (UD).
    pub qkey: u32,
    /// Receive PSN.
    pub rq_psn: u32,
    /// Send PSN.
    pub sq_psn: u32,
    /// Remote QP number.
    pub dest_qp_num: u32,
    /// Remote access allowed to incoming requests (`IBV_ACCESS_REMOTE_*`).
    pub qp_access_flags: u32,
    /// Capacities.
    pub cap: QpCap,
    /// Primary path.
    pub ah_attr: AhAttr,
    /// Alternate path.
    pub alt_ah_attr: AhAttr,
    /// P_Key index.
    pub pkey_index: u16,
    /// Alternate P_Key index.
    pub alt_pkey_index: u16,
    /// Whether the SQD-drained event is requested.
    pub en_sqd_async_notify: u8,
    /// Whether the SQ is draining (query).
    pub sq_draining: u8,
    /// Outstanding RDMA reads/atomics as initiator.
    pub max_rd_atomic: u8,
    /// Outstanding RDMA reads/atomics as responder.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (0..=31, IB spec table).
    pub min_rnr_timer: u8,
    /// Port number.
    pub port_num: u8,
    /// Local ACK timeout code: 4.096 us * 2^timeout (0 = infinite).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// Alternate port.
    pub alt_port_num: u8,
    /// Alternate timeout.
    pub alt_timeout: u8,
}

/// Memory access flags, bit for bit `enum ibv_access_flags`.
pub mod access {
    /// `IBV_ACCESS_LOCAL_WRITE`
    pub const LOCAL_WRITE: u32 = 1;
    /// `IBV_ACCESS_REMOTE_WRITE`
    pub const REMOTE_WRITE: u32 = 2;
    /// `IBV_ACCESS_REMOTE_READ`
    pub const REMOTE_READ: u32 = 4;
    /// `IBV_ACCESS_REMOTE_ATOMIC`
    pub const REMOTE_ATOMIC: u32 = 8;
    /// `IBV_ACCESS_MW_BIND`
    pub const MW_BIND: u32 = 16;
    /// `IBV_ACCESS_ZERO_BASED`
    pub const ZERO_BASED: u32 = 32;
    /// `IBV_ACCESS_ON_DEMAND`
    pub const ON_DEMAND: u32 = 64;
    /// `IBV_ACCESS_HUGETLB`
    pub const HUGETLB: u32 = 128;
    /// `IBV_ACCESS_RELAXED_ORDERING`
    pub const RELAXED_ORDERING: u32 = 1 << 20;
    /// Flags accepted on registration; `ON_DEMAND` and `ZERO_BASED` are refused.
    pub const SUPPORTED: u32 = LOCAL_WRITE
        | REMOTE_WRITE
        | REMOTE_READ
        | REMOTE_ATOMIC
        | MW_BIND
        | HUGETLB
        | RELAXED_ORDERING;
    /// Flags a memory window may be bound with: those a registration takes (a window grants
    /// only the remote ones; rdma-core's own tests bind windows with `LOCAL_WRITE` among
    /// them, which rxe and mlx5 take). `ZERO_BASED` windows are refused.
    pub const MW_SUPPORTED: u32 = SUPPORTED;
    /// The rights a memory window grants.
    pub const MW_RIGHTS: u32 = REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
}

/// `ibv_qp_attr_mask` bits.
pub mod qp_attr {
    #![allow(missing_docs)]
    pub const STATE: u32 = 1;
    pub const CUR_STATE: u32 = 1 << 1;
    pub const EN_SQD_ASYNC_NOTIFY: u32 = 1 << 2;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const QKEY: u32 = 1 << 6;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const ALT_PATH: u32 = 1 << 14;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const PATH_MIG_STATE: u32 = 1 << 18;
    pub const CAP: u32 = 1 << 19;
    pub const DEST_QPN: u32 = 1 << 20;
    pub const RATE_LIMIT: u32 = 1 << 25;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_wqe_round_trips_with_sges_and_inline() {
        let mut wqe = SendWqe {
            wr_id: u64::MAX,
            opcode: SendOpcode::RdmaWriteWithImm,
            flags: SendFlags::SIGNALED | SendFlags::FENCE,
            imm_data: 0xdead_beef,
            remote_addr: 0x1234_5678_9abc,
            rkey: 99,
            compare_add: 1,
            swap: 2,
            ud: Default::default(),
            xrc_srqn: 0x00ab_cdef,
            payload: SendPayload::Sges(
                (0..MAX_SGE as u32)
                    .map(|i| Sge {
                        addr: i as u64,
                        length: i,
                        lkey: i,
                    })
                    .collect(),
            ),
        };
        let mut slot = [0xffu8; SQ_SLOT];
        wqe.encode(&mut slot);
        assert_eq!(SendWqe::parse(&slot).unwrap(), wqe);
        wqe.flags = SendFlags::INLINE;
        wqe.payload = SendPayload::Inline(smallvec::smallvec![7; MAX_INLINE]);
        wqe.encode(&mut slot);
        assert_eq!(SendWqe::parse(&slot).unwrap(), wqe);
    }

    /// What a reader copies (the header, then the bytes `used` names) parses to the WQE that
    /// was encoded, whatever the rest of its buffer holds; garbage headers name at most a slot.
    #[test]
    fn the_bytes_a_wqe_uses_are_all_its_parse_reads() {
        let sges = |n: u32| -> SgeList {
            (0..n)
                .map(|i| Sge {
                    addr: 0x1000 * u64::from(i) + 3,
                    length: i + 1,
                    lkey: i + 7,
                })
                .collect()
        };
        let mut cases: Vec<SendPayload> = (0..=MAX_SGE as u32)
            .map(|n| SendPayload::Sges(sges(n)))
            .collect();
        cases.extend(
            [0, 1, 17, MAX_INLINE].map(|n| SendPayload::Inline(smallvec::smallvec![0x5a; n])),
        );
        for payload in cases {
            let flags = match payload {
                SendPayload::Inline(_) => SendFlags::INLINE,
                SendPayload::Sges(_) => SendFlags::SIGNALED,
            };
            let wqe = SendWqe {
                wr_id: 42,
                opcode: SendOpcode::RdmaWrite,
                flags,
                imm_data: 0,
                remote_addr: 0x9000,
                rkey: 5,
                compare_add: 0,
                swap: 0,
                ud: Default::default(),
                xrc_srqn: 0,
                payload,
            };
            let mut slot = [0u8; SQ_SLOT];
            wqe.encode(&mut slot);
            let used = SendWqe::used(slot[..SQ_HEADER].try_into().unwrap());
            let mut copy = [0xeeu8; SQ_SLOT];
            copy[..used].copy_from_slice(&slot[..used]);
            assert_eq!(SendWqe::parse(&copy).unwrap(), wqe, "{used} bytes");
            let want = RecvWqe {
                wr_id: 9,
                sges: sges(((used - SQ_HEADER) / SGE_SIZE).min(MAX_SGE) as u32),
            };
            let mut r = [0u8; RQ_SLOT];
            want.encode(&mut r);
            let used = RecvWqe::used(r[..RQ_HEADER].try_into().unwrap());
            let mut copy = [0xeeu8; RQ_SLOT];
            copy[..used].copy_from_slice(&r[..used]);
            assert_eq!(RecvWqe::parse(&copy).unwrap(), want);
        }
        assert_eq!(SendWqe::used(&[0xff; SQ_HEADER]), SQ_SLOT);
        assert_eq!(RecvWqe::used(&[0xff; RQ_HEADER]), RQ_SLOT);
    }

    /// `IBV_WR_ATOMIC_WRITE` is 15 (verbs.h); 10 to 14 (TSO, driver, FLUSH) are not offered.
    #[test]
    fn an_atomic_write_is_opcode_15_with_its_eight_bytes_inline() {
        let wqe = SendWqe {
            wr_id: 9,
            opcode: SendOpcode::AtomicWrite,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
            imm_data: 0,
            remote_addr: 0x7000_0040,
            rkey: 0x1234,
            compare_add: 0,
            swap: 0,
            ud: UdAddr::default(),
            xrc_srqn: 0,
            payload: SendPayload::Inline(smallvec::SmallVec::from_slice(&[1, 2, 3, 4, 5, 6, 7, 8])),
        };
        let mut slot = [0u8; SQ_SLOT];
        wqe.encode(&mut slot);
        assert_eq!(slot[8], 15);
        assert_eq!(SendWqe::parse(&slot).unwrap(), wqe);
        assert_eq!(SendOpcode::AtomicWrite.wc_opcode(), WcOpcode::AtomicWrite);
        assert_eq!(WcOpcode::from_u8(9), Some(WcOpcode::AtomicWrite));
        assert!(SendOpcode::AtomicWrite.needs_reliable() && !SendOpcode::AtomicWrite.reads_back());
        for op in 10..15 {
            slot[8] = op;
            assert_eq!(SendWqe::parse(&slot), Err(ParseError::Opcode(op)));
        }
    }

    #[test]
    fn garbage_slots_are_refused_not_trusted() {
        let mut slot = [0u8; SQ_SLOT];
        slot[8] = 200;
        assert_eq!(SendWqe::parse(&slot), Err(ParseError::Opcode(200)));
        slot[8] = 2;
        slot[10] = 17;
        assert_eq!(SendWqe::parse(&slot), Err(ParseError::TooManySges(17)));
        slot[9] = SendFlags::INLINE.0;
        slot[28] = 0xff;
        slot[29] = 0xff;
        assert!(matches!(
            SendWqe::parse(&slot),
            Err(ParseError::InlineTooLong(_))
        ));
        let mut r = [0u8; RQ_SLOT];
        r[8] = 0xff;
        r[11] = 0xff;
        assert!(RecvWqe::parse(&r).is_err());
    }

    #[test]
    fn cqe_round_trips() {
        let cqe = Cqe {
            wr_id: 5,
            status: WcStatus::RemAccessErr,
            opcode: WcOpcode::RecvRdmaWithImm,
            wc_flags: WC_WITH_IMM,
            byte_len: 4097,
            imm_data: 0x01020304,
            qp_num: 0x11,
            src_qp: 0x12,
            slid: 3,
            sl: 0,
            vendor_err: 0,
            timestamp_ns: 42,
        };
        let mut slot = [0u8; CQ_SLOT];
        cqe.encode(&mut slot);
        assert_eq!(Cqe::parse(&slot).unwrap(), cqe);
    }

    #[test]
    fn every_status_value_decodes_to_itself() {
        for v in 0..=21u8 {
            assert_eq!(WcStatus::from_u8(v).unwrap() as u8, v);
        }
        assert!(WcStatus::from_u8(22).is_none());
    }
}
