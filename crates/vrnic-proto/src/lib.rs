//! The vrnic engine: executes verbs work requests the way an RNIC does, with no I/O of its own.
//!
//! The engine owns the objects of every vRNIC on a daemon (protection domains, memory regions,
//! completion queues, queue pairs), runs the QP state machine with the attribute-mask rules of
//! the InfiniBand spec, and executes RC work requests between QPs it holds: SEND and
//! SEND_WITH_IMM (matched to posted receives, RNR waits when none is posted), RDMA WRITE and
//! WRITE_WITH_IMM, RDMA READ and the two atomics, with lkey/rkey/PD/access/bounds checks that
//! produce the completion statuses a real device produces, and flush on error.
//!
//! What it deliberately is not: a transport or a memory mapper. It reaches registered memory
//! only through the [`Memory`] trait (the daemon implements it over the mapped region files;
//! tests over vectors), learns time only from `now` arguments and randomness from the seed
//! given to [`Engine::new`]. Every call does bounded work, whatever a hostile work request says.
//!
//! ```
//! use std::time::Instant;
//! use vrnic_proto::{CtxId, Engine, VnicId};
//! let mut e = Engine::new(1);
//! e.add_vnic(VnicId(1), 1, [0; 16]);
//! let pd = e.alloc_pd(VnicId(1), CtxId(1)).unwrap();
//! let cq = e.create_cq(VnicId(1), CtxId(1), 16).unwrap();
//! let cap = vrnic_wire::QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
//! let (qp, qpn) = e.create_qp(CtxId(1), pd, cq, cq, vrnic_wire::QpType::Rc, cap, false).unwrap();
//! assert!(qpn > 1);
//! assert_eq!(e.qp_state(qp), Some(vrnic_wire::QpState::Reset));
//! # let _ = Instant::now();
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod engine;
mod state;

pub use engine::Engine;

/// A positive errno value, returned for local misuse or resource failure.
pub type Errno = i32;

/// errno values used by the engine (Linux numbering).
pub mod errno {
    #![allow(missing_docs)]
    pub const EPERM: i32 = 1;
    pub const ENOENT: i32 = 2;
    pub const ENOMEM: i32 = 12;
    pub const EBUSY: i32 = 16;
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
    QpId
}

/// A byte location: offset `off` in the shared region of `vnic`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Loc {
    /// Whose region.
    pub vnic: VnicId,
    /// Byte offset in it.
    pub off: u64,
}

/// Access to registered memory, implemented by the daemon over mapped regions.
pub trait Memory {
    /// Copies `len` bytes (memmove semantics: ranges may overlap).
    fn copy(&mut self, src: Loc, dst: Loc, len: usize);
    /// Writes `data` at `dst`.
    fn write(&mut self, dst: Loc, data: &[u8]);
    /// Reads `out.len()` bytes at `src`.
    fn read(&mut self, src: Loc, out: &mut [u8]);
}

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
}
