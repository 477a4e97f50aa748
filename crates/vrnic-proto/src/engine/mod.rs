//! The engine proper: its objects and state (this file), the control verbs on them
//! (`verbs`), work requests handed in and error flushes (`queues`), the scheduler that runs
//! them in turn (`sched`), the two ends of a message (`requester`, `responder`), and the
//! translation of registered memory into region runs (`memory`).

mod groups;
mod memory;
mod meter;
mod mw;
mod qos;
mod queues;
mod remote;
mod requester;
mod responder;
mod sched;
mod segment;
mod siblings;
mod verbs;
mod xrc;

pub use groups::{MAX_REFUSALS, Refusal, Refused};
use memory::{Translated, copy_runs, grh, inside, scatter_bytes, translate};
pub use meter::{CLASSES, Flow, Meter};
pub use mw::{MAX_MW, MW_TYPE_1, MW_TYPE_2, Windows};
pub use qos::{BURST, Limit, Policy};
use remote::Flights;
pub use remote::{Placement, SEGMENT, Sender, Transmit, TxPayload, WINDOW, WINDOW_FULL};
use responder::Rx;
pub use sched::Turn;
use segment::{Route, psn_after};
pub use xrc::MAX_XRCD;
use xrc::Xrcd;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use vrnic_wire::frame::AddrRepr;
use vrnic_wire::{
    AhAttr, Cqe, MAX_INLINE, MAX_MSG_SIZE, MAX_SGE, ParseError, QpAttr, QpCap, QpState, QpType,
    RecvWqe, SendFlags, SendOpcode, SendPayload, SendWqe, Sge, SgeList, WC_GRH, WC_WITH_IMM,
    WC_WITH_INV, WcOpcode, WcStatus, access, qp_attr,
};

use crate::errno::*;
use crate::state;
use crate::{
    AhId, CqId, CtxId, Errno, Event, GroupId, HostId, Loc, Memory, MemoryRefused, MrId, MrKeys,
    Newcomers, NoNewcomers, NoSiblings, PdId, QpId, Siblings, SrqId, VnicId, XrcdId,
};

/// Deepest work queue.
pub const MAX_QP_WR: u32 = 16384;
/// Deepest completion queue: 4 Mi entries, an RNIC's depth (mlx5 offers 4 Mi - 1; libfabric's
/// `ofi_rxm` asks for 256 Ki). A CQ's ring is carved from the region's sparse heap, so its
/// pages cost memory only once a completion is written there (a 4 Mi-entry ring spans
/// 256 MiB of the region's address space, a sixty-fourth of a default region); a ring that
/// has wrapped holds them all, as a device's CQ buffer does, within the region's quota.
pub const MAX_CQE: u32 = 1 << 22;
/// Most QPs per vRNIC.
pub const MAX_QP: usize = 16384;
/// Most MRs per vRNIC.
pub const MAX_MR: usize = 65536;
/// Most CQs per vRNIC.
pub const MAX_CQ: usize = 16384;
/// Most PDs per vRNIC.
pub const MAX_PD: usize = 16384;
/// Most SRQs per vRNIC.
pub const MAX_SRQ: usize = 16384;
/// Most address handles per vRNIC.
pub const MAX_AH: usize = 65536;
/// Largest UD message (the port's active MTU, 4096).
pub const UD_MTU: u64 = 4096;
/// The Global Route Header at the start of every UD receive buffer.
pub const GRH_LEN: u64 = 40;
/// Work requests one [`Engine::process`] call executes at most.
pub const PASS_WRS: usize = 64;
/// Bytes after which one [`Engine::process`] call stops starting new chunks. Small, so that
/// a driver that runs a call between looks at its rings sees new work soon (latency of
/// others under a flood is about one call).
pub const PASS_BYTES: u64 = 1 << 20;
/// Work requests one QP executes per [`Engine::process`] call at most (fairness).
pub const QP_WRS: usize = 16;
/// Work requests one vRNIC executes per [`Engine::process`] call at most (fairness between
/// tenants, whatever their number of QPs).
pub const VNIC_WRS: usize = 32;
/// Largest piece of one message moved at once, and the most a vRNIC moves in one turn, while
/// other vRNICs wait for theirs: a tenant whose work arrives waits for at most this much of
/// another's copying (about 2 us here).
pub const CHUNK: u64 = 64 << 10;
/// The same while no light tenant competes: for the last [`SOLO_TURNS`] turns, no vRNIC had a
/// turn that did all its work while others waited. Short steps are for a tenant with little
/// work (a ping-pong, a small message) beside busy ones: it waits for the turn under way. Busy
/// tenants among themselves (one flow alone, bulk flows in rotation, or a ping-pong of large
/// messages, whose sides never wait for each other) wait for each other's turns anyway, so
/// their steps are long: each step pays its checks and lookups again, and with 64 KiB steps a
/// lone `ib_write_bw` of 1 MiB lost a tenth of its bandwidth, 32 bulk pairs a fifth. A light
/// tenant that comes after such a stretch waits for at most one long step; from its first
/// turn on, while it stays active, steps are short again.
pub const CHUNK_ALONE: u64 = 256 << 10;
/// Turns without a light tenant competing before steps grow to [`CHUNK_ALONE`].
pub const SOLO_TURNS: u64 = 64;
/// While a light tenant competes, the most one step of a turn copies on this host (a turn
/// still moves up to [`CHUNK`]): between steps the driver is asked whether a light tenant has
/// new work ([`crate::Newcomers`]), and the turn ends if one has. So a ping-pong beside a flood
/// waits for about one step of the flood's copying (~3 us at streaming copy speed), while the
/// flood's turns are cut short only when the ping-pong has a message. 16 KiB steps halve that
/// wait, but each step pays the requester's fixed cost again: a flood beside even a slow
/// ping-pong kept 65-71% of its rate, against 74-81% with 32 KiB steps and 77-90% with whole
/// 64 KiB turns (`docs/performance.md`, "A busy turn cut by a light tenant's news"). Steps over
/// a peer link are not shortened: a frame's payload is read by the kernel, not copied by the
/// engine.
pub const STEP: u64 = 32 << 10;
/// The most light tenants an engine remembers, the latest ([`Engine::is_light`]): between the
/// steps of a busy turn the driver looks at these alone, so the question stays a few loads
/// however many tenants are light. An older one waits for the turn under way, as every tenant
/// did before turns were cut.
pub const LIGHT_MAX: usize = 8;
/// Page size of the region page lists.
pub const PAGE: u64 = 4096;

const _: () = assert!(MAX_QP_WR.is_power_of_two() && MAX_CQE.is_power_of_two());
const _: () = assert!(QP_WRS <= VNIC_WRS && VNIC_WRS <= PASS_WRS);
const _: () = assert!(STEP < CHUNK && CHUNK <= CHUNK_ALONE && CHUNK_ALONE <= PASS_BYTES);
// Every completion's byte_len fits the CQE field.
const _: () = assert!(MAX_MSG_SIZE as u64 <= u32::MAX as u64);

#[derive(Debug)]
struct Vnic {
    lid: u16,
    gid: [u8; 16],
    /// Its tenants' group: routes reach only vRNICs of the same group.
    group: GroupId,
    /// Memory keys -> MR.
    keys: FxHashMap<u32, MrId>,
    /// Its memory windows (shared with the engines holding its other slices).
    windows: std::sync::Arc<Windows>,
    /// Its QPs that may have work to run, in turn (each at most once: `Qp::queued`).
    ready: VecDeque<QpId>,
    /// In the engine's run queue.
    queued: bool,
    /// What it moved and how its work requests ended.
    meter: Meter,
    /// Its QoS limits (shared with its other engines and the daemon), if it was given any.
    limit: Option<std::sync::Arc<Limit>>,
    /// Off the run queue until its limit's debt is paid (in `Scheduler::throttled`).
    throttled: bool,
}

#[derive(Debug)]
struct Pd {
    vnic: VnicId,
    ctx: CtxId,
    users: u32,
}

#[derive(Debug)]
struct Mr {
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    addr: u64,
    len: u64,
    iova: u64,
    access: u32,
    key: u32,
    /// The region pages behind its pages (counted from floor(addr)), as runs in order: one
    /// entry per stretch contiguous in the region, so that its size and every lookup go with
    /// the runs, not the pages.
    spans: Vec<Span>,
}

/// Pages `first..first + pages` of an MR (counted from the page holding its first byte) are
/// region pages `off..off + pages * PAGE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Span {
    first: u64,
    off: u64,
    pages: u64,
}

#[derive(Debug)]
struct Cq {
    vnic: VnicId,
    ctx: CtxId,
    users: u32,
}

#[derive(Debug)]
struct Srq {
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    rq: VecDeque<RecvWqe>,
    depth: u32,
    max_wr: u32,
    max_sge: u32,
    retired: u32,
    /// Armed limit (0: disarmed).
    limit: u32,
    /// Its retired counter moved since [`Engine::drain_retired`].
    touched: bool,
    /// QPs attached.
    users: u32,
    /// Its ring broke: it takes no more receives.
    broken: bool,
    /// Its SRQ number (`ibv_get_srq_num`), unique on this daemon.
    srqn: u32,
    /// An XRC SRQ: its domain and the CQ its receives complete on.
    xrc: Option<XrcSrq>,
}

/// What makes an SRQ an XRC SRQ.
#[derive(Debug, Clone, Copy)]
struct XrcSrq {
    /// The domain handle it was created with (counted as a user of it).
    xrcd: XrcdId,
    /// The domain itself (shared by every handle that opened it).
    domain: u32,
    /// Where its receives complete.
    cq: CqId,
}

#[derive(Debug)]
struct Ah {
    ctx: CtxId,
    pd: PdId,
    attr: AhAttr,
    /// Where datagrams sent along it go, resolved when it was made.
    route: Route,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    None,
    /// No receive at the responder: retry at `until`, `retries` timer expiries so far, the
    /// responder's RNR `timer` code; a receive posted to `on` wakes it before.
    Rnr {
        until: Instant,
        retries: u8,
        on: Option<RecvQueue>,
        timer: u8,
    },
    /// No answer (no responder, or it dropped the segment): fail at `until`.
    Retry {
        until: Instant,
    },
}

#[derive(Debug)]
struct Qp {
    /// What it moved and how its work requests ended (its share of its vRNIC's meter).
    meter: Meter,
    /// RC, UC (nothing is acknowledged, so nothing the responder does is reported), UD, or
    /// either half of XRC (an XRC send QP requests as RC does; an XRC receive QP answers as
    /// RC does, its receives taken from the XRC SRQ each request names).
    ty: QpType,
    /// An XRC receive QP: its domain handle (counted as a user) and the domain.
    xrcd: Option<(XrcdId, u32)>,
    /// An XRC receive QP: the SRQ of the request it is serving (resolved and checked for
    /// every request segment; its receives, PD and CQ are the responder's).
    xrc_srq: Option<SrqId>,
    /// Receives come from this SRQ instead of `rq`.
    srq: Option<SrqId>,
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    send_cq: CqId,
    recv_cq: CqId,
    qpn: u32,
    cap: QpCap,
    sq_sig_all: bool,
    attr: QpAttr,
    sq: VecDeque<Result<SendWqe, ParseError>>,
    rq: VecDeque<RecvWqe>,
    sq_depth: u32,
    rq_depth: u32,
    sq_retired: u32,
    rq_retired: u32,
    wait: Wait,
    /// The head WQE moved part of its message already.
    progress: Option<Progress>,
    /// Where its segments go, resolved at RTR from its address.
    route: Route,
    /// The address word of the segments it sends over a link (a connected QP's, set with its
    /// route): its peer's LID, its own vRNIC's, its own number. A segment from a link reaches
    /// it only from that peer: DLID its vRNIC's LID, SLID `addr.dlid`, source `dest_qp_num`.
    addr: AddrRepr,
    /// Its state over a peer link (or the seam between engine threads): what is in flight,
    /// the ACK timer, the WRITE being placed, the ACK owed.
    link: Link,
    /// Its responder's message in progress and what it answered last.
    resp: Resp,
    /// Its place in the scheduler: ready list, waiter lists, timer heap, retired counters.
    sched: Sched,
    /// Translations kept for the next chunk or message (requester and responder).
    tr: Tr,
}

/// A QP's state over a peer link (requester and responder): see [`Qp::link`].
#[derive(Debug, Default)]
struct Link {
    /// Requester: how many WQEs at the front of `sq` are sent wholly and wait for their
    /// answer, and for each WQE sent (wholly or partly) its PSNs.
    sq_sent: usize,
    flights: Flights,
    /// Requester: the oldest PSN not yet answered (everything before it is acknowledged or
    /// its data arrived), from which the window is counted. Meaningful while `flights` is
    /// not empty.
    una: u32,
    /// Requester: its next WQE waits for those in flight to be answered.
    stalled: bool,
    /// Requester: the PSN an RNR NAK named; its wait ends when that PSN is acknowledged.
    rnr_psn: Option<u32>,
    /// Requester: when it sends again what is unanswered (the local ACK timeout), or fails
    /// once it did so `retry_cnt` times.
    ack_until: Option<Instant>,
    /// Requester: local ACK timeouts since the last answer.
    ack_tries: u8,
    /// Responder: the RDMA WRITE in progress (next VA, R_Key, bytes left).
    write_at: Option<(u64, u32, u64)>,
    /// Responder: the PSN its next (coalesced) ACK acknowledges.
    ack_due: Option<u32>,
}

impl Link {
    /// Forgets what is in flight (its queue was flushed or reset), keeping the buffers.
    fn clear(&mut self) {
        self.sq_sent = 0;
        self.stalled = false;
        self.rnr_psn = None;
        self.flights.clear();
        self.ack_until = None;
        self.ack_tries = 0;
        self.write_at = None;
        self.ack_due = None;
    }
}

/// A QP's responder state: see [`Qp::resp`].
#[derive(Debug, Default)]
struct Resp {
    /// The SEND message in progress.
    rx: Option<Rx>,
    /// (UC) The message in progress lost a segment; drop the rest of it.
    rx_lost: bool,
    /// It NAKed a PSN sequence error or sent an RNR NAK, and drops what comes out of sequence
    /// until the PSN it expects arrives.
    nak_sent: bool,
    /// The DMA length of the RDMA WRITE in progress.
    write_len: u64,
    /// The PSN and answer of the last atomic (for a retransmitted request).
    last_atomic: Option<(u32, u64)>,
    /// The sender last admitted to this connected QP (its link or sibling, its address
    /// word) and the routes' generation then: the same sender is admitted again without the
    /// lookups while neither the routes nor the QP's connection changed (`Engine::admits`).
    admitted: Option<(HostId, AddrRepr, u64)>,
}

/// A QP's place in the scheduler: see [`Qp::sched`].
#[derive(Debug, Default)]
struct Sched {
    /// In its vRNIC's ready list.
    queued: bool,
    /// Blocked: off the ready lists until something wakes it.
    parked: bool,
    /// In a waiter list (`rnr_waiters` or `retry_waiters`): listed once however often it
    /// parks, so the lists cannot grow past the QPs.
    listed: bool,
    /// The time of its entry in the timer heap, if any (one live entry per QP).
    armed: Option<Instant>,
    /// Its retired counters moved since the driver last took [`Engine::drain_retired`].
    touched: bool,
}

/// A QP's translations kept between chunks and messages: see [`Qp::tr`].
#[derive(Debug, Default)]
struct Tr {
    /// Requester: the head WQE's local memory, translated (on the local route).
    tx_mem: Translated,
    /// Requester: what the key of its last single-SGE work request grants around that SGE
    /// (checked for this QP's PD and, with `need` 1, local write), translated.
    tx_ahead: Translated,
    /// Responder: the memory of the last RDMA WRITE or READ it served, translated.
    rx_mem: Translated,
}

impl Qp {
    /// When the head send WQE's timer fires; only an RTS QP with work runs timers (an SQD QP
    /// keeps its wait but does not execute, so its timer must not keep a driver awake).
    fn deadline(&self) -> Option<Instant> {
        if self.attr.qp_state != QpState::Rts || self.sq.is_empty() {
            return None;
        }
        let wait = match self.wait {
            Wait::Rnr { until, .. } | Wait::Retry { until } => Some(until),
            Wait::None => None,
        };
        match (wait, self.link.ack_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether it has a WQE it may send now: one not yet sent (all of them, on a local route,
    /// until retired), with room in its window and nothing before it to wait for.
    fn has_unsent(&self) -> bool {
        self.sq.len() > self.link.sq_sent && !self.link.stalled && self.window_open()
    }

    /// Whether the next segment fits in the window over a peer link: fewer than [`WINDOW`]
    /// PSNs unanswered, and, for a full segment, fewer than [`WINDOW_FULL`] (so what is in
    /// flight stays under `WINDOW_FULL` x [`SEGMENT`] bytes however large the messages: the
    /// path drains it well within a local ACK timeout, and a timeout that does come sends
    /// again no more than that). Counted from the oldest PSN unanswered, so a message of
    /// any length moves as its segments are acknowledged. UC has no window (no answers).
    fn window_open(&self) -> bool {
        // UC waits for no answer: its flight is only the message being sent.
        if self.link.flights.is_empty() || self.ty == QpType::Uc {
            return true;
        }
        let d = psn_after(self.attr.sq_psn, self.link.una);
        if d >= WINDOW {
            return false;
        }
        if d < WINDOW_FULL {
            return true;
        }
        // A full segment next, or a short one (the last of a message, or a small message).
        let idx = self.link.sq_sent;
        let sent = self.link.flights.get(idx).map_or(0, |f| f.sent);
        let len = match self.sq.get(idx) {
            Some(Ok(w)) => w.payload.len(),
            _ => 0,
        };
        len.saturating_sub(sent) < SEGMENT
    }

    /// Forgets what is in flight over a peer link (its queue was flushed or reset).
    fn clear_flights(&mut self) {
        self.link.clear();
    }
}

/// How far the head send WQE got, when a message moves over several [`Engine::process`] calls.
#[derive(Debug, Clone, Copy)]
struct Progress {
    /// Bytes moved (acknowledged).
    done: u64,
    /// The PSN of the message's first segment (where a retransmission starts).
    psn: u32,
}

/// Outcome of trying the head send WQE.
enum Step {
    /// Done (successfully or not), having moved this many bytes in this step: retire it.
    Done(u64),
    /// Moved this many bytes of a message that continues in a later step.
    Partial(u64),
    /// Sent the last of its message over a peer link, this many bytes in this step: the next
    /// WQE may go while it waits for its answer.
    Sent(u64),
    /// Cannot progress now.
    Blocked,
    /// Its destination's engine (a sibling) is held by another thread: tried again at the
    /// next pass ([`Engine::has_deferred`]).
    Busy,
}

/// The engine. See the crate documentation.
#[derive(Debug)]
pub struct Engine {
    rng: u64,
    next_id: u32,
    next_qpn: u32,
    /// Its QP numbers, and the ids it gives out, are `qpn_offset` modulo `qpn_stride`
    /// ([`Engine::set_qpn_space`]).
    qpn_offset: u32,
    qpn_stride: u32,
    /// The engines sharing this daemon's number space are hosts `siblings + class`
    /// ([`Engine::set_siblings`]): a destination on this daemon whose QP number is of another
    /// class is reached through that host.
    siblings: Option<u32>,
    /// The id (and, for an MR, the key) the next object made takes: an object mirrored from
    /// the engine that made it ([`Engine::mirrored`]).
    forced: Option<(u32, Option<u32>)>,
    /// Its objects, by id, and the numbers that name them.
    objs: Objects,
    /// The memory generation: bumped whenever a translation could change (see
    /// [`Engine::memory_changed`]); starts at 1 (0 marks an empty [`Translated`]).
    mem_gen: u64,
    /// Who runs next, who waits for what, whose counters moved.
    sched: Scheduler,
    /// Where addresses lead: this engine's vRNICs and those behind links, and what was refused.
    routes: Routes,
    /// What the driver takes out: completions, events, frames, and what it must be told.
    out: Outputs,
    /// Run lists kept to spare an allocation per segment.
    scratch: Scratch,
}

/// An engine's objects, by id, and the numbers that name them (QP and SRQ numbers).
#[derive(Debug)]
struct Objects {
    vnics: FxHashMap<VnicId, Vnic>,
    pds: FxHashMap<PdId, Pd>,
    mrs: FxHashMap<MrId, Mr>,
    cqs: FxHashMap<CqId, Cq>,
    qps: FxHashMap<QpId, Qp>,
    srqs: FxHashMap<SrqId, Srq>,
    ahs: FxHashMap<AhId, Ah>,
    xrcds: FxHashMap<XrcdId, Xrcd>,
    by_qpn: FxHashMap<u32, QpId>,
    /// SRQs by number (what XRC requests name).
    by_srqn: FxHashMap<u32, SrqId>,
    next_srqn: u32,
}

/// The scheduler's state: the run queue, the turn under way, the timers and waiter lists, and
/// the queues whose retired counters moved.
#[derive(Debug)]
struct Scheduler {
    /// vRNICs with QPs that may have work, served in turn by [`Engine::process`]: a vRNIC
    /// that was idle goes first, one that used its turn goes last. Idle QPs and vRNICs are in
    /// no list and cost nothing.
    runq: VecDeque<VnicId>,
    /// The most the turn under way moves: [`CHUNK`], or [`CHUNK_ALONE`] for a vRNIC alone.
    turn_bytes: u64,
    /// The most one step of the turn under way copies on this host: [`STEP`] while a light
    /// tenant competes, else `turn_bytes`.
    step_bytes: u64,
    /// Turns given so far, and the last one of a light tenant (its work all done in the turn)
    /// while others waited.
    turns: u64,
    light_at: u64,
    /// The light tenants: each vRNIC whose turn did all its work while others waited, with
    /// that turn's number, oldest first; those older than [`SOLO_TURNS`] turns are dropped as
    /// others come, and past [`LIGHT_MAX`] the oldest.
    light: Vec<(VnicId, u64)>,
    /// Timers of waiting QPs (RNR and retry), earliest first; an entry whose QP no longer
    /// waits until then is stale and skipped.
    timers: BinaryHeap<Reverse<(Instant, QpId)>>,
    /// vRNICs in debt to their QoS limit, by when it is paid, earliest first.
    throttled: BinaryHeap<Reverse<(Instant, VnicId)>>,
    /// QPs blocked on RNR, by the receive queue they wait for: a receive posted there wakes
    /// them (before their timer).
    rnr_waiters: FxHashMap<RecvQueue, Vec<QpId>>,
    /// QPs blocked because no responder exists: any QP reaching RTR may be it.
    retry_waiters: Vec<QpId>,
    /// QPs whose destination's engine was busy (held by another thread): woken at the next
    /// [`Engine::handle_timeout`], so a pass never tries one twice.
    deferred: Vec<QpId>,
    /// QPs and SRQs whose retired counters moved (see [`Engine::drain_retired`]).
    touched: Vec<QpId>,
    touched_srqs: Vec<SrqId>,
}

/// Where addresses lead: this engine's vRNICs by address, those behind peer links, and the
/// routes and segments refused.
#[derive(Debug, Default)]
struct Routes {
    /// vRNICs by address, to resolve routes.
    by_lid: FxHashMap<u16, VnicId>,
    by_gid: FxHashMap<[u8; 16], VnicId>,
    /// vRNICs behind peer links, by address: their host and group (and, by GID, their LID).
    /// SipHash: their keys come from peers.
    remote_lids: HashMap<u16, (HostId, GroupId)>,
    remote_gids: HashMap<[u8; 16], (HostId, GroupId, u16)>,
    /// Segments from links that [`Engine::segments_refused`] counts.
    refused_segments: u64,
    /// Moves whenever an address's vRNIC or group changes here (a vRNIC added or removed,
    /// here or behind a link): admissions remembered by QPs before it are checked again.
    generation: u64,
    /// Routes refused because the two ends are in different groups, for the daemon to log
    /// ([`Engine::take_refusals`]); at most `groups::MAX_REFUSALS` wait.
    refusals: Vec<Refusal>,
    /// Refusals since the last take, kept or not.
    refused: u64,
}

/// What the driver takes out of the engine.
#[derive(Debug, Default)]
struct Outputs {
    completions: VecDeque<(CqId, Cqe, bool)>,
    events: VecDeque<(CtxId, Event)>,
    /// Frames to send over peer links, in order.
    outbox: VecDeque<Transmit>,
    /// Responder QPs that owe a coalesced ACK.
    acks_due: Vec<QpId>,
    /// Segments sent again, by peer link.
    resent: HashMap<HostId, u64>,
    /// QPs of contexts that died while connected over a peer link: (that host, the QP's
    /// number), for the driver to tell the engine at the other end if it can
    /// ([`Engine::take_died_remote`], [`Engine::peer_died`]).
    died_remote: Vec<(HostId, u32)>,
}

/// Scratch run lists, kept to spare an allocation per segment: the requester's payload, a READ
/// response, the requester's local buffer, the responder's destination.
#[derive(Debug, Default)]
struct Scratch {
    scratch_src: Vec<(Loc, u64)>,
    scratch_dst: Vec<(Loc, u64)>,
    scratch_local: Vec<(Loc, u64)>,
    scratch_place: Vec<(Loc, u64)>,
}

/// A receive queue: a QP's own, or an SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum RecvQueue {
    Qp(QpId),
    Srq(SrqId),
}

fn cqe(wr_id: u64, status: WcStatus, opcode: WcOpcode, qp_num: u32) -> Cqe {
    Cqe {
        wr_id,
        status,
        opcode,
        wc_flags: 0,
        byte_len: 0,
        imm_data: 0,
        qp_num,
        src_qp: 0,
        slid: 0,
        sl: 0,
        vendor_err: if status == WcStatus::Success || status == WcStatus::WrFlushErr {
            0
        } else {
            0x100 + status as u32
        },
        timestamp_ns: 0,
    }
}

/// Lists a QP whose retired counters moved (once until drained).
fn touch(list: &mut Vec<QpId>, id: QpId, q: &mut Qp) {
    if !q.sched.touched {
        q.sched.touched = true;
        list.push(id);
    }
}

/// Lists an SRQ whose retired counter moved (once until drained).
fn touch_srq(list: &mut Vec<SrqId>, id: SrqId, s: &mut Srq) {
    if !s.touched {
        s.touched = true;
        list.push(id);
    }
}

fn wqe_wc_opcode(w: &Result<SendWqe, ParseError>) -> WcOpcode {
    w.as_ref()
        .map(|w| w.opcode.wc_opcode())
        .unwrap_or(WcOpcode::Send)
}

impl Engine {
    /// A new engine; `seed` drives key generation.
    pub fn new(seed: u64) -> Engine {
        Engine {
            rng: seed | 1,
            next_id: 1,
            next_qpn: 0x11,
            qpn_offset: 0,
            qpn_stride: 1,
            siblings: None,
            forced: None,
            objs: Objects {
                vnics: FxHashMap::default(),
                pds: FxHashMap::default(),
                mrs: FxHashMap::default(),
                cqs: FxHashMap::default(),
                qps: FxHashMap::default(),
                srqs: FxHashMap::default(),
                ahs: FxHashMap::default(),
                xrcds: FxHashMap::default(),
                by_qpn: FxHashMap::default(),
                by_srqn: FxHashMap::default(),
                next_srqn: 0x40,
            },
            mem_gen: 1,
            sched: Scheduler {
                runq: VecDeque::new(),
                turn_bytes: CHUNK,
                step_bytes: CHUNK,
                turns: 0,
                light_at: 0,
                light: Vec::new(),
                timers: BinaryHeap::new(),
                throttled: BinaryHeap::new(),
                rnr_waiters: FxHashMap::default(),
                retry_waiters: Vec::new(),
                deferred: Vec::new(),
                touched: Vec::new(),
                touched_srqs: Vec::new(),
            },
            routes: Routes::default(),
            out: Outputs::default(),
            scratch: Scratch::default(),
        }
    }

    /// A fresh object id: of this engine's class ([`Engine::set_qpn_space`]), or the one an
    /// object mirrored from another engine keeps ([`Engine::mirrored`]).
    fn id(&mut self) -> u32 {
        if let Some((id, _)) = self.forced {
            return id;
        }
        let id = self.next_id;
        self.next_id = match self.next_id.checked_add(self.qpn_stride) {
            Some(n) => n,
            None => self.first_id(),
        };
        id
    }

    fn random(&mut self) -> u64 {
        // splitmix64
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Gives this engine the QP numbers, and the object ids, that are `offset` modulo
    /// `stride` (at most 256 classes), so that engines sharing a daemon's number space never
    /// give out the same one: a segment's destination QP number names its engine, and so does
    /// an object's id. Call before any object is made.
    pub fn set_qpn_space(&mut self, offset: u32, stride: u32) {
        let stride = stride.clamp(1, 256);
        let offset = offset % stride;
        self.qpn_offset = offset;
        self.qpn_stride = stride;
        // The first of the class from 0x11 on, as a lone engine starts.
        self.next_qpn = 0x11 + (offset + stride - 0x11 % stride) % stride;
        self.next_id = self.first_id();
    }

    /// The first id of this engine's class (ids are 1 and up).
    fn first_id(&self) -> u32 {
        if self.qpn_offset == 0 {
            self.qpn_stride
        } else {
            self.qpn_offset
        }
    }

    /// Names the engines sharing this daemon's QP numbers ([`Engine::set_qpn_space`]): the
    /// engine of class `c` is host `HostId(base + c)`, and a route to one of them is not a
    /// peer link: a work request along it is executed here, inside that engine, through the
    /// [`Siblings`] given to [`Engine::turn_with`]. A vRNIC may also have QPs on several
    /// engines (each holds a *slice* of it: the same vRNIC, its objects mirrored), so a
    /// destination that resolves to a vRNIC on this engine, with a QP number of another class,
    /// is reached through that class's engine.
    pub fn set_siblings(&mut self, base: HostId) {
        self.siblings = Some(base.0);
    }

    /// Runs `make` (one verb that makes an object: `alloc_pd`, `create_cq`, `create_ah`,
    /// `reg_mr`) so that the object takes id `id` and, for an MR, key `key`: the copy, in this
    /// engine's slice of a vRNIC, of an object another engine of the daemon made (`id` is of
    /// that engine's class, so it is free here).
    pub fn mirrored<T>(
        &mut self,
        id: u32,
        key: Option<u32>,
        make: impl FnOnce(&mut Engine) -> T,
    ) -> T {
        self.forced = Some((id, key));
        let r = make(self);
        self.forced = None;
        r
    }

    /// The engine of class `c` serving QP number `qpn`, as a host, if it is not this one.
    pub(super) fn sibling_of(&self, qpn: u32) -> Option<HostId> {
        let base = self.siblings?;
        let class = qpn % self.qpn_stride;
        (class != self.qpn_offset).then(|| HostId(base + class))
    }

    /// Whether `host` is another engine of this daemon ([`Engine::set_siblings`]).
    pub(super) fn is_sibling(&self, host: HostId) -> bool {
        is_sibling(self.siblings, self.qpn_stride, host)
    }

    /// `route` if it leads to another engine of this daemon: the sibling's host.
    fn sibling_route(&self, route: Route) -> Option<HostId> {
        sibling_host(self.siblings, self.qpn_stride, route)
    }

    /// This engine, as its siblings know it ([`Engine::set_siblings`]).
    fn me(&self) -> HostId {
        HostId(self.siblings.unwrap_or(0).wrapping_add(self.qpn_offset))
    }

    /// The number of completions waiting (for tests and metrics).
    pub fn pending_completions(&self) -> usize {
        self.out.completions.len()
    }
}

/// Whether `host` is another engine of a daemon whose engines are hosts `siblings..` (one per
/// class of `stride`): [`Engine::is_sibling`] by its fields, for a caller that holds a QP.
fn is_sibling(siblings: Option<u32>, stride: u32, host: HostId) -> bool {
    siblings.is_some_and(|b| host.0 >= b && host.0 - b < stride)
}

/// `route` if it leads to another engine of the daemon ([`is_sibling`]): the sibling's host.
fn sibling_host(siblings: Option<u32>, stride: u32, route: Route) -> Option<HostId> {
    match route {
        Route::Remote(host) if is_sibling(siblings, stride, host) => Some(host),
        _ => None,
    }
}
