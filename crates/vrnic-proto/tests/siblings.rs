//! Two engines of one daemon (engine threads), each with vRNICs of its own: a work request
//! whose destination is on the other engine is executed by the engine that took it, through
//! `Siblings`, with the other held. These tests run the two engines turn by turn over one
//! memory (the daemon maps every region in one process) and check the bytes, the statuses,
//! that no frame goes between the engines, that each byte is copied once, that a busy sibling
//! only delays, and that the address-word checks of every path between QPs hold here too.

mod common;

use common::{VecMem, bind, inc, per_page};

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use vrnic_proto::{
    CtxId, Engine, GroupId, HostId, Loc, Memory, MemoryRefused, MrKeys, NoNewcomers, PdId, QpId,
    Siblings, VnicId,
};
use vrnic_wire::{
    AhAttr, Cqe, QpAttr, QpCap, QpState, QpType, RecvWqe, SendFlags, SendOpcode, SendPayload,
    SendWqe, Sge, UdAddr, WcOpcode, WcStatus, access, qp_attr,
};

const REGION: usize = 4 << 20;
/// The engines are hosts `BASE + class` to each other.
const BASE: u32 = 0x8000_0000;

/// One memory for both engines, counting every byte copied, written or read.
struct Shared<'a> {
    mem: &'a RefCell<VecMem>,
    moved: &'a Cell<u64>,
}

impl Memory for Shared<'_> {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        self.moved.set(self.moved.get() + len as u64);
        self.mem.borrow_mut().copy(src, dst, len)
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        self.moved.set(self.moved.get() + data.len() as u64);
        self.mem.borrow_mut().write(dst, data)
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        self.moved.set(self.moved.get() + out.len() as u64);
        self.mem.borrow_mut().read(src, out)
    }
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        self.moved.set(self.moved.get() + 8);
        self.mem.borrow_mut().store_u64(dst, value)
    }
}

/// The other engine, as the one running a turn reaches it; busy for the next `busy` calls.
struct Other<'a> {
    e: &'a mut Engine,
    host: HostId,
    mem: &'a RefCell<VecMem>,
    moved: &'a Cell<u64>,
    busy: &'a Cell<u32>,
    calls: &'a Cell<u32>,
}

impl Siblings for Other<'_> {
    fn with<R>(
        &mut self,
        host: HostId,
        _recv_for: Option<u32>,
        f: impl FnOnce(&mut Engine, &mut dyn Memory) -> R,
    ) -> Option<R> {
        assert_eq!(
            host, self.host,
            "a request for an engine that does not exist"
        );
        if self.busy.get() > 0 {
            self.busy.set(self.busy.get() - 1);
            return None;
        }
        self.calls.set(self.calls.get() + 1);
        Some(f(
            self.e,
            &mut Shared {
                mem: self.mem,
                moved: self.moved,
            },
        ))
    }
}

/// A vRNIC with one QP, on engine `k`.
struct End {
    k: usize,
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    qp: QpId,
    qpn: u32,
    lid: u16,
    next_page: u64,
}

struct Pair {
    e: [Engine; 2],
    mem: RefCell<VecMem>,
    moved: Cell<u64>,
    busy: Cell<u32>,
    calls: Cell<u32>,
    now: Instant,
}

fn cap() -> QpCap {
    QpCap {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    }
}

impl Pair {
    fn new() -> Pair {
        let e = [0u32, 1].map(|k| {
            let mut e = Engine::new(u64::from(k) + 5);
            e.set_qpn_space(k, 2);
            e.set_siblings(HostId(BASE));
            e
        });
        Pair {
            e,
            mem: RefCell::new(VecMem(Default::default())),
            moved: Cell::new(0),
            busy: Cell::new(0),
            calls: Cell::new(0),
            now: Instant::now(),
        }
    }

    /// vRNIC `id` in group `group` on engine `k` (the other knows it as a vRNIC of host
    /// `BASE + k`), with one QP of type `ty`.
    fn end(&mut self, k: usize, id: u32, group: u32, ty: QpType) -> End {
        let (vnic, ctx, lid) = (VnicId(id), CtxId(id), id as u16 * 10);
        let gid = [id as u8; 16];
        self.e[k].add_vnic_in_group(vnic, lid, gid, GroupId(group));
        self.e[1 - k].add_remote_vnic_in_group(HostId(BASE + k as u32), lid, gid, GroupId(group));
        self.mem.borrow_mut().0.insert(vnic, vec![0u8; REGION]);
        let e = &mut self.e[k];
        let pd = e.alloc_pd(vnic, ctx).unwrap();
        let cq = e.create_cq(vnic, ctx, 4096).unwrap();
        let (qp, qpn) = e.create_qp(ctx, pd, cq, cq, ty, cap(), false).unwrap();
        assert_eq!(qpn % 2, k as u32);
        End {
            k,
            vnic,
            ctx,
            pd,
            qp,
            qpn,
            lid,
            next_page: 1,
        }
    }

    fn map(&mut self, x: &mut End, addr: u64, len: u64) -> (MrKeys, Vec<u64>) {
        let n = (addr + len).div_ceil(4096) - addr / 4096;
        let base = x.next_page;
        x.next_page += n + 1;
        let pages: Vec<u64> = (0..n).map(|i| (base + i) * 4096).collect();
        let acc = access::LOCAL_WRITE
            | access::REMOTE_WRITE
            | access::REMOTE_READ
            | access::REMOTE_ATOMIC;
        let keys = self.e[x.k]
            .reg_mr(x.ctx, x.pd, addr, len, addr, acc, &per_page(&pages))
            .unwrap();
        (keys, pages)
    }

    fn off(m: &(MrKeys, Vec<u64>), base: u64, a: u64) -> usize {
        (m.1[(a / 4096 - base / 4096) as usize] + a % 4096) as usize
    }

    fn set(&self, x: &End, m: &(MrKeys, Vec<u64>), base: u64, a: u64, data: &[u8]) {
        let mut mem = self.mem.borrow_mut();
        let r = mem.0.get_mut(&x.vnic).unwrap();
        for (i, b) in data.iter().enumerate() {
            r[Self::off(m, base, a + i as u64)] = *b;
        }
    }

    fn get(&self, x: &End, m: &(MrKeys, Vec<u64>), base: u64, a: u64, len: usize) -> Vec<u8> {
        let mem = self.mem.borrow();
        let r = &mem.0[&x.vnic];
        (0..len)
            .map(|i| r[Self::off(m, base, a + i as u64)])
            .collect()
    }

    /// `x`'s RC or UC QP to RTS, connected to QP `dqpn` of the vRNIC at `dlid`.
    fn connect(&mut self, x: &End, dqpn: u32, dlid: u16, uc: bool) {
        let now = self.now;
        let e = &mut self.e[x.k];
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: if uc {
                access::REMOTE_WRITE
            } else {
                access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC
            },
            ..Default::default()
        };
        let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
        e.modify_qp(now, x.ctx, x.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        a.path_mtu = 5;
        a.dest_qp_num = dqpn;
        a.rq_psn = 0x10;
        a.min_rnr_timer = 1;
        a.ah_attr = AhAttr {
            dlid,
            port_num: 1,
            ..Default::default()
        };
        let mut rtr =
            qp_attr::STATE | qp_attr::AV | qp_attr::PATH_MTU | qp_attr::DEST_QPN | qp_attr::RQ_PSN;
        if !uc {
            rtr |= qp_attr::MAX_DEST_RD_ATOMIC | qp_attr::MIN_RNR_TIMER;
        }
        e.modify_qp(now, x.ctx, x.qp, rtr, &a).unwrap();
        a.qp_state = QpState::Rts;
        a.sq_psn = 0x10;
        a.timeout = 10;
        a.retry_cnt = 2;
        a.rnr_retry = 7;
        let mut rts = qp_attr::STATE | qp_attr::SQ_PSN;
        if !uc {
            rts |= qp_attr::TIMEOUT
                | qp_attr::RETRY_CNT
                | qp_attr::RNR_RETRY
                | qp_attr::MAX_QP_RD_ATOMIC;
        }
        e.modify_qp(now, x.ctx, x.qp, rts, &a).unwrap();
    }

    /// `x`'s UD QP to RTS with Q_Key `qkey`.
    fn ud_up(&mut self, x: &End, qkey: u32) {
        let now = self.now;
        let e = &mut self.e[x.k];
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey,
            ..Default::default()
        };
        let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY;
        e.modify_qp(now, x.ctx, x.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        e.modify_qp(now, x.ctx, x.qp, qp_attr::STATE, &a).unwrap();
        a.qp_state = QpState::Rts;
        e.modify_qp(now, x.ctx, x.qp, qp_attr::STATE | qp_attr::SQ_PSN, &a)
            .unwrap();
    }

    fn post(&mut self, x: &End, w: SendWqe) {
        self.e[x.k].handle_send_wqe(self.now, x.qp, Ok(w));
    }

    fn recv(&mut self, x: &End, wr_id: u64, s: Sge) {
        self.e[x.k].handle_recv_wqe(
            self.now,
            x.qp,
            Ok(RecvWqe {
                wr_id,
                sges: vec![s].into(),
            }),
        );
    }

    /// Runs both engines (timers first, as a pass does) until neither moves.
    fn run(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            for k in 0..2 {
                let [e0, e1] = &mut self.e;
                let (me, other) = if k == 0 { (e0, e1) } else { (e1, e0) };
                me.handle_timeout(self.now);
                let mut own = Shared {
                    mem: &self.mem,
                    moved: &self.moved,
                };
                let mut sib = Other {
                    e: other,
                    host: HostId(BASE + 1 - k as u32),
                    mem: &self.mem,
                    moved: &self.moved,
                    busy: &self.busy,
                    calls: &self.calls,
                };
                while let Some(t) = me.turn_with(self.now, &mut own, &mut sib, &mut NoNewcomers) {
                    moved |= t.did;
                }
                assert!(
                    me.poll_transmit().is_none(),
                    "a frame between engines of one daemon"
                );
                moved |= me.has_deferred();
            }
            if !moved {
                return;
            }
        }
        panic!("the engines never settle");
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.run();
    }

    fn cqes(&mut self, x: &End) -> Vec<Cqe> {
        let e = &mut self.e[x.k];
        std::iter::from_fn(|| e.poll_completion().map(|(_, c, _)| c)).collect()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
    Sge { addr, length, lkey }
}

fn wqe(wr_id: u64, opcode: SendOpcode, sges: Vec<Sge>, remote_addr: u64, rkey: u32) -> SendWqe {
    SendWqe {
        wr_id,
        opcode,
        flags: SendFlags::SIGNALED,
        imm_data: 0,
        remote_addr,
        rkey,
        compare_add: 0,
        swap: 0,
        ud: UdAddr::default(),
        xrc_srqn: 0,
        payload: SendPayload::Sges(sges.into()),
    }
}

fn statuses(c: &[Cqe]) -> Vec<(u64, WcStatus)> {
    c.iter().map(|c| (c.wr_id, c.status)).collect()
}

/// Two RC QPs on two engines, connected.
fn rc_pair(p: &mut Pair) -> (End, End) {
    let a = p.end(0, 1, 0, QpType::Rc);
    let b = p.end(1, 2, 0, QpType::Rc);
    p.connect(&a, b.qpn, b.lid, false);
    p.connect(&b, a.qpn, a.lid, false);
    (a, b)
}

#[test]
fn rc_across_engines_lands_byte_exact_with_one_copy_per_byte_and_no_frame() {
    let mut p = Pair::new();
    let (mut a, mut b) = rc_pair(&mut p);
    let (aa, ba, len) = (0x10_0000u64, 0x20_0000u64, 256u64 << 10);
    let am = p.map(&mut a, aa, len);
    let bm = p.map(&mut b, ba, len);
    // A SEND larger than a turn's chunk, a WRITE, a READ back, and both atomics.
    let msg = pattern(200_000, 1);
    p.set(&a, &am, aa, aa, &msg);
    p.recv(&b, 7, sge(ba, 200_000, bm.0.lkey));
    p.post(
        &a,
        wqe(1, SendOpcode::Send, vec![sge(aa, 200_000, am.0.lkey)], 0, 0),
    );
    let w = pattern(5000, 2);
    p.set(&a, &am, aa, aa + 0x3_1000, &w);
    p.post(
        &a,
        wqe(
            2,
            SendOpcode::RdmaWrite,
            vec![sge(aa + 0x3_1000, 5000, am.0.lkey)],
            ba + 0x3_2000,
            bm.0.rkey,
        ),
    );
    let r = pattern(3000, 3);
    p.set(&b, &bm, ba, ba + 0x3_8000, &r);
    p.post(
        &a,
        wqe(
            3,
            SendOpcode::RdmaRead,
            vec![sge(aa + 0x3_8000, 3000, am.0.lkey)],
            ba + 0x3_8000,
            bm.0.rkey,
        ),
    );
    p.set(&b, &bm, ba, ba + 0x3_c000, &40u64.to_le_bytes());
    let mut fa = wqe(
        4,
        SendOpcode::AtomicFetchAndAdd,
        vec![sge(aa + 0x3_c000, 8, am.0.lkey)],
        ba + 0x3_c000,
        bm.0.rkey,
    );
    fa.compare_add = 2;
    p.post(&a, fa);
    let mut cs = wqe(
        5,
        SendOpcode::AtomicCmpAndSwp,
        vec![sge(aa + 0x3_c008, 8, am.0.lkey)],
        ba + 0x3_c000,
        bm.0.rkey,
    );
    cs.compare_add = 42;
    cs.swap = 99;
    p.post(&a, cs);
    p.run();
    assert_eq!(
        statuses(&p.cqes(&a)),
        (1..=5).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    let got = p.cqes(&b);
    assert_eq!(statuses(&got), vec![(7, WcStatus::Success)]);
    assert_eq!((got[0].byte_len, got[0].opcode), (200_000, WcOpcode::Recv));
    assert_eq!(got[0].src_qp, a.qpn);
    assert_eq!(p.get(&b, &bm, ba, ba, 200_000), msg, "the SEND");
    assert_eq!(p.get(&b, &bm, ba, ba + 0x3_2000, 5000), w, "the WRITE");
    assert_eq!(p.get(&a, &am, aa, aa + 0x3_8000, 3000), r, "the READ");
    assert_eq!(p.get(&a, &am, aa, aa + 0x3_c000, 8), 40u64.to_le_bytes());
    assert_eq!(p.get(&a, &am, aa, aa + 0x3_c008, 8), 42u64.to_le_bytes());
    assert_eq!(p.get(&b, &bm, ba, ba + 0x3_c000, 8), 99u64.to_le_bytes());
    // Each payload byte once (atomics: 8 bytes read and written at the responder, and the
    // original value written back at the requester, per atomic).
    let payload = 200_000 + 5000 + 3000;
    assert_eq!(
        p.moved.get(),
        payload + 2 * 24,
        "bytes copied more than once"
    );
    let m = p.e[1].meter(b.vnic).unwrap();
    assert_eq!(m.received[0].bytes, 200_000, "the responder's meter");
}

#[test]
fn a_busy_sibling_only_delays_in_order_and_nothing_twice() {
    let mut p = Pair::new();
    let (mut a, mut b) = rc_pair(&mut p);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let am = p.map(&mut a, aa, 64 << 10);
    let bm = p.map(&mut b, ba, 64 << 10);
    for i in 0..4u64 {
        let d = pattern(1000, i as u8);
        p.set(&a, &am, aa, aa + i * 4096, &d);
        p.recv(&b, 10 + i, sge(ba + i * 4096, 1000, bm.0.lkey));
        p.post(
            &a,
            wqe(
                i,
                SendOpcode::Send,
                vec![sge(aa + i * 4096, 1000, am.0.lkey)],
                0,
                0,
            ),
        );
    }
    // The sibling is held elsewhere for the first three tries: the head waits, deferred.
    p.busy.set(3);
    let now = p.now;
    let sib_host = HostId(BASE + 1);
    {
        let [e0, e1] = &mut p.e;
        e0.handle_timeout(now);
        let mut own = Shared {
            mem: &p.mem,
            moved: &p.moved,
        };
        let mut sib = Other {
            e: e1,
            host: sib_host,
            mem: &p.mem,
            moved: &p.moved,
            busy: &p.busy,
            calls: &p.calls,
        };
        while e0
            .turn_with(now, &mut own, &mut sib, &mut NoNewcomers)
            .is_some()
        {}
        assert!(
            e0.has_deferred(),
            "a QP whose sibling is busy waits, deferred"
        );
        assert_eq!(p.calls.get(), 0);
    }
    p.run();
    assert_eq!(
        statuses(&p.cqes(&a)),
        (0..4).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(
        statuses(&p.cqes(&b)),
        (0..4)
            .map(|i| (10 + i, WcStatus::Success))
            .collect::<Vec<_>>()
    );
    for i in 0..4u64 {
        assert_eq!(
            p.get(&b, &bm, ba, ba + i * 4096, 1000),
            pattern(1000, i as u8)
        );
    }
    assert_eq!(p.moved.get(), 4000);
}

#[test]
fn rnr_across_engines_waits_for_the_responders_timer_then_lands() {
    let mut p = Pair::new();
    let (mut a, mut b) = rc_pair(&mut p);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let am = p.map(&mut a, aa, 8192);
    let bm = p.map(&mut b, ba, 8192);
    p.set(&a, &am, aa, aa, b"hello");
    p.post(
        &a,
        wqe(1, SendOpcode::Send, vec![sge(aa, 5, am.0.lkey)], 0, 0),
    );
    p.run();
    assert!(p.cqes(&a).is_empty(), "no receive: RNR, waiting");
    p.recv(&b, 9, sge(ba, 64, bm.0.lkey));
    p.advance(Duration::from_millis(2));
    assert_eq!(statuses(&p.cqes(&a)), vec![(1, WcStatus::Success)]);
    assert_eq!(statuses(&p.cqes(&b)), vec![(9, WcStatus::Success)]);
    assert_eq!(p.get(&b, &bm, ba, ba, 5), b"hello");
    assert_eq!(p.e[1].meter(b.vnic).unwrap().rnr_naks, 1);
}

#[test]
fn ud_and_uc_across_engines_deliver_with_the_qkey_and_group_checks() {
    let mut p = Pair::new();
    let mut a = p.end(0, 1, 0, QpType::Ud);
    let mut b = p.end(1, 2, 0, QpType::Ud);
    p.ud_up(&a, 0x1111);
    p.ud_up(&b, 0x1111);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let am = p.map(&mut a, aa, 8192);
    let bm = p.map(&mut b, ba, 8192);
    let ah = p.e[0]
        .create_ah(
            a.ctx,
            a.pd,
            AhAttr {
                dlid: b.lid,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    p.set(&a, &am, aa, aa, b"datagram");
    p.recv(&b, 5, sge(ba, 64 + 40, bm.0.lkey));
    let mut w = wqe(1, SendOpcode::Send, vec![sge(aa, 8, am.0.lkey)], 0, 0);
    w.ud = UdAddr {
        ah: ah.0,
        remote_qpn: b.qpn,
        remote_qkey: 0x2222,
    };
    p.post(&a, w.clone());
    w.wr_id = 2;
    w.ud.remote_qkey = 0x1111;
    p.post(&a, w);
    p.run();
    assert_eq!(
        statuses(&p.cqes(&a)),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let got = p.cqes(&b);
    assert_eq!(
        statuses(&got),
        vec![(5, WcStatus::Success)],
        "the wrong Q_Key is dropped"
    );
    assert_eq!((got[0].src_qp, got[0].slid), (a.qpn, a.lid));
    assert_eq!(p.get(&b, &bm, ba, ba + 40, 8), b"datagram");
    assert_eq!(p.e[1].meter(b.vnic).unwrap().ud_dropped, 1);

    // UC: a WRITE with immediate takes the receive on the other engine.
    let mut c = p.end(0, 3, 0, QpType::Uc);
    let mut d = p.end(1, 4, 0, QpType::Uc);
    p.connect(&c, d.qpn, d.lid, true);
    p.connect(&d, c.qpn, c.lid, true);
    let cm = p.map(&mut c, aa, 8192);
    let dm = p.map(&mut d, ba, 8192);
    p.set(&c, &cm, aa, aa, b"unreliable");
    p.recv(&d, 3, sge(ba, 0, dm.0.lkey));
    let mut w = wqe(
        1,
        SendOpcode::RdmaWriteWithImm,
        vec![sge(aa, 10, cm.0.lkey)],
        ba + 100,
        dm.0.rkey,
    );
    w.imm_data = 77;
    p.post(&c, w);
    p.run();
    assert_eq!(statuses(&p.cqes(&c)), vec![(1, WcStatus::Success)]);
    let got = p.cqes(&d);
    assert_eq!(statuses(&got), vec![(3, WcStatus::Success)]);
    assert_eq!(got[0].imm_data, 77);
    assert_eq!(p.get(&d, &dm, ba, ba + 100, 10), b"unreliable");
}

/// The attack of the trust boundary's item 1 between engines: red routes its QPs to its own
/// second vRNIC (on the other engine) but names a blue QP's number there. Nothing is
/// delivered; the sibling counts the refusals.
#[test]
fn a_qp_number_reaches_only_its_own_vrnic_and_group_across_engines() {
    let mut p = Pair::new();
    let (red, blue) = (1, 2);
    // Blue: b1 on engine 0, b2 on engine 1, UD and RC, connected to each other.
    let mut b2 = p.end(1, 12, blue, QpType::Ud);
    p.ud_up(&b2, 0x1111);
    let mut b2rc = p.end(1, 13, blue, QpType::Rc);
    let b1rc = p.end(0, 11, blue, QpType::Rc);
    p.connect(&b1rc, b2rc.qpn, b2rc.lid, false);
    p.connect(&b2rc, b1rc.qpn, b1rc.lid, false);
    // Red: r1 on engine 0, r2 on engine 1.
    let mut r1 = p.end(0, 21, red, QpType::Ud);
    p.ud_up(&r1, 0x1111);
    let r2 = p.end(1, 22, red, QpType::Rc);
    let mut r1rc = p.end(0, 23, red, QpType::Rc);
    let (ba, ra) = (0x20_0000u64, 0x10_0000u64);
    let bm = p.map(&mut b2, ba, 8192);
    let brm = p.map(&mut b2rc, ba, 8192);
    p.recv(&b2, 1, sge(ba, 200, bm.0.lkey));
    p.recv(&b2rc, 2, sge(ba, 200, brm.0.lkey));
    let rm = p.map(&mut r1, ra, 8192);
    let rrm = p.map(&mut r1rc, ra, 8192);
    p.set(&r1, &rm, ra, ra, b"evil");
    p.set(&r1rc, &rrm, ra, ra, b"evil");
    // UD: an address handle to red's own r2, the blue UD QP's number and Q_Key.
    let ah = p.e[0]
        .create_ah(
            r1.ctx,
            r1.pd,
            AhAttr {
                dlid: r2.lid,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    let mut w = wqe(1, SendOpcode::Send, vec![sge(ra, 4, rm.0.lkey)], 0, 0);
    w.ud = UdAddr {
        ah: ah.0,
        remote_qpn: b2.qpn,
        remote_qkey: 0x1111,
    };
    p.post(&r1, w);
    // RC: red's QP connected to r2's LID with blue's QP number.
    p.connect(&r1rc, b2rc.qpn, r2.lid, false);
    p.post(
        &r1rc,
        wqe(2, SendOpcode::Send, vec![sge(ra, 4, rrm.0.lkey)], 0, 0),
    );
    p.run();
    p.advance(Duration::from_secs(60));
    assert!(p.cqes(&b2).is_empty(), "CROSS-TENANT DELIVERY (UD)");
    assert!(p.cqes(&b2rc).is_empty(), "CROSS-TENANT DELIVERY (RC)");
    // (One engine's completions: red's datagram completes once sent, as UD does.)
    assert_eq!(
        statuses(&p.cqes(&r1rc)),
        vec![(1, WcStatus::Success), (2, WcStatus::RetryExcErr)],
        "the RC attacker gets no answer"
    );
    assert!(p.e[1].segments_refused() >= 2, "the sibling refused them");
}

/// One vRNIC sliced over the two engines (`vrnic serve --spread-qps`): the PD, CQ and MR made
/// in one are made in the other with the same ids and keys (`Engine::mirrored`), each makes a
/// QP of its own class, and the QPs, connected to the vRNIC's own LID, reach each other through
/// the sibling, by a call: a SEND and an RDMA WRITE land byte for byte in the one region both
/// slices share, with the MR key the maker gave honoured by the mirror.
/// One vRNIC sliced over both engines (as `--spread-qps` makes it: its PD and CQ made by
/// engine 0 and mirrored in engine 1 with the same ids, one window table shared), with one RC
/// QP in each slice, not yet connected.
fn sliced(p: &mut Pair) -> (End, End) {
    let (vnic, ctx, lid, gid) = (VnicId(1), CtxId(1), 10u16, [1u8; 16]);
    p.mem.borrow_mut().0.insert(vnic, vec![0u8; REGION]);
    for e in &mut p.e {
        e.add_vnic(vnic, lid, gid);
    }
    let windows = p.e[0].vnic_windows(vnic).unwrap();
    p.e[1].set_vnic_windows(vnic, windows);
    let pd = p.e[0].alloc_pd(vnic, ctx).unwrap();
    let cq = p.e[0].create_cq(vnic, ctx, 256).unwrap();
    let pd1 = p.e[1]
        .mirrored(pd.0, None, |e| e.alloc_pd(vnic, ctx))
        .unwrap();
    let cq1 = p.e[1]
        .mirrored(cq.0, None, |e| e.create_cq(vnic, ctx, 256))
        .unwrap();
    assert_eq!((pd1, cq1), (pd, cq), "mirrors keep their maker's ids");
    let mut ends: Vec<End> = (0..2)
        .map(|k| {
            let (qp, qpn) = p.e[k]
                .create_qp(ctx, pd, cq, cq, QpType::Rc, cap(), false)
                .unwrap();
            assert_eq!(
                (qpn % 2, qp.0 % 2),
                (k as u32, k as u32),
                "of its engine's class"
            );
            End {
                k,
                vnic,
                ctx,
                pd,
                qp,
                qpn,
                lid,
                next_page: 1,
            }
        })
        .collect();
    let b = ends.pop().unwrap();
    let a = ends.pop().unwrap();
    (a, b)
}

/// An MR of the sliced vRNIC `a` is of, with access `acc`, made by engine 0 and mirrored in
/// engine 1 with the same id and keys.
fn sliced_mr(p: &mut Pair, a: &mut End, addr: u64, len: u64, acc: u32) -> (MrKeys, Vec<u64>) {
    let n = (addr + len).div_ceil(4096) - addr / 4096;
    let base = a.next_page;
    a.next_page += n + 1;
    let pages: Vec<u64> = (0..n).map(|i| (base + i) * 4096).collect();
    let (ctx, pd) = (a.ctx, a.pd);
    let keys = p.e[0]
        .reg_mr(ctx, pd, addr, len, addr, acc, &per_page(&pages))
        .unwrap();
    let mirror = p.e[1]
        .mirrored(keys.mr.0, Some(keys.lkey), |e| {
            e.reg_mr(ctx, pd, addr, len, addr, acc, &per_page(&pages))
        })
        .unwrap();
    assert_eq!(mirror, keys, "a mirrored MR keeps its id and keys");
    (keys, pages)
}

#[test]
fn a_vrnic_sliced_over_two_engines_connects_its_qps_through_its_siblings() {
    let mut p = Pair::new();
    let (mut a, b) = sliced(&mut p);
    let lid = a.lid;
    let (addr, len) = (0x40_0000u64, 64u64 << 10);
    let acc =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    let mr = sliced_mr(&mut p, &mut a, addr, len, acc);
    p.connect(&a, b.qpn, lid, false);
    p.connect(&b, a.qpn, lid, false);
    let msg = pattern(5000, 3);
    p.set(&a, &mr, addr, addr, &msg);
    p.recv(&b, 9, sge(addr + 0x8000, 5000, mr.0.lkey));
    p.post(
        &a,
        wqe(1, SendOpcode::Send, vec![sge(addr, 5000, mr.0.lkey)], 0, 0),
    );
    let w = pattern(3000, 8);
    p.set(&a, &mr, addr, addr + 0x2000, &w);
    p.post(
        &a,
        wqe(
            2,
            SendOpcode::RdmaWrite,
            vec![sge(addr + 0x2000, 3000, mr.0.lkey)],
            addr + 0xc000,
            mr.0.rkey,
        ),
    );
    p.run();
    assert!(p.calls.get() > 0, "the sibling was not called");
    assert_eq!(p.get(&b, &mr, addr, addr + 0x8000, 5000), msg, "the SEND");
    assert_eq!(p.get(&b, &mr, addr, addr + 0xc000, 3000), w, "the WRITE");
    assert_eq!(
        statuses(&p.cqes(&a)),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(statuses(&p.cqes(&b)), vec![(9, WcStatus::Success)]);
    assert_eq!(p.moved.get(), 8000);
}

/// Memory windows of a vRNIC sliced over two engines (`--spread-qps`): one table, so a window
/// allocated by the home engine is bound by a work request in either slice and used by a
/// request to the other; an MR with a window bound in one slice is pinned in the other, and a
/// PD with windows too; a type 2 window bound to the QP of one slice is invalidated by a local
/// invalidation in the other; and a type 1 window unbound in one slice refuses, at once, the
/// key that the other slice's responder checked a moment before (no translation through a
/// window is kept, since an unbinding changes only the binding engine's memory generation).
#[test]
fn memory_windows_of_a_sliced_vrnic_are_one_table_for_both_engines() {
    let mut p = Pair::new();
    let (mut a, b) = sliced(&mut p);
    let (addr, len) = (0x40_0000u64, 64u64 << 10);
    // The MR grants no remote access: only windows open it.
    let mr = sliced_mr(
        &mut p,
        &mut a,
        addr,
        len,
        access::LOCAL_WRITE | access::MW_BIND,
    );
    let lkey = mr.0.lkey;
    p.connect(&a, b.qpn, a.lid, false);
    p.connect(&b, a.qpn, a.lid, false);
    let (w1, r1) = p.e[0]
        .alloc_mw(a.ctx, a.pd, vrnic_proto::MW_TYPE_1)
        .unwrap();
    let (w2, r2) = p.e[0]
        .alloc_mw(a.ctx, a.pd, vrnic_proto::MW_TYPE_2)
        .unwrap();
    let (k1, k2) = (inc(r1), inc(r2));
    let rights = access::REMOTE_WRITE;
    // Type 2 bound by b's bind (engine 1) to b; type 1 by a's (engine 0).
    p.post(&b, bind(1, w2, k2, lkey, addr + 0x2000, 0x1000, rights));
    p.post(&a, bind(2, w1, k1, lkey, addr + 0x1000, 0x1000, rights));
    p.run();
    assert_eq!(statuses(&p.cqes(&b)), vec![(1, WcStatus::Success)]);
    assert_eq!(statuses(&p.cqes(&a)), vec![(2, WcStatus::Success)]);
    // a (engine 0) writes through both; b's slice (engine 1) checks them.
    let (x, y) = (pattern(300, 1), pattern(200, 2));
    p.set(&a, &mr, addr, addr + 0x8000, &x);
    p.set(&a, &mr, addr, addr + 0x9000, &y);
    let write = |id, from, to, rkey, n| {
        wqe(
            id,
            SendOpcode::RdmaWrite,
            vec![sge(from, n, lkey)],
            to,
            rkey,
        )
    };
    p.post(&a, write(3, addr + 0x8000, addr + 0x2100, k2, 300));
    p.post(&a, write(4, addr + 0x9000, addr + 0x1040, k1, 200));
    p.run();
    assert!(p.calls.get() > 0, "the sibling was not called");
    assert_eq!(
        statuses(&p.cqes(&a)),
        vec![(3, WcStatus::Success), (4, WcStatus::Success)]
    );
    assert_eq!(
        p.get(&b, &mr, addr, addr + 0x2100, 300),
        x,
        "through type 2"
    );
    assert_eq!(
        p.get(&b, &mr, addr, addr + 0x1040, 200),
        y,
        "through type 1"
    );
    // Pinned in the other slice: its MR (bound windows), its PD (windows).
    for e in &mut p.e {
        assert_eq!(e.dereg_mr(a.ctx, mr.0.mr), Err(vrnic_proto::errno::EINVAL));
        assert_eq!(e.dealloc_pd(a.ctx, a.pd), Err(vrnic_proto::errno::EBUSY));
        assert!(e.pd_busy(a.ctx, a.pd));
    }
    // a (engine 0) invalidates the type 2 window bound to b (engine 1) and unbinds type 1.
    p.post(
        &a,
        SendWqe {
            imm_data: k2,
            ..wqe(5, SendOpcode::LocalInv, vec![], 0, 0)
        },
    );
    p.post(&a, bind(6, w1, k1, 0, 0, 0, 0));
    p.run();
    assert_eq!(
        statuses(&p.cqes(&a)),
        vec![(5, WcStatus::Success), (6, WcStatus::Success)]
    );
    // The key engine 1 checked last is refused there now; nothing lands.
    p.set(&a, &mr, addr, addr + 0x9000, &pattern(200, 9));
    p.post(&a, write(7, addr + 0x9000, addr + 0x1040, k1, 200));
    p.run();
    assert_eq!(statuses(&p.cqes(&a)), vec![(7, WcStatus::RemAccessErr)]);
    assert_eq!(p.get(&b, &mr, addr, addr + 0x1040, 200), y, "unchanged");
    // Once the windows are gone (deallocated by the home), either slice may let the MR go.
    p.e[0].dealloc_mw(a.ctx, w1).unwrap();
    p.e[0].dealloc_mw(a.ctx, w2).unwrap();
    for e in &mut p.e {
        assert_eq!(e.dereg_mr(a.ctx, mr.0.mr), Ok(()));
    }
}

/// A connected QP remembers the peer it admitted (no lookups per segment), but not past a
/// change of the routes: the same peer, its LID now announced in another group, is refused.
#[test]
fn an_admitted_peer_is_checked_again_when_its_group_changes() {
    let mut p = Pair::new();
    let (mut a, mut b) = rc_pair(&mut p);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let am = p.map(&mut a, aa, 8192);
    let bm = p.map(&mut b, ba, 8192);
    p.set(&a, &am, aa, aa, b"first");
    p.recv(&b, 1, sge(ba, 64, bm.0.lkey));
    p.recv(&b, 2, sge(ba + 64, 64, bm.0.lkey));
    p.post(
        &a,
        wqe(1, SendOpcode::Send, vec![sge(aa, 5, am.0.lkey)], 0, 0),
    );
    p.run();
    assert_eq!(statuses(&p.cqes(&b)), vec![(1, WcStatus::Success)]);
    // Engine 1 now knows a's LID as a vRNIC of another group.
    let refused = p.e[1].segments_refused();
    p.e[1].add_remote_vnic_in_group(HostId(BASE), a.lid, [1u8; 16], GroupId(9));
    p.post(
        &a,
        wqe(2, SendOpcode::Send, vec![sge(aa, 5, am.0.lkey)], 0, 0),
    );
    p.run();
    p.advance(Duration::from_secs(60));
    assert!(p.cqes(&b).is_empty(), "delivered from another group");
    assert!(p.e[1].segments_refused() > refused);
    assert_eq!(
        statuses(&p.cqes(&a)),
        vec![(1, WcStatus::Success), (2, WcStatus::RetryExcErr)]
    );
}

/// A request sent before its responder on the other engine reached RTR gets no answer; when
/// that QP reaches RTR (the daemon tells every engine: `responder_ready_elsewhere`), it is sent
/// again at once, as on one engine, instead of failing when its retry budget runs out.
#[test]
fn a_request_before_the_siblings_rtr_goes_again_when_it_is_ready() {
    let mut p = Pair::new();
    let mut a = p.end(0, 1, 0, QpType::Rc);
    let mut b = p.end(1, 2, 0, QpType::Rc);
    p.connect(&a, b.qpn, b.lid, false);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let am = p.map(&mut a, aa, 8192);
    let bm = p.map(&mut b, ba, 8192);
    p.set(&a, &am, aa, aa, b"early");
    p.post(
        &a,
        wqe(1, SendOpcode::Send, vec![sge(aa, 5, am.0.lkey)], 0, 0),
    );
    p.run();
    assert!(p.cqes(&a).is_empty(), "no responder yet: waiting");
    p.connect(&b, a.qpn, a.lid, false);
    p.recv(&b, 9, sge(ba, 64, bm.0.lkey));
    assert!(p.e[0].responder_ready_elsewhere(), "the QP was waiting");
    p.run();
    assert_eq!(statuses(&p.cqes(&a)), vec![(1, WcStatus::Success)]);
    assert_eq!(statuses(&p.cqes(&b)), vec![(9, WcStatus::Success)]);
    assert_eq!(p.get(&b, &bm, ba, ba, 5), b"early");
}

/// ATOMIC WRITE to a QP of the other engine: executed inside it by the engine that took the
/// work request, its 8 bytes stored once (no frame), completing `IBV_WC_ATOMIC_WRITE`; a
/// misaligned one is refused there as on one engine (`REM_INV_REQ_ERR`, both QPs in error).
#[test]
fn an_atomic_write_across_engines_stores_its_eight_bytes_once() {
    let mut p = Pair::new();
    let (mut a, mut b) = rc_pair(&mut p);
    let (aa, ba) = (0x10_0000u64, 0x20_0000u64);
    let _am = p.map(&mut a, aa, 4096);
    let bm = p.map(&mut b, ba, 4096);
    p.set(&b, &bm, ba, ba + 0x38, &[0xee; 24]);
    let data = 0x0102_0304_0506_0708u64.to_le_bytes();
    let mut w = wqe(1, SendOpcode::AtomicWrite, vec![], ba + 0x40, bm.0.rkey);
    w.flags = SendFlags::SIGNALED | SendFlags::INLINE;
    w.payload = SendPayload::Inline(data.as_slice().into());
    p.post(&a, w.clone());
    p.run();
    let c = p.cqes(&a);
    assert_eq!(statuses(&c), vec![(1, WcStatus::Success)]);
    assert_eq!((c[0].opcode, c[0].byte_len), (WcOpcode::AtomicWrite, 8));
    assert_eq!(p.get(&b, &bm, ba, ba + 0x38, 8), [0xee; 8]);
    assert_eq!(p.get(&b, &bm, ba, ba + 0x40, 8), data);
    assert_eq!(p.get(&b, &bm, ba, ba + 0x48, 8), [0xee; 8]);
    assert_eq!(
        p.moved.get(),
        8,
        "the 8 bytes stored once, nothing else moved"
    );
    assert!(p.calls.get() >= 1, "executed inside the other engine");
    assert!(p.cqes(&b).is_empty(), "no receive taken");

    w.wr_id = 2;
    w.remote_addr = ba + 0x44;
    p.post(&a, w);
    p.run();
    assert_eq!(statuses(&p.cqes(&a)), vec![(2, WcStatus::RemInvReqErr)]);
    assert_eq!(p.get(&b, &bm, ba, ba + 0x40, 8), data);
    assert_eq!(p.e[0].qp_state(a.qp), Some(QpState::Err));
    assert_eq!(p.e[1].qp_state(b.qp), Some(QpState::Err));
}
