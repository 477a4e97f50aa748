//! The engine proper: objects, the control operations on them, and the execution of work
//! requests on the local transport (both QPs on this daemon; one copy per byte).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use vrnic_wire::{
    AhAttr, Cqe, MAX_INLINE, MAX_MSG_SIZE, MAX_SGE, ParseError, QpAttr, QpCap, QpState, QpType,
    RecvWqe, SendFlags, SendOpcode, SendPayload, SendWqe, Sge, WC_GRH, WC_WITH_IMM, WcOpcode,
    WcStatus, access, qp_attr,
};

use crate::errno::*;
use crate::state;
use crate::{
    AhId, CqId, CtxId, Errno, Event, Loc, Memory, MrId, MrKeys, PdId, QpId, SrqId, VnicId,
};

/// Deepest work queue.
pub const MAX_QP_WR: u32 = 16384;
/// Deepest completion queue.
pub const MAX_CQE: u32 = 65536;
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
/// Largest piece of one message moved at once; a QP, and a vRNIC, moves at most this much
/// per call.
pub const CHUNK: u64 = 256 << 10;
/// Page size of the region page lists.
pub const PAGE: u64 = 4096;

const _: () = assert!(MAX_QP_WR.is_power_of_two() && MAX_CQE.is_power_of_two());
const _: () = assert!(QP_WRS <= VNIC_WRS && VNIC_WRS <= PASS_WRS && CHUNK <= PASS_BYTES);
// Every completion's byte_len fits the CQE field.
const _: () = assert!(MAX_MSG_SIZE as u64 <= u32::MAX as u64);

#[derive(Debug)]
struct Vnic {
    lid: u16,
    gid: [u8; 16],
    /// Memory keys -> MR.
    keys: HashMap<u32, MrId>,
    /// Its QPs that may have work to run, in turn (each at most once: `Qp::queued`).
    ready: VecDeque<QpId>,
    /// In the engine's run queue.
    queued: bool,
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
    /// Region offset of each 4 KiB page from floor(addr).
    pages: Vec<u64>,
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
}

#[derive(Debug)]
struct Ah {
    ctx: CtxId,
    pd: PdId,
    attr: AhAttr,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    None,
    /// No receive at the responder: retry at `until`, `retries` timer expiries so far.
    Rnr {
        until: Instant,
        retries: u8,
    },
    /// No responder: fail at `until`.
    Retry {
        until: Instant,
    },
}

#[derive(Debug)]
struct Qp {
    /// RC, UC (nothing is acknowledged, so nothing the responder does is reported) or UD.
    ty: QpType,
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

impl Qp {
    /// When the head send WQE's timer fires; only an RTS QP with work runs timers (an SQD QP
    /// keeps its wait but does not execute, so its timer must not keep a driver awake).
    fn deadline(&self) -> Option<Instant> {
        if self.attr.qp_state != QpState::Rts || self.sq.is_empty() {
            return None;
        }
        match self.wait {
            Wait::Rnr { until, .. } | Wait::Retry { until } => Some(until),
            Wait::None => None,
        }
    }
}

/// How far the head send WQE got, when a message moves over several [`Engine::process`] calls.
#[derive(Debug, Clone, Copy)]
struct Progress {
    /// Bytes moved.
    done: u64,
    /// To this responder ...
    peer: QpId,
    /// ... whose receive queue had retired this many (so the same receive is still the head).
    peer_rq: u32,
}

/// Outcome of trying the head send WQE.
enum Step {
    /// Done (successfully or not), having moved this many bytes in this step: retire it.
    Done(u64),
    /// Moved this many bytes of a message that continues in a later step.
    Partial(u64),
    /// Cannot progress now.
    Blocked,
}

/// The engine. See the crate documentation.
#[derive(Debug)]
pub struct Engine {
    rng: u64,
    next_id: u32,
    next_qpn: u32,
    vnics: HashMap<VnicId, Vnic>,
    pds: HashMap<PdId, Pd>,
    mrs: HashMap<MrId, Mr>,
    cqs: HashMap<CqId, Cq>,
    qps: BTreeMap<QpId, Qp>,
    srqs: BTreeMap<SrqId, Srq>,
    ahs: HashMap<AhId, Ah>,
    by_qpn: HashMap<u32, QpId>,
    completions: VecDeque<(CqId, Cqe, bool)>,
    events: VecDeque<(CtxId, Event)>,
    /// vRNICs with QPs that may have work, served in turn by [`Engine::process`]: a vRNIC
    /// that was idle goes first, one that used its turn goes last. Idle QPs and vRNICs are in
    /// no list and cost nothing.
    runq: VecDeque<VnicId>,
    /// Timers of waiting QPs (RNR and retry), earliest first; an entry whose QP no longer
    /// waits until then is stale and skipped.
    timers: BinaryHeap<Reverse<(Instant, QpId)>>,
    /// QPs blocked on RNR, by the receive queue they wait for: a receive posted there wakes
    /// them (before their timer).
    rnr_waiters: HashMap<RecvQueue, Vec<QpId>>,
    /// QPs blocked because no responder exists: any QP reaching RTR may be it.
    retry_waiters: Vec<QpId>,
    /// QPs and SRQs whose retired counters moved (see [`Engine::drain_retired`]).
    touched: Vec<QpId>,
    touched_srqs: Vec<SrqId>,
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
    if !q.touched {
        q.touched = true;
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
            vnics: HashMap::new(),
            pds: HashMap::new(),
            mrs: HashMap::new(),
            cqs: HashMap::new(),
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            ahs: HashMap::new(),
            by_qpn: HashMap::new(),
            completions: VecDeque::new(),
            events: VecDeque::new(),
            runq: VecDeque::new(),
            timers: BinaryHeap::new(),
            rnr_waiters: HashMap::new(),
            retry_waiters: Vec::new(),
            touched: Vec::new(),
            touched_srqs: Vec::new(),
        }
    }

    fn id(&mut self) -> u32 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
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

    // ---- vRNICs and contexts ---------------------------------------------------------------

    /// Registers a vRNIC with its address.
    pub fn add_vnic(&mut self, vnic: VnicId, lid: u16, gid: [u8; 16]) {
        self.vnics.insert(
            vnic,
            Vnic {
                lid,
                gid,
                keys: HashMap::new(),
                ready: VecDeque::new(),
                queued: false,
            },
        );
    }

    /// Destroys every object of `vnic` and forgets it.
    pub fn remove_vnic(&mut self, now: Instant, vnic: VnicId) {
        let mut ctxs: Vec<CtxId> = self
            .pds
            .values()
            .filter(|p| p.vnic == vnic)
            .map(|p| p.ctx)
            .collect();
        ctxs.extend(self.qps.values().filter(|q| q.vnic == vnic).map(|q| q.ctx));
        ctxs.extend(self.cqs.values().filter(|c| c.vnic == vnic).map(|c| c.ctx));
        ctxs.extend(self.srqs.values().filter(|s| s.vnic == vnic).map(|s| s.ctx));
        ctxs.sort();
        ctxs.dedup();
        for c in ctxs {
            self.destroy_context(now, c);
        }
        self.vnics.remove(&vnic);
    }

    /// Destroys everything `ctx` owns: its QPs (their peers see errors), SRQs, AHs, MRs, CQs
    /// and PDs.
    pub fn destroy_context(&mut self, now: Instant, ctx: CtxId) {
        let qps: Vec<QpId> = self
            .qps
            .iter()
            .filter(|(_, q)| q.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for qp in qps {
            self.fail_peers(qp);
            let _ = self.destroy_qp(now, ctx, qp);
        }
        let mrs: Vec<MrId> = self
            .mrs
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for mr in mrs {
            let _ = self.dereg_mr(ctx, mr);
        }
        self.srqs.retain(|_, s| s.ctx != ctx);
        self.ahs.retain(|_, a| a.ctx != ctx);
        self.cqs.retain(|_, c| c.ctx != ctx);
        self.pds.retain(|_, p| p.ctx != ctx);
        self.completions
            .retain(|(cq, _, _)| self.cqs.contains_key(cq));
        self.events.retain(|(c, _)| *c != ctx);
    }

    // ---- PDs and MRs -----------------------------------------------------------------------

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&mut self, vnic: VnicId, ctx: CtxId) -> Result<PdId, Errno> {
        if !self.vnics.contains_key(&vnic) {
            return Err(ENOENT);
        }
        if self.pds.values().filter(|p| p.vnic == vnic).count() >= MAX_PD {
            return Err(ENOMEM);
        }
        let pd = PdId(self.id());
        self.pds.insert(
            pd,
            Pd {
                vnic,
                ctx,
                users: 0,
            },
        );
        Ok(pd)
    }

    /// `ibv_dealloc_pd`: `EBUSY` while MRs or QPs use it.
    pub fn dealloc_pd(&mut self, ctx: CtxId, pd: PdId) -> Result<(), Errno> {
        match self.pds.get(&pd) {
            Some(p) if p.ctx == ctx => {
                if p.users > 0 {
                    return Err(EBUSY);
                }
                self.pds.remove(&pd);
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// The checks of [`Engine::reg_mr`] that need no pages: the PD, the access flags, the
    /// range, the MR limit. The daemon runs them before it does any work for a registration.
    /// Returns the vRNIC the MR would belong to.
    pub fn check_reg_mr(
        &self,
        ctx: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Result<VnicId, Errno> {
        let vnic = match self.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if access & !access::SUPPORTED != 0 {
            return Err(EOPNOTSUPP);
        }
        // Remote write or atomic access requires local write (IB spec, every device).
        if len == 0
            || (access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
                && access & access::LOCAL_WRITE == 0)
        {
            return Err(EINVAL);
        }
        addr.checked_add(len).ok_or(EINVAL)?;
        iova.checked_add(len).ok_or(EINVAL)?;
        if self.vnics.get(&vnic).ok_or(ENOENT)?.keys.len() >= MAX_MR {
            return Err(ENOMEM);
        }
        Ok(vnic)
    }

    /// `ibv_reg_mr`: `pages[i]` backs the i-th 4 KiB page from floor(`addr`).
    #[allow(clippy::too_many_arguments)]
    pub fn reg_mr(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
        pages: Vec<u64>,
    ) -> Result<MrKeys, Errno> {
        let vnic = self.check_reg_mr(ctx, pd, addr, len, iova, access)?;
        let npages = (addr + len).div_ceil(PAGE) - addr / PAGE;
        if pages.len() as u64 != npages || pages.iter().any(|p| p % PAGE != 0) {
            return Err(EINVAL);
        }
        let mut key;
        loop {
            key = self.random() as u32;
            if key != 0
                && !self
                    .vnics
                    .get(&vnic)
                    .is_some_and(|v| v.keys.contains_key(&key))
            {
                break;
            }
        }
        let mr = MrId(self.id());
        self.vnics
            .get_mut(&vnic)
            .ok_or(ENOENT)?
            .keys
            .insert(key, mr);
        self.mrs.insert(
            mr,
            Mr {
                vnic,
                ctx,
                pd,
                addr,
                len,
                iova,
                access,
                key,
                pages,
            },
        );
        if let Some(p) = self.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok(MrKeys {
            mr,
            lkey: key,
            rkey: key,
        })
    }

    /// `ibv_dereg_mr`: from now on no work request can reach its memory.
    pub fn dereg_mr(&mut self, ctx: CtxId, mr: MrId) -> Result<(), Errno> {
        match self.mrs.get(&mr) {
            Some(m) if m.ctx == ctx => {}
            _ => return Err(EINVAL),
        }
        let m = self.mrs.remove(&mr).ok_or(EINVAL)?;
        if let Some(v) = self.vnics.get_mut(&m.vnic) {
            v.keys.remove(&m.key);
        }
        if let Some(p) = self.pds.get_mut(&m.pd) {
            p.users = p.users.saturating_sub(1);
        }
        Ok(())
    }

    // ---- CQs and QPs -----------------------------------------------------------------------

    /// `ibv_create_cq`.
    pub fn create_cq(&mut self, vnic: VnicId, ctx: CtxId, depth: u32) -> Result<CqId, Errno> {
        if !self.vnics.contains_key(&vnic) {
            return Err(ENOENT);
        }
        if depth == 0 || depth > MAX_CQE {
            return Err(EINVAL);
        }
        if self.cqs.values().filter(|c| c.vnic == vnic).count() >= MAX_CQ {
            return Err(ENOMEM);
        }
        let cq = CqId(self.id());
        self.cqs.insert(
            cq,
            Cq {
                vnic,
                ctx,
                users: 0,
            },
        );
        Ok(cq)
    }

    /// `ibv_destroy_cq`: `EBUSY` while a QP uses it.
    pub fn destroy_cq(&mut self, ctx: CtxId, cq: CqId) -> Result<(), Errno> {
        match self.cqs.get(&cq) {
            Some(c) if c.ctx == ctx => {
                if c.users > 0 {
                    return Err(EBUSY);
                }
                self.cqs.remove(&cq);
                self.completions.retain(|(c, _, _)| *c != cq);
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// `ibv_create_qp` without an SRQ. Returns the QP and its number.
    #[allow(clippy::too_many_arguments)]
    pub fn create_qp(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        qp_type: QpType,
        cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        self.create_qp_srq(ctx, pd, send_cq, recv_cq, None, qp_type, cap, sq_sig_all)
    }

    /// `ibv_create_qp`, its receives taken from `srq` if given (then `max_recv_wr` and
    /// `max_recv_sge` are ignored, as on a device). Returns the QP and its number.
    #[allow(clippy::too_many_arguments)]
    pub fn create_qp_srq(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
        qp_type: QpType,
        mut cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        let vnic = match self.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        for cq in [send_cq, recv_cq] {
            match self.cqs.get(&cq) {
                Some(c) if c.ctx == ctx && c.vnic == vnic => {}
                _ => return Err(EINVAL),
            }
        }
        if let Some(s) = srq {
            match self.srqs.get(&s) {
                Some(s) if s.ctx == ctx && s.vnic == vnic => {}
                _ => return Err(EINVAL),
            }
            cap.max_recv_wr = 0;
            cap.max_recv_sge = 0;
        }
        if cap.max_send_wr > MAX_QP_WR
            || cap.max_recv_wr > MAX_QP_WR
            || cap.max_send_sge as usize > MAX_SGE
            || cap.max_recv_sge as usize > MAX_SGE
            || cap.max_inline_data as usize > MAX_INLINE
        {
            return Err(EINVAL);
        }
        if self.qp_count(vnic) >= MAX_QP || self.by_qpn.len() >= 0xff_0000 {
            return Err(ENOMEM);
        }
        let mut qpn = self.next_qpn;
        while self.by_qpn.contains_key(&qpn) || qpn < 2 {
            qpn = (qpn + 1) & 0xff_ffff;
        }
        self.next_qpn = (qpn + 1) & 0xff_ffff;
        let id = QpId(self.id());
        self.by_qpn.insert(qpn, id);
        self.qps.insert(
            id,
            Qp {
                ty: qp_type,
                srq,
                vnic,
                ctx,
                pd,
                send_cq,
                recv_cq,
                qpn,
                cap,
                sq_sig_all,
                attr: QpAttr {
                    cap,
                    ..QpAttr::default()
                },
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_depth: cap.max_send_wr.max(1).next_power_of_two(),
                rq_depth: cap.max_recv_wr.max(1).next_power_of_two(),
                sq_retired: 0,
                rq_retired: 0,
                wait: Wait::None,
                progress: None,
                queued: false,
                parked: false,
                listed: false,
                armed: None,
                touched: false,
            },
        );
        if let Some(p) = self.pds.get_mut(&pd) {
            p.users += 1;
        }
        for cq in [send_cq, recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.users += 1;
            }
        }
        if let Some(s) = srq.and_then(|s| self.srqs.get_mut(&s)) {
            s.users += 1;
        }
        Ok((id, qpn))
    }

    fn own_qp(&self, ctx: CtxId, qp: QpId) -> Result<&Qp, Errno> {
        match self.qps.get(&qp) {
            Some(q) if q.ctx == ctx => Ok(q),
            _ => Err(EINVAL),
        }
    }

    /// `ibv_modify_qp`, with the attribute-mask rules of a real device.
    pub fn modify_qp(
        &mut self,
        now: Instant,
        ctx: CtxId,
        qp: QpId,
        mask: u32,
        attr: &QpAttr,
    ) -> Result<(), Errno> {
        let q = self.own_qp(ctx, qp)?;
        let (cur, ty) = (q.attr.qp_state, q.ty);
        let next = if mask & qp_attr::STATE != 0 {
            attr.qp_state
        } else {
            cur
        };
        if mask & qp_attr::CUR_STATE != 0 && attr.cur_qp_state != cur {
            return Err(EINVAL);
        }
        if !state::check(ty, cur, next, mask) {
            return Err(EINVAL);
        }
        if (mask & qp_attr::PORT != 0 && attr.port_num != 1)
            || (mask & qp_attr::PKEY_INDEX != 0 && attr.pkey_index != 0)
            || (mask & qp_attr::PATH_MTU != 0 && !(1..=5).contains(&attr.path_mtu))
            || (mask & qp_attr::MAX_QP_RD_ATOMIC != 0 && attr.max_rd_atomic > 16)
            || (mask & qp_attr::MAX_DEST_RD_ATOMIC != 0 && attr.max_dest_rd_atomic > 16)
            || (mask & qp_attr::MIN_RNR_TIMER != 0 && attr.min_rnr_timer > 31)
            || (mask & qp_attr::TIMEOUT != 0 && attr.timeout > 31)
            || (mask & qp_attr::RETRY_CNT != 0 && attr.retry_cnt > 7)
            || (mask & qp_attr::RNR_RETRY != 0 && attr.rnr_retry > 7)
            || (mask & qp_attr::ACCESS_FLAGS != 0
                && attr.qp_access_flags
                    & !(access::LOCAL_WRITE
                        | access::REMOTE_WRITE
                        | access::REMOTE_READ
                        | access::REMOTE_ATOMIC)
                    != 0)
            || (mask & qp_attr::DEST_QPN != 0 && attr.dest_qp_num > 0xff_ffff)
            || (mask & qp_attr::AV != 0 && attr.ah_attr.port_num > 1)
        {
            return Err(EINVAL);
        }
        let Some(q) = self.qps.get_mut(&qp) else {
            return Err(EINVAL);
        };
        let a = &mut q.attr;
        macro_rules! set {
            ($bit:ident => $($f:ident),+) => {
                if mask & qp_attr::$bit != 0 { $(a.$f = attr.$f;)+ }
            };
        }
        set!(ACCESS_FLAGS => qp_access_flags);
        set!(PKEY_INDEX => pkey_index);
        set!(PORT => port_num);
        set!(QKEY => qkey);
        set!(AV => ah_attr);
        set!(PATH_MTU => path_mtu);
        set!(TIMEOUT => timeout);
        set!(RETRY_CNT => retry_cnt);
        set!(RNR_RETRY => rnr_retry);
        set!(RQ_PSN => rq_psn);
        set!(MAX_QP_RD_ATOMIC => max_rd_atomic);
        set!(ALT_PATH => alt_ah_attr, alt_pkey_index, alt_port_num, alt_timeout);
        set!(MIN_RNR_TIMER => min_rnr_timer);
        set!(SQ_PSN => sq_psn);
        set!(MAX_DEST_RD_ATOMIC => max_dest_rd_atomic);
        set!(PATH_MIG_STATE => path_mig_state);
        set!(DEST_QPN => dest_qp_num);
        set!(EN_SQD_ASYNC_NOTIFY => en_sqd_async_notify);
        a.qp_state = next;
        match next {
            QpState::Reset => {
                // Forget the queues silently: their slots are free again.
                q.sq_retired = q.sq_retired.wrapping_add(q.sq.len() as u32);
                touch(&mut self.touched, qp, q);
                q.rq_retired = q.rq_retired.wrapping_add(q.rq.len() as u32);
                touch(&mut self.touched, qp, q);
                q.sq.clear();
                q.rq.clear();
                q.wait = Wait::None;
                q.progress = None;
                q.attr = QpAttr {
                    cap: q.cap,
                    ..QpAttr::default()
                };
            }
            QpState::Err => {
                let (ctx, srq) = (q.ctx, q.srq);
                self.flush(qp);
                if srq.is_some() && cur != QpState::Err {
                    self.events.push_back((ctx, Event::LastWqeReached { qp }));
                }
            }
            QpState::Rtr | QpState::Rts => {
                // This QP may be the responder someone waits for; and it may have work.
                for w in std::mem::take(&mut self.retry_waiters) {
                    self.unlist(w);
                }
                self.wake(qp);
            }
            _ => {}
        }
        let _ = now;
        Ok(())
    }

    /// `ibv_query_qp`.
    pub fn query_qp(&self, ctx: CtxId, qp: QpId) -> Result<QpAttr, Errno> {
        let q = self.own_qp(ctx, qp)?;
        let mut a = q.attr;
        a.cur_qp_state = a.qp_state;
        a.cap = q.cap;
        Ok(a)
    }

    /// `ibv_destroy_qp`. As on a real fabric, a connected peer notices only when it next sends
    /// (`RETRY_EXC_ERR` after its transport timeout).
    pub fn destroy_qp(&mut self, now: Instant, ctx: CtxId, qp: QpId) -> Result<(), Errno> {
        self.own_qp(ctx, qp)?;
        let Some(q) = self.qps.remove(&qp) else {
            return Err(EINVAL);
        };
        self.by_qpn.remove(&q.qpn);
        if let Some(p) = self.pds.get_mut(&q.pd) {
            p.users = p.users.saturating_sub(1);
        }
        if let Some(s) = q.srq.and_then(|s| self.srqs.get_mut(&s)) {
            s.users = s.users.saturating_sub(1);
        }
        for cq in [q.send_cq, q.recv_cq] {
            if let Some(c) = self.cqs.get_mut(&cq) {
                c.users = c.users.saturating_sub(1);
            }
        }
        let _ = now;
        Ok(())
    }

    /// A context died with `qp` still connected: its RC peers move to ERR at once (the head
    /// send fails with `RETRY_EXC_ERR`, everything else flushes), so a peer that only waits for
    /// receives does not hang.
    fn fail_peers(&mut self, qp: QpId) {
        let Some(q) = self.qps.get(&qp) else { return };
        let (qpn, vnic) = (q.qpn, q.vnic);
        let (lid, gid) = self
            .vnics
            .get(&vnic)
            .map(|v| (v.lid, v.gid))
            .unwrap_or_default();
        let peers: Vec<QpId> = self
            .qps
            .iter()
            .filter(|(_, p)| {
                matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
                    && p.attr.dest_qp_num == qpn
                    && if p.attr.ah_attr.is_global {
                        p.attr.ah_attr.grh.dgid == gid
                    } else {
                        p.attr.ah_attr.dlid == lid
                    }
            })
            .map(|(&id, _)| id)
            .collect();
        for p in peers {
            self.fail_qp(p, Some(WcStatus::RetryExcErr));
        }
    }

    /// The QP's current state.
    pub fn qp_state(&self, qp: QpId) -> Option<QpState> {
        self.qps.get(&qp).map(|q| q.attr.qp_state)
    }

    /// All QPs (for the daemon's ring scan).
    pub fn qps(&self) -> impl Iterator<Item = QpId> + '_ {
        self.qps.keys().copied()
    }

    /// Number of QPs of a vRNIC.
    pub fn qp_count(&self, vnic: VnicId) -> usize {
        self.qps.values().filter(|q| q.vnic == vnic).count()
    }

    // ---- SRQs and address handles ----------------------------------------------------------

    /// `ibv_create_srq`: returns the SRQ and its ring depth (`max_wr` rounded up to a power
    /// of two). `limit` (0: disarmed) must be below `max_wr`.
    pub fn create_srq(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<(SrqId, u32), Errno> {
        let vnic = match self.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if max_wr == 0 || max_wr > MAX_QP_WR || max_sge as usize > MAX_SGE || limit >= max_wr {
            return Err(EINVAL);
        }
        if self.srqs.values().filter(|s| s.vnic == vnic).count() >= MAX_SRQ {
            return Err(ENOMEM);
        }
        let id = SrqId(self.id());
        let depth = max_wr.next_power_of_two();
        self.srqs.insert(
            id,
            Srq {
                vnic,
                ctx,
                pd,
                rq: VecDeque::new(),
                depth,
                max_wr,
                max_sge: max_sge.max(1),
                retired: 0,
                limit,
                users: 0,
                broken: false,
                touched: false,
            },
        );
        if let Some(p) = self.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok((id, depth))
    }

    /// `ibv_modify_srq` with `IBV_SRQ_LIMIT`: arms the limit event (`limit` below `max_wr`;
    /// 0 disarms). Resizing (`IBV_SRQ_MAX_WR`) is not supported: the device does not report
    /// `IBV_DEVICE_SRQ_RESIZE`, so it is `EINVAL`, as the kernel's verbs layer answers.
    pub fn modify_srq(
        &mut self,
        ctx: CtxId,
        srq: SrqId,
        resize: bool,
        limit: Option<u32>,
    ) -> Result<(), Errno> {
        let s = match self.srqs.get_mut(&srq) {
            Some(s) if s.ctx == ctx => s,
            _ => return Err(EINVAL),
        };
        if resize {
            return Err(EINVAL);
        }
        if let Some(l) = limit {
            if l >= s.max_wr {
                return Err(EINVAL);
            }
            s.limit = l;
            if l > 0 && (s.rq.len() as u32) < l {
                // Already below: the event fires at once, as a device raises it on arming.
                s.limit = 0;
                self.events.push_back((ctx, Event::SrqLimit { srq }));
            }
        }
        Ok(())
    }

    /// `ibv_query_srq`: `(max_wr, max_sge, srq_limit)`.
    pub fn query_srq(&self, ctx: CtxId, srq: SrqId) -> Result<(u32, u32, u32), Errno> {
        match self.srqs.get(&srq) {
            Some(s) if s.ctx == ctx => Ok((s.max_wr, s.max_sge, s.limit)),
            _ => Err(EINVAL),
        }
    }

    /// `ibv_destroy_srq`: `EBUSY` while a QP uses it.
    pub fn destroy_srq(&mut self, ctx: CtxId, srq: SrqId) -> Result<(), Errno> {
        match self.srqs.get(&srq) {
            Some(s) if s.ctx == ctx => {
                if s.users > 0 {
                    return Err(EBUSY);
                }
                let pd = s.pd;
                self.srqs.remove(&srq);
                if let Some(p) = self.pds.get_mut(&pd) {
                    p.users = p.users.saturating_sub(1);
                }
                self.events
                    .retain(|(_, e)| !matches!(e, Event::SrqLimit { srq: x } | Event::SrqError { srq: x } if *x == srq));
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// Receive WQEs the SRQ can take now.
    pub fn srq_room(&self, srq: SrqId) -> u32 {
        self.srqs
            .get(&srq)
            .filter(|s| !s.broken)
            .map(|s| s.depth.saturating_sub(s.rq.len() as u32))
            .unwrap_or(0)
    }

    /// SRQ receive WQEs retired so far (free running).
    pub fn srq_retired(&self, srq: SrqId) -> u32 {
        self.srqs.get(&srq).map(|s| s.retired).unwrap_or(0)
    }

    /// All SRQs (for the daemon's ring scan).
    pub fn srq_ids(&self) -> impl Iterator<Item = SrqId> + '_ {
        self.srqs.keys().copied()
    }

    /// A receive WQE from an SRQ's ring. One that does not parse, has more SGEs than the SRQ
    /// allows, or exceeds the depth breaks the SRQ: it takes no more receives and its owner
    /// gets `IBV_EVENT_SRQ_ERR` (the QPs on it see RNR, as with an empty queue).
    pub fn handle_srq_wqe(&mut self, srq: SrqId, wqe: Result<RecvWqe, ParseError>) {
        let Some(s) = self.srqs.get_mut(&srq) else {
            return;
        };
        if s.broken {
            return;
        }
        match wqe {
            Ok(w) if (s.rq.len() as u32) < s.depth && w.sges.len() as u32 <= s.max_sge => {
                s.rq.push_back(w);
                self.wake_rnr(RecvQueue::Srq(srq));
            }
            w => {
                tracing::debug!(
                    srq = srq.0,
                    ok = w.is_ok(),
                    "SRQ receive refused; SRQ in error"
                );
                s.broken = true;
                s.retired = s.retired.wrapping_add(1);
                touch_srq(&mut self.touched_srqs, srq, s);
                let ctx = s.ctx;
                self.events.push_back((ctx, Event::SrqError { srq }));
            }
        }
    }

    /// `ibv_create_ah`: an address for UD sends from QPs of `pd`. Only port 1 and GID index 0
    /// exist; the address need not name a vRNIC that exists now (datagrams to nowhere are
    /// dropped).
    pub fn create_ah(&mut self, ctx: CtxId, pd: PdId, attr: AhAttr) -> Result<AhId, Errno> {
        let vnic = match self.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if attr.port_num != 1 || (attr.is_global && attr.grh.sgid_index != 0) {
            return Err(EINVAL);
        }
        let mine = self
            .ahs
            .values()
            .filter(|a| self.pds.get(&a.pd).is_some_and(|p| p.vnic == vnic))
            .count();
        if mine >= MAX_AH {
            return Err(ENOMEM);
        }
        let id = AhId(self.id());
        self.ahs.insert(id, Ah { ctx, pd, attr });
        if let Some(p) = self.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok(id)
    }

    /// `ibv_destroy_ah`.
    pub fn destroy_ah(&mut self, ctx: CtxId, ah: AhId) -> Result<(), Errno> {
        match self.ahs.get(&ah) {
            Some(a) if a.ctx == ctx => {
                let pd = a.pd;
                self.ahs.remove(&ah);
                if let Some(p) = self.pds.get_mut(&pd) {
                    p.users = p.users.saturating_sub(1);
                }
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// `ibv_rereg_mr` without a new translation: moves the MR to `pd` and/or gives it new
    /// `access` flags; keys stay. (A new address range is a new registration: the driver
    /// registers it and deregisters the old one.)
    pub fn rereg_mr(
        &mut self,
        ctx: CtxId,
        mr: MrId,
        pd: Option<PdId>,
        acc: Option<u32>,
    ) -> Result<(), Errno> {
        let (old_pd, vnic) = match self.mrs.get(&mr) {
            Some(m) if m.ctx == ctx => (m.pd, m.vnic),
            _ => return Err(EINVAL),
        };
        if let Some(p) = pd {
            match self.pds.get(&p) {
                Some(x) if x.ctx == ctx && x.vnic == vnic => {}
                _ => return Err(EINVAL),
            }
        }
        if let Some(a) = acc {
            if a & !access::SUPPORTED != 0 {
                return Err(EOPNOTSUPP);
            }
            if a & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
                && a & access::LOCAL_WRITE == 0
            {
                return Err(EINVAL);
            }
        }
        let Some(m) = self.mrs.get_mut(&mr) else {
            return Err(EINVAL);
        };
        if let Some(a) = acc {
            m.access = a;
        }
        if let Some(p) = pd {
            m.pd = p;
            if let Some(x) = self.pds.get_mut(&old_pd) {
                x.users = x.users.saturating_sub(1);
            }
            if let Some(x) = self.pds.get_mut(&p) {
                x.users += 1;
            }
        }
        Ok(())
    }

    // ---- feeding work requests -------------------------------------------------------------

    /// Send WQEs that may be handed in now.
    pub fn sq_room(&self, qp: QpId) -> u32 {
        self.qps
            .get(&qp)
            .map(|q| q.sq_depth.saturating_sub(q.sq.len() as u32))
            .unwrap_or(0)
    }

    /// Receive WQEs that may be handed in now.
    pub fn rq_room(&self, qp: QpId) -> u32 {
        self.qps
            .get(&qp)
            .map(|q| q.rq_depth.saturating_sub(q.rq.len() as u32))
            .unwrap_or(0)
    }

    /// Send WQEs retired so far (free running).
    pub fn sq_retired(&self, qp: QpId) -> u32 {
        self.qps.get(&qp).map(|q| q.sq_retired).unwrap_or(0)
    }

    /// Receive WQEs retired so far (free running).
    pub fn rq_retired(&self, qp: QpId) -> u32 {
        self.qps.get(&qp).map(|q| q.rq_retired).unwrap_or(0)
    }

    /// A send WQE from the ring (already copied and parsed).
    ///
    /// In RTS and SQD it is queued, even if its slot did not parse: such a WQE fails with
    /// `LOC_QP_OP_ERR` when it reaches the head, after the ones before it ran. A WQE that
    /// arrives in INIT or RTR, beyond the queue depth, or as a broken ring
    /// ([`ParseError::ProducerIndex`]) fails at once: the QP moves to ERR, what was queued
    /// flushes and this WQE completes with `LOC_QP_OP_ERR`, last. In ERR it is flushed; in
    /// RESET it is dropped silently.
    pub fn handle_send_wqe(&mut self, now: Instant, qp: QpId, wqe: Result<SendWqe, ParseError>) {
        let _ = now;
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        match q.attr.qp_state {
            QpState::Reset => {
                q.sq_retired = q.sq_retired.wrapping_add(1);
                touch(&mut self.touched, qp, q);
            }
            QpState::Err | QpState::Sqe => {
                let c = cqe(
                    wqe.as_ref().map(|w| w.wr_id).unwrap_or(0),
                    WcStatus::WrFlushErr,
                    wqe_wc_opcode(&wqe),
                    q.qpn,
                );
                q.sq_retired = q.sq_retired.wrapping_add(1);
                touch(&mut self.touched, qp, q);
                self.completions.push_back((q.send_cq, c, false));
            }
            QpState::Rts | QpState::Sqd
                if (q.sq.len() as u32) < q.sq_depth
                    && !matches!(wqe, Err(ParseError::ProducerIndex(_))) =>
            {
                q.sq.push_back(wqe);
                self.wake(qp);
            }
            state => {
                tracing::debug!(qpn = q.qpn, ?state, ok = wqe.is_ok(), "send WQE refused");
                q.sq.push_back(wqe);
                self.fail_qp_with(qp, None, Some(WcStatus::LocQpOpErr), None);
            }
        }
    }

    /// A receive WQE from the ring.
    ///
    /// Queued in INIT, RTR, RTS and SQD. A slot that did not parse or exceeds the queue depth
    /// fails at once: the QP moves to ERR, posted receives flush and this one completes with
    /// `LOC_QP_OP_ERR`, last. In ERR it is flushed; in RESET it is dropped silently.
    pub fn handle_recv_wqe(&mut self, now: Instant, qp: QpId, wqe: Result<RecvWqe, ParseError>) {
        let _ = now;
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        match (q.attr.qp_state, wqe) {
            (QpState::Reset, _) => {
                q.rq_retired = q.rq_retired.wrapping_add(1);
                touch(&mut self.touched, qp, q);
            }
            (QpState::Err, w) => {
                let c = cqe(
                    w.map(|w| w.wr_id).unwrap_or(0),
                    WcStatus::WrFlushErr,
                    WcOpcode::Recv,
                    q.qpn,
                );
                q.rq_retired = q.rq_retired.wrapping_add(1);
                touch(&mut self.touched, qp, q);
                self.completions.push_back((q.recv_cq, c, false));
            }
            (_, Ok(w)) if (q.rq.len() as u32) < q.rq_depth => {
                q.rq.push_back(w);
                self.wake_rnr(RecvQueue::Qp(qp));
            }
            (state, w) => {
                tracing::debug!(qpn = q.qpn, ?state, ok = w.is_ok(), "receive WQE refused");
                q.rq.push_back(w.unwrap_or(RecvWqe {
                    wr_id: 0,
                    sges: Vec::new(),
                }));
                self.fail_qp_with(qp, None, None, Some(WcStatus::LocQpOpErr));
            }
        }
    }

    // ---- errors ----------------------------------------------------------------------------

    /// Moves a QP to ERR because of an error: the head send completes with `head` (if given and
    /// present), everything else flushes, and the owner gets `QP_FATAL`.
    fn fail_qp(&mut self, qp: QpId, head: Option<WcStatus>) {
        self.fail_qp_with(qp, head, None, None);
    }

    /// [`Engine::fail_qp`], where the last queued send (`sq_last`) or receive (`rq_last`)
    /// completes with the given status instead of `WR_FLUSH_ERR`.
    fn fail_qp_with(
        &mut self,
        qp: QpId,
        head: Option<WcStatus>,
        sq_last: Option<WcStatus>,
        rq_last: Option<WcStatus>,
    ) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        if q.attr.qp_state == QpState::Err {
            return;
        }
        tracing::debug!(qpn = q.qpn, ?head, state = ?q.attr.qp_state, "QP to error");
        if let Some(status) = head
            && let Some(w) = q.sq.pop_front()
        {
            let c = cqe(
                w.as_ref().map(|w| w.wr_id).unwrap_or(0),
                status,
                wqe_wc_opcode(&w),
                q.qpn,
            );
            q.sq_retired = q.sq_retired.wrapping_add(1);
            touch(&mut self.touched, qp, q);
            self.completions.push_back((q.send_cq, c, false));
        }
        q.attr.qp_state = QpState::Err;
        let (ctx, srq) = (q.ctx, q.srq);
        self.flush_with(qp, sq_last, rq_last);
        self.events.push_back((ctx, Event::QpFatal { qp }));
        if srq.is_some() {
            self.events.push_back((ctx, Event::LastWqeReached { qp }));
        }
    }

    /// Completes everything queued on an ERR QP with `WR_FLUSH_ERR`.
    fn flush(&mut self, qp: QpId) {
        self.flush_with(qp, None, None);
    }

    /// [`Engine::flush`], with another status for the last send or receive.
    fn flush_with(&mut self, qp: QpId, sq_last: Option<WcStatus>, rq_last: Option<WcStatus>) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        q.wait = Wait::None;
        q.progress = None;
        while let Some(w) = q.sq.pop_front() {
            let status = match sq_last {
                Some(s) if q.sq.is_empty() => s,
                _ => WcStatus::WrFlushErr,
            };
            let c = cqe(
                w.as_ref().map(|w| w.wr_id).unwrap_or(0),
                status,
                wqe_wc_opcode(&w),
                q.qpn,
            );
            q.sq_retired = q.sq_retired.wrapping_add(1);
            touch(&mut self.touched, qp, q);
            self.completions.push_back((q.send_cq, c, false));
        }
        while let Some(w) = q.rq.pop_front() {
            let status = match rq_last {
                Some(s) if q.rq.is_empty() => s,
                _ => WcStatus::WrFlushErr,
            };
            let c = cqe(w.wr_id, status, WcOpcode::Recv, q.qpn);
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.touched, qp, q);
            self.completions.push_back((q.recv_cq, c, false));
        }
    }

    // ---- execution -------------------------------------------------------------------------

    /// Fires the timers that are due: a QP waiting for a missing responder fails with
    /// `RETRY_EXC_ERR`; a QP waiting on RNR counts one retry (and fails with
    /// `RNR_RETRY_EXC_ERR` once they are used up). [`Engine::process`] fires them too, so a
    /// driver may call either or both. Costs the due timers only.
    pub fn handle_timeout(&mut self, now: Instant) {
        while let Some(&Reverse((t, qp))) = self.timers.peek() {
            if t > now {
                break;
            }
            self.timers.pop();
            let Some(q) = self.qps.get_mut(&qp) else {
                continue;
            };
            if q.armed != Some(t) {
                // Stale: superseded by an earlier entry of the same QP.
                continue;
            }
            q.armed = None;
            match q.deadline() {
                Some(d) if d > now => {
                    // It waits until later now: keep one entry for that.
                    self.arm(qp, d);
                    continue;
                }
                Some(_) => {}
                None => continue,
            }
            match (q.wait, self.responder(qp)) {
                (Wait::Retry { .. }, None) => self.fail_qp(qp, Some(WcStatus::RetryExcErr)),
                (Wait::Rnr { .. }, Some(peer)) if self.recv_empty(peer) => {
                    self.rnr(now, qp, peer);
                }
                // The situation changed: the next `process` retries at once.
                _ => {}
            }
            self.unpark(qp);
        }
    }

    /// The earliest deadline of a waiting QP (possibly one that no longer waits: waking for
    /// it early is harmless).
    #[must_use]
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.peek().map(|&Reverse((t, _))| t)
    }

    /// The next completion: `(cq, cqe, solicited)`.
    #[must_use]
    pub fn poll_completion(&mut self) -> Option<(CqId, Cqe, bool)> {
        self.completions.pop_front()
    }

    /// The next async event for a context.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<(CtxId, Event)> {
        self.events.pop_front()
    }

    /// Executes queued work requests, a bounded amount: at most [`PASS_WRS`] work requests and
    /// about [`PASS_BYTES`] bytes per call. vRNICs with work take turns, each at most once
    /// per call and for at most [`VNIC_WRS`] work requests and [`CHUNK`] bytes; within a
    /// vRNIC its QPs take turns, each for at most [`QP_WRS`] work requests. A vRNIC that was
    /// idle goes before those that used their turn, so a tenant with little traffic waits for
    /// at most one turn of each busy one, however many QPs they have; idle QPs cost nothing.
    /// A large message moves in chunks over several calls. Returns whether anything
    /// happened; if not, nothing will until a WQE arrives or [`Engine::poll_timeout`] passes.
    pub fn process(&mut self, now: Instant, mem: &mut dyn Memory) -> bool {
        self.handle_timeout(now);
        let mut did = false;
        let (mut pass_wrs, mut pass_bytes) = (0usize, 0u64);
        for _ in 0..self.runq.len() {
            if pass_wrs >= PASS_WRS || pass_bytes >= PASS_BYTES {
                break;
            }
            let Some(vid) = self.runq.pop_front() else {
                break;
            };
            let turns = self.vnics.get(&vid).map_or(0, |v| v.ready.len());
            let (mut v_wrs, mut v_bytes) = (0usize, 0u64);
            for _ in 0..turns {
                if v_wrs >= VNIC_WRS || v_bytes >= CHUNK {
                    break;
                }
                let Some(qp) = self.vnics.get_mut(&vid).and_then(|v| v.ready.pop_front()) else {
                    break;
                };
                let Some(q) = self.qps.get_mut(&qp) else {
                    continue;
                };
                q.queued = false;
                let (mut wrs, mut blocked) = (0usize, false);
                while wrs < QP_WRS && v_wrs < VNIC_WRS && v_bytes < CHUNK {
                    let Some(q) = self.qps.get(&qp) else { break };
                    if q.sq.is_empty() || q.attr.qp_state != QpState::Rts {
                        break;
                    }
                    let (n, retired) = match self.step(now, qp, mem) {
                        Step::Done(n) => (n, 1),
                        Step::Partial(n) if n > 0 => (n, 0),
                        Step::Partial(_) | Step::Blocked => {
                            blocked = true;
                            break;
                        }
                    };
                    did = true;
                    wrs += retired;
                    v_wrs += retired;
                    v_bytes = v_bytes.saturating_add(n);
                }
                if blocked {
                    self.park(qp);
                } else {
                    // More work: back of its vRNIC's list (an empty or stopped QP is dropped
                    // by `wake`).
                    self.wake(qp);
                }
            }
            pass_wrs += v_wrs;
            pass_bytes = pass_bytes.saturating_add(v_bytes);
            if let Some(v) = self.vnics.get_mut(&vid) {
                v.queued = !v.ready.is_empty();
                if v.queued {
                    self.runq.push_back(vid);
                }
            }
        }
        did
    }

    /// Puts a QP that may have work in its vRNIC's ready list (once), and the vRNIC in the run
    /// queue: at the front if it was idle.
    fn wake(&mut self, qp: QpId) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        if q.queued || q.parked || q.sq.is_empty() || q.attr.qp_state != QpState::Rts {
            return;
        }
        q.queued = true;
        let vid = q.vnic;
        let Some(v) = self.vnics.get_mut(&vid) else {
            return;
        };
        v.ready.push_back(qp);
        if !v.queued {
            v.queued = true;
            self.runq.push_front(vid);
        }
    }

    /// Takes a blocked QP off the ready lists: what it waits for wakes it (a receive at its
    /// responder, a responder appearing), and its timer in any case.
    fn park(&mut self, qp: QpId) {
        let Some(q) = self.qps.get(&qp) else { return };
        let wait = q.wait;
        match wait {
            Wait::Rnr { .. } => {
                let Some(peer) = self.responder(qp) else {
                    self.wake(qp);
                    return;
                };
                let key = match self.qps.get(&peer).and_then(|p| p.srq) {
                    Some(s) => RecvQueue::Srq(s),
                    None => RecvQueue::Qp(peer),
                };
                if let Some(q) = self.qps.get_mut(&qp)
                    && !q.listed
                {
                    q.listed = true;
                    self.rnr_waiters.entry(key).or_default().push(qp);
                }
            }
            Wait::Retry { .. } => {
                if let Some(q) = self.qps.get_mut(&qp)
                    && !q.listed
                {
                    q.listed = true;
                    self.retry_waiters.push(qp);
                }
            }
            // Nothing to wait for: try again next call.
            Wait::None => {
                self.wake(qp);
                return;
            }
        }
        if let Some(q) = self.qps.get_mut(&qp) {
            q.parked = true;
        }
    }

    /// Keeps one timer entry for `qp` at or before `until`.
    fn arm(&mut self, qp: QpId, until: Instant) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        if q.armed.is_none_or(|a| until < a) {
            q.armed = Some(until);
            self.timers.push(Reverse((until, qp)));
        }
    }

    /// Takes a QP off the waiter list it was in, and wakes it.
    fn unlist(&mut self, qp: QpId) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.listed = false;
        }
        self.unpark(qp);
    }

    /// Wakes a parked QP (its wait may be over).
    fn unpark(&mut self, qp: QpId) {
        if let Some(q) = self.qps.get_mut(&qp) {
            q.parked = false;
        }
        self.wake(qp);
    }

    /// A receive was posted to `rq`: the QPs waiting on RNR for it try again.
    fn wake_rnr(&mut self, rq: RecvQueue) {
        if let Some(list) = self.rnr_waiters.remove(&rq) {
            for qp in list {
                self.unlist(qp);
            }
        }
    }

    /// Hands the driver every QP and SRQ whose retired counters moved since the last call:
    /// `qp(id, sq_retired, rq_retired)` and `srq(id, retired)`, so it publishes those and
    /// looks at no other.
    pub fn drain_retired(
        &mut self,
        mut qp: impl FnMut(QpId, u32, u32),
        mut srq: impl FnMut(SrqId, u32),
    ) {
        for id in std::mem::take(&mut self.touched) {
            if let Some(q) = self.qps.get_mut(&id) {
                q.touched = false;
                qp(id, q.sq_retired, q.rq_retired);
            }
        }
        for id in std::mem::take(&mut self.touched_srqs) {
            if let Some(s) = self.srqs.get_mut(&id) {
                s.touched = false;
                srq(id, s.retired);
            }
        }
    }

    /// Finds the responder of an RC QP: the QP its address and `dest_qp_num` name, if it is
    /// ready to receive and connected back to us.
    fn responder(&self, qp: QpId) -> Option<QpId> {
        let q = self.qps.get(&qp)?;
        let ah = &q.attr.ah_attr;
        let (&vid, _) = self.vnics.iter().find(|(_, v)| {
            if ah.is_global {
                v.gid == ah.grh.dgid
            } else {
                v.lid == ah.dlid
            }
        })?;
        let &peer = self.by_qpn.get(&q.attr.dest_qp_num)?;
        let p = self.qps.get(&peer)?;
        let me = self.vnics.get(&q.vnic)?;
        let back = if p.attr.ah_attr.is_global {
            p.attr.ah_attr.grh.dgid == me.gid
        } else {
            p.attr.ah_attr.dlid == me.lid
        };
        (p.vnic == vid
            && p.ty == q.ty
            && matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
            && p.attr.dest_qp_num == q.qpn
            && back)
            .then_some(peer)
    }

    /// Retires the head send WQE, with a completion if it is signaled.
    fn complete_head(&mut self, qp: QpId, byte_len: u32) {
        let Some(q) = self.qps.get_mut(&qp) else {
            return;
        };
        q.wait = Wait::None;
        q.progress = None;
        let Some(Ok(w)) = q.sq.pop_front() else {
            return;
        };
        q.sq_retired = q.sq_retired.wrapping_add(1);
        touch(&mut self.touched, qp, q);
        if q.sq_sig_all || w.flags.contains(SendFlags::SIGNALED) {
            let mut c = cqe(w.wr_id, WcStatus::Success, w.opcode.wc_opcode(), q.qpn);
            c.byte_len = byte_len;
            self.completions.push_back((q.send_cq, c, false));
        }
    }

    /// Records that the head WQE moved its first `done` bytes to `peer` and continues later.
    fn partial(&mut self, qp: QpId, peer: QpId, done: u64, n: u64) -> Step {
        let peer_rq = self.recv_retired(peer);
        if let Some(q) = self.qps.get_mut(&qp) {
            q.wait = Wait::None;
            q.progress = Some(Progress {
                done,
                peer,
                peer_rq,
            });
        }
        Step::Partial(n)
    }

    fn step(&mut self, now: Instant, qp: QpId, mem: &mut dyn Memory) -> Step {
        let Some(q) = self.qps.get(&qp) else {
            return Step::Blocked;
        };
        // A waiting head costs nothing until its timer fires or its responder changes.
        match q.wait {
            Wait::Rnr { until, .. }
                if now < until && self.responder(qp).is_some_and(|p| self.recv_empty(p)) =>
            {
                return Step::Blocked;
            }
            Wait::Retry { until } if now < until && self.responder(qp).is_none() => {
                return Step::Blocked;
            }
            _ => {}
        }
        let wqe = match q.sq.front() {
            Some(Ok(w)) => w.clone(),
            Some(Err(_)) => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            None => return Step::Blocked,
        };
        let (vnic, pd, ty) = (q.vnic, q.pd, q.ty);
        let uc = ty == QpType::Uc;
        let len = wqe.payload.len();
        if len > u64::from(MAX_MSG_SIZE) {
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        // Local side: where the payload comes from (or, for READ/atomics, goes to).
        let needs_write = matches!(
            wqe.opcode,
            SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd
        );
        if uc && needs_write {
            // UC has no responses: READ and atomics are invalid on it.
            self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
            return Step::Done(0);
        }
        match &wqe.payload {
            SendPayload::Sges(sges) => {
                if !self.check_sges(vnic, pd, sges, needs_write) {
                    self.fail_qp(qp, Some(WcStatus::LocProtErr));
                    return Step::Done(0);
                }
            }
            SendPayload::Inline(_) if needs_write => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
            SendPayload::Inline(_) => {}
        }
        if ty == QpType::Ud {
            return self.exec_ud(qp, &wqe, mem);
        }
        // Remote side.
        let Some(peer) = self.responder(qp) else {
            if uc {
                // Nobody acknowledges UC: the message is simply lost.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            let Some(q) = self.qps.get_mut(&qp) else {
                return Step::Blocked;
            };
            match q.wait {
                Wait::Retry { until } if now >= until => {
                    self.fail_qp(qp, Some(WcStatus::RetryExcErr));
                    return Step::Done(0);
                }
                Wait::Retry { .. } => {}
                _ => {
                    let us = state::ack_timeout_us(q.attr.timeout)
                        .saturating_mul(u64::from(q.attr.retry_cnt) + 1);
                    let until = now + Duration::from_micros(us);
                    q.wait = Wait::Retry { until };
                    self.arm(qp, until);
                }
            }
            return Step::Blocked;
        };
        // Continue a message in progress if it still goes to the same receive; otherwise
        // start over, as a retransmission would.
        let peer_rq = self.recv_retired(peer);
        let done = match self.qps.get_mut(&qp).and_then(|q| q.progress.take()) {
            Some(p) if p.peer == peer && p.peer_rq == peer_rq && p.done < len => p.done,
            _ => 0,
        };
        match wqe.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => {
                self.exec_send(now, qp, peer, &wqe, done, mem)
            }
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => {
                self.exec_write(now, qp, peer, &wqe, done, mem)
            }
            SendOpcode::RdmaRead => self.exec_read(qp, peer, &wqe, done, mem),
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => {
                self.exec_atomic(qp, peer, &wqe, mem)
            }
        }
    }

    /// Handles "no receive posted" at the responder: RNR wait and retry accounting.
    fn rnr(&mut self, now: Instant, qp: QpId, peer: QpId) -> Step {
        let timer = self
            .qps
            .get(&peer)
            .map(|p| p.attr.min_rnr_timer)
            .unwrap_or(0);
        let Some(q) = self.qps.get_mut(&qp) else {
            return Step::Blocked;
        };
        let limit = q.attr.rnr_retry;
        let rearm = now + Duration::from_micros(state::rnr_timer_us(timer));
        match q.wait {
            Wait::Rnr { until, retries } if now >= until => {
                let retries = retries.saturating_add(1);
                if limit != 7 && retries > limit {
                    self.fail_qp(qp, Some(WcStatus::RnrRetryExcErr));
                    return Step::Done(0);
                }
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries,
                };
                self.arm(qp, rearm);
            }
            Wait::Rnr { .. } => {}
            _ => {
                q.wait = Wait::Rnr {
                    until: rearm,
                    retries: 0,
                };
                self.arm(qp, rearm);
            }
        }
        Step::Blocked
    }

    /// Both QPs to ERR after a responder-detected error.
    fn fail_both(&mut self, qp: QpId, requester: WcStatus, peer: QpId) {
        self.fail_qp(qp, Some(requester));
        self.fail_qp(peer, None);
    }

    /// The region runs of the requester's payload bytes `[done, done + n)`.
    fn local_runs(&self, qp: QpId, wqe: &SendWqe, done: u64, n: u64) -> Vec<(Loc, u64)> {
        let mut runs = Vec::new();
        if let (SendPayload::Sges(sges), Some(q)) = (&wqe.payload, self.qps.get(&qp)) {
            // Checked by `check_sges` in this same step, so it cannot fail.
            let _ = self.sge_runs(q.vnic, sges, done, n, &mut runs);
        }
        runs
    }

    /// Moves payload bytes `[done, done + n)` of `wqe` into `dst`.
    fn gather(
        &self,
        qp: QpId,
        wqe: &SendWqe,
        done: u64,
        n: u64,
        dst: &[(Loc, u64)],
        mem: &mut dyn Memory,
    ) {
        match &wqe.payload {
            SendPayload::Inline(data) => {
                let (a, b) = (done as usize, done.saturating_add(n) as usize);
                if let Some(part) = data.get(a..b) {
                    scatter_bytes(mem, part, dst);
                }
            }
            SendPayload::Sges(_) => {
                let src = self.local_runs(qp, wqe, done, n);
                copy_runs(mem, &src, dst, n);
            }
        }
    }

    fn exec_send(
        &mut self,
        now: Instant,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let Some(p) = self.qps.get(&peer) else {
            return Step::Blocked;
        };
        let uc = p.ty == QpType::Uc;
        let Some(recv) = self.recv_head(peer) else {
            if uc {
                // No receive posted: a UC responder drops the message; the sender never knows.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            return self.rnr(now, qp, peer);
        };
        let capacity: u64 = recv.sges.iter().map(|s| u64::from(s.length)).sum();
        let prot_ok = self.check_sges(p.vnic, p.pd, &recv.sges, true);
        let n = len.saturating_sub(done).min(CHUNK);
        let mut dst = Vec::new();
        if prot_ok && len <= capacity {
            // Checked just above, so it cannot fail.
            let _ = self.sge_runs(p.vnic, &recv.sges, done, n, &mut dst);
        }
        if uc && (!prot_ok || len > capacity) {
            // A UC responder that cannot take the message fails its receive and its QP; the
            // sender is not told.
            let status = if prot_ok {
                WcStatus::LocLenErr
            } else {
                WcStatus::LocProtErr
            };
            self.take_recv(peer, status, 0, None);
            self.fail_qp(peer, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        if !prot_ok {
            // The responder's own receive buffer is bad: its receive fails, the requester
            // learns a remote operational error.
            self.take_recv(peer, WcStatus::LocProtErr, 0, None);
            self.fail_both(qp, WcStatus::RemOpErr, peer);
            return Step::Done(0);
        }
        if len > capacity {
            self.take_recv(peer, WcStatus::LocLenErr, 0, None);
            self.fail_both(qp, WcStatus::RemInvReqErr, peer);
            return Step::Done(0);
        }
        self.gather(qp, wqe, done, n, &dst, mem);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        let imm = (wqe.opcode == SendOpcode::SendWithImm).then_some(wqe.imm_data);
        let (slid, qpn) = (
            self.lid_of(qp),
            self.qps.get(&qp).map(|q| q.qpn).unwrap_or(0),
        );
        self.take_recv_ok(
            peer,
            WcOpcode::Recv,
            len as u32,
            imm,
            qpn,
            slid,
            wqe.flags.contains(SendFlags::SOLICITED),
            0,
        );
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    fn exec_write(
        &mut self,
        now: Instant,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let with_imm = wqe.opcode == SendOpcode::RdmaWriteWithImm;
        let uc = self.qps.get(&peer).is_some_and(|p| p.ty == QpType::Uc);
        if with_imm && self.recv_empty(peer) {
            if uc {
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            return self.rnr(now, qp, peer);
        }
        let n = len.saturating_sub(done).min(CHUNK);
        // A zero-length write names no memory, so its rkey is not checked (IB C9-88, as rxe).
        let dst = if len == 0 {
            Some(Vec::new())
        } else {
            self.remote_mr(peer, wqe.remote_addr, len, wqe.rkey, access::REMOTE_WRITE)
                .and_then(|m| {
                    let mut runs = Vec::new();
                    translate(m, wqe.remote_addr.checked_add(done)?, n, &mut runs)?;
                    Some(runs)
                })
        };
        let Some(dst) = dst else {
            if uc {
                // A UC responder drops a write it may not perform; the sender is not told.
                self.complete_head(qp, len as u32);
                return Step::Done(len);
            }
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        self.gather(qp, wqe, done, n, &dst, mem);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        if with_imm {
            let (slid, qpn) = (
                self.lid_of(qp),
                self.qps.get(&qp).map(|q| q.qpn).unwrap_or(0),
            );
            self.take_recv_ok(
                peer,
                WcOpcode::RecvRdmaWithImm,
                len as u32,
                Some(wqe.imm_data),
                qpn,
                slid,
                wqe.flags.contains(SendFlags::SOLICITED),
                0,
            );
        }
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    fn exec_read(
        &mut self,
        qp: QpId,
        peer: QpId,
        wqe: &SendWqe,
        done: u64,
        mem: &mut dyn Memory,
    ) -> Step {
        let len = wqe.payload.len();
        let n = len.saturating_sub(done).min(CHUNK);
        let src = if len == 0 {
            Some(Vec::new())
        } else {
            self.remote_mr(peer, wqe.remote_addr, len, wqe.rkey, access::REMOTE_READ)
                .and_then(|m| {
                    let mut runs = Vec::new();
                    translate(m, wqe.remote_addr.checked_add(done)?, n, &mut runs)?;
                    Some(runs)
                })
        };
        let Some(src) = src else {
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        let local = self.local_runs(qp, wqe, done, n);
        copy_runs(mem, &src, &local, n);
        if done + n < len {
            return self.partial(qp, peer, done + n, n);
        }
        self.complete_head(qp, len as u32);
        Step::Done(n)
    }

    /// A UD send: to the QP the address handle and QP number name, if its Q_Key matches;
    /// otherwise (or with no receive posted) the datagram is dropped and the sender never
    /// knows. The receive gets a GRH in its first [`GRH_LEN`] bytes and the payload after it.
    fn exec_ud(&mut self, qp: QpId, wqe: &SendWqe, mem: &mut dyn Memory) -> Step {
        let len = wqe.payload.len();
        let Some(q) = self.qps.get(&qp) else {
            return Step::Blocked;
        };
        let (pd, qpn, own_qkey, vnic) = (q.pd, q.qpn, q.attr.qkey, q.vnic);
        if !matches!(wqe.opcode, SendOpcode::Send | SendOpcode::SendWithImm) {
            self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
            return Step::Done(0);
        }
        let ah = match self.ahs.get(&AhId(wqe.ud.ah)) {
            Some(a) if a.pd == pd => a.attr,
            _ => {
                self.fail_qp(qp, Some(WcStatus::LocQpOpErr));
                return Step::Done(0);
            }
        };
        if len > UD_MTU {
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        // A Q_Key with the high bit set means the sender's own (IB spec 10.2.4).
        let qkey = if wqe.ud.remote_qkey & 0x8000_0000 != 0 {
            own_qkey
        } else {
            wqe.ud.remote_qkey
        };
        let dest = self
            .vnics
            .iter()
            .find(|(_, v)| {
                if ah.is_global {
                    v.gid == ah.grh.dgid
                } else {
                    v.lid == ah.dlid
                }
            })
            .map(|(&id, _)| id)
            .and_then(|vid| {
                let &d = self.by_qpn.get(&wqe.ud.remote_qpn)?;
                let p = self.qps.get(&d)?;
                (p.vnic == vid
                    && p.ty == QpType::Ud
                    && matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
                    && p.attr.qkey == qkey)
                    .then_some(d)
            });
        let Some(peer) = dest else {
            tracing::trace!(
                qpn,
                dqpn = wqe.ud.remote_qpn,
                "UD datagram dropped: no such QP"
            );
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        };
        let Some(recv) = self.recv_head(peer) else {
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        };
        let Some(p) = self.qps.get(&peer) else {
            return Step::Blocked;
        };
        let (pvnic, ppd) = (p.vnic, p.pd);
        let capacity: u64 = recv.sges.iter().map(|s| u64::from(s.length)).sum();
        if !self.check_sges(pvnic, ppd, &recv.sges, true) {
            self.take_recv(peer, WcStatus::LocProtErr, 0, None);
            self.fail_qp(peer, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        if len + GRH_LEN > capacity {
            self.take_recv(peer, WcStatus::LocLenErr, 0, None);
            self.complete_head(qp, len as u32);
            return Step::Done(len);
        }
        let (mut grh_runs, mut data_runs) = (Vec::new(), Vec::new());
        // Checked just above, so neither can fail.
        let _ = self.sge_runs(pvnic, &recv.sges, 0, GRH_LEN, &mut grh_runs);
        let _ = self.sge_runs(pvnic, &recv.sges, GRH_LEN, len, &mut data_runs);
        let mut flags = 0;
        if ah.is_global {
            let sgid = self.vnics.get(&vnic).map(|v| v.gid).unwrap_or_default();
            scatter_bytes(mem, &grh(&ah, sgid, len), &grh_runs);
            flags = WC_GRH;
        }
        self.gather(qp, wqe, 0, len, &data_runs, mem);
        let imm = (wqe.opcode == SendOpcode::SendWithImm).then_some(wqe.imm_data);
        let slid = self.lid_of(qp);
        self.take_recv_ok(
            peer,
            WcOpcode::Recv,
            (len + GRH_LEN) as u32,
            imm,
            qpn,
            slid,
            wqe.flags.contains(SendFlags::SOLICITED),
            flags,
        );
        self.complete_head(qp, len as u32);
        Step::Done(len)
    }

    fn exec_atomic(&mut self, qp: QpId, peer: QpId, wqe: &SendWqe, mem: &mut dyn Memory) -> Step {
        if wqe.payload.len() != 8 {
            // The local buffer must hold exactly the 8-byte original value.
            self.fail_qp(qp, Some(WcStatus::LocLenErr));
            return Step::Done(0);
        }
        if !wqe.remote_addr.is_multiple_of(8) {
            self.fail_both(qp, WcStatus::RemInvReqErr, peer);
            return Step::Done(0);
        }
        let dst = self
            .remote_mr(peer, wqe.remote_addr, 8, wqe.rkey, access::REMOTE_ATOMIC)
            .and_then(|m| {
                let mut runs = Vec::new();
                translate(m, wqe.remote_addr, 8, &mut runs)?;
                Some(runs)
            });
        // An aligned 8-byte word never crosses a page, so it is one run.
        let Some(&(at, _)) = dst.as_ref().and_then(|d| d.first()) else {
            self.fail_both(qp, WcStatus::RemAccessErr, peer);
            return Step::Done(0);
        };
        let mut old = [0u8; 8];
        mem.read(at, &mut old);
        let cur = u64::from_le_bytes(old);
        let new = match wqe.opcode {
            SendOpcode::AtomicCmpAndSwp if cur == wqe.compare_add => Some(wqe.swap),
            SendOpcode::AtomicCmpAndSwp => None,
            _ => Some(cur.wrapping_add(wqe.compare_add)),
        };
        if let Some(v) = new {
            mem.write(at, &v.to_le_bytes());
        }
        let local = self.local_runs(qp, wqe, 0, 8);
        scatter_bytes(mem, &old, &local);
        self.complete_head(qp, 8);
        Step::Done(8)
    }

    /// The receive a message to `qp` would land in: the head of its SRQ or of its own queue.
    fn recv_head(&self, qp: QpId) -> Option<&RecvWqe> {
        let q = self.qps.get(&qp)?;
        match q.srq {
            Some(s) => self.srqs.get(&s)?.rq.front(),
            None => q.rq.front(),
        }
    }

    fn recv_empty(&self, qp: QpId) -> bool {
        self.recv_head(qp).is_none()
    }

    /// Receives retired so far from the queue `qp` receives from (its SRQ's or its own).
    fn recv_retired(&self, qp: QpId) -> u32 {
        let Some(q) = self.qps.get(&qp) else { return 0 };
        match q.srq {
            Some(s) => self.srqs.get(&s).map(|s| s.retired).unwrap_or(0),
            None => q.rq_retired,
        }
    }

    /// Takes the receive a message to `qp` lands in. Taking from an SRQ below its armed limit
    /// raises `SRQ_LIMIT_REACHED` (once; the limit disarms).
    fn pop_recv(&mut self, qp: QpId) -> Option<RecvWqe> {
        let q = self.qps.get_mut(&qp)?;
        let Some(sid) = q.srq else {
            let r = q.rq.pop_front()?;
            q.rq_retired = q.rq_retired.wrapping_add(1);
            touch(&mut self.touched, qp, q);
            return Some(r);
        };
        let s = self.srqs.get_mut(&sid)?;
        let r = s.rq.pop_front()?;
        s.retired = s.retired.wrapping_add(1);
        touch_srq(&mut self.touched_srqs, sid, s);
        if s.limit > 0 && (s.rq.len() as u32) < s.limit {
            s.limit = 0;
            let ctx = s.ctx;
            self.events.push_back((ctx, Event::SrqLimit { srq: sid }));
        }
        Some(r)
    }

    fn lid_of(&self, qp: QpId) -> u16 {
        self.qps
            .get(&qp)
            .and_then(|q| self.vnics.get(&q.vnic))
            .map(|v| v.lid)
            .unwrap_or(0)
    }

    fn take_recv(&mut self, peer: QpId, status: WcStatus, byte_len: u32, imm: Option<u32>) {
        let Some(r) = self.pop_recv(peer) else { return };
        let Some(p) = self.qps.get(&peer) else {
            return;
        };
        let mut c = cqe(r.wr_id, status, WcOpcode::Recv, p.qpn);
        c.byte_len = byte_len;
        if let Some(i) = imm {
            c.imm_data = i;
            c.wc_flags |= WC_WITH_IMM;
        }
        self.completions.push_back((p.recv_cq, c, false));
    }

    #[allow(clippy::too_many_arguments)]
    fn take_recv_ok(
        &mut self,
        peer: QpId,
        opcode: WcOpcode,
        byte_len: u32,
        imm: Option<u32>,
        src_qp: u32,
        slid: u16,
        solicited: bool,
        wc_flags: u8,
    ) {
        let Some(r) = self.pop_recv(peer) else { return };
        let Some(p) = self.qps.get(&peer) else {
            return;
        };
        let mut c = cqe(r.wr_id, WcStatus::Success, opcode, p.qpn);
        c.byte_len = byte_len;
        c.src_qp = src_qp;
        c.slid = slid;
        c.wc_flags |= wc_flags;
        if let Some(i) = imm {
            c.imm_data = i;
            c.wc_flags |= WC_WITH_IMM;
        }
        self.completions.push_back((p.recv_cq, c, solicited));
    }

    /// Checks local SGEs: each nonempty one names an MR of `vnic` by lkey, in `pd`, with
    /// `LOCAL_WRITE` if `write`, and lies inside it.
    fn check_sges(&self, vnic: VnicId, pd: PdId, sges: &[Sge], write: bool) -> bool {
        let Some(v) = self.vnics.get(&vnic) else {
            return false;
        };
        sges.iter().all(|s| {
            s.length == 0
                || v.keys
                    .get(&s.lkey)
                    .and_then(|mr| self.mrs.get(mr))
                    .is_some_and(|m| {
                        m.pd == pd
                            && (!write || m.access & access::LOCAL_WRITE != 0)
                            && inside(m, s.addr, u64::from(s.length))
                    })
        })
    }

    /// Appends the region runs of bytes `[skip, skip + take)` of an SGE list (already checked
    /// by [`Engine::check_sges`]) to `runs`.
    fn sge_runs(
        &self,
        vnic: VnicId,
        sges: &[Sge],
        mut skip: u64,
        mut take: u64,
        runs: &mut Vec<(Loc, u64)>,
    ) -> Option<()> {
        let v = self.vnics.get(&vnic)?;
        for s in sges {
            if take == 0 {
                break;
            }
            let l = u64::from(s.length);
            if skip >= l {
                skip -= l;
                continue;
            }
            let n = (l - skip).min(take);
            let m = self.mrs.get(v.keys.get(&s.lkey)?)?;
            translate(m, s.addr.checked_add(skip)?, n, runs)?;
            skip = 0;
            take -= n;
        }
        Some(())
    }

    /// The responder's MR for `[addr, addr+len)` under `rkey`, if the responder QP allows
    /// `need`, the MR is in its PD, allows `need` and holds the whole range.
    fn remote_mr(&self, peer: QpId, addr: u64, len: u64, rkey: u32, need: u32) -> Option<&Mr> {
        let p = self.qps.get(&peer)?;
        if p.attr.qp_access_flags & need == 0 {
            return None;
        }
        let v = self.vnics.get(&p.vnic)?;
        let m = self.mrs.get(v.keys.get(&rkey)?)?;
        (m.pd == p.pd && m.access & need != 0 && inside(m, addr, len)).then_some(m)
    }

    /// The number of completions waiting (for tests and metrics).
    pub fn pending_completions(&self) -> usize {
        self.completions.len()
    }
}

/// Whether `[addr, addr+len)` (in the MR's iova space) lies inside the MR.
/// The Global Route Header of a UD datagram of `len` payload bytes sent from `sgid` along
/// `ah` (IB spec 8.3: version 6, traffic class, flow label, payload length, next header 0x1B
/// (IBA transport), hop limit, source GID, destination GID).
fn grh(ah: &AhAttr, sgid: [u8; 16], len: u64) -> [u8; GRH_LEN as usize] {
    let mut g = [0u8; GRH_LEN as usize];
    let word =
        (6u32 << 28) | (u32::from(ah.grh.traffic_class) << 20) | (ah.grh.flow_label & 0xf_ffff);
    g[0..4].copy_from_slice(&word.to_be_bytes());
    g[4..6].copy_from_slice(&(len as u16).to_be_bytes());
    g[6] = 0x1b;
    g[7] = ah.grh.hop_limit;
    g[8..24].copy_from_slice(&sgid);
    g[24..40].copy_from_slice(&ah.grh.dgid);
    g
}

fn inside(m: &Mr, addr: u64, len: u64) -> bool {
    addr.checked_sub(m.iova)
        .and_then(|start| start.checked_add(len))
        .is_some_and(|end| end <= m.len)
}

/// Appends the region runs of `[addr, addr+len)` (in the MR's iova space) to `runs`, merging
/// contiguous pages; `None` if the range leaves the MR.
fn translate(m: &Mr, addr: u64, len: u64, runs: &mut Vec<(Loc, u64)>) -> Option<()> {
    if !inside(m, addr, len) {
        return None;
    }
    let start = addr - m.iova;
    let mut app = m.addr.checked_add(start)?;
    let app_end = app.checked_add(len)?;
    let first_page = m.addr / PAGE;
    while app < app_end {
        let page = usize::try_from(app / PAGE - first_page).ok()?;
        let in_page = app % PAGE;
        let n = (PAGE - in_page).min(app_end - app);
        let off = m.pages.get(page)?.checked_add(in_page)?;
        match runs.last_mut() {
            Some((loc, l)) if loc.vnic == m.vnic && loc.off.checked_add(*l) == Some(off) => *l += n,
            _ => runs.push((Loc { vnic: m.vnic, off }, n)),
        }
        app += n;
    }
    Some(())
}

/// Copies `len` bytes from the `src` runs into the `dst` runs, one [`Memory::copy`] per
/// stretch that is contiguous on both sides.
fn copy_runs(mem: &mut dyn Memory, src: &[(Loc, u64)], dst: &[(Loc, u64)], len: u64) {
    let (mut si, mut so, mut di, mut dof) = (0usize, 0u64, 0usize, 0u64);
    let mut left = len;
    while left > 0
        && let (Some(&(s, sl)), Some(&(d, dl))) = (src.get(si), dst.get(di))
    {
        let n = (sl - so).min(dl - dof).min(left);
        mem.copy(
            Loc {
                vnic: s.vnic,
                off: s.off + so,
            },
            Loc {
                vnic: d.vnic,
                off: d.off + dof,
            },
            n as usize,
        );
        so += n;
        dof += n;
        left -= n;
        if so == sl {
            si += 1;
            so = 0;
        }
        if dof == dl {
            di += 1;
            dof = 0;
        }
    }
}

/// Writes `data` across the `dst` runs.
fn scatter_bytes(mem: &mut dyn Memory, data: &[u8], dst: &[(Loc, u64)]) {
    let mut at = 0usize;
    for &(d, l) in dst {
        if at >= data.len() {
            break;
        }
        let n = usize::try_from(l)
            .unwrap_or(usize::MAX)
            .min(data.len() - at);
        mem.write(d, &data[at..at + n]);
        at += n;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mr(addr: u64, len: u64, iova: u64, pages: Vec<u64>) -> Mr {
        Mr {
            vnic: VnicId(1),
            ctx: CtxId(1),
            pd: PdId(1),
            addr,
            len,
            iova,
            access: 0,
            key: 1,
            pages,
        }
    }

    #[test]
    fn translation_merges_contiguous_pages_into_one_run() {
        let m = mr(
            0x1008,
            3 * 4096,
            0x1008,
            vec![0x10_000, 0x11_000, 0x12_000, 0x13_000],
        );
        let mut runs = Vec::new();
        translate(&m, 0x1008, 3 * 4096, &mut runs).unwrap();
        let at = Loc {
            vnic: VnicId(1),
            off: 0x10_008,
        };
        assert_eq!(runs, vec![(at, 3 * 4096)]);
    }

    #[test]
    fn translation_splits_at_discontiguous_pages_and_honours_iova() {
        // App bytes from 0x2ffe; iova 0 names the first of them.
        let m = mr(0x2ffe, 4, 0, vec![0x5000, 0x1000]);
        let mut runs = Vec::new();
        translate(&m, 1, 3, &mut runs).unwrap();
        let l = |off| Loc {
            vnic: VnicId(1),
            off,
        };
        assert_eq!(runs, vec![(l(0x5fff), 1), (l(0x1000), 2)]);
        assert_eq!(translate(&m, 1, 4, &mut runs), None, "past the end");
        assert_eq!(translate(&m, u64::MAX, 2, &mut runs), None, "overflow");
    }

    #[test]
    fn copy_runs_uses_one_copy_per_stretch_contiguous_on_both_sides() {
        struct Log(Vec<(u64, u64, usize)>);
        impl Memory for Log {
            fn copy(&mut self, src: Loc, dst: Loc, len: usize) {
                self.0.push((src.off, dst.off, len));
            }
            fn write(&mut self, _: Loc, _: &[u8]) {}
            fn read(&mut self, _: Loc, _: &mut [u8]) {}
        }
        let l = |off| Loc {
            vnic: VnicId(1),
            off,
        };
        let mut log = Log(Vec::new());
        copy_runs(
            &mut log,
            &[(l(0), 10), (l(100), 10)],
            &[(l(1000), 15), (l(2000), 5)],
            20,
        );
        assert_eq!(log.0, vec![(0, 1000, 10), (100, 1010, 5), (105, 2000, 5)]);
    }
}
