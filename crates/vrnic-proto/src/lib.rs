//! The vrnic engine: executes verbs work requests the way an RNIC does, with no I/O of its own.
//!
//! The engine plays the RNIC inside the host daemon. It owns the objects of every vRNIC on
//! the daemon (protection domains, memory regions, completion queues, queue pairs), runs the
//! QP state machine with the attribute-mask rules of the InfiniBand spec (`EINVAL` for a
//! missing or disallowed mask bit or an illegal transition), and executes RC, UC and UD work
//! requests between QPs it holds, copying each byte once from the source MR to the
//! destination MR: SEND and SEND_WITH_IMM (matched to posted receives, from the QP's own queue
//! or a shared receive queue; RNR waits when none is posted, and retries as soon as one is),
//! RDMA WRITE and WRITE_WITH_IMM, RDMA READ, the two atomics and ATOMIC WRITE (IBA 1.5: 8
//! bytes stored by one atomic store, [`Memory::store_u64`]), memory windows (type 1 and
//! 2: bind work requests, local invalidation, SEND with Invalidate, remote access through a
//! window's rkey), XRC (domains, XRC SRQs named by number from an XRC send QP's work
//! requests, XRC receive QPs that deliver into the SRQs of their own domain); UD datagrams go through
//! address handles, with a GRH in the receive buffer and Q_Key checks. lkey/rkey, PD, access-flag and bounds checks produce the completion statuses
//! a real device (rxe) produces; an error completes its work request, flushes the rest with
//! `WR_FLUSH_ERR`, moves the QP to ERR and raises [`Event::QpFatal`].
//!
//! Inside, the two ends of a message are apart, as on a fabric: the requester cuts a work
//! request into request segments (IB transport semantics: opcode, destination QPN, PSN,
//! RETH/AtomicETH/ImmDt/DETH, the payload as region runs rather than bytes), and sends each
//! along the route its QP resolved at RTR (an address handle at creation); the responder checks
//! the connection, the PSN (a duplicate is answered without effect, a gap is NAKed), its
//! receive and its memory, places the payload, and answers ACK, RNR NAK, NAK, READ data or the
//! atomic's original value, which the requester acts on. Same-daemon delivery is a call, and
//! still one copy per byte, also into another engine of the daemon (an engine thread's,
//! [`Siblings`]).
//!
//! # What it is not
//!
//! Not a transport, a ring reader or a memory mapper. It reaches registered memory only
//! through the [`Memory`] trait (the daemon implements it over the mapped region files, tests
//! over vectors), learns time only from `now` arguments and randomness (memory keys) only
//! from the seed given to [`Engine::new`]. No threads, sockets, clocks or `unsafe`.
//!
//! # Driving it
//!
//! * Control verbs (`alloc_pd`, `reg_mr`, `create_qp`, `modify_qp`, ...) return
//!   `Result<_, Errno>`; every one checks that the object belongs to the calling context.
//! * Work requests come from the rings: hand at most [`Engine::sq_room`] /
//!   [`Engine::rq_room`] of them to [`Engine::handle_send_wqe`] /
//!   [`Engine::handle_recv_wqe`]; ring slots up to [`Engine::sq_retired`] /
//!   [`Engine::rq_retired`] (free-running counts) may be reused by the app.
//! * [`Engine::process`] executes a bounded amount (at most [`PASS_WRS`] work requests and
//!   about [`PASS_BYTES`] bytes; vRNICs with work take turns of at most [`VNIC_WRS`] and
//!   [`CHUNK`], a newly active one first; large messages move in chunks over several calls)
//!   and says whether it did anything; call it again while it does. Then drain
//!   [`Engine::poll_completion`] and [`Engine::poll_event`], and publish what
//!   [`Engine::drain_retired`] hands over (only queues whose retired counters moved).
//!   Idle QPs are in no list and cost nothing; a blocked one waits for a receive, a responder
//!   or its timer.
//! * When idle, sleep until [`Engine::poll_timeout`] (RNR and transport timers) or the next
//!   doorbell, then call [`Engine::handle_timeout`] and [`Engine::process`].
//!
//! # Panics
//!
//! None on any input: work requests are untrusted, so their lengths, SGE counts, keys and
//! addresses are checked with checked arithmetic, and every loop they drive is bounded. The
//! page lists given to [`Engine::reg_mr`] are trusted: the daemon builds them and its
//! [`Memory`] must accept every offset in them.
//!
//! # Example
//!
//! Two vRNICs, one RC QP on each, connected; an RDMA WRITE lands in the peer's MR.
//!
//! ```
//! use std::time::Instant;
//! use vrnic_proto::{CtxId, Engine, Loc, Memory, MemoryRefused, VnicId};
//! use vrnic_wire::{
//!     AhAttr, QpAttr, QpCap, QpState, QpType, SendFlags, SendOpcode, SendPayload, SendWqe, Sge,
//!     WcStatus, access, qp_attr,
//! };
//!
//! /// One 8 KiB region per vRNIC.
//! struct Regions(Vec<Vec<u8>>);
//! impl Memory for Regions {
//!     fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
//!         let mut tmp = vec![0; len];
//!         self.read(src, &mut tmp)?;
//!         self.write(dst, &tmp)
//!     }
//!     fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
//!         let at = dst.off as usize;
//!         let r = self.0.get_mut(dst.vnic.0 as usize).ok_or(MemoryRefused)?;
//!         r.get_mut(at..at + data.len()).ok_or(MemoryRefused)?.copy_from_slice(data);
//!         Ok(())
//!     }
//!     fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
//!         let at = src.off as usize;
//!         let r = self.0.get(src.vnic.0 as usize).ok_or(MemoryRefused)?;
//!         out.copy_from_slice(r.get(at..at + out.len()).ok_or(MemoryRefused)?);
//!         Ok(())
//!     }
//!     // Private vectors, reached by this thread alone: a plain write is atomic enough.
//!     fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
//!         self.write(dst, &value)
//!     }
//! }
//!
//! let now = Instant::now();
//! let mut e = Engine::new(7);
//! let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
//! let mut side = Vec::new();
//! for i in 0..2u32 {
//!     let (vnic, ctx) = (VnicId(i), CtxId(i));
//!     e.add_vnic(vnic, 10 + i as u16, [i as u8; 16]);
//!     let pd = e.alloc_pd(vnic, ctx).unwrap();
//!     let cq = e.create_cq(vnic, ctx, 16).unwrap();
//!     let (qp, qpn) = e.create_qp(ctx, pd, cq, cq, QpType::Rc, cap, true).unwrap();
//!     // The app's page at 0x7000 is region page 4096 of its vRNIC.
//!     let acc = access::LOCAL_WRITE | access::REMOTE_WRITE;
//!     let keys = e.reg_mr(ctx, pd, 0x7000, 4096, 0x7000, acc, &[(4096, 1)]).unwrap();
//!     side.push((ctx, qp, qpn, cq, keys));
//! }
//! for i in 0..2 {
//!     let (ctx, qp, peer_qpn) = (side[i].0, side[i].1, side[1 - i].2);
//!     let mut a = QpAttr { qp_state: QpState::Init, port_num: 1, qp_access_flags: access::REMOTE_WRITE, ..Default::default() };
//!     e.modify_qp(now, ctx, qp, qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS, &a).unwrap();
//!     a.qp_state = QpState::Rtr;
//!     a.path_mtu = 5;
//!     a.dest_qp_num = peer_qpn;
//!     a.min_rnr_timer = 12;
//!     a.ah_attr = AhAttr { dlid: 10 + (1 - i) as u16, port_num: 1, ..Default::default() };
//!     let rtr = qp_attr::STATE | qp_attr::AV | qp_attr::PATH_MTU | qp_attr::DEST_QPN
//!         | qp_attr::RQ_PSN | qp_attr::MAX_DEST_RD_ATOMIC | qp_attr::MIN_RNR_TIMER;
//!     e.modify_qp(now, ctx, qp, rtr, &a).unwrap();
//!     a.qp_state = QpState::Rts;
//!     a.timeout = 14;
//!     a.retry_cnt = 7;
//!     a.rnr_retry = 7;
//!     let rts = qp_attr::STATE | qp_attr::SQ_PSN | qp_attr::TIMEOUT | qp_attr::RETRY_CNT
//!         | qp_attr::RNR_RETRY | qp_attr::MAX_QP_RD_ATOMIC;
//!     e.modify_qp(now, ctx, qp, rts, &a).unwrap();
//! }
//!
//! let mut mem = Regions(vec![vec![0; 8192], vec![0; 8192]]);
//! mem.0[0][4096 + 16..4096 + 21].copy_from_slice(b"hello");
//! let (_, qp, _, cq, src) = side[0];
//! let dst = side[1].4;
//! let wqe = SendWqe {
//!     wr_id: 1,
//!     opcode: SendOpcode::RdmaWrite,
//!     flags: SendFlags::SIGNALED,
//!     imm_data: 0,
//!     remote_addr: 0x7100,
//!     rkey: dst.rkey,
//!     compare_add: 0,
//!     swap: 0,
//!     ud: Default::default(),
//!     xrc_srqn: 0,
//!     payload: SendPayload::Sges([Sge { addr: 0x7010, length: 5, lkey: src.lkey }].into_iter().collect()),
//! };
//! e.handle_send_wqe(now, qp, Ok(wqe));
//! while e.process(now, &mut mem) {}
//! assert_eq!(&mem.0[1][4096 + 0x100..4096 + 0x105], b"hello");
//! let (on, c, _solicited) = e.poll_completion().unwrap();
//! assert_eq!((on, c.wr_id, c.status), (cq, 1, WcStatus::Success));
//! assert_eq!(e.sq_retired(qp), 1);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod engine;
mod state;

pub use engine::{
    BURST, CHUNK, CHUNK_ALONE, CLASSES, Engine, Flow, GRH_LEN, LIGHT_MAX, Limit, MAX_AH, MAX_CQ,
    MAX_CQE, MAX_MR, MAX_MW, MAX_PD, MAX_QP, MAX_QP_WR, MAX_REFUSALS, MAX_SRQ, MAX_XRCD, MW_TYPE_1,
    MW_TYPE_2, Meter, PAGE, PASS_BYTES, PASS_WRS, Placement, Policy, QP_WRS, Refusal, Refused,
    SEGMENT, SOLO_TURNS, STEP, Sender, Transmit, Turn, TxPayload, UD_MTU, VNIC_WRS, WINDOW,
    WINDOW_FULL, Windows,
};

/// A positive errno value, returned for local misuse or resource failure.
pub type Errno = i32;

/// errno values used by the engine (Linux numbering).
pub mod errno {
    #![allow(missing_docs)]
    pub const EPERM: i32 = 1;
    pub const ENOENT: i32 = 2;
    pub const EBADF: i32 = 9;
    pub const ENOMEM: i32 = 12;
    pub const EBUSY: i32 = 16;
    pub const EEXIST: i32 = 17;
    pub const EINVAL: i32 = 22;
    pub const ENOSYS: i32 = 38;
    pub const EOPNOTSUPP: i32 = 95;
}

macro_rules! id {
    ($($(#[$m:meta])* $name:ident),*) => {$(
        $(#[$m])*
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u32);
    )*};
}

id! {
    /// A vRNIC.
    VnicId,
    /// An attached context (one device open); owns the objects it creates.
    CtxId,
    /// A protection domain.
    PdId,
    /// A memory region.
    MrId,
    /// A completion queue.
    CqId,
    /// A queue pair.
    QpId,
    /// A shared receive queue.
    SrqId,
    /// An address handle (UD destinations).
    AhId,
    /// A memory window.
    MwId,
    /// Another daemon (a host), as the transport numbers its peer links.
    HostId,
    /// A tenants' group: routes join vRNICs of one group only (the daemon numbers the groups'
    /// names; 0 is the default group).
    GroupId,
    /// An XRC domain as one context opened it (`struct ibv_xrcd`); several may name one
    /// domain.
    XrcdId
}

/// A byte location: offset `off` in the shared region of `vnic`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Whose region.
    pub vnic: VnicId,
    /// Byte offset in it.
    pub off: u64,
}

/// Access to registered memory, implemented by the daemon over mapped regions. Each call may
/// be refused ([`MemoryRefused`]: memory the daemon cannot reach, such as a region its tenant
/// truncated); the engine then completes the work request with an error, never success.
pub trait Memory {
    /// Copies `len` bytes (memmove semantics: ranges may overlap).
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused>;
    /// Writes `data` at `dst`.
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused>;
    /// Reads `out.len()` bytes at `src`.
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused>;
    /// Stores `value` at `dst`, which the engine has checked to be 8-byte aligned, as one
    /// atomic store that orders after every write made before it (release): a concurrent
    /// reader of the word, in any process, sees the old 8 bytes or the new ones, never a mix
    /// (an ATOMIC WRITE's promise).
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused>;
}

/// The other engines of this daemon (its engine threads), as a driver lets an engine reach
/// them while it runs a turn ([`Engine::turn_with`]). An engine names them as hosts
/// ([`Engine::set_siblings`]); a work request whose destination is on one of them is executed
/// by the engine that took it, to the end, as if both QPs were its own: the sibling's
/// responder checks and places it inside `f`, the payload copied once, straight from one
/// region into the other. No frame, PSN window or ACK goes between engines of one daemon.
pub trait Siblings {
    /// Runs `f` with the engine that serves sibling host `host` (held for the call, so no
    /// other thread changes it meanwhile) and a [`Memory`] that reaches both engines'
    /// regions. With `recv_for` (the request takes a receive at QP number `recv_for`), the
    /// driver first hands that engine the receives posted to that QP's queue or SRQ since its
    /// last look, if it holds none ([`Engine::receives_wanted`]), as a pass of its own would.
    /// `None`, without calling `f`, if that engine is busy now (another thread holds it): the
    /// work request waits for the next pass ([`Engine::has_deferred`]). Generic, not a trait
    /// object: the requester's step is compiled for each driver's siblings, and the call and
    /// `f` inline into it (a dynamic call and closure cost a sixth of what a request across
    /// engines costs beyond one on one engine).
    fn with<R>(
        &mut self,
        host: HostId,
        recv_for: Option<u32>,
        f: impl FnOnce(&mut Engine, &mut dyn Memory) -> R,
    ) -> Option<R>;
}

/// No sibling engines (a daemon with one engine, or a test): a destination on one is never
/// reached.
pub struct NoSiblings;

impl Siblings for NoSiblings {
    fn with<R>(
        &mut self,
        _: HostId,
        _: Option<u32>,
        _: impl FnOnce(&mut Engine, &mut dyn Memory) -> R,
    ) -> Option<R> {
        None
    }
}

/// What a driver tells an engine between the steps of a turn ([`Engine::turn_with`]): whether
/// a light tenant, one whose recent turns did all their work while others waited
/// ([`Engine::is_light`]), has posted work the engine has not taken yet. While a light tenant
/// competes, a turn moves memory in steps of at most [`STEP`] bytes and asks after each: a yes
/// ends the turn, so the newcomer waits for one step of a busy tenant's copying, not for its
/// whole turn, and a busy tenant's turn is cut only when a light one has work. It is asked
/// after every step of a busy turn: a driver answers from a few loads (a doorbell word, the
/// producer indices of the light tenants' rings it watches), never a full look.
pub trait Newcomers {
    /// Whether a light tenant has work posted that the engine has not taken.
    fn arrived(&mut self) -> bool;
}

/// No driver to ask (a test, or a caller that looks only between turns): turns end at their
/// byte and work-request budgets alone.
pub struct NoNewcomers;

impl Newcomers for NoNewcomers {
    fn arrived(&mut self) -> bool {
        false
    }
}

/// A copy, write or read that [`Memory`] could not make. The work request it served completes
/// with an error: the responder answers Remote Operational Error (the requester sees
/// `IBV_WC_REM_OP_ERR`) and a receive it took, or a requester's own READ or atomic result,
/// completes with `IBV_WC_GENERAL_ERR`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("memory the daemon cannot reach")]
pub struct MemoryRefused;

/// Keys of a new memory region.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct MrKeys {
    /// Its handle.
    pub mr: MrId,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

/// Asynchronous events for the owning context.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// `IBV_EVENT_QP_FATAL`: the QP went to ERR because of an error.
    QpFatal {
        /// The QP.
        qp: QpId,
    },
    /// `IBV_EVENT_CQ_ERR`.
    CqError {
        /// The CQ.
        cq: CqId,
    },
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: fewer receives than the armed limit are posted (the
    /// limit disarms; `ibv_modify_srq` arms it again).
    SrqLimit {
        /// The SRQ.
        srq: SrqId,
    },
    /// `IBV_EVENT_SRQ_ERR`: the SRQ's ring was broken; it takes no more receives.
    SrqError {
        /// The SRQ.
        srq: SrqId,
    },
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP attached to an SRQ went to ERR and will take no
    /// more receives from it.
    LastWqeReached {
        /// The QP.
        qp: QpId,
    },
}
