//! XRC scenarios: an XRC send QP on one vRNIC, an XRC receive QP and XRC SRQs on another,
//! once with both vRNICs on one engine (the same daemon) and once on two engines joined by a
//! link that carries real frames (two daemons: every segment encoded, decoded strictly and
//! handed over). Each test names the rule it checks and asserts bytes, completions and
//! errnos.

mod common;

use common::{VecMem, per_page};

use std::time::{Duration, Instant};

use vrnic_proto::{
    CqId, CtxId, Engine, HostId, MrKeys, PdId, QpId, Sender, SrqId, VnicId, XrcdId, errno,
};
use vrnic_wire::frame::{Frame, FrameRepr, Transport};
use vrnic_wire::{
    AhAttr, Cqe, QpAttr, QpCap, QpState, RecvWqe, SendFlags, SendOpcode, SendPayload, SendWqe, Sge,
    WC_WITH_IMM, WcOpcode, WcStatus, access, qp_attr,
};

const REGION: usize = 1 << 20;

/// The requester: an XRC send QP with its PD and send CQ.
struct Ini {
    eng: usize,
    ctx: CtxId,
    pd: PdId,
    cq: CqId,
    qp: QpId,
    qpn: u32,
}

/// The target: an XRC domain, a receive QP in it, and an XRC SRQ with its PD and CQ.
struct Tgt {
    eng: usize,
    vnic: VnicId,
    ctx: CtxId,
    xrcd: XrcdId,
    pd: PdId,
    cq: CqId,
    srq: SrqId,
    srqn: u32,
    qp: QpId,
    qpn: u32,
}

struct World {
    /// One engine (same daemon) or two (two daemons and a link).
    engines: Vec<(Engine, VecMem)>,
    now: Instant,
    ini: Ini,
    tgt: Tgt,
    /// Next free region page, per vRNIC id.
    next_page: [u64; 8],
    /// XRC frames seen on the link (remote worlds).
    xrc_frames: usize,
}

const ALL_REMOTE: u32 = access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;

impl World {
    fn new(remote: bool) -> World {
        let mut engines = vec![(Engine::new(5), VecMem(Default::default()))];
        if remote {
            engines.push((Engine::new(6), VecMem(Default::default())));
        }
        let (ea, eb) = (0, usize::from(remote));
        for (eng, id, lid) in [(ea, 1u32, 10u16), (eb, 2, 20)] {
            let (e, mem) = &mut engines[eng];
            e.add_vnic(VnicId(id), lid, [id as u8; 16]);
            mem.0.insert(VnicId(id), vec![0; REGION]);
        }
        if remote {
            engines[0].0.add_remote_vnic(HostId(2), 20, [2; 16]);
            engines[1].0.add_remote_vnic(HostId(1), 10, [1; 16]);
        }
        let now = Instant::now();
        // The requester.
        let e = &mut engines[ea].0;
        let ctx = CtxId(1);
        let pd = e.alloc_pd(VnicId(1), ctx).unwrap();
        let cq = e.create_cq(VnicId(1), ctx, 64).unwrap();
        let cap = QpCap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 64,
        };
        let (qp, qpn) = e.create_xrc_send_qp(ctx, pd, cq, cap, false).unwrap();
        let ini = Ini {
            eng: ea,
            ctx,
            pd,
            cq,
            qp,
            qpn,
        };
        // The target.
        let e = &mut engines[eb].0;
        let (vnic, ctx) = (VnicId(2), CtxId(2));
        let xrcd = e.open_xrcd(vnic, ctx, None, true, false).unwrap();
        let pd = e.alloc_pd(vnic, ctx).unwrap();
        let cq = e.create_cq(vnic, ctx, 64).unwrap();
        let (srq, _, srqn) = e.create_xrc_srq(ctx, xrcd, pd, cq, 16, 2, 0).unwrap();
        let (qp, qpn) = e.create_xrc_recv_qp(ctx, xrcd).unwrap();
        let tgt = Tgt {
            eng: eb,
            vnic,
            ctx,
            xrcd,
            pd,
            cq,
            srq,
            srqn,
            qp,
            qpn,
        };
        let mut w = World {
            engines,
            now,
            ini,
            tgt,
            next_page: [1; 8],
            xrc_frames: 0,
        };
        w.connect(ALL_REMOTE);
        w
    }

    /// Both halves to RTS with the masks `ibv_xsrq_pingpong` uses.
    fn connect(&mut self, tgt_access: u32) {
        let now = self.now;
        let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
        let (ini_qpn, tgt_qpn) = (self.ini.qpn, self.tgt.qpn);
        // Target: RTR with responder resources and an RNR timer, RTS with a timeout only.
        let t = &self.tgt;
        let e = &mut self.engines[t.eng].0;
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: tgt_access,
            ..Default::default()
        };
        e.modify_qp(now, t.ctx, t.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        a.path_mtu = 3;
        a.dest_qp_num = ini_qpn;
        a.rq_psn = 0x55;
        a.min_rnr_timer = 1;
        a.ah_attr = AhAttr {
            dlid: 10,
            port_num: 1,
            ..Default::default()
        };
        let base =
            qp_attr::STATE | qp_attr::AV | qp_attr::PATH_MTU | qp_attr::DEST_QPN | qp_attr::RQ_PSN;
        e.modify_qp(
            now,
            t.ctx,
            t.qp,
            base | qp_attr::MAX_DEST_RD_ATOMIC | qp_attr::MIN_RNR_TIMER,
            &a,
        )
        .unwrap();
        a.qp_state = QpState::Rts;
        a.timeout = 14;
        a.sq_psn = 0x66;
        e.modify_qp(
            now,
            t.ctx,
            t.qp,
            qp_attr::STATE | qp_attr::TIMEOUT | qp_attr::SQ_PSN,
            &a,
        )
        .unwrap();
        // Initiator: RTR with the path only, RTS as RC.
        let i = &self.ini;
        let e = &mut self.engines[i.eng].0;
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            ..Default::default()
        };
        e.modify_qp(now, i.ctx, i.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        a.path_mtu = 3;
        a.dest_qp_num = tgt_qpn;
        a.ah_attr = AhAttr {
            dlid: 20,
            port_num: 1,
            ..Default::default()
        };
        e.modify_qp(now, i.ctx, i.qp, base, &a).unwrap();
        a.qp_state = QpState::Rts;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        a.sq_psn = 0x55;
        let rts = qp_attr::STATE
            | qp_attr::TIMEOUT
            | qp_attr::SQ_PSN
            | qp_attr::RETRY_CNT
            | qp_attr::RNR_RETRY
            | qp_attr::MAX_QP_RD_ATOMIC;
        e.modify_qp(now, i.ctx, i.qp, rts, &a).unwrap();
    }

    /// Registers `len` bytes at app address `addr` for vRNIC `vnic` (context `ctx`, `pd`) on
    /// engine `eng`; returns the keys and the region offset of its first byte (contiguous).
    #[allow(clippy::too_many_arguments)]
    fn reg(
        &mut self,
        eng: usize,
        vnic: u32,
        ctx: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        acc: u32,
    ) -> (MrKeys, usize) {
        let n = (addr + len).div_ceil(4096) - addr / 4096;
        let base = self.next_page[vnic as usize];
        self.next_page[vnic as usize] += n + 1;
        let pages: Vec<u64> = (0..n).map(|i| (base + i) * 4096).collect();
        let keys = self.engines[eng]
            .0
            .reg_mr(ctx, pd, addr, len, addr, acc, &per_page(&pages))
            .unwrap();
        (keys, (base * 4096 + addr % 4096) as usize)
    }

    fn bytes(&mut self, eng: usize, vnic: u32, at: usize, len: usize) -> &mut [u8] {
        &mut self.engines[eng].1.0.get_mut(&VnicId(vnic)).unwrap()[at..at + len]
    }

    fn post(&mut self, w: SendWqe) {
        let (eng, qp) = (self.ini.eng, self.ini.qp);
        self.engines[eng].0.handle_send_wqe(self.now, qp, Ok(w));
    }

    fn post_srq_recv(&mut self, srq: SrqId, wr_id: u64, sges: Vec<Sge>) {
        let eng = self.tgt.eng;
        self.engines[eng].0.handle_srq_wqe(
            srq,
            Ok(RecvWqe {
                wr_id,
                sges: sges.into(),
            }),
        );
    }

    /// Runs the engines and carries frames until nothing moves.
    fn run(&mut self) {
        for _ in 0..10_000 {
            let mut moved = false;
            for i in 0..self.engines.len() {
                let (e, mem) = &mut self.engines[i];
                moved |= e.process(self.now, mem);
            }
            if self.engines.len() == 2 {
                moved |= self.carry(0, 1);
                moved |= self.carry(1, 0);
            }
            if !moved {
                return;
            }
        }
        panic!("the engines never settle");
    }

    fn carry(&mut self, from: usize, to: usize) -> bool {
        let mut moved = false;
        let mut buf = Vec::new();
        loop {
            let (e, mem) = &mut self.engines[from];
            let Some(t) = e.poll_transmit() else { break };
            moved = true;
            buf.clear();
            assert!(t.encode(mem, &mut buf), "a consistent frame");
            let frame = Frame::new_checked(&buf[..]).expect("a whole frame");
            let repr = FrameRepr::parse(&frame).expect("a valid frame");
            let FrameRepr::Segment { addr, grh, segment } = repr else {
                panic!("a segment");
            };
            if segment.opcode.transport() == Transport::Xrc {
                self.xrc_frames += 1;
            }
            let payload = buf[repr.payload_range()].to_vec();
            let (e, mem) = &mut self.engines[to];
            e.handle_segment(
                self.now,
                HostId(from as u32 + 1),
                Sender {
                    addr,
                    grh: grh.as_ref(),
                },
                &segment,
                &payload,
                mem,
            );
        }
        moved
    }

    fn cqes(&mut self) -> Vec<(CqId, Cqe)> {
        let mut out = Vec::new();
        for (e, _) in &mut self.engines {
            out.extend(std::iter::from_fn(|| {
                e.poll_completion().map(|(cq, c, _)| (cq, c))
            }));
        }
        out
    }

    fn tgt_engine(&mut self) -> &mut Engine {
        &mut self.engines[self.tgt.eng].0
    }
}

fn wqe(wr_id: u64, opcode: SendOpcode, srqn: u32, sges: Vec<Sge>) -> SendWqe {
    SendWqe {
        wr_id,
        opcode,
        flags: SendFlags::SIGNALED,
        imm_data: 0x0102_0304,
        remote_addr: 0,
        rkey: 0,
        compare_add: 0,
        swap: 0,
        ud: Default::default(),
        xrc_srqn: srqn,
        payload: SendPayload::Sges(sges.into()),
    }
}

fn both(f: impl Fn(bool)) {
    f(false);
    f(true);
}

/// The source buffer of the requester, filled with a pattern; returns its SGE.
fn source(w: &mut World, len: usize) -> Sge {
    let (eng, ctx, pd) = (w.ini.eng, w.ini.ctx, w.ini.pd);
    let (k, at) = w.reg(eng, 1, ctx, pd, 0x10_0000, len as u64, access::LOCAL_WRITE);
    for (i, b) in w.bytes(eng, 1, at, len).iter_mut().enumerate() {
        *b = (i % 251) as u8 ^ 0x5a;
    }
    Sge {
        addr: 0x10_0000,
        length: len as u32,
        lkey: k.lkey,
    }
}

fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ 0x5a).collect()
}

#[test]
fn an_xrc_send_lands_in_the_named_srq_and_completes_on_its_cq_with_the_receive_qpn() {
    both(|remote| {
        let mut w = World::new(remote);
        // 9000 bytes: more than a path MTU (1024 here), one segment over the link.
        let len = 9000;
        let sge = source(&mut w, len);
        let (eng, ctx, pd) = (w.tgt.eng, w.tgt.ctx, w.tgt.pd);
        let (k, at) = w.reg(eng, 2, ctx, pd, 0x20_0000, 16384, access::LOCAL_WRITE);
        let (srq, srqn) = (w.tgt.srq, w.tgt.srqn);
        w.post_srq_recv(
            srq,
            77,
            vec![Sge {
                addr: 0x20_0000,
                length: 16384,
                lkey: k.lkey,
            }],
        );
        let mut s = wqe(1, SendOpcode::SendWithImm, srqn, vec![sge]);
        s.imm_data = 0xabcd;
        w.post(s);
        w.run();
        assert_eq!(
            w.bytes(eng, 2, at, len).to_vec(),
            pattern(len),
            "remote {remote}"
        );
        let mut cqes = w.cqes();
        cqes.sort_by_key(|(cq, _)| *cq == w.tgt.cq);
        assert_eq!(cqes.len(), 2, "{cqes:?}");
        let (cq, c) = &cqes[0];
        assert_eq!((*cq, c.wr_id, c.status), (w.ini.cq, 1, WcStatus::Success));
        let (cq, c) = &cqes[1];
        assert_eq!(*cq, w.tgt.cq, "on the SRQ's CQ");
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len),
            (77, WcStatus::Success, WcOpcode::Recv, len as u32)
        );
        assert_eq!(c.qp_num, w.tgt.qpn, "the XRC receive QP's number");
        assert_eq!(
            (c.imm_data, c.wc_flags & WC_WITH_IMM),
            (0xabcd, WC_WITH_IMM)
        );
        assert_eq!(w.tgt_engine().srq_retired(srq), 1);
        if remote {
            assert!(w.xrc_frames >= 2, "XRC opcodes on the link, both ways");
        }
    });
}

#[test]
fn an_srq_of_another_domain_is_refused_with_rem_inv_req_err_and_nothing_lands() {
    both(|remote| {
        let mut w = World::new(remote);
        let sge = source(&mut w, 64);
        let (eng, vnic, ctx, pd, cq) = (w.tgt.eng, w.tgt.vnic, w.tgt.ctx, w.tgt.pd, w.tgt.cq);
        let (k, at) = w.reg(eng, 2, ctx, pd, 0x20_0000, 4096, access::LOCAL_WRITE);
        // A second private domain on the same vRNIC, with an SRQ holding a receive.
        let e = w.tgt_engine();
        let other = e.open_xrcd(vnic, ctx, None, true, false).unwrap();
        let (srq2, _, srqn2) = e.create_xrc_srq(ctx, other, pd, cq, 4, 1, 0).unwrap();
        w.post_srq_recv(
            srq2,
            5,
            vec![Sge {
                addr: 0x20_0000,
                length: 4096,
                lkey: k.lkey,
            }],
        );
        w.post(wqe(1, SendOpcode::Send, srqn2, vec![sge]));
        w.run();
        let cqes = w.cqes();
        assert_eq!(cqes.len(), 1, "{cqes:?}");
        assert_eq!(cqes[0].0, w.ini.cq);
        assert_eq!(cqes[0].1.status, WcStatus::RemInvReqErr, "remote {remote}");
        assert!(w.bytes(eng, 2, at, 64).iter().all(|&b| b == 0));
        let tq = w.tgt.qp;
        let e = w.tgt_engine();
        assert_eq!(e.srq_retired(srq2), 0, "its receive stays posted");
        assert_eq!(e.qp_state(tq), Some(QpState::Err), "the target fails");
    });
}

#[test]
fn a_basic_srq_a_destroyed_srq_and_another_vnics_srq_are_refused() {
    for case in 0..3 {
        both(|remote| {
            let mut w = World::new(remote);
            let sge = source(&mut w, 8);
            let (vnic, ctx, pd) = (w.tgt.vnic, w.tgt.ctx, w.tgt.pd);
            let srqn = match case {
                0 => {
                    let e = w.tgt_engine();
                    let (s, _) = e.create_srq(ctx, pd, 4, 1, 0).unwrap();
                    e.srq_num(ctx, s).unwrap()
                }
                1 => {
                    let (srq, srqn) = (w.tgt.srq, w.tgt.srqn);
                    w.tgt_engine().destroy_srq(ctx, srq).unwrap();
                    srqn
                }
                _ => {
                    // vRNIC 3 on the target's daemon, its own XRC SRQ.
                    let e = w.tgt_engine();
                    e.add_vnic(VnicId(3), 30, [3; 16]);
                    let c3 = CtxId(3);
                    let x = e.open_xrcd(VnicId(3), c3, None, true, false).unwrap();
                    let p = e.alloc_pd(VnicId(3), c3).unwrap();
                    let c = e.create_cq(VnicId(3), c3, 4).unwrap();
                    let (_, _, n) = e.create_xrc_srq(c3, x, p, c, 4, 1, 0).unwrap();
                    assert_ne!(vnic, VnicId(3));
                    n
                }
            };
            w.post(wqe(9, SendOpcode::Send, srqn, vec![sge]));
            w.run();
            let cqes = w.cqes();
            assert_eq!(cqes.len(), 1, "case {case} remote {remote}: {cqes:?}");
            assert_eq!(
                (cqes[0].0, cqes[0].1.status),
                (w.ini.cq, WcStatus::RemInvReqErr),
                "case {case} remote {remote}"
            );
        });
    }
}

#[test]
fn write_read_and_atomics_are_checked_against_the_named_srqs_pd() {
    both(|remote| {
        let mut w = World::new(remote);
        let sge = source(&mut w, 256);
        let (eng, ctx, pd, srqn) = (w.tgt.eng, w.tgt.ctx, w.tgt.pd, w.tgt.srqn);
        let acc = access::LOCAL_WRITE | ALL_REMOTE;
        let (k, at) = w.reg(eng, 2, ctx, pd, 0x30_0000, 4096, acc);
        // WRITE lands.
        let mut wr = wqe(1, SendOpcode::RdmaWrite, srqn, vec![sge]);
        (wr.remote_addr, wr.rkey) = (0x30_0000, k.rkey);
        w.post(wr);
        w.run();
        assert_eq!(w.bytes(eng, 2, at, 256).to_vec(), pattern(256));
        // READ brings bytes back.
        w.bytes(eng, 2, at + 512, 100).fill(0xee);
        let (ieng, ictx, ipd) = (w.ini.eng, w.ini.ctx, w.ini.pd);
        let (lk, lat) = w.reg(ieng, 1, ictx, ipd, 0x40_0000, 4096, access::LOCAL_WRITE);
        let mut rd = wqe(
            2,
            SendOpcode::RdmaRead,
            srqn,
            vec![Sge {
                addr: 0x40_0000,
                length: 100,
                lkey: lk.lkey,
            }],
        );
        (rd.remote_addr, rd.rkey) = (0x30_0200, k.rkey);
        w.post(rd);
        w.run();
        assert_eq!(w.bytes(ieng, 1, lat, 100).to_vec(), vec![0xee; 100]);
        // Fetch-and-add returns the old value and adds.
        w.bytes(eng, 2, at + 1024, 8)
            .copy_from_slice(&40u64.to_le_bytes());
        let mut fa = wqe(
            3,
            SendOpcode::AtomicFetchAndAdd,
            srqn,
            vec![Sge {
                addr: 0x40_0800,
                length: 8,
                lkey: lk.lkey,
            }],
        );
        (fa.remote_addr, fa.rkey, fa.compare_add) = (0x30_0400, k.rkey, 2);
        w.post(fa);
        w.run();
        assert_eq!(w.bytes(eng, 2, at + 1024, 8), &42u64.to_le_bytes());
        assert_eq!(w.bytes(ieng, 1, lat + 0x800, 8), &40u64.to_le_bytes());
        let st: Vec<_> = w.cqes().iter().map(|(_, c)| (c.wr_id, c.status)).collect();
        assert_eq!(
            st,
            vec![
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::Success)
            ],
            "remote {remote}"
        );
        // An MR of another PD of the target is out of reach, though its R_Key is valid there.
        let e = w.tgt_engine();
        let pd2 = e.alloc_pd(VnicId(2), ctx).unwrap();
        let (k2, at2) = w.reg(eng, 2, ctx, pd2, 0x50_0000, 4096, acc);
        let mut wr = wqe(4, SendOpcode::RdmaWrite, srqn, vec![source(&mut w, 16)]);
        (wr.remote_addr, wr.rkey) = (0x50_0000, k2.rkey);
        w.post(wr);
        w.run();
        let st: Vec<_> = w.cqes().iter().map(|(_, c)| (c.wr_id, c.status)).collect();
        assert_eq!(st, vec![(4, WcStatus::RemAccessErr)], "remote {remote}");
        assert!(w.bytes(eng, 2, at2, 16).iter().all(|&b| b == 0));
    });
}

#[test]
fn an_srq_in_the_domain_another_context_opened_by_the_same_file_takes_the_message() {
    both(|remote| {
        let mut w = World::new(remote);
        let sge = source(&mut w, 32);
        let (eng, vnic, tctx, tqp) = (w.tgt.eng, w.tgt.vnic, w.tgt.ctx, w.tgt.qp);
        let key = Some((0x801, 4242));
        let now = w.now;
        let e = w.tgt_engine();
        // Context 2 holds its receive QP in domain `key`; context 4 opens the same file.
        let x2 = e.open_xrcd(vnic, tctx, key, true, false).unwrap();
        assert_eq!(
            e.open_xrcd(vnic, CtxId(4), key, true, true),
            Err(errno::EINVAL),
            "O_EXCL: the domain exists"
        );
        assert_eq!(
            e.open_xrcd(vnic, CtxId(4), Some((0x801, 1)), false, false),
            Err(errno::EINVAL),
            "no O_CREAT: no such domain"
        );
        let x4 = e.open_xrcd(vnic, CtxId(4), key, false, false).unwrap();
        let pd4 = e.alloc_pd(vnic, CtxId(4)).unwrap();
        let cq4 = e.create_cq(vnic, CtxId(4), 8).unwrap();
        let (srq4, _, srqn4) = e.create_xrc_srq(CtxId(4), x4, pd4, cq4, 4, 1, 0).unwrap();
        // Context 2's receive QP moves into domain `key`: a new one, connected anew.
        e.destroy_qp(now, tctx, tqp).unwrap();
        let (qp, qpn) = e.create_xrc_recv_qp(tctx, x2).unwrap();
        (w.tgt.qp, w.tgt.qpn) = (qp, qpn);
        let (ieng, ictx, iqp) = (w.ini.eng, w.ini.ctx, w.ini.qp);
        let reset = QpAttr::default();
        w.engines[ieng]
            .0
            .modify_qp(w.now, ictx, iqp, qp_attr::STATE, &reset)
            .unwrap();
        w.connect(ALL_REMOTE);
        let (k, at) = w.reg(eng, 2, CtxId(4), pd4, 0x60_0000, 64, access::LOCAL_WRITE);
        w.post_srq_recv(
            srq4,
            44,
            vec![Sge {
                addr: 0x60_0000,
                length: 64,
                lkey: k.lkey,
            }],
        );
        w.post(wqe(1, SendOpcode::Send, srqn4, vec![sge]));
        w.run();
        assert_eq!(
            w.bytes(eng, 2, at, 32).to_vec(),
            pattern(32),
            "remote {remote}"
        );
        let cqes = w.cqes();
        let got: Vec<_> = cqes
            .iter()
            .map(|(cq, c)| (*cq, c.wr_id, c.status))
            .collect();
        assert!(got.contains(&(cq4, 44, WcStatus::Success)), "{got:?}");
        assert!(got.contains(&(w.ini.cq, 1, WcStatus::Success)), "{got:?}");
        // The same file on vRNIC 3 is another domain.
        let e = w.tgt_engine();
        e.add_vnic(VnicId(3), 30, [3; 16]);
        assert_eq!(
            e.open_xrcd(VnicId(3), CtxId(3), key, false, false),
            Err(errno::EINVAL),
            "vRNIC 3 does not see vRNIC 2's domain"
        );
    });
}

#[test]
fn close_xrcd_is_ebusy_while_srqs_or_receive_qps_use_it() {
    let mut w = World::new(false);
    let (ctx, xrcd, srq, qp) = (w.tgt.ctx, w.tgt.xrcd, w.tgt.srq, w.tgt.qp);
    let now = w.now;
    let e = w.tgt_engine();
    assert_eq!(
        e.close_xrcd(CtxId(9), xrcd),
        Err(errno::EINVAL),
        "not its handle"
    );
    assert_eq!(e.close_xrcd(ctx, xrcd), Err(errno::EBUSY));
    e.destroy_srq(ctx, srq).unwrap();
    assert_eq!(
        e.close_xrcd(ctx, xrcd),
        Err(errno::EBUSY),
        "the QP still uses it"
    );
    e.destroy_qp(now, ctx, qp).unwrap();
    assert_eq!(e.close_xrcd(ctx, xrcd), Ok(()));
    assert_eq!(e.close_xrcd(ctx, xrcd), Err(errno::EINVAL));
}

#[test]
fn an_xrc_send_waits_for_a_receive_in_its_srq_and_goes_when_one_is_posted() {
    both(|remote| {
        let mut w = World::new(remote);
        let sge = source(&mut w, 16);
        let (eng, ctx, pd, srq, srqn) = (w.tgt.eng, w.tgt.ctx, w.tgt.pd, w.tgt.srq, w.tgt.srqn);
        let (k, at) = w.reg(eng, 2, ctx, pd, 0x20_0000, 64, access::LOCAL_WRITE);
        w.post(wqe(1, SendOpcode::Send, srqn, vec![sge]));
        w.run();
        assert!(w.cqes().is_empty(), "RNR: nothing completes");
        w.post_srq_recv(
            srq,
            3,
            vec![Sge {
                addr: 0x20_0000,
                length: 64,
                lkey: k.lkey,
            }],
        );
        for _ in 0..50 {
            w.now += Duration::from_millis(1);
            for (e, _) in &mut w.engines {
                e.handle_timeout(w.now);
            }
            w.run();
        }
        assert_eq!(
            w.bytes(eng, 2, at, 16).to_vec(),
            pattern(16),
            "remote {remote}"
        );
        assert_eq!(w.cqes().len(), 2);
    });
}

/// ATOMIC WRITE from an XRC send QP (on one daemon, and across a link as opcode 0xbd): its 8
/// bytes land under an R_Key of the named SRQ's PD; an MR of another PD of the target is out
/// of reach (`REM_ACCESS_ERR`), nothing stored.
#[test]
fn an_atomic_write_reaches_memory_of_the_named_srqs_pd_only() {
    both(|remote| {
        let mut w = World::new(remote);
        let (eng, ctx, pd, srqn) = (w.tgt.eng, w.tgt.ctx, w.tgt.pd, w.tgt.srqn);
        let acc = access::LOCAL_WRITE | ALL_REMOTE;
        let (k, at) = w.reg(eng, 2, ctx, pd, 0x30_0000, 4096, acc);
        let data = 0x0807_0605_0403_0201u64.to_le_bytes();
        let mut aw = wqe(1, SendOpcode::AtomicWrite, srqn, vec![]);
        aw.flags = SendFlags::SIGNALED | SendFlags::INLINE;
        aw.payload = SendPayload::Inline(data.as_slice().into());
        (aw.remote_addr, aw.rkey) = (0x30_0040, k.rkey);
        w.post(aw.clone());
        w.run();
        assert_eq!(w.bytes(eng, 2, at + 0x40, 8), &data, "remote {remote}");
        let c: Vec<_> = w
            .cqes()
            .iter()
            .map(|(_, c)| (c.wr_id, c.status, c.opcode))
            .collect();
        assert_eq!(
            c,
            vec![(1, WcStatus::Success, WcOpcode::AtomicWrite)],
            "remote {remote}"
        );
        let e = w.tgt_engine();
        let pd2 = e.alloc_pd(VnicId(2), ctx).unwrap();
        let (k2, at2) = w.reg(eng, 2, ctx, pd2, 0x50_0000, 4096, acc);
        (aw.wr_id, aw.remote_addr, aw.rkey) = (2, 0x50_0000, k2.rkey);
        w.post(aw);
        w.run();
        let st: Vec<_> = w.cqes().iter().map(|(_, c)| (c.wr_id, c.status)).collect();
        assert_eq!(st, vec![(2, WcStatus::RemAccessErr)], "remote {remote}");
        assert!(w.bytes(eng, 2, at2, 8).iter().all(|&b| b == 0));
    });
}
