//! Engine scenarios: two vRNICs with Vec-backed regions, RC QPs connected through the real
//! state machine, work requests fed as the daemon feeds them. Each test names the rule it
//! checks and asserts bytes and completions.

mod common;

use common::{VecMem, bind, inc, per_page};

use std::time::{Duration, Instant};

use vrnic_proto::{
    CqId, CtxId, Engine, Event, GroupId, Loc, Memory, MrKeys, PdId, QpId, Refused, VnicId,
};
use vrnic_wire::{
    AhAttr, Cqe, QpAttr, QpCap, QpState, QpType, RecvWqe, SendFlags, SendOpcode, SendPayload,
    SendWqe, Sge, WC_WITH_IMM, WcOpcode, WcStatus, access, qp_attr,
};

const REGION: usize = 8 << 20;

struct Side {
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    cq: CqId,
    qp: QpId,
    qpn: u32,
    lid: u16,
    /// Next free region page for "registrations".
    next_page: u64,
}

struct World {
    e: Engine,
    mem: VecMem,
    now: Instant,
    a: Side,
    b: Side,
}

fn side(e: &mut Engine, id: u32, lid: u16) -> Side {
    side_of(e, id, lid, QpType::Rc, 64)
}

fn side_of(e: &mut Engine, id: u32, lid: u16, qp_type: QpType, depth: u32) -> Side {
    side_in(e, id, lid, qp_type, depth, GroupId(0))
}

/// A side whose vRNIC is in `group`.
fn side_in(e: &mut Engine, id: u32, lid: u16, qp_type: QpType, depth: u32, group: GroupId) -> Side {
    let vnic = VnicId(id);
    let ctx = CtxId(id);
    e.add_vnic_in_group(vnic, lid, [id as u8; 16], group);
    let pd = e.alloc_pd(vnic, ctx).unwrap();
    let cq = e.create_cq(vnic, ctx, 256).unwrap();
    let cap = QpCap {
        max_send_wr: depth,
        max_recv_wr: depth,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    let (qp, qpn) = e.create_qp(ctx, pd, cq, cq, qp_type, cap, false).unwrap();
    Side {
        vnic,
        ctx,
        pd,
        cq,
        qp,
        qpn,
        lid,
        next_page: 1,
    }
}

fn to_rts(
    e: &mut Engine,
    now: Instant,
    s: &Side,
    peer_qpn: u32,
    peer_lid: u16,
    access_flags: u32,
    rnr_retry: u8,
) {
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: access_flags,
        ..Default::default()
    };
    e.modify_qp(
        now,
        s.ctx,
        s.qp,
        qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS,
        &a,
    )
    .unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = 5;
    a.dest_qp_num = peer_qpn;
    a.min_rnr_timer = 12;
    a.ah_attr = AhAttr {
        dlid: peer_lid,
        port_num: 1,
        ..Default::default()
    };
    let rtr = qp_attr::STATE
        | qp_attr::AV
        | qp_attr::PATH_MTU
        | qp_attr::DEST_QPN
        | qp_attr::RQ_PSN
        | qp_attr::MAX_DEST_RD_ATOMIC
        | qp_attr::MIN_RNR_TIMER;
    e.modify_qp(now, s.ctx, s.qp, rtr, &a).unwrap();
    a.qp_state = QpState::Rts;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = rnr_retry;
    let rts = qp_attr::STATE
        | qp_attr::SQ_PSN
        | qp_attr::TIMEOUT
        | qp_attr::RETRY_CNT
        | qp_attr::RNR_RETRY
        | qp_attr::MAX_QP_RD_ATOMIC;
    e.modify_qp(now, s.ctx, s.qp, rts, &a).unwrap();
}

impl World {
    fn new() -> World {
        World::with(
            access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
            7,
        )
    }

    fn with(qp_access: u32, rnr_retry: u8) -> World {
        let mut e = Engine::new(42);
        let a = side(&mut e, 1, 10);
        let b = side(&mut e, 2, 20);
        let now = Instant::now();
        to_rts(&mut e, now, &a, b.qpn, b.lid, qp_access, rnr_retry);
        to_rts(&mut e, now, &b, a.qpn, a.lid, qp_access, rnr_retry);
        let mem = VecMem(
            [(a.vnic, vec![0u8; REGION]), (b.vnic, vec![0u8; REGION])]
                .into_iter()
                .collect(),
        );
        World { e, mem, now, a, b }
    }

    fn send(&mut self, on_a: bool, w: SendWqe) {
        let qp = if on_a { self.a.qp } else { self.b.qp };
        self.e.handle_send_wqe(self.now, qp, Ok(w));
    }

    fn recv(&mut self, on_a: bool, wr_id: u64, sges: Vec<Sge>) {
        let qp = if on_a { self.a.qp } else { self.b.qp };
        self.e.handle_recv_wqe(
            self.now,
            qp,
            Ok(RecvWqe {
                wr_id,
                sges: sges.into(),
            }),
        );
    }

    fn run(&mut self) {
        for _ in 0..1000 {
            if !self.e.process(self.now, &mut self.mem) {
                break;
            }
        }
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.run();
    }

    fn cqes(&mut self) -> Vec<(CqId, Cqe)> {
        std::iter::from_fn(|| self.e.poll_completion().map(|(cq, c, _)| (cq, c))).collect()
    }
}

fn wqe(wr_id: u64, opcode: SendOpcode, sges: Vec<Sge>, remote_addr: u64, rkey: u32) -> SendWqe {
    SendWqe {
        wr_id,
        opcode,
        flags: SendFlags::SIGNALED,
        imm_data: 0x1234_5678,
        remote_addr,
        rkey,
        compare_add: 0,
        swap: 0,
        ud: Default::default(),
        xrc_srqn: 0,
        payload: SendPayload::Sges(sges.into()),
    }
}

/// A registration with an explicit page map, so tests can read and write app bytes.
struct Mapping {
    on_a: bool,
    addr: u64,
    pages: Vec<u64>,
    keys: MrKeys,
}

impl World {
    fn map(&mut self, on_a: bool, addr: u64, len: u64, acc: u32) -> Mapping {
        let s = if on_a { &mut self.a } else { &mut self.b };
        let n = (addr + len).div_ceil(4096) - addr / 4096;
        let base = s.next_page;
        s.next_page += n + 1;
        let pages: Vec<u64> = (0..n).rev().map(|i| (base + i) * 4096).collect();
        let keys = self
            .e
            .reg_mr(s.ctx, s.pd, addr, len, addr, acc, &per_page(&pages))
            .unwrap();
        Mapping {
            on_a,
            addr,
            pages,
            keys,
        }
    }

    fn loc(&self, m: &Mapping, a: u64) -> (VnicId, usize) {
        let vnic = if m.on_a { self.a.vnic } else { self.b.vnic };
        let page = (a / 4096 - m.addr / 4096) as usize;
        (vnic, (m.pages[page] + a % 4096) as usize)
    }

    fn set(&mut self, m: &Mapping, a: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let (v, off) = self.loc(m, a + i as u64);
            self.mem.0.get_mut(&v).unwrap()[off] = *b;
        }
    }

    fn get(&self, m: &Mapping, a: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| {
                let (v, off) = self.loc(m, a + i as u64);
                self.mem.0[&v][off]
            })
            .collect()
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

#[test]
fn send_lands_exact_bytes_at_awkward_sizes_and_alignments() {
    for &len in &[0usize, 1, 4095, 4096, 4097, 1 << 20] {
        let mut w = World::new();
        let src = w.map(true, 0x10_0003, (1 << 20) + 16, access::LOCAL_WRITE);
        let dst = w.map(false, 0x20_0bcd, (1 << 20) + 64, access::LOCAL_WRITE);
        let data = pattern(len, 3);
        w.set(&src, 0x10_0003, &data);
        w.set(&dst, 0x20_0bcd, &vec![0xee; len + 8]);
        w.recv(
            false,
            9,
            vec![Sge {
                addr: 0x20_0bcd,
                length: (1 << 20) + 64,
                lkey: dst.keys.lkey,
            }],
        );
        w.send(
            true,
            wqe(
                1,
                SendOpcode::Send,
                vec![Sge {
                    addr: 0x10_0003,
                    length: len as u32,
                    lkey: src.keys.lkey,
                }],
                0,
                0,
            ),
        );
        w.run();
        assert_eq!(w.get(&dst, 0x20_0bcd, len), data, "len {len}");
        assert_eq!(
            w.get(&dst, 0x20_0bcd + len as u64, 8),
            vec![0xee; 8],
            "overrun at len {len}"
        );
        let c = w.cqes();
        assert_eq!(c.len(), 2);
        let recv = c.iter().find(|(cq, _)| *cq == w.b.cq).unwrap().1;
        assert_eq!(
            (recv.status, recv.opcode, recv.byte_len, recv.wr_id),
            (WcStatus::Success, WcOpcode::Recv, len as u32, 9)
        );
        assert_eq!(
            (recv.src_qp, recv.slid, recv.qp_num),
            (w.a.qpn, w.a.lid, w.b.qpn)
        );
        let send = c.iter().find(|(cq, _)| *cq == w.a.cq).unwrap().1;
        assert_eq!(
            (send.status, send.opcode, send.wr_id),
            (WcStatus::Success, WcOpcode::Send, 1)
        );
    }
}

#[test]
fn write_gathers_sges_and_lands_bytes_without_a_receive() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 3 * 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x5_0001,
        3 * 4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    w.set(&src, 0x1000, &pattern(3 * 4096, 1));
    let sges = vec![
        Sge {
            addr: 0x1000 + 5,
            length: 4000,
            lkey: src.keys.lkey,
        },
        Sge {
            addr: 0x1000 + 8000,
            length: 3000,
            lkey: src.keys.lkey,
        },
    ];
    w.send(
        true,
        wqe(
            4,
            SendOpcode::RdmaWrite,
            sges,
            0x5_0001 + 100,
            dst.keys.rkey,
        ),
    );
    w.run();
    let mut want = pattern(3 * 4096, 1)[5..4005].to_vec();
    want.extend_from_slice(&pattern(3 * 4096, 1)[8000..11000]);
    assert_eq!(w.get(&dst, 0x5_0001 + 100, 7000), want);
    let c = w.cqes();
    assert_eq!(c.len(), 1, "a plain WRITE completes only on the requester");
    assert_eq!(
        (c[0].1.status, c[0].1.opcode),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
}

#[test]
fn write_with_imm_consumes_a_receive_and_reports_imm() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    w.recv(false, 77, vec![]);
    w.send(
        true,
        wqe(
            5,
            SendOpcode::RdmaWriteWithImm,
            vec![Sge {
                addr: 0x1000,
                length: 100,
                lkey: src.keys.lkey,
            }],
            0x9000,
            dst.keys.rkey,
        ),
    );
    w.run();
    let recv = w
        .cqes()
        .into_iter()
        .find(|(cq, _)| *cq == w.b.cq)
        .unwrap()
        .1;
    assert_eq!(
        (recv.opcode, recv.byte_len, recv.imm_data, recv.wr_id),
        (WcOpcode::RecvRdmaWithImm, 100, 0x1234_5678, 77)
    );
    assert_eq!(recv.wc_flags & WC_WITH_IMM, WC_WITH_IMM);
}

fn remote_access_error(acc: u32, qp_access: u32, remote_addr: u64, bad_key: bool) {
    let mut w = World::with(qp_access, 7);
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x9000, 4096, acc);
    w.set(&src, 0x1000, &[0x55; 64]);
    w.recv(false, 300, vec![]);
    let rkey = if bad_key {
        dst.keys.rkey ^ 0x00ff_00ff
    } else {
        dst.keys.rkey
    };
    w.send(
        true,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![Sge {
                addr: 0x1000,
                length: 64,
                lkey: src.keys.lkey,
            }],
            remote_addr,
            rkey,
        ),
    );
    w.send(true, wqe(2, SendOpcode::Send, vec![], 0, 0));
    w.run();
    assert_eq!(
        w.get(&dst, 0x9000, 4096),
        vec![0u8; 4096],
        "no byte may land"
    );
    let c = w.cqes();
    let a: Vec<(u64, WcStatus)> = c
        .iter()
        .filter(|(cq, _)| *cq == w.a.cq)
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        a,
        vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]
    );
    let b: Vec<(u64, WcStatus)> = c
        .iter()
        .filter(|(cq, _)| *cq == w.b.cq)
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        b,
        vec![(300, WcStatus::WrFlushErr)],
        "the responder goes to ERR and flushes"
    );
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Err));
    let ev: Vec<_> = std::iter::from_fn(|| w.e.poll_event()).collect();
    assert!(ev.contains(&(w.a.ctx, Event::QpFatal { qp: w.a.qp })));
}

#[test]
fn write_with_a_wrong_rkey_is_rem_access_err() {
    remote_access_error(
        access::LOCAL_WRITE | access::REMOTE_WRITE,
        access::REMOTE_WRITE,
        0x9000,
        true,
    );
}

#[test]
fn write_past_the_end_of_the_mr_is_rem_access_err() {
    remote_access_error(
        access::LOCAL_WRITE | access::REMOTE_WRITE,
        access::REMOTE_WRITE,
        0x9000 + 4096 - 10,
        false,
    );
}

#[test]
fn write_to_an_mr_without_remote_write_is_rem_access_err() {
    remote_access_error(access::LOCAL_WRITE, access::REMOTE_WRITE, 0x9000, false);
}

#[test]
fn write_to_a_qp_without_remote_write_access_is_rem_access_err() {
    remote_access_error(
        access::LOCAL_WRITE | access::REMOTE_WRITE,
        access::REMOTE_READ,
        0x9000,
        false,
    );
}

#[test]
fn a_bad_lkey_is_loc_prot_err_and_flushes_the_rest() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    w.send(
        true,
        wqe(
            1,
            SendOpcode::Send,
            vec![Sge {
                addr: 0x1000,
                length: 8,
                lkey: src.keys.lkey + 1,
            }],
            0,
            0,
        ),
    );
    w.send(true, wqe(2, SendOpcode::Send, vec![], 0, 0));
    w.run();
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        c,
        vec![(1, WcStatus::LocProtErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn a_receive_buffer_without_local_write_fails_the_receive() {
    let mut w = World::new();
    let dst = w.map(false, 0x9000, 4096, 0);
    w.recv(
        false,
        3,
        vec![Sge {
            addr: 0x9000,
            length: 64,
            lkey: dst.keys.lkey,
        }],
    );
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert!(c.contains(&(3, WcStatus::LocProtErr)), "{c:?}");
    assert!(c.contains(&(1, WcStatus::RemOpErr)), "{c:?}");
}

#[test]
fn a_send_longer_than_the_receive_is_len_err_on_both_sides() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    w.recv(
        false,
        3,
        vec![Sge {
            addr: 0x9000,
            length: 10,
            lkey: dst.keys.lkey,
        }],
    );
    w.send(
        true,
        wqe(
            1,
            SendOpcode::Send,
            vec![Sge {
                addr: 0x1000,
                length: 11,
                lkey: src.keys.lkey,
            }],
            0,
            0,
        ),
    );
    w.run();
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert!(
        c.contains(&(3, WcStatus::LocLenErr)) && c.contains(&(1, WcStatus::RemInvReqErr)),
        "{c:?}"
    );
}

#[test]
fn rnr_waits_for_a_receive_instead_of_dropping() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    w.set(&src, 0x1000, b"hello");
    w.send(
        true,
        wqe(
            1,
            SendOpcode::Send,
            vec![Sge {
                addr: 0x1000,
                length: 5,
                lkey: src.keys.lkey,
            }],
            0,
            0,
        ),
    );
    w.run();
    assert!(
        w.cqes().is_empty(),
        "nothing completes while no receive is posted"
    );
    w.advance(Duration::from_secs(2));
    assert!(w.cqes().is_empty(), "rnr_retry 7 waits forever");
    w.recv(
        false,
        8,
        vec![Sge {
            addr: 0x9000,
            length: 64,
            lkey: dst.keys.lkey,
        }],
    );
    w.run();
    assert_eq!(w.get(&dst, 0x9000, 5), b"hello");
    assert_eq!(w.cqes().len(), 2);
}

#[test]
fn rnr_retries_run_out_with_rnr_retry_exc_err() {
    let mut w = World::with(access::REMOTE_WRITE, 2);
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    for _ in 0..5 {
        w.advance(Duration::from_millis(1));
    }
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(1, WcStatus::RnrRetryExcErr)]);
}

#[test]
fn a_missing_peer_is_retry_exc_err_after_the_transport_timeout() {
    let mut w = World::new();
    w.e.destroy_qp(w.now, w.b.ctx, w.b.qp).unwrap();
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    assert!(w.cqes().is_empty(), "the requester retries first");
    w.advance(Duration::from_secs(2));
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(1, WcStatus::RetryExcErr)]);
}

/// Takes `b` through RESET and back to RTR (a responder) expecting PSN `rq_psn` (`a` sends
/// from PSN 0).
fn reconnect_b_expecting(w: &mut World, rq_psn: u32) {
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..Default::default()
    };
    w.e.modify_qp(w.now, w.b.ctx, w.b.qp, qp_attr::STATE, &reset)
        .unwrap();
    let mut a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qp_access_flags: access::REMOTE_WRITE,
        ..Default::default()
    };
    w.e.modify_qp(
        w.now,
        w.b.ctx,
        w.b.qp,
        qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS,
        &a,
    )
    .unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = 5;
    a.dest_qp_num = w.a.qpn;
    a.rq_psn = rq_psn;
    a.ah_attr = AhAttr {
        dlid: w.a.lid,
        port_num: 1,
        ..Default::default()
    };
    let rtr = qp_attr::STATE
        | qp_attr::AV
        | qp_attr::PATH_MTU
        | qp_attr::DEST_QPN
        | qp_attr::RQ_PSN
        | qp_attr::MAX_DEST_RD_ATOMIC
        | qp_attr::MIN_RNR_TIMER;
    w.e.modify_qp(w.now, w.b.ctx, w.b.qp, rtr, &a).unwrap();
}

#[test]
fn a_psn_ahead_of_the_responder_is_nakked_and_ends_in_retry_exc_err() {
    let mut w = World::new();
    reconnect_b_expecting(&mut w, 0xff_fff0);
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    w.recv(false, 8, vec![sge(0x9000, 64, dst.keys.lkey)]);
    // PSN 0 is 16 ahead of 0xfffff0 (the 24-bit space wraps): a sequence error.
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    assert!(w.cqes().is_empty(), "NAKed segments are retried first");
    w.advance(Duration::from_secs(2));
    let c: Vec<(CqId, u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(q, c)| (q, c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(w.a.cq, 1, WcStatus::RetryExcErr)]);
    assert_eq!(w.e.rq_retired(w.b.qp), 0, "the receive was never taken");
}

#[test]
fn a_psn_behind_the_responder_is_a_duplicate_acked_without_effect() {
    let mut w = World::new();
    reconnect_b_expecting(&mut w, 0x10);
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    w.set(&src, 0x1000, b"hello");
    w.recv(false, 8, vec![sge(0x9000, 64, dst.keys.lkey)]);
    w.send(
        true,
        wqe(
            1,
            SendOpcode::Send,
            vec![sge(0x1000, 5, src.keys.lkey)],
            0,
            0,
        ),
    );
    w.run();
    // As a responder answers a retransmission: ACKed again, nothing placed, nothing taken.
    let c: Vec<(CqId, u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(q, c)| (q, c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(w.a.cq, 1, WcStatus::Success)]);
    assert_eq!(w.get(&dst, 0x9000, 5), vec![0; 5]);
    assert_eq!(w.e.rq_retired(w.b.qp), 0);
}

#[test]
fn a_dead_context_fails_its_peers_at_once() {
    let mut w = World::new();
    w.recv(true, 11, vec![]);
    w.e.destroy_context(w.now, w.b.ctx);
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(11, WcStatus::WrFlushErr)]);
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
}

#[test]
fn unsignaled_sends_complete_silently_and_retire() {
    let mut w = World::new();
    w.recv(false, 1, vec![]);
    let mut s = wqe(1, SendOpcode::Send, vec![], 0, 0);
    s.flags = SendFlags(0);
    w.send(true, s);
    w.run();
    let c = w.cqes();
    assert_eq!(c.len(), 1, "only the receive completes");
    assert_eq!(w.e.sq_retired(w.a.qp), 1);
}

#[test]
fn modify_qp_refuses_wrong_masks_and_transitions() {
    let mut e = Engine::new(1);
    let s = side(&mut e, 1, 1);
    let now = Instant::now();
    let a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..Default::default()
    };
    assert_eq!(
        e.modify_qp(now, s.ctx, s.qp, qp_attr::STATE | qp_attr::PORT, &a),
        Err(22),
        "missing required bits"
    );
    let rts = QpAttr {
        qp_state: QpState::Rts,
        ..Default::default()
    };
    assert_eq!(
        e.modify_qp(now, s.ctx, s.qp, qp_attr::STATE, &rts),
        Err(22),
        "RESET to RTS"
    );
    let bad_port = QpAttr {
        qp_state: QpState::Init,
        port_num: 2,
        ..Default::default()
    };
    let m = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
    assert_eq!(
        e.modify_qp(now, s.ctx, s.qp, m, &bad_port),
        Err(22),
        "port 2 does not exist"
    );
    assert_eq!(e.modify_qp(now, s.ctx, s.qp, m, &a), Ok(()));
    assert_eq!(
        e.modify_qp(now, s.ctx, s.qp, m | qp_attr::SQ_PSN, &a),
        Err(22),
        "SQ_PSN is not allowed INIT->INIT"
    );
    assert_eq!(e.query_qp(s.ctx, s.qp).unwrap().qp_state, QpState::Init);
}

#[test]
fn another_context_cannot_touch_my_objects() {
    let mut e = Engine::new(1);
    let s = side(&mut e, 1, 1);
    let other = CtxId(99);
    let now = Instant::now();
    assert!(e.destroy_qp(now, other, s.qp).is_err());
    assert!(e.query_qp(other, s.qp).is_err());
    assert!(e.dealloc_pd(other, s.pd).is_err());
    assert!(e.destroy_cq(other, s.cq).is_err());
    assert!(
        e.reg_mr(other, s.pd, 0x1000, 10, 0x1000, 1, &per_page(&[4096]))
            .is_err()
    );
    assert_eq!(e.dealloc_pd(s.ctx, s.pd), Err(16), "the PD is in use");
}

#[test]
fn moving_to_err_flushes_everything_in_order() {
    let mut w = World::new();
    w.e.destroy_qp(w.now, w.b.ctx, w.b.qp).unwrap();
    for i in 0..3 {
        w.recv(true, 100 + i, vec![]);
    }
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.send(true, wqe(2, SendOpcode::Send, vec![], 0, 0));
    let err = QpAttr {
        qp_state: QpState::Err,
        ..Default::default()
    };
    w.e.modify_qp(w.now, w.a.ctx, w.a.qp, qp_attr::STATE, &err)
        .unwrap();
    let c: Vec<(u64, WcStatus, WcOpcode)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status, c.opcode))
        .collect();
    assert_eq!(
        c,
        vec![
            (1, WcStatus::WrFlushErr, WcOpcode::Send),
            (2, WcStatus::WrFlushErr, WcOpcode::Send),
            (100, WcStatus::WrFlushErr, WcOpcode::Recv),
            (101, WcStatus::WrFlushErr, WcOpcode::Recv),
            (102, WcStatus::WrFlushErr, WcOpcode::Recv),
        ]
    );
}

#[test]
fn read_and_atomics_move_the_right_bytes() {
    let mut w = World::new();
    let local = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let remote = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
    );
    w.set(&remote, 0x9000, &pattern(100, 9));
    w.send(
        true,
        wqe(
            1,
            SendOpcode::RdmaRead,
            vec![Sge {
                addr: 0x1000 + 1,
                length: 100,
                lkey: local.keys.lkey,
            }],
            0x9000,
            remote.keys.rkey,
        ),
    );
    w.run();
    assert_eq!(w.get(&local, 0x1001, 100), pattern(100, 9));
    w.set(&remote, 0x9000 + 256, &41u64.to_le_bytes());
    let mut fa = wqe(
        2,
        SendOpcode::AtomicFetchAndAdd,
        vec![Sge {
            addr: 0x1000 + 512,
            length: 8,
            lkey: local.keys.lkey,
        }],
        0x9000 + 256,
        remote.keys.rkey,
    );
    fa.compare_add = 1;
    w.send(true, fa);
    let mut cs = wqe(
        3,
        SendOpcode::AtomicCmpAndSwp,
        vec![Sge {
            addr: 0x1000 + 520,
            length: 8,
            lkey: local.keys.lkey,
        }],
        0x9000 + 256,
        remote.keys.rkey,
    );
    cs.compare_add = 42;
    cs.swap = 7;
    w.send(true, cs);
    w.run();
    assert_eq!(w.get(&local, 0x1000 + 512, 8), 41u64.to_le_bytes());
    assert_eq!(w.get(&local, 0x1000 + 520, 8), 42u64.to_le_bytes());
    assert_eq!(w.get(&remote, 0x9000 + 256, 8), 7u64.to_le_bytes());
    assert!(w.cqes().iter().all(|(_, c)| c.status == WcStatus::Success));
}

#[test]
fn hostile_wqes_fail_their_qp_only() {
    let mut w = World::new();
    w.e.handle_send_wqe(w.now, w.a.qp, Err(vrnic_wire::ParseError::Opcode(99)));
    w.run();
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
    assert_eq!(
        w.e.qp_state(w.b.qp),
        Some(QpState::Rts),
        "the peer is untouched"
    );
    let huge = wqe(
        1,
        SendOpcode::RdmaWrite,
        vec![
            Sge {
                addr: u64::MAX - 3,
                length: u32::MAX,
                lkey: 12345
            };
            16
        ],
        u64::MAX,
        1,
    );
    w.e.handle_send_wqe(w.now, w.b.qp, Ok(huge));
    w.run();
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Err));
}

fn uc_world() -> World {
    let mut e = Engine::new(7);
    let a = side_of(&mut e, 1, 10, QpType::Uc, 8);
    let b = side_of(&mut e, 2, 20, QpType::Uc, 8);
    let now = Instant::now();
    for (s, peer) in [(&a, &b), (&b, &a)] {
        let mut at = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: access::REMOTE_WRITE,
            ..Default::default()
        };
        e.modify_qp(
            now,
            s.ctx,
            s.qp,
            qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS,
            &at,
        )
        .unwrap();
        at.qp_state = QpState::Rtr;
        at.path_mtu = 5;
        at.dest_qp_num = peer.qpn;
        at.ah_attr = AhAttr {
            dlid: peer.lid,
            port_num: 1,
            ..Default::default()
        };
        let rc_only = qp_attr::MAX_DEST_RD_ATOMIC | qp_attr::MIN_RNR_TIMER;
        let rtr =
            qp_attr::STATE | qp_attr::AV | qp_attr::PATH_MTU | qp_attr::DEST_QPN | qp_attr::RQ_PSN;
        assert_eq!(
            e.modify_qp(now, s.ctx, s.qp, rtr | rc_only, &at),
            Err(22),
            "UC refuses RC-only attributes"
        );
        e.modify_qp(now, s.ctx, s.qp, rtr, &at).unwrap();
        at.qp_state = QpState::Rts;
        e.modify_qp(now, s.ctx, s.qp, qp_attr::STATE | qp_attr::SQ_PSN, &at)
            .unwrap();
    }
    let mem = VecMem(
        [(a.vnic, vec![0u8; REGION]), (b.vnic, vec![0u8; REGION])]
            .into_iter()
            .collect(),
    );
    World { e, mem, now, a, b }
}

#[test]
fn uc_send_without_a_receive_is_lost_and_the_sender_completes() {
    let mut w = uc_world();
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(1, WcStatus::Success)], "no RNR wait on UC");
    // A later message with a receive posted arrives.
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    w.recv(
        false,
        5,
        vec![Sge {
            addr: 0x9000,
            length: 64,
            lkey: dst.keys.lkey,
        }],
    );
    w.send(true, wqe(2, SendOpcode::Send, vec![], 0, 0));
    w.run();
    assert_eq!(w.cqes().len(), 2);
}

#[test]
fn uc_write_with_a_bad_rkey_is_dropped_silently() {
    let mut w = uc_world();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    w.set(&src, 0x1000, &[7; 64]);
    w.send(
        true,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![Sge {
                addr: 0x1000,
                length: 64,
                lkey: src.keys.lkey,
            }],
            0x9000,
            dst.keys.rkey ^ 1,
        ),
    );
    w.run();
    assert_eq!(w.get(&dst, 0x9000, 64), vec![0u8; 64]);
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(1, WcStatus::Success)]);
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Rts));
    // READ is not a UC operation.
    w.send(
        true,
        wqe(
            2,
            SendOpcode::RdmaRead,
            vec![Sge {
                addr: 0x1000,
                length: 8,
                lkey: src.keys.lkey,
            }],
            0x9000,
            dst.keys.rkey,
        ),
    );
    w.run();
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(2, WcStatus::LocQpOpErr)]);
}

// ---- bounded work, bad WQEs, limits -------------------------------------------------------

use vrnic_proto::{
    CHUNK, CHUNK_ALONE, LIGHT_MAX, MemoryRefused, Newcomers, NoSiblings, QP_WRS, SOLO_TURNS, STEP,
};

/// Counts what one `process` call moves.
struct Counting<'a> {
    inner: &'a mut VecMem,
    bytes: u64,
}

impl Memory for Counting<'_> {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        self.bytes += len as u64;
        self.inner.copy(src, dst, len)
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        self.bytes += data.len() as u64;
        self.inner.write(dst, data)
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        self.inner.read(src, out)
    }
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        self.bytes += 8;
        self.inner.store_u64(dst, value)
    }
}

impl World {
    /// Runs `process` until idle; returns how many calls did something, checking that none
    /// moved more than one chunk (there is one busy QP, so one turn per call).
    fn run_counted(&mut self) -> usize {
        let mut calls = 0;
        loop {
            let mut m = Counting {
                inner: &mut self.mem,
                bytes: 0,
            };
            let did = self.e.process(self.now, &mut m);
            assert!(m.bytes <= CHUNK_ALONE, "one call moved {} bytes", m.bytes);
            if !did {
                return calls;
            }
            calls += 1;
            assert!(calls < 1000);
        }
    }

    fn statuses(&mut self) -> Vec<(CqId, u64, WcStatus)> {
        self.cqes()
            .into_iter()
            .map(|(cq, c)| (cq, c.wr_id, c.status))
            .collect()
    }
}

fn sge(addr: u64, length: u32, lkey: u32) -> Sge {
    Sge { addr, length, lkey }
}

#[test]
fn a_large_write_moves_in_bounded_chunks_and_lands_exactly() {
    let mut w = World::new();
    let len = (3 << 20) + 5;
    let src = w.map(true, 0x100_0007, len, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x300_0ff1,
        len,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    let data = pattern(len as usize, 9);
    w.set(&src, 0x100_0007, &data);
    w.send(
        true,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x100_0007, len as u32, src.keys.lkey)],
            0x300_0ff1,
            dst.keys.rkey,
        ),
    );
    let calls = w.run_counted();
    assert!(calls >= 4, "{calls} calls");
    assert_eq!(w.get(&dst, 0x300_0ff1, len as usize), data);
    assert_eq!(w.statuses(), vec![(w.a.cq, 1, WcStatus::Success)]);
}

#[test]
fn a_large_send_scatters_across_receive_sges_over_several_calls() {
    let mut w = World::new();
    let len: u64 = (2 << 20) + 3;
    let src = w.map(true, 0x10_0001, len, access::LOCAL_WRITE);
    let dst = w.map(false, 0x40_0000, len + 100, access::LOCAL_WRITE);
    let data = pattern(len as usize, 5);
    w.set(&src, 0x10_0001, &data);
    // Two receive SGEs with a 100-byte hole between them.
    let first = 1_000_003u32;
    w.recv(
        false,
        7,
        vec![
            sge(0x40_0000, first, dst.keys.lkey),
            sge(
                0x40_0000 + u64::from(first) + 100,
                len as u32 - first,
                dst.keys.lkey,
            ),
        ],
    );
    w.send(
        true,
        wqe(
            1,
            SendOpcode::Send,
            vec![
                sge(0x10_0001, 4097, src.keys.lkey),
                sge(0x10_0001 + 4097, len as u32 - 4097, src.keys.lkey),
            ],
            0,
            0,
        ),
    );
    assert!(w.run_counted() >= 3);
    assert_eq!(
        w.get(&dst, 0x40_0000, first as usize),
        data[..first as usize]
    );
    assert_eq!(
        w.get(
            &dst,
            0x40_0000 + u64::from(first) + 100,
            (len - u64::from(first)) as usize
        ),
        data[first as usize..]
    );
    let c = w.cqes();
    let recv = c.iter().find(|(cq, _)| *cq == w.b.cq).unwrap().1;
    assert_eq!((recv.wr_id, recv.byte_len), (7, len as u32));
    assert_eq!(c.len(), 2);
}

// ---- turns between vRNICs ------------------------------------------------------------------

/// Pairs of vRNICs, each pair's RC QPs connected, with a 4 MiB buffer registered on each side;
/// the engine driven turn by turn, as the daemon does.
struct Tenants {
    e: Engine,
    mem: VecMem,
    now: Instant,
    pairs: Vec<(Side, MrKeys, MrKeys)>,
    next: u64,
}

const BUF: u64 = 4 << 20;
const AT: u64 = 0x1000_0000;

impl Tenants {
    fn new(n: u32) -> Tenants {
        let mut e = Engine::new(7);
        let now = Instant::now();
        let mut mem = VecMem(Default::default());
        let mut pairs = Vec::new();
        let pages: Vec<u64> = (0..BUF / 4096).map(|p| (p + 1) * 4096).collect();
        for i in 0..n {
            let (ia, ib) = (10 + 2 * i, 11 + 2 * i);
            let a = side(&mut e, ia, ia as u16);
            let b = side(&mut e, ib, ib as u16);
            to_rts(&mut e, now, &a, b.qpn, b.lid, access::REMOTE_WRITE, 7);
            to_rts(&mut e, now, &b, a.qpn, a.lid, access::REMOTE_WRITE, 7);
            let acc = access::LOCAL_WRITE | access::REMOTE_WRITE;
            let ka = e.reg_mr(a.ctx, a.pd, AT, BUF, AT, acc, &per_page(&pages));
            let kb = e.reg_mr(b.ctx, b.pd, AT, BUF, AT, acc, &per_page(&pages));
            for v in [a.vnic, b.vnic] {
                mem.0.insert(v, vec![0u8; (BUF + 4096) as usize]);
            }
            pairs.push((a, ka.unwrap(), kb.unwrap()));
        }
        Tenants {
            e,
            mem,
            now,
            pairs,
            next: 0,
        }
    }

    fn vnic(&self, pair: usize) -> VnicId {
        self.pairs[pair].0.vnic
    }

    /// Pair `pair`'s first side writes `len` bytes to its second.
    fn write(&mut self, pair: usize, len: u32) {
        let (a, ka, kb) = &self.pairs[pair];
        self.next += 1;
        let w = wqe(
            self.next,
            SendOpcode::RdmaWrite,
            vec![sge(AT, len, ka.lkey)],
            AT,
            kb.rkey,
        );
        self.e.handle_send_wqe(self.now, a.qp, Ok(w));
    }

    /// Pair 0 floods (8 writes of the whole buffer) until it has had the engine to itself for
    /// [`SOLO_TURNS`] turns; its vRNIC and pair 1's.
    fn flooding_alone(&mut self) -> (VnicId, VnicId) {
        for _ in 0..8 {
            self.write(0, BUF as u32);
        }
        for _ in 0..=SOLO_TURNS {
            self.turn();
        }
        (self.vnic(0), self.vnic(1))
    }

    /// The next turn: whose it was and the bytes it moved.
    fn turn(&mut self) -> Option<(VnicId, u64)> {
        let t = self.e.turn(self.now, &mut self.mem)?;
        Some((t.vnic, t.bytes))
    }

    /// The same, asking `news` between steps as the daemon does.
    fn turn_asking(&mut self, news: &mut dyn Newcomers) -> Option<(VnicId, u64)> {
        let t = self
            .e
            .turn_with(self.now, &mut self.mem, &mut NoSiblings, news)?;
        Some((t.vnic, t.bytes))
    }
}

/// A driver's answers to "has a light tenant new work?", in order (then no), counted.
struct Answers {
    yes_at: Option<usize>,
    asked: usize,
}

impl Newcomers for Answers {
    fn arrived(&mut self) -> bool {
        self.asked += 1;
        self.yes_at == Some(self.asked)
    }
}

#[test]
fn a_vrnic_alone_moves_short_steps_until_it_has_had_the_engine_to_itself() {
    let mut t = Tenants::new(1);
    let flood = t.vnic(0);
    for _ in 0..8 {
        t.write(0, BUF as u32);
    }
    let turns: Vec<(VnicId, u64)> = (0..SOLO_TURNS + 4).map_while(|_| t.turn()).collect();
    assert!(turns.iter().all(|&(v, _)| v == flood));
    let (short, long) = turns.split_at(SOLO_TURNS as usize);
    assert!(short.iter().all(|&(_, n)| n == CHUNK), "{short:?}");
    assert!(long.iter().all(|&(_, n)| n == CHUNK_ALONE), "{long:?}");
}

#[test]
fn a_vrnic_whose_work_arrives_goes_next_and_the_flood_steps_stay_short_while_it_is_active() {
    let mut t = Tenants::new(2);
    let (flood, pair) = t.flooding_alone();
    assert_eq!(t.turn(), Some((flood, CHUNK_ALONE)), "alone: long steps");
    // Each of the pair's small messages goes right after the turn under way, and from its first
    // one on the flood moves short steps: the pair's turns begin with the flood waiting, though
    // the pair's vRNIC has no work between its messages.
    for round in 0..10 {
        t.write(1, 64);
        assert_eq!(
            t.turn(),
            Some((pair, 64)),
            "round {round}: the pair's turn comes next"
        );
        for _ in 0..5 {
            assert_eq!(t.turn(), Some((flood, CHUNK)), "round {round}");
        }
    }
    // Once the pair has been quiet for SOLO_TURNS turns, the flood's steps grow again.
    for _ in 0..SOLO_TURNS {
        t.turn();
    }
    assert_eq!(t.turn(), Some((flood, CHUNK_ALONE)));
}

#[test]
fn a_light_tenants_new_work_cuts_a_busy_turn_after_the_step_under_way() {
    let mut t = Tenants::new(2);
    let (flood, pair) = t.flooding_alone();
    // Alone: one long step, nothing asked (no light tenant).
    let mut quiet = Answers {
        yes_at: Some(1),
        asked: 0,
    };
    assert_eq!(t.turn_asking(&mut quiet), Some((flood, CHUNK_ALONE)));
    assert_eq!(quiet.asked, 0);
    assert!(!t.e.is_light(pair) && !t.e.is_light(flood));
    t.write(1, 64);
    assert_eq!(t.turn(), Some((pair, 64)));
    assert!(t.e.is_light(pair) && !t.e.is_light(flood));
    // Beside a light tenant: steps of STEP, asked after each; a turn with no news moves CHUNK.
    let mut none = Answers {
        yes_at: None,
        asked: 0,
    };
    assert_eq!(t.turn_asking(&mut none), Some((flood, CHUNK)));
    assert_eq!(none.asked as u64, CHUNK / STEP);
    // News after the first step: the turn ends there, and the flood keeps its place in line.
    let mut news = Answers {
        yes_at: Some(1),
        asked: 0,
    };
    assert_eq!(t.turn_asking(&mut news), Some((flood, STEP)));
    assert_eq!(news.asked, 1);
    t.write(1, 64);
    assert_eq!(t.turn(), Some((pair, 64)), "the light tenant goes next");
    assert_eq!(t.turn(), Some((flood, CHUNK)));
    // Quiet for SOLO_TURNS turns: no longer light, long steps again, nothing asked.
    for _ in 0..SOLO_TURNS {
        t.turn();
    }
    assert!(!t.e.is_light(pair));
    let mut quiet = Answers {
        yes_at: Some(1),
        asked: 0,
    };
    assert_eq!(t.turn_asking(&mut quiet), Some((flood, CHUNK_ALONE)));
    assert_eq!(quiet.asked, 0);
}

#[test]
fn the_engine_remembers_the_latest_light_tenants_only() {
    let n = LIGHT_MAX + 2;
    let mut t = Tenants::new(n as u32 + 1);
    for _ in 0..8 {
        t.write(0, BUF as u32);
    }
    t.turn();
    for pair in 1..=n {
        t.write(pair, 64);
        assert_eq!(t.turn(), Some((t.vnic(pair), 64)), "pair {pair} goes next");
        t.turn();
    }
    let mut light: Vec<VnicId> = t.e.light_vnics().collect();
    light.sort();
    let latest: Vec<VnicId> = (n + 1 - LIGHT_MAX..=n).map(|p| t.vnic(p)).collect();
    assert_eq!(light, latest);
    assert!(!t.e.is_light(t.vnic(1)) && !t.e.is_light(t.vnic(2)));
    assert!(latest.iter().all(|&v| t.e.is_light(v)));
}

#[test]
fn vrnics_that_take_turns_without_waiting_for_each_other_get_long_steps() {
    // A ping-pong of 4 MiB messages: one side's message, then the other's, never both at once.
    let mut t = Tenants::new(2);
    let mut sizes = Vec::new();
    for i in 0..6 {
        t.write(i % 2, BUF as u32);
        sizes.extend(std::iter::from_fn(|| t.turn()).map(|(_, n)| n));
    }
    let (short, long) = sizes.split_at(SOLO_TURNS as usize);
    assert!(short.iter().all(|&n| n == CHUNK));
    assert!(long.iter().all(|&n| n == CHUNK_ALONE), "{long:?}");
    assert!(!long.is_empty());
}

#[test]
fn bulk_flows_rotate_strictly_with_long_steps_among_themselves_and_all_bytes_land() {
    let mut t = Tenants::new(3);
    let data = pattern(BUF as usize, 11);
    for pair in 0..3 {
        let v = t.vnic(pair);
        t.mem.0.get_mut(&v).unwrap()[4096..4096 + BUF as usize].copy_from_slice(&data);
        t.write(pair, BUF as u32);
    }
    let turns: Vec<(VnicId, u64)> = std::iter::from_fn(|| t.turn()).collect();
    // Until the first of them is done: a strict rotation (newcomers went to the front, so it
    // starts with the last one), short steps at first, then long ones (none is light: each
    // has work after every turn).
    let done = (0..3)
        .map(|p| turns.iter().rposition(|&(v, _)| v == t.vnic(p)).unwrap())
        .min()
        .unwrap();
    let mut first: Vec<VnicId> = turns[..3].iter().map(|&(v, _)| v).collect();
    assert!(
        turns[..done]
            .iter()
            .enumerate()
            .all(|(i, &(v, _))| v == first[i % 3])
    );
    first.sort();
    assert_eq!(first, vec![t.vnic(0), t.vnic(1), t.vnic(2)]);
    let (short, long) = turns[..done].split_at(SOLO_TURNS as usize);
    assert!(short.iter().all(|&(_, n)| n == CHUNK));
    assert!(
        long.len() >= 20 && long.iter().all(|&(_, n)| n == CHUNK_ALONE),
        "{long:?}"
    );
    assert_eq!(turns.iter().map(|&(_, n)| n).sum::<u64>(), 3 * BUF);
    for (a, _, _) in &t.pairs {
        let b = VnicId(a.vnic.0 + 1);
        assert_eq!(&t.mem.0[&b][4096..4096 + BUF as usize], &data[..]);
    }
}

#[test]
fn one_process_call_runs_at_most_qp_wrs_per_qp() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    for i in 0..40 {
        w.send(
            true,
            wqe(
                i,
                SendOpcode::RdmaWrite,
                vec![sge(0x1000 + i, 1, src.keys.lkey)],
                0x9000 + i,
                dst.keys.rkey,
            ),
        );
    }
    assert!(w.e.process(w.now, &mut w.mem));
    assert_eq!(w.cqes().len(), QP_WRS);
    w.run();
    let rest: Vec<u64> = w.cqes().into_iter().map(|(_, c)| c.wr_id).collect();
    assert_eq!(rest, (QP_WRS as u64..40).collect::<Vec<_>>(), "in order");
}

#[test]
fn an_unparsable_send_fails_in_its_turn_after_earlier_wqes() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    let write = |id| {
        wqe(
            id,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 8, src.keys.lkey)],
            0x9000,
            dst.keys.rkey,
        )
    };
    w.send(true, write(1));
    w.e.handle_send_wqe(w.now, w.a.qp, Err(vrnic_wire::ParseError::Opcode(99)));
    w.send(true, write(3));
    w.run();
    let a = w.a.cq;
    assert_eq!(
        w.statuses(),
        vec![
            (a, 1, WcStatus::Success),
            (a, 0, WcStatus::LocQpOpErr),
            (a, 3, WcStatus::WrFlushErr)
        ]
    );
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Rts));
    assert_eq!(
        w.e.poll_event(),
        Some((w.a.ctx, Event::QpFatal { qp: w.a.qp }))
    );
    assert_eq!(w.e.poll_event(), None);
}

#[test]
fn an_unparsable_receive_fails_itself_and_flushes_the_others_first() {
    let mut w = World::new();
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    // b also has a send waiting on RNR: it must flush, not take the receive's error.
    w.send(false, wqe(20, SendOpcode::Send, vec![], 0, 0));
    w.run();
    w.recv(false, 5, vec![sge(0x9000, 64, dst.keys.lkey)]);
    w.e.handle_recv_wqe(w.now, w.b.qp, Err(vrnic_wire::ParseError::TooManySges(40)));
    let b = w.b.cq;
    let c = w.statuses();
    assert!(c.contains(&(b, 20, WcStatus::WrFlushErr)), "{c:?}");
    let recvs: Vec<_> = c.iter().copied().filter(|&(_, id, _)| id != 20).collect();
    assert_eq!(
        recvs,
        vec![(b, 5, WcStatus::WrFlushErr), (b, 0, WcStatus::LocQpOpErr)]
    );
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Err));
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Rts));
    assert_eq!(
        w.e.poll_event(),
        Some((w.b.ctx, Event::QpFatal { qp: w.b.qp }))
    );
}

#[test]
fn a_send_posted_outside_rts_fails_and_in_reset_is_dropped() {
    let mut w = World::new();
    let cap = QpCap {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let (qp, _) =
        w.e.create_qp(w.a.ctx, w.a.pd, w.a.cq, w.a.cq, QpType::Rc, cap, true)
            .unwrap();
    // RESET: dropped silently, but the slot is retired.
    w.e.handle_send_wqe(w.now, qp, Ok(wqe(1, SendOpcode::Send, vec![], 0, 0)));
    assert_eq!(w.e.sq_retired(qp), 1);
    assert!(w.cqes().is_empty());
    let init = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..Default::default()
    };
    w.e.modify_qp(
        w.now,
        w.a.ctx,
        qp,
        qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS,
        &init,
    )
    .unwrap();
    w.e.handle_recv_wqe(
        w.now,
        qp,
        Ok(RecvWqe {
            wr_id: 8,
            sges: Default::default(),
        }),
    );
    w.e.handle_send_wqe(w.now, qp, Ok(wqe(2, SendOpcode::Send, vec![], 0, 0)));
    let a = w.a.cq;
    assert_eq!(
        w.statuses(),
        vec![(a, 2, WcStatus::LocQpOpErr), (a, 8, WcStatus::WrFlushErr)]
    );
    assert_eq!(w.e.qp_state(qp), Some(QpState::Err));
    assert_eq!(w.e.poll_event(), Some((w.a.ctx, Event::QpFatal { qp })));
    assert_eq!(w.e.sq_retired(qp), 2);
}

#[test]
fn moving_to_reset_forgets_the_queues_without_completions() {
    let mut w = World::new();
    let dst = w.map(false, 0x9000, 4096, access::LOCAL_WRITE);
    for i in 0..3 {
        w.recv(false, i, vec![sge(0x9000, 64, dst.keys.lkey)]);
    }
    let reset = QpAttr {
        qp_state: QpState::Reset,
        ..Default::default()
    };
    w.e.modify_qp(w.now, w.b.ctx, w.b.qp, qp_attr::STATE, &reset)
        .unwrap();
    assert!(w.cqes().is_empty());
    assert_eq!(w.e.rq_retired(w.b.qp), 3);
    assert_eq!(w.e.rq_room(w.b.qp), 64);
    assert_eq!(w.e.poll_event(), None, "RESET by modify_qp is not an error");
    let a = w.e.query_qp(w.b.ctx, w.b.qp).unwrap();
    assert_eq!((a.qp_state, a.dest_qp_num), (QpState::Reset, 0));
}

#[test]
fn reg_mr_checks_access_and_page_list() {
    let mut w = World::new();
    let (ctx, pd) = (w.a.ctx, w.a.pd);
    let e = &mut w.e;
    // Remote write or atomic without local write.
    assert_eq!(
        e.reg_mr(
            ctx,
            pd,
            0x1000,
            4096,
            0x1000,
            access::REMOTE_WRITE,
            &per_page(&[0])
        ),
        Err(22)
    );
    assert_eq!(
        e.reg_mr(
            ctx,
            pd,
            0x1000,
            4096,
            0x1000,
            access::REMOTE_ATOMIC,
            &per_page(&[0])
        ),
        Err(22)
    );
    // Wrong page count, unaligned page, zero length, address overflow.
    assert_eq!(
        e.reg_mr(ctx, pd, 0x1001, 4096, 0x1001, 0, &per_page(&[0])),
        Err(22)
    );
    assert_eq!(
        e.reg_mr(ctx, pd, 0x1000, 4096, 0x1000, 0, &per_page(&[12])),
        Err(22)
    );
    assert_eq!(
        e.reg_mr(ctx, pd, 0x1000, 0, 0x1000, 0, &per_page(&[])),
        Err(22)
    );
    assert_eq!(
        e.reg_mr(ctx, pd, u64::MAX - 10, 4096, 0, 0, &per_page(&[0, 4096])),
        Err(22)
    );
    // Unknown access bits.
    assert_eq!(
        e.reg_mr(ctx, pd, 0x1000, 4096, 0x1000, 1 << 30, &per_page(&[0])),
        Err(95)
    );
    // Another context's PD.
    assert!(
        e.reg_mr(w.b.ctx, pd, 0x1000, 4096, 0x1000, 0, &per_page(&[0]))
            .is_err()
    );
    // An unaligned range over two pages, keys nonzero and distinct.
    let k1 = e
        .reg_mr(ctx, pd, 0x1ff0, 32, 0x1ff0, 0, &per_page(&[0, 8192]))
        .unwrap();
    let k2 = e
        .reg_mr(ctx, pd, 0x1000, 1, 0x1000, 0, &per_page(&[0]))
        .unwrap();
    assert!(k1.lkey != 0 && k2.lkey != 0 && k1.lkey != k2.lkey && k1.mr != k2.mr);
    assert_eq!(e.dealloc_pd(ctx, pd), Err(16), "MRs and a QP use it");
}

#[test]
fn create_qp_and_cq_enforce_limits_types_and_ownership() {
    let mut w = World::new();
    let (ctx, pd, cq) = (w.a.ctx, w.a.pd, w.a.cq);
    let cap = QpCap {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let e = &mut w.e;
    assert_eq!(e.create_cq(w.a.vnic, ctx, 0), Err(22));
    assert_eq!(
        e.create_cq(w.a.vnic, ctx, vrnic_proto::MAX_CQE + 1),
        Err(22)
    );
    assert_eq!(e.create_cq(VnicId(99), ctx, 4), Err(2));
    let (ud, _) = e
        .create_qp(ctx, pd, cq, cq, QpType::Ud, cap, false)
        .unwrap();
    e.destroy_qp(w.now, ctx, ud).unwrap();
    for bad in [
        QpCap {
            max_send_wr: vrnic_proto::MAX_QP_WR + 1,
            ..cap
        },
        QpCap {
            max_send_sge: 17,
            ..cap
        },
        QpCap {
            max_inline_data: 257,
            ..cap
        },
    ] {
        assert_eq!(
            e.create_qp(ctx, pd, cq, cq, QpType::Rc, bad, false),
            Err(22)
        );
    }
    // A CQ of the same context on another vRNIC, and another context's CQ.
    e.add_vnic(VnicId(3), 30, [3; 16]);
    let far = e.create_cq(VnicId(3), ctx, 4).unwrap();
    assert_eq!(
        e.create_qp(ctx, pd, far, cq, QpType::Rc, cap, false),
        Err(22)
    );
    assert_eq!(
        e.create_qp(ctx, pd, cq, w.b.cq, QpType::Rc, cap, false),
        Err(22)
    );
    // QPNs and ids are unique, 24-bit, never 0 or 1, and not reused at once.
    let (q1, n1) = e
        .create_qp(ctx, pd, cq, cq, QpType::Rc, cap, false)
        .unwrap();
    e.destroy_qp(w.now, ctx, q1).unwrap();
    let (q2, n2) = e
        .create_qp(ctx, pd, cq, cq, QpType::Rc, cap, false)
        .unwrap();
    assert!(q1 != q2 && n1 != n2 && n1 >= 0x11 && n2 <= 0xff_ffff);
    assert_eq!(e.destroy_qp(w.now, ctx, q1), Err(22), "gone");
    assert_eq!(e.destroy_cq(ctx, cq), Err(16), "QPs use it");
    assert_eq!(e.qp_count(w.a.vnic), 2);
}

#[test]
fn handle_timeout_alone_fails_a_qp_whose_peer_is_gone() {
    let mut w = World::new();
    // A graceful destroy_qp does not touch the peer (as on a fabric) ...
    w.e.destroy_qp(w.now, w.b.ctx, w.b.qp).unwrap();
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Rts));
    assert_eq!(w.e.poll_event(), None);
    // ... which notices when it next sends.
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.send(true, wqe(2, SendOpcode::Send, vec![], 0, 0));
    w.run();
    let deadline = w.e.poll_timeout().expect("a transport timer");
    w.e.handle_timeout(deadline - Duration::from_micros(1));
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Rts));
    w.e.handle_timeout(deadline);
    let a = w.a.cq;
    assert_eq!(
        w.statuses(),
        vec![(a, 1, WcStatus::RetryExcErr), (a, 2, WcStatus::WrFlushErr)]
    );
    assert_eq!(w.e.poll_timeout(), None);
}

#[test]
fn rnr_timer_expiries_count_through_handle_timeout_too() {
    let mut w = World::with(access::REMOTE_WRITE, 2);
    w.send(true, wqe(1, SendOpcode::Send, vec![], 0, 0));
    w.run();
    for _ in 0..2 {
        let t = w.e.poll_timeout().expect("RNR timer");
        w.now = t;
        w.e.handle_timeout(t);
        assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Rts));
    }
    let t = w.e.poll_timeout().expect("RNR timer");
    w.e.handle_timeout(t);
    assert_eq!(w.statuses(), vec![(w.a.cq, 1, WcStatus::RnrRetryExcErr)]);
}

#[test]
fn zero_length_write_with_imm_needs_no_rkey_but_a_receive() {
    let mut w = World::new();
    w.send(
        true,
        wqe(1, SendOpcode::RdmaWriteWithImm, vec![], 0, 0xdead),
    );
    w.run();
    assert!(w.cqes().is_empty(), "RNR: no receive yet");
    w.recv(false, 4, vec![]);
    w.run();
    let c = w.cqes();
    let recv = c.iter().find(|(cq, _)| *cq == w.b.cq).unwrap().1;
    assert_eq!(
        (
            recv.wr_id,
            recv.opcode,
            recv.byte_len,
            recv.wc_flags & WC_WITH_IMM
        ),
        (4, WcOpcode::RecvRdmaWithImm, 0, WC_WITH_IMM)
    );
    assert_eq!(recv.imm_data, 0x1234_5678);
    assert_eq!(c.len(), 2);
}

#[test]
fn an_atomic_with_a_short_local_buffer_is_loc_len_err_on_the_requester_only() {
    let mut w = World::new();
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_ATOMIC,
    );
    w.set(&dst, 0x9000, &5u64.to_le_bytes());
    w.send(
        true,
        wqe(
            1,
            SendOpcode::AtomicFetchAndAdd,
            vec![sge(0x1000, 4, src.keys.lkey)],
            0x9000,
            dst.keys.rkey,
        ),
    );
    w.run();
    assert_eq!(w.statuses(), vec![(w.a.cq, 1, WcStatus::LocLenErr)]);
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Rts));
    assert_eq!(w.get(&dst, 0x9000, 8), 5u64.to_le_bytes());
}

fn ud_ready(w: &mut World, on_a: bool, qkey: u32) {
    let s = if on_a { &w.a } else { &w.b };
    let a = QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        qkey,
        ..Default::default()
    };
    let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY;
    w.e.modify_qp(w.now, s.ctx, s.qp, init, &a).unwrap();
    for (state, mask) in [
        (QpState::Rtr, qp_attr::STATE),
        (QpState::Rts, qp_attr::STATE | qp_attr::SQ_PSN),
    ] {
        let a = QpAttr {
            qp_state: state,
            ..Default::default()
        };
        w.e.modify_qp(w.now, s.ctx, s.qp, mask, &a).unwrap();
    }
}

fn ud_world() -> World {
    let mut e = Engine::new(7);
    let a = side_of(&mut e, 1, 10, QpType::Ud, 16);
    let b = side_of(&mut e, 2, 20, QpType::Ud, 16);
    let mem = VecMem(
        [(a.vnic, vec![0u8; REGION]), (b.vnic, vec![0u8; REGION])]
            .into_iter()
            .collect(),
    );
    let mut w = World {
        e,
        mem,
        now: Instant::now(),
        a,
        b,
    };
    ud_ready(&mut w, true, 0x11);
    ud_ready(&mut w, false, 0x22);
    w
}

#[test]
fn ud_datagrams_carry_a_grh_and_obey_qkeys() {
    let mut w = ud_world();
    let src = w.map(true, 0x10_0000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x20_0000, 8192, access::LOCAL_WRITE);
    let data = pattern(300, 9);
    w.set(&src, 0x10_0000, &data);
    let mut gid = [0u8; 16];
    gid.fill(2); // b's GID in `side_of`
    let ah =
        w.e.create_ah(
            w.a.ctx,
            w.a.pd,
            AhAttr {
                is_global: true,
                port_num: 1,
                grh: vrnic_wire::GlobalRoute {
                    dgid: gid,
                    hop_limit: 3,
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .unwrap();
    let sge = |addr, length, lkey| Sge { addr, length, lkey };
    let (lkey, bqpn) = (src.keys.lkey, w.b.qpn);
    let datagram = |wr_id, qkey| {
        let mut s = wqe(
            wr_id,
            SendOpcode::Send,
            vec![sge(0x10_0000, 300, lkey)],
            0,
            0,
        );
        s.ud = vrnic_wire::UdAddr {
            ah: ah.0,
            remote_qpn: bqpn,
            remote_qkey: qkey,
        };
        s
    };
    // Wrong Q_Key: dropped; the sender still completes.
    w.recv(false, 70, vec![sge(0x20_0000, 4096, dst.keys.lkey)]);
    w.send(true, datagram(1, 0x33));
    w.run();
    let c = w.cqes();
    assert_eq!(c.len(), 1, "{c:?}");
    assert_eq!((c[0].1.wr_id, c[0].1.status), (1, WcStatus::Success));
    // Right Q_Key: GRH, then the payload at byte 40; byte_len counts both.
    w.send(true, datagram(2, 0x22));
    w.run();
    let c = w.cqes();
    let r = c.iter().find(|(_, c)| c.wr_id == 70).expect("receive").1;
    assert_eq!(r.status, WcStatus::Success);
    assert_eq!(r.byte_len, 340);
    assert_eq!(r.wc_flags & vrnic_wire::WC_GRH, vrnic_wire::WC_GRH);
    assert_eq!((r.src_qp, r.slid), (w.a.qpn, 10));
    let grh = w.get(&dst, 0x20_0000, 40);
    assert_eq!(grh[0] >> 4, 6, "IP version 6");
    assert_eq!(grh[7], 3, "hop limit");
    assert_eq!(&grh[8..24], &[1u8; 16], "source GID");
    assert_eq!(&grh[24..40], &gid, "destination GID");
    assert_eq!(w.get(&dst, 0x20_0000 + 40, 300), data);
    // No receive posted: dropped silently, not RNR.
    w.send(true, datagram(3, 0x22));
    w.run();
    let c = w.cqes();
    assert_eq!(c.len(), 1);
    assert_eq!((c[0].1.wr_id, c[0].1.status), (3, WcStatus::Success));
    // An AH of another PD fails the QP: LOC_QP_OP_ERR.
    let other_pd = w.e.alloc_pd(w.a.vnic, w.a.ctx).unwrap();
    let foreign =
        w.e.create_ah(
            w.a.ctx,
            other_pd,
            AhAttr {
                dlid: 20,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    let mut bad = datagram(4, 0x22);
    bad.ud.ah = foreign.0;
    w.send(true, bad);
    w.run();
    let c = w.cqes();
    assert_eq!((c[0].1.wr_id, c[0].1.status), (4, WcStatus::LocQpOpErr));
    assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
}

#[test]
fn ud_refuses_rdma_and_messages_over_the_mtu() {
    let mut w = ud_world();
    let src = w.map(true, 0x10_0000, 8192, access::LOCAL_WRITE);
    let ah =
        w.e.create_ah(
            w.a.ctx,
            w.a.pd,
            AhAttr {
                dlid: 20,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    let mut s = wqe(
        1,
        SendOpcode::Send,
        vec![Sge {
            addr: 0x10_0000,
            length: 4097,
            lkey: src.keys.lkey,
        }],
        0,
        0,
    );
    s.ud = vrnic_wire::UdAddr {
        ah: ah.0,
        remote_qpn: w.b.qpn,
        remote_qkey: 0x22,
    };
    w.send(true, s);
    w.run();
    let c = w.cqes();
    assert_eq!((c[0].1.wr_id, c[0].1.status), (1, WcStatus::LocLenErr));
    // On a fresh UD QP, an RDMA WRITE is not a UD operation.
    let mut w = ud_world();
    let src = w.map(true, 0x10_0000, 4096, access::LOCAL_WRITE);
    let mut s = wqe(
        2,
        SendOpcode::RdmaWrite,
        vec![Sge {
            addr: 0x10_0000,
            length: 8,
            lkey: src.keys.lkey,
        }],
        0,
        0,
    );
    s.ud.ah = ah.0;
    w.send(true, s);
    w.run();
    let c = w.cqes();
    assert_eq!((c[0].1.wr_id, c[0].1.status), (2, WcStatus::LocQpOpErr));
}

#[test]
fn an_srq_feeds_several_qps_and_raises_its_limit_event_once() {
    let mut w = World::new();
    let (srq, depth) = w.e.create_srq(w.b.ctx, w.b.pd, 8, 1, 0).unwrap();
    assert_eq!(depth, 8);
    let cap = QpCap {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    // Two responder QPs on b share the SRQ; two requesters on a.
    let mut pairs = Vec::new();
    for _ in 0..2 {
        let (rq, rqn) =
            w.e.create_qp_srq(
                w.b.ctx,
                w.b.pd,
                w.b.cq,
                w.b.cq,
                Some(srq),
                QpType::Rc,
                cap,
                false,
            )
            .unwrap();
        let (sq, sqn) =
            w.e.create_qp(w.a.ctx, w.a.pd, w.a.cq, w.a.cq, QpType::Rc, cap, false)
                .unwrap();
        let r = Side {
            qp: rq,
            qpn: rqn,
            ..w.b
        };
        let s = Side {
            qp: sq,
            qpn: sqn,
            ..w.a
        };
        let acc = access::REMOTE_WRITE;
        to_rts(&mut w.e, w.now, &r, s.qpn, s.lid, acc, 7);
        to_rts(&mut w.e, w.now, &s, r.qpn, r.lid, acc, 7);
        pairs.push((s, r));
    }
    let src = w.map(true, 0x10_0000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x20_0000, 8 * 512, access::LOCAL_WRITE);
    w.set(&src, 0x10_0000, &pattern(64, 3));
    for i in 0..4u64 {
        w.e.handle_srq_wqe(
            srq,
            Ok(RecvWqe {
                wr_id: 100 + i,
                sges: smallvec::smallvec![Sge {
                    addr: 0x20_0000 + i * 512,
                    length: 512,
                    lkey: dst.keys.lkey,
                }],
            }),
        );
    }
    w.e.modify_srq(w.b.ctx, srq, None, Some(2)).unwrap();
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, None, Some(8)), Err(22));
    while w.e.poll_event().is_some() {}
    for (i, (s, _)) in pairs.iter().enumerate() {
        w.e.handle_send_wqe(
            w.now,
            s.qp,
            Ok(wqe(
                i as u64,
                SendOpcode::Send,
                vec![Sge {
                    addr: 0x10_0000,
                    length: 64,
                    lkey: src.keys.lkey,
                }],
                0,
                0,
            )),
        );
    }
    w.run();
    let recvs: Vec<Cqe> = w
        .cqes()
        .into_iter()
        .filter(|(cq, _)| *cq == w.b.cq)
        .map(|(_, c)| c)
        .collect();
    assert_eq!(recvs.len(), 2);
    let qpns: Vec<u32> = recvs.iter().map(|c| c.qp_num).collect();
    assert!(qpns.contains(&pairs[0].1.qpn) && qpns.contains(&pairs[1].1.qpn));
    assert_eq!(w.e.srq_retired(srq), 2);
    assert_eq!(w.get(&dst, 0x20_0000, 64), pattern(64, 3));
    // Two receives left, limit 2: not below yet. One more send takes it below: one event.
    assert!(w.e.poll_event().is_none());
    w.e.handle_send_wqe(
        w.now,
        pairs[0].0.qp,
        Ok(wqe(
            9,
            SendOpcode::Send,
            vec![Sge {
                addr: 0x10_0000,
                length: 64,
                lkey: src.keys.lkey,
            }],
            0,
            0,
        )),
    );
    w.run();
    assert_eq!(w.e.poll_event(), Some((w.b.ctx, Event::SrqLimit { srq })));
    assert_eq!(w.e.query_srq(w.b.ctx, srq), Ok((8, 1, 0)));
    assert_eq!(w.e.destroy_srq(w.b.ctx, srq), Err(16));
}

#[test]
fn a_broken_srq_ring_raises_srq_error_and_takes_nothing_more() {
    let mut w = World::new();
    let (srq, _) = w.e.create_srq(w.b.ctx, w.b.pd, 4, 1, 0).unwrap();
    w.e.handle_srq_wqe(srq, Err(vrnic_wire::ParseError::ProducerIndex(99)));
    assert_eq!(w.e.poll_event(), Some((w.b.ctx, Event::SrqError { srq })));
    assert_eq!(w.e.srq_room(srq), 0);
    // Too many SGEs for the SRQ also breaks it (checked by a fresh one).
    let (srq2, _) = w.e.create_srq(w.b.ctx, w.b.pd, 4, 1, 0).unwrap();
    let sge = Sge {
        addr: 0,
        length: 1,
        lkey: 0,
    };
    w.e.handle_srq_wqe(
        srq2,
        Ok(RecvWqe {
            wr_id: 1,
            sges: smallvec::smallvec![sge, sge],
        }),
    );
    assert_eq!(
        w.e.poll_event(),
        Some((w.b.ctx, Event::SrqError { srq: srq2 }))
    );
}

/// `IBV_SRQ_MAX_WR`: an SRQ grows and shrinks keeping its posted receives (they are still
/// consumed in order afterwards); shrinking below the receives outstanding, below an armed
/// limit, to 0 or past the device's depth fails with `EINVAL` and changes nothing (rxe's
/// `rxe_srq_chk_attr`/`rxe_queue_resize`); a broken SRQ cannot be resized.
#[test]
fn an_srq_resizes_keeping_its_receives_and_refuses_to_shrink_below_them() {
    let mut w = World::new();
    let (srq, depth) = w.e.create_srq(w.b.ctx, w.b.pd, 4, 1, 0).unwrap();
    assert_eq!(depth, 4);
    let cap = QpCap {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let (rq, rqn) =
        w.e.create_qp_srq(
            w.b.ctx,
            w.b.pd,
            w.b.cq,
            w.b.cq,
            Some(srq),
            QpType::Rc,
            cap,
            false,
        )
        .unwrap();
    let r = Side {
        qp: rq,
        qpn: rqn,
        ..w.b
    };
    let (sq, sqn) =
        w.e.create_qp(w.a.ctx, w.a.pd, w.a.cq, w.a.cq, QpType::Rc, cap, false)
            .unwrap();
    let a = Side {
        qp: sq,
        qpn: sqn,
        ..w.a
    };
    to_rts(&mut w.e, w.now, &r, a.qpn, a.lid, 0, 7);
    to_rts(&mut w.e, w.now, &a, r.qpn, r.lid, 0, 7);
    let src = w.map(true, 0x10_0000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x20_0000, 16 * 256, access::LOCAL_WRITE);
    w.set(&src, 0x10_0000, &pattern(256, 5));
    let recv = |i: u64| RecvWqe {
        wr_id: 100 + i,
        sges: smallvec::smallvec![Sge {
            addr: 0x20_0000 + i * 256,
            length: 256,
            lkey: dst.keys.lkey,
        }],
    };
    for i in 0..4 {
        w.e.handle_srq_wqe(srq, Ok(recv(i)));
    }
    assert_eq!(w.e.srq_room(srq), 0);
    // Grow to 10 (ring depth 16): six more fit.
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, Some(10), None), Ok(16));
    assert_eq!(w.e.query_srq(w.b.ctx, srq), Ok((10, 1, 0)));
    assert_eq!(w.e.srq_room(srq), 12);
    for i in 4..10 {
        w.e.handle_srq_wqe(srq, Ok(recv(i)));
    }
    // Ten outstanding: shrinking to 9 fails and changes nothing; to 0 or past the device's
    // depth too.
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, Some(9), None), Err(22));
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, Some(0), None), Err(22));
    assert_eq!(
        w.e.modify_srq(w.b.ctx, srq, Some(vrnic_proto::MAX_QP_WR + 1), None),
        Err(22)
    );
    assert_eq!(w.e.query_srq(w.b.ctx, srq), Ok((10, 1, 0)));
    // Seven SENDs consume the seven oldest receives, in order.
    for i in 0..7u64 {
        let s = vec![Sge {
            addr: 0x10_0000,
            length: 200 + i as u32,
            lkey: src.keys.lkey,
        }];
        w.e.handle_send_wqe(w.now, a.qp, Ok(wqe(i, SendOpcode::Send, s, 0, 0)));
    }
    w.run();
    let recvs: Vec<(u64, u32)> = w
        .cqes()
        .into_iter()
        .filter(|(cq, c)| *cq == w.b.cq && c.qp_num == rqn)
        .map(|(_, c)| (c.wr_id, c.byte_len))
        .collect();
    assert_eq!(
        recvs,
        (0..7u64)
            .map(|i| (100 + i, 200 + i as u32))
            .collect::<Vec<_>>()
    );
    assert_eq!(w.get(&dst, 0x20_0000 + 6 * 256, 206), pattern(206, 5));
    // Three left: shrink to 3 (depth 4) keeps them; an armed limit of 2 forbids going to 2.
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, Some(3), Some(2)), Ok(4));
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, Some(2), None), Err(22));
    assert_eq!(w.e.modify_srq(w.b.ctx, srq, None, Some(3)), Err(22));
    assert_eq!(w.e.query_srq(w.b.ctx, srq), Ok((3, 1, 2)));
    assert_eq!(w.e.srq_room(srq), 1);
    // The three kept receives still take SENDs, in order.
    for i in 7..10u64 {
        let s = vec![Sge {
            addr: 0x10_0000,
            length: 10,
            lkey: src.keys.lkey,
        }];
        w.e.handle_send_wqe(w.now, a.qp, Ok(wqe(i, SendOpcode::Send, s, 0, 0)));
    }
    w.run();
    let ids: Vec<u64> = w
        .cqes()
        .into_iter()
        .filter(|(cq, c)| *cq == w.b.cq && c.qp_num == rqn)
        .map(|(_, c)| c.wr_id)
        .collect();
    assert_eq!(ids, vec![107, 108, 109]);
    // Another context cannot resize it; a broken SRQ cannot be resized.
    assert_eq!(w.e.modify_srq(w.a.ctx, srq, Some(8), None), Err(22));
    let (srq2, _) = w.e.create_srq(w.b.ctx, w.b.pd, 4, 1, 0).unwrap();
    w.e.handle_srq_wqe(srq2, Err(vrnic_wire::ParseError::ProducerIndex(99)));
    assert_eq!(w.e.modify_srq(w.b.ctx, srq2, Some(8), None), Err(22));
}

// ---- memory windows -------------------------------------------------------------------------

/// A local invalidation (or, with `SendWithInv`, a SEND that invalidates) of `rkey`.
fn inv(wr_id: u64, opcode: SendOpcode, sges: Vec<Sge>, rkey: u32) -> SendWqe {
    SendWqe {
        imm_data: rkey,
        ..wqe(wr_id, opcode, sges, 0, 0)
    }
}

/// Setup for the window tests: on b, an MR at 0x40_0000 (8 KiB, MW_BIND) and a type-`ty`
/// window; on a, a source buffer with a pattern.
fn window_world(ty: u32) -> (World, Mapping, Mapping, vrnic_proto::MwId, u32) {
    let mut w = World::new();
    let acc = access::LOCAL_WRITE | access::MW_BIND;
    let mr = w.map(false, 0x40_0000, 8192, acc);
    let src = w.map(true, 0x10_0000, 8192, access::LOCAL_WRITE);
    w.set(&src, 0x10_0000, &pattern(8192, 9));
    let (mw, rkey) = w.e.alloc_mw(w.b.ctx, w.b.pd, ty).unwrap();
    (w, mr, src, mw, rkey)
}

fn write_via(w: &mut World, src: &Mapping, wr_id: u64, va: u64, len: u32, rkey: u32) {
    let s = vec![Sge {
        addr: 0x10_0000,
        length: len,
        lkey: src.keys.lkey,
    }];
    w.send(true, wqe(wr_id, SendOpcode::RdmaWrite, s, va, rkey));
    w.run();
}

fn statuses(w: &mut World, cq: CqId) -> Vec<(u64, WcStatus, WcOpcode)> {
    w.cqes()
        .into_iter()
        .filter(|(c, _)| *c == cq)
        .map(|(_, c)| (c.wr_id, c.status, c.opcode))
        .collect()
}

/// Type 2: a bind on the responder's QP opens `[0x40_1000, +256)` of the MR for remote
/// write under the new key; a write inside lands exactly there; the old key, and a range
/// past the window's end though inside the MR, fail with REM_ACCESS_ERR and write nothing.
#[test]
fn a_type2_window_gives_remote_write_to_its_range_only() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    let b_cq = w.b.cq;
    let a_cq = w.a.cq;
    w.send(
        false,
        bind(
            1,
            mw,
            key,
            mr.keys.lkey,
            0x40_1000,
            256,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    assert_eq!(
        statuses(&mut w, b_cq),
        vec![(1, WcStatus::Success, WcOpcode::BindMw)]
    );
    assert_eq!(w.e.mw_rkey(mw), Some(key));
    write_via(&mut w, &src, 2, 0x40_1010, 200, key);
    assert_eq!(
        statuses(&mut w, a_cq),
        vec![(2, WcStatus::Success, WcOpcode::RdmaWrite)]
    );
    assert_eq!(w.get(&mr, 0x40_1010, 200), pattern(200, 9));
    assert_eq!(w.get(&mr, 0x40_100f, 1), vec![0]);
    assert_eq!(w.get(&mr, 0x40_10d8, 1), vec![0]);
    // 0x40_1010 + 250 passes the window's end (0x40_1100), not the MR's.
    let (mut w2, mr2, src2, mw2, rkey2) = window_world(vrnic_proto::MW_TYPE_2);
    let key2 = inc(rkey2);
    w2.send(
        false,
        bind(
            1,
            mw2,
            key2,
            mr2.keys.lkey,
            0x40_1000,
            256,
            access::REMOTE_WRITE,
        ),
    );
    w2.run();
    write_via(&mut w2, &src2, 3, 0x40_1010, 250, key2);
    let a2 = w2.a.cq;
    assert_eq!(
        statuses(&mut w2, a2),
        vec![(3, WcStatus::RemAccessErr, WcOpcode::RdmaWrite)]
    );
    assert_eq!(w2.get(&mr2, 0x40_1010, 250), vec![0; 250]);
    // The window's previous key names nothing.
    let (mut w3, mr3, src3, mw3, rkey3) = window_world(vrnic_proto::MW_TYPE_2);
    w3.send(
        false,
        bind(
            1,
            mw3,
            inc(rkey3),
            mr3.keys.lkey,
            0x40_1000,
            256,
            access::REMOTE_WRITE,
        ),
    );
    w3.run();
    write_via(&mut w3, &src3, 4, 0x40_1010, 8, rkey3);
    let a3 = w3.a.cq;
    assert_eq!(statuses(&mut w3, a3)[0].1, WcStatus::RemAccessErr);
    assert_eq!(w3.get(&mr3, 0x40_1010, 8), vec![0; 8]);
}

/// A window's access rights are its own: a write-only window refuses an RDMA READ (and an
/// atomic) though its MR could be read, and the MR's own key still needs the MR's rights.
#[test]
fn a_window_grants_only_the_access_it_was_bound_with() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    w.send(
        false,
        bind(
            1,
            mw,
            key,
            mr.keys.lkey,
            0x40_0000,
            4096,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    let s = vec![Sge {
        addr: 0x10_0000,
        length: 16,
        lkey: src.keys.lkey,
    }];
    w.send(true, wqe(2, SendOpcode::RdmaRead, s, 0x40_0000, key));
    w.run();
    let a = w.a.cq;
    assert_eq!(
        statuses(&mut w, a),
        vec![(2, WcStatus::RemAccessErr, WcOpcode::RdmaRead)]
    );
    assert_eq!(w.get(&src, 0x10_0000, 16), pattern(16, 9));
}

/// IB spec C10-73/C10-74: what a window needs of its MR is MW_BIND and, to grant remote write
/// or atomics, local write; no remote right of the MR's own. A window whose flags hold
/// LOCAL_WRITE beside REMOTE_WRITE (as rdma-core's `tests/test_mr.py` binds them) over an MR
/// of LOCAL_WRITE | MW_BIND binds, takes a write, and grants no read: LOCAL_WRITE gives a
/// window nothing remote. Over an MR with MW_BIND alone, a window granting read (LOCAL_WRITE
/// in its flags too) binds; one granting write does not.
#[test]
fn a_window_grants_remote_rights_its_mr_lacks_and_local_write_in_its_flags_grants_none() {
    for ty in [vrnic_proto::MW_TYPE_1, vrnic_proto::MW_TYPE_2] {
        let (mut w, mr, src, mw, rkey) = window_world(ty);
        let key = inc(rkey);
        let acc = access::LOCAL_WRITE | access::REMOTE_WRITE;
        w.send(false, bind(1, mw, key, mr.keys.lkey, 0x40_0000, 4096, acc));
        w.run();
        let b = w.b.cq;
        assert_eq!(
            statuses(&mut w, b),
            vec![(1, WcStatus::Success, WcOpcode::BindMw)],
            "type {ty}"
        );
        write_via(&mut w, &src, 2, 0x40_0100, 300, key);
        let a = w.a.cq;
        assert_eq!(
            statuses(&mut w, a),
            vec![(2, WcStatus::Success, WcOpcode::RdmaWrite)],
            "type {ty}"
        );
        assert_eq!(w.get(&mr, 0x40_0100, 300), pattern(300, 9), "type {ty}");
        let s = vec![Sge {
            addr: 0x10_0000,
            length: 16,
            lkey: src.keys.lkey,
        }];
        w.send(true, wqe(3, SendOpcode::RdmaRead, s, 0x40_0100, key));
        w.run();
        assert_eq!(
            statuses(&mut w, a),
            vec![(3, WcStatus::RemAccessErr, WcOpcode::RdmaRead)],
            "type {ty}: a read through a write-only window"
        );
    }
    // MW_BIND alone: a readable window binds, a writable one does not (C10-74).
    let (mut w, _, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_1);
    let bare = w.map(false, 0x60_0000, 4096, access::MW_BIND);
    w.set(&bare, 0x60_0000, &pattern(4096, 3));
    let key = inc(rkey);
    let acc = access::LOCAL_WRITE | access::REMOTE_READ;
    w.send(
        false,
        bind(1, mw, key, bare.keys.lkey, 0x60_0000, 4096, acc),
    );
    w.run();
    let b = w.b.cq;
    assert_eq!(
        statuses(&mut w, b),
        vec![(1, WcStatus::Success, WcOpcode::BindMw)]
    );
    let s = vec![Sge {
        addr: 0x10_0000,
        length: 64,
        lkey: src.keys.lkey,
    }];
    w.send(true, wqe(2, SendOpcode::RdmaRead, s, 0x60_0010, key));
    w.run();
    let a = w.a.cq;
    assert_eq!(
        statuses(&mut w, a),
        vec![(2, WcStatus::Success, WcOpcode::RdmaRead)]
    );
    assert_eq!(
        w.get(&src, 0x10_0000, 64),
        pattern(4096, 3)[0x10..0x50].to_vec()
    );
    w.send(
        false,
        bind(
            3,
            mw,
            inc(key),
            bare.keys.lkey,
            0x60_0000,
            64,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    assert_eq!(statuses(&mut w, b)[0].1, WcStatus::MwBindErr);
}

/// The bind checks of rxe's `rxe_check_bind_mw`, each failing with MW_BIND_ERR and the QP
/// in error: an MR without MW_BIND, a range past the MR, a writable window on an MR without
/// local write, a key whose index is not the window's, a type 2 window already bound, an
/// unknown access bit, and another context's window.
#[test]
fn binds_the_spec_forbids_fail_with_mw_bind_err() {
    type Case = Box<dyn Fn(&mut World, &Mapping, vrnic_proto::MwId, u32) -> SendWqe>;
    let cases: Vec<(&str, Case)> = vec![
        (
            "MR without MW_BIND",
            Box::new(|w, _, mw, rkey| {
                let plain = w.map(false, 0x60_0000, 4096, access::LOCAL_WRITE);
                bind(
                    9,
                    mw,
                    inc(rkey),
                    plain.keys.lkey,
                    0x60_0000,
                    64,
                    access::REMOTE_READ,
                )
            }),
        ),
        (
            "range past the MR",
            Box::new(|_, mr, mw, rkey| {
                bind(
                    9,
                    mw,
                    inc(rkey),
                    mr.keys.lkey,
                    0x40_1000,
                    8192,
                    access::REMOTE_READ,
                )
            }),
        ),
        (
            "writable window, MR without local write",
            Box::new(|w, _, mw, rkey| {
                let ro = w.map(false, 0x60_0000, 4096, access::MW_BIND);
                bind(
                    9,
                    mw,
                    inc(rkey),
                    ro.keys.lkey,
                    0x60_0000,
                    64,
                    access::REMOTE_WRITE,
                )
            }),
        ),
        (
            "another window's key index",
            Box::new(|_, mr, mw, rkey| {
                bind(
                    9,
                    mw,
                    rkey ^ 0x100,
                    mr.keys.lkey,
                    0x40_0000,
                    64,
                    access::REMOTE_READ,
                )
            }),
        ),
        (
            "unknown access bit",
            Box::new(|_, mr, mw, rkey| {
                bind(
                    9,
                    mw,
                    inc(rkey),
                    mr.keys.lkey,
                    0x40_0000,
                    64,
                    access::ZERO_BASED,
                )
            }),
        ),
        (
            "another context's window",
            Box::new(|w, mr, _, _| {
                let (other, orkey) = w.e.alloc_mw(w.a.ctx, w.a.pd, 2).unwrap();
                bind(
                    9,
                    other,
                    inc(orkey),
                    mr.keys.lkey,
                    0x40_0000,
                    64,
                    access::REMOTE_READ,
                )
            }),
        ),
    ];
    for (what, make) in cases {
        let (mut w, mr, _, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
        let bad = make(&mut w, &mr, mw, rkey);
        w.send(false, bad);
        w.run();
        let b = w.b.cq;
        let got = statuses(&mut w, b);
        assert_eq!(
            got.first().map(|c| (c.1, c.2)),
            Some((WcStatus::MwBindErr, WcOpcode::BindMw)),
            "{what}: {got:?}"
        );
    }
    // A bound type 2 window cannot be bound again before it is invalidated.
    let (mut w, mr, _, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    w.send(
        false,
        bind(1, mw, key, mr.keys.lkey, 0x40_0000, 64, access::REMOTE_READ),
    );
    w.send(
        false,
        bind(
            2,
            mw,
            inc(key),
            mr.keys.lkey,
            0x40_0000,
            64,
            access::REMOTE_READ,
        ),
    );
    w.run();
    let b = w.b.cq;
    assert_eq!(
        statuses(&mut w, b),
        vec![
            (1, WcStatus::Success, WcOpcode::BindMw),
            (2, WcStatus::MwBindErr, WcOpcode::BindMw)
        ]
    );
    assert_eq!(w.e.mw_rkey(mw), Some(key));
}

/// LOCAL_INV frees a type 2 window: its key fails afterwards, it may be bound again (with a
/// new key, which works); LOCAL_INV of a type 1 window, of an unbound one or of an MR's key
/// fails with LOC_QP_OP_ERR.
#[test]
fn local_invalidation_frees_a_type2_window_and_refuses_the_rest() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let k1 = inc(rkey);
    let acc = access::REMOTE_WRITE;
    w.send(false, bind(1, mw, k1, mr.keys.lkey, 0x40_0000, 4096, acc));
    w.send(false, inv(2, SendOpcode::LocalInv, vec![], k1));
    let k2 = inc(k1);
    w.send(false, bind(3, mw, k2, mr.keys.lkey, 0x40_0000, 4096, acc));
    w.run();
    let b = w.b.cq;
    assert_eq!(
        statuses(&mut w, b),
        vec![
            (1, WcStatus::Success, WcOpcode::BindMw),
            (2, WcStatus::Success, WcOpcode::LocalInv),
            (3, WcStatus::Success, WcOpcode::BindMw)
        ]
    );
    write_via(&mut w, &src, 4, 0x40_0000, 32, k2);
    let a = w.a.cq;
    assert_eq!(statuses(&mut w, a)[0].1, WcStatus::Success);
    assert_eq!(w.get(&mr, 0x40_0000, 32), pattern(32, 9));
    // Invalidated: the key no longer works.
    w.send(false, inv(5, SendOpcode::LocalInv, vec![], k2));
    w.run();
    write_via(&mut w, &src, 6, 0x40_0100, 32, k2);
    assert_eq!(statuses(&mut w, a)[0].1, WcStatus::RemAccessErr);
    assert_eq!(w.get(&mr, 0x40_0100, 32), vec![0; 32]);
    for (what, ty, bound) in [
        ("type 1", 1, true),
        ("unbound type 2", 2, false),
        ("an MR key", 0, false),
    ] {
        let (mut w, mr, _, mw, rkey) = window_world(if ty == 1 { 1 } else { 2 });
        let key = inc(rkey);
        if bound {
            w.send(
                false,
                bind(1, mw, key, mr.keys.lkey, 0x40_0000, 64, access::REMOTE_READ),
            );
        }
        let target = if ty == 0 { mr.keys.rkey } else { key };
        w.send(false, inv(2, SendOpcode::LocalInv, vec![], target));
        w.run();
        let b = w.b.cq;
        let got = statuses(&mut w, b);
        assert_eq!(
            got.last().map(|c| (c.0, c.1, c.2)),
            Some((2, WcStatus::LocQpOpErr, WcOpcode::LocalInv)),
            "{what}: {got:?}"
        );
    }
}

/// SEND with Invalidate: the receive completes with IBV_WC_WITH_INV and the invalidated key,
/// and the window is free (its key fails); a key naming no window bound to the receiving QP
/// fails the receive with REM_INV_REQ_ERR and the requester with REM_INV_REQ_ERR.
#[test]
fn send_with_invalidate_frees_the_window_bound_to_the_receiving_qp() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    let dst = w.map(false, 0x50_0000, 4096, access::LOCAL_WRITE);
    w.send(
        false,
        bind(
            1,
            mw,
            key,
            mr.keys.lkey,
            0x40_0000,
            4096,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    let s = |n| {
        vec![Sge {
            addr: 0x10_0000,
            length: n,
            lkey: src.keys.lkey,
        }]
    };
    let r = vec![Sge {
        addr: 0x50_0000,
        length: 4096,
        lkey: dst.keys.lkey,
    }];
    w.recv(false, 10, r.clone());
    w.send(true, inv(2, SendOpcode::SendWithInv, s(100), key));
    w.run();
    let (a, b) = (w.a.cq, w.b.cq);
    let all = w.cqes();
    let sent: Vec<(u64, WcStatus)> = all
        .iter()
        .filter(|(c, _)| *c == a)
        .map(|(_, x)| (x.wr_id, x.status))
        .collect();
    assert_eq!(sent, vec![(2, WcStatus::Success)]);
    let recv: Vec<Cqe> = all
        .into_iter()
        .filter(|(c, x)| *c == b && x.opcode == WcOpcode::Recv)
        .map(|(_, c)| c)
        .collect();
    assert_eq!(recv.len(), 1);
    let c = &recv[0];
    assert_eq!(
        (c.wr_id, c.status, c.byte_len),
        (10, WcStatus::Success, 100)
    );
    assert_eq!(
        c.wc_flags & vrnic_wire::WC_WITH_INV,
        vrnic_wire::WC_WITH_INV
    );
    assert_eq!(c.imm_data, key);
    assert_eq!(w.get(&dst, 0x50_0000, 100), pattern(100, 9));
    write_via(&mut w, &src, 3, 0x40_0000, 8, key);
    let got = statuses(&mut w, a);
    assert_eq!(got[0], (3, WcStatus::RemAccessErr, WcOpcode::RdmaWrite));
    assert_eq!(w.get(&mr, 0x40_0000, 8), vec![0; 8]);
    // An unbound key: both sides fail.
    let (mut w, _, src, _, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let dst = w.map(false, 0x50_0000, 4096, access::LOCAL_WRITE);
    let r = vec![Sge {
        addr: 0x50_0000,
        length: 4096,
        lkey: dst.keys.lkey,
    }];
    w.recv(false, 10, r);
    let s1 = vec![Sge {
        addr: 0x10_0000,
        length: 10,
        lkey: src.keys.lkey,
    }];
    w.send(true, inv(2, SendOpcode::SendWithInv, s1, rkey));
    w.run();
    let all = w.cqes();
    let b = w.b.cq;
    let recv = all.iter().find(|(c, x)| *c == b && x.wr_id == 10).unwrap();
    assert_eq!(recv.1.status, WcStatus::RemInvReqErr);
    let a = w.a.cq;
    let sent = all.iter().find(|(c, x)| *c == a && x.wr_id == 2).unwrap();
    assert_eq!(sent.1.status, WcStatus::RemInvReqErr);
}

/// Type 1: any QP of the window's PD may use it; a bind moves it (the old range and key
/// fail), a zero-length bind unbinds it. Its MR cannot be deregistered or reregistered while
/// it is bound; deallocating the window releases the MR.
#[test]
fn a_type1_window_rebinds_unbinds_and_pins_its_mr() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_1);
    let k1 = inc(rkey);
    w.send(
        false,
        bind(1, mw, k1, mr.keys.lkey, 0x40_0000, 64, access::REMOTE_WRITE),
    );
    w.run();
    assert_eq!(w.e.dereg_mr(w.b.ctx, mr.keys.mr), Err(22));
    assert_eq!(
        w.e.rereg_mr(w.b.ctx, mr.keys.mr, None, Some(access::LOCAL_WRITE)),
        Err(22)
    );
    write_via(&mut w, &src, 2, 0x40_0000, 64, k1);
    let k2 = inc(k1);
    w.send(
        false,
        bind(3, mw, k2, mr.keys.lkey, 0x40_1000, 64, access::REMOTE_WRITE),
    );
    w.run();
    write_via(&mut w, &src, 4, 0x40_1000, 64, k2);
    let (a, b) = (w.a.cq, w.b.cq);
    let all: Vec<(CqId, u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(c, x)| (c, x.wr_id, x.status))
        .collect();
    let ok = WcStatus::Success;
    assert_eq!(all, vec![(b, 1, ok), (a, 2, ok), (b, 3, ok), (a, 4, ok)]);
    assert_eq!(w.get(&mr, 0x40_0000, 64), pattern(64, 9));
    assert_eq!(w.get(&mr, 0x40_1000, 64), pattern(64, 9));
    // Unbind (length 0): the MR is free again.
    w.send(false, bind(5, mw, inc(k2), 0, 0, 0, 0));
    w.run();
    assert_eq!(statuses(&mut w, b)[0].1, WcStatus::Success);
    assert_eq!(w.e.dealloc_pd(w.b.ctx, w.b.pd), Err(16));
    assert_eq!(w.e.dealloc_mw(w.a.ctx, mw), Err(22));
    assert_eq!(w.e.dealloc_mw(w.b.ctx, mw), Ok(()));
    assert_eq!(w.e.dereg_mr(w.b.ctx, mr.keys.mr), Ok(()));
    // Bound again then deallocated: the MR is released too.
    let (mut w, mr, _, mw, rkey) = window_world(vrnic_proto::MW_TYPE_1);
    w.send(
        false,
        bind(
            1,
            mw,
            inc(rkey),
            mr.keys.lkey,
            0x40_0000,
            64,
            access::REMOTE_READ,
        ),
    );
    w.run();
    assert_eq!(w.e.dereg_mr(w.b.ctx, mr.keys.mr), Err(22));
    w.e.dealloc_mw(w.b.ctx, mw).unwrap();
    assert_eq!(w.e.dereg_mr(w.b.ctx, mr.keys.mr), Ok(()));
}

/// A window's key is checked against the responder QP: a type 2 window bound to one QP is
/// refused to the peer of another QP of the same PD; a window of another PD is refused.
#[test]
fn a_window_serves_only_its_pd_and_its_type2_qp() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    // Bind on a second QP pair (b2 <-> a2), not on b.qp.
    let cap = QpCap {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let (b2, b2n) =
        w.e.create_qp(w.b.ctx, w.b.pd, w.b.cq, w.b.cq, QpType::Rc, cap, false)
            .unwrap();
    let (a2, a2n) =
        w.e.create_qp(w.a.ctx, w.a.pd, w.a.cq, w.a.cq, QpType::Rc, cap, false)
            .unwrap();
    let sb2 = Side {
        qp: b2,
        qpn: b2n,
        ..w.b
    };
    let sa2 = Side {
        qp: a2,
        qpn: a2n,
        ..w.a
    };
    to_rts(&mut w.e, w.now, &sb2, a2n, w.a.lid, access::REMOTE_WRITE, 7);
    to_rts(&mut w.e, w.now, &sa2, b2n, w.b.lid, access::REMOTE_WRITE, 7);
    w.e.handle_send_wqe(
        w.now,
        b2,
        Ok(bind(
            1,
            mw,
            key,
            mr.keys.lkey,
            0x40_0000,
            4096,
            access::REMOTE_WRITE,
        )),
    );
    w.run();
    // Through a <-> b (not the window's QP): refused.
    write_via(&mut w, &src, 2, 0x40_0000, 16, key);
    let a = w.a.cq;
    let got = statuses(&mut w, a);
    assert_eq!(
        got.iter().find(|c| c.0 == 2).map(|c| c.1),
        Some(WcStatus::RemAccessErr)
    );
    assert_eq!(w.get(&mr, 0x40_0000, 16), vec![0; 16]);
    // Through a2 <-> b2: allowed.
    let s = vec![Sge {
        addr: 0x10_0000,
        length: 16,
        lkey: src.keys.lkey,
    }];
    w.e.handle_send_wqe(
        w.now,
        a2,
        Ok(wqe(3, SendOpcode::RdmaWrite, s, 0x40_0000, key)),
    );
    w.run();
    let got = statuses(&mut w, a);
    assert_eq!(
        got.iter().find(|c| c.0 == 3).map(|c| c.1),
        Some(WcStatus::Success)
    );
    assert_eq!(w.get(&mr, 0x40_0000, 16), pattern(16, 9));
    // Destroying b2 frees the window: its key fails even through a new QP.
    w.e.destroy_qp(w.now, w.b.ctx, b2).unwrap();
    assert_eq!(w.e.dereg_mr(w.b.ctx, mr.keys.mr), Ok(()));
    // A type 1 window of another PD than the responder QP's is refused.
    let (mut w, mr, src, _, _) = window_world(vrnic_proto::MW_TYPE_1);
    let pd2 = w.e.alloc_pd(w.b.vnic, w.b.ctx).unwrap();
    let (mw2, rk2) = w.e.alloc_mw(w.b.ctx, pd2, 1).unwrap();
    let mr2 =
        w.e.reg_mr(
            w.b.ctx,
            pd2,
            0x40_0000,
            4096,
            0x40_0000,
            access::LOCAL_WRITE | access::MW_BIND,
            &per_page(&mr.pages[..1]),
        )
        .unwrap();
    w.send(
        false,
        bind(
            1,
            mw2,
            inc(rk2),
            mr2.lkey,
            0x40_0000,
            4096,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    let b = w.b.cq;
    assert_eq!(statuses(&mut w, b)[0].1, WcStatus::Success);
    write_via(&mut w, &src, 2, 0x40_0000, 16, inc(rk2));
    let a = w.a.cq;
    assert_eq!(statuses(&mut w, a)[0].1, WcStatus::RemAccessErr);
    assert_eq!(w.get(&mr, 0x40_0000, 16), vec![0; 16]);
}

/// Two vRNICs, `a` in group `ga` and `b` in `gb`, with a QP each of `ty` (RC ones taken to
/// RTS towards each other).
fn grouped(ga: GroupId, gb: GroupId, ty: QpType) -> World {
    let mut e = Engine::new(3);
    let a = side_in(&mut e, 1, 10, ty, 16, ga);
    let b = side_in(&mut e, 2, 20, ty, 16, gb);
    let now = Instant::now();
    if ty == QpType::Rc {
        to_rts(&mut e, now, &a, b.qpn, b.lid, access::REMOTE_WRITE, 7);
        to_rts(&mut e, now, &b, a.qpn, a.lid, access::REMOTE_WRITE, 7);
    }
    let mem = VecMem(
        [(a.vnic, vec![0u8; REGION]), (b.vnic, vec![0u8; REGION])]
            .into_iter()
            .collect(),
    );
    World { e, mem, now, a, b }
}

/// Two vRNICs in different groups: an RC connection between them behaves as one to a peer
/// that does not exist (the SEND is retried, then fails with `RETRY_EXC_ERR`, and nothing
/// lands), a UD datagram through an AH is dropped (the sender completes, the receiver gets
/// nothing), and each refusal is kept for the daemon's log with both ends and both groups.
#[test]
fn routes_across_groups_are_refused_as_if_the_peer_did_not_exist() {
    let mut w = grouped(GroupId(1), GroupId(2), QpType::Rc);
    let (a, b) = (&w.a, &w.b);
    let (refusals, n) = w.e.take_refusals();
    assert_eq!(n, 2, "both RTRs were refused");
    assert_eq!(
        refusals[0],
        vrnic_proto::Refusal {
            from: a.vnic,
            from_group: GroupId(1),
            to: Refused::Local(b.vnic),
            to_group: GroupId(2),
        }
    );
    assert_eq!(w.e.take_refusals().1, 0, "taken once");
    let dst = w.map(false, 0x20_0000, 4096, access::LOCAL_WRITE);
    w.recv(false, 9, vec![sge(0x20_0000, 4096, dst.keys.lkey)]);
    w.send(
        true,
        SendWqe {
            payload: SendPayload::Inline(smallvec::smallvec![7; 32]),
            ..wqe(1, SendOpcode::Send, vec![], 0, 0)
        },
    );
    w.run();
    w.advance(Duration::from_secs(2));
    let c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        c,
        vec![(1, WcStatus::RetryExcErr)],
        "the receive stays posted"
    );
    assert_eq!(w.get(&dst, 0x20_0000, 32), vec![0; 32], "nothing landed");

    // UD: an AH to the other group's vRNIC is made (as for any unreachable address), and what
    // is sent through it is dropped.
    let mut w = grouped(GroupId(1), GroupId(2), QpType::Ud);
    ud_ready(&mut w, true, 0x11);
    ud_ready(&mut w, false, 0x11);
    let dst = w.map(false, 0x20_0000, 8192, access::LOCAL_WRITE);
    w.recv(false, 5, vec![sge(0x20_0000, 8192, dst.keys.lkey)]);
    let ah =
        w.e.create_ah(
            w.a.ctx,
            w.a.pd,
            AhAttr {
                dlid: 20,
                port_num: 1,
                ..Default::default()
            },
        )
        .unwrap();
    let mut s = wqe(2, SendOpcode::Send, vec![], 0, 0);
    s.payload = SendPayload::Inline(smallvec::smallvec![3; 16]);
    s.ud = vrnic_wire::UdAddr {
        ah: ah.0,
        remote_qpn: w.b.qpn,
        remote_qkey: 0x11,
    };
    w.send(true, s);
    w.run();
    let c: Vec<(CqId, u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(cq, c)| (cq, c.wr_id, c.status))
        .collect();
    assert_eq!(
        c,
        vec![(w.a.cq, 2, WcStatus::Success)],
        "the sender completes, the receiver gets nothing"
    );
    assert_eq!(w.get(&dst, 0x20_0000 + 40, 16), vec![0; 16]);
    let (r, _) = w.e.take_refusals();
    assert_eq!(r.len(), 1);
    assert_eq!((r[0].from, r[0].to), (w.a.vnic, Refused::Local(w.b.vnic)));
}

/// The same two vRNICs in one group reach each other: groups refuse only across.
#[test]
fn routes_within_a_group_work() {
    let mut w = grouped(GroupId(7), GroupId(7), QpType::Rc);
    assert_eq!(w.e.take_refusals().1, 0);
    let dst = w.map(false, 0x20_0000, 4096, access::LOCAL_WRITE);
    w.recv(false, 9, vec![sge(0x20_0000, 4096, dst.keys.lkey)]);
    w.send(
        true,
        SendWqe {
            payload: SendPayload::Inline(smallvec::smallvec![7; 32]),
            ..wqe(1, SendOpcode::Send, vec![], 0, 0)
        },
    );
    w.run();
    let mut c: Vec<(u64, WcStatus)> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    c.sort_by_key(|&(id, _)| id);
    assert_eq!(c, vec![(1, WcStatus::Success), (9, WcStatus::Success)]);
    assert_eq!(w.get(&dst, 0x20_0000, 32), vec![7; 32]);
}

// ---- the responder's translation, kept between messages ---------------------------------------

/// A requester that walks a buffer with short writes (as perftest does) reuses the responder's
/// last check and translation, which reach past each message to the end of what the R_Key
/// grants: every byte lands where it should, and a message that then runs past the MR's end
/// still fails with REM_ACCESS_ERR and writes nothing.
#[test]
fn short_writes_walking_a_buffer_land_exactly_and_one_past_the_mr_still_fails() {
    let mut w = World::new();
    let acc = access::LOCAL_WRITE | access::REMOTE_WRITE;
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    let dst = w.map(false, 0x9000, 4096, acc);
    w.set(&src, 0x1000, &pattern(4096, 3));
    for i in 0..200u64 {
        let s = vec![sge(0x1000 + 2 * i, 2, src.keys.lkey)];
        w.send(
            true,
            wqe(i, SendOpcode::RdmaWrite, s, 0x9000 + 2 * i, dst.keys.rkey),
        );
        w.run();
    }
    let a_cq = w.a.cq;
    let done = statuses(&mut w, a_cq);
    assert_eq!(done.len(), 200);
    assert!(done.iter().all(|c| c.1 == WcStatus::Success), "{done:?}");
    assert_eq!(w.get(&dst, 0x9000, 400), pattern(4096, 3)[..400].to_vec());
    assert_eq!(w.get(&dst, 0x9000 + 400, 3696), vec![0; 3696]);
    // 64 bytes from 10 before the MR's end: past it.
    let s = vec![sge(0x1000, 64, src.keys.lkey)];
    w.send(
        true,
        wqe(
            999,
            SendOpcode::RdmaWrite,
            s,
            0x9000 + 4096 - 10,
            dst.keys.rkey,
        ),
    );
    w.run();
    assert_eq!(
        statuses(&mut w, a_cq),
        vec![(999, WcStatus::RemAccessErr, WcOpcode::RdmaWrite)]
    );
    assert_eq!(w.get(&dst, 0x9000 + 4096 - 10, 10), vec![0; 10]);
}

/// Through a window, what a check grants ends at the window's end, not its MR's: after a
/// write at the window's start, a write just past its end (inside the MR) still fails.
#[test]
fn a_write_just_past_a_window_after_one_inside_it_fails() {
    let (mut w, mr, src, mw, rkey) = window_world(vrnic_proto::MW_TYPE_2);
    let key = inc(rkey);
    let a_cq = w.a.cq;
    w.send(
        false,
        bind(
            1,
            mw,
            key,
            mr.keys.lkey,
            0x40_1000,
            256,
            access::REMOTE_WRITE,
        ),
    );
    w.run();
    write_via(&mut w, &src, 2, 0x40_1000, 2, key);
    assert_eq!(
        statuses(&mut w, a_cq),
        vec![(2, WcStatus::Success, WcOpcode::RdmaWrite)]
    );
    write_via(&mut w, &src, 3, 0x40_1100, 2, key);
    assert_eq!(
        statuses(&mut w, a_cq),
        vec![(3, WcStatus::RemAccessErr, WcOpcode::RdmaWrite)]
    );
    assert_eq!(w.get(&mr, 0x40_1000, 2), pattern(2, 9));
    assert_eq!(w.get(&mr, 0x40_1100, 2), vec![0, 0]);
}

/// A requester walking its source buffer reuses what its key's check granted around the last
/// SGE, and anything outside that grant is checked as before: bytes land exactly across pages
/// (mapped out of order) and a 64 KiB boundary; a READ into the same MR, which lacks
/// LOCAL_WRITE, fails with LOC_PROT_ERR; an SGE running past the MR's end fails; after the MR
/// is deregistered, its lkey fails. Each failure moves no byte.
#[test]
fn a_requester_walking_its_buffer_is_checked_past_what_its_key_granted() {
    const BASE: u64 = 0x1_0000 - 8192;
    const LEN: u64 = 4 * 4096;
    let setup = || {
        let mut w = World::new();
        let src = w.map(true, BASE, LEN, 0);
        let dst = w.map(
            false,
            0x9000,
            LEN,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
        );
        w.set(&src, BASE, &pattern(LEN as usize, 5));
        (w, src, dst)
    };
    let walk = |w: &mut World, src: &Mapping, dst: &Mapping| {
        for i in 0..400u64 {
            let s = vec![sge(BASE + 40 * i, 40, src.keys.lkey)];
            w.send(
                true,
                wqe(i, SendOpcode::RdmaWrite, s, 0x9000 + 40 * i, dst.keys.rkey),
            );
            w.run();
        }
        let a_cq = w.a.cq;
        let done = statuses(w, a_cq);
        assert_eq!(done.len(), 400);
        assert!(done.iter().all(|c| c.1 == WcStatus::Success), "{done:?}");
        assert_eq!(
            w.get(dst, 0x9000, 16000),
            pattern(LEN as usize, 5)[..16000].to_vec()
        );
    };
    let fails = |w: &mut World, dst: &Mapping, s: Sge, op: SendOpcode, want: WcStatus| {
        let before = w.get(dst, 0x9000, LEN as usize);
        w.send(true, wqe(999, op, vec![s], 0x9000, dst.keys.rkey));
        w.run();
        let a_cq = w.a.cq;
        assert_eq!(statuses(w, a_cq), vec![(999, want, op.wc_opcode())]);
        assert_eq!(w.get(dst, 0x9000, LEN as usize), before);
    };

    let (mut w, src, dst) = setup();
    walk(&mut w, &src, &dst);
    let s = sge(BASE + 80, 8, src.keys.lkey);
    fails(&mut w, &dst, s, SendOpcode::RdmaRead, WcStatus::LocProtErr);

    let (mut w, src, dst) = setup();
    walk(&mut w, &src, &dst);
    let s = sge(BASE + LEN - 10, 64, src.keys.lkey);
    fails(&mut w, &dst, s, SendOpcode::RdmaWrite, WcStatus::LocProtErr);

    let (mut w, src, dst) = setup();
    walk(&mut w, &src, &dst);
    assert_eq!(w.e.dereg_mr(w.a.ctx, src.keys.mr), Ok(()));
    let s = sge(BASE + 80, 8, src.keys.lkey);
    fails(&mut w, &dst, s, SendOpcode::RdmaWrite, WcStatus::LocProtErr);
}

/// Engines given the classes of one QP number space (`set_qpn_space`, as a daemon's engine
/// threads are) never hand out the same number, and each number names its engine: it is the
/// engine's offset modulo the stride. A QP destroyed frees its number for its own engine only.
#[test]
fn engines_sharing_a_qpn_space_give_out_disjoint_numbers_of_their_class() {
    let stride = 3;
    let mut seen = std::collections::HashSet::new();
    for offset in 0..stride {
        let mut e = Engine::new(u64::from(offset) + 1);
        e.set_qpn_space(offset, stride);
        let s = side(&mut e, 1, 1);
        let cap = QpCap {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut qpns = vec![s.qpn];
        for _ in 0..20 {
            let (_, qpn) = e
                .create_qp(s.ctx, s.pd, s.cq, s.cq, QpType::Rc, cap, false)
                .unwrap();
            qpns.push(qpn);
        }
        for &q in &qpns {
            assert_eq!(q % stride, offset, "QPN {q:#x} of engine {offset}");
            assert!((0x11..=0xff_ffff).contains(&q), "QPN {q:#x}");
            assert!(seen.insert(q), "QPN {q:#x} given twice");
        }
        assert_eq!(qpns[0], 0x11 + (offset + stride - 0x11 % stride) % stride);
    }
}

// ---- memory the daemon cannot reach ---------------------------------------------------------

/// A copy the daemon cannot make (a region its tenant truncated: here, the responder's vRNIC
/// has no memory behind it) completes its work request with an error, never success: a SEND
/// gets `REM_OP_ERR` and its receive `GENERAL_ERR`; a WRITE and an atomic `REM_OP_ERR`; a READ
/// whose own buffer cannot be written, `GENERAL_ERR`.
#[test]
fn a_copy_the_daemon_cannot_make_completes_with_an_error_never_success() {
    let cases = [
        (SendOpcode::Send, WcStatus::RemOpErr, true),
        (SendOpcode::RdmaWrite, WcStatus::RemOpErr, true),
        (SendOpcode::AtomicFetchAndAdd, WcStatus::RemOpErr, true),
        (SendOpcode::RdmaRead, WcStatus::GeneralErr, false),
    ];
    for (op, want, responder_gone) in cases {
        let mut w = World::new();
        let all = access::LOCAL_WRITE
            | access::REMOTE_WRITE
            | access::REMOTE_READ
            | access::REMOTE_ATOMIC;
        let src = w.map(true, 0x10_0000, 4096, all);
        let dst = w.map(false, 0x20_0000, 4096, all);
        w.recv(false, 9, vec![sge(0x20_0000, 4096, dst.keys.lkey)]);
        let len = if op == SendOpcode::AtomicFetchAndAdd {
            8
        } else {
            64
        };
        w.send(
            true,
            wqe(
                1,
                op,
                vec![sge(0x10_0000, len, src.keys.lkey)],
                0x20_0000,
                dst.keys.rkey,
            ),
        );
        // The side whose memory is gone: the responder's, or (READ) the requester's own.
        let gone = if responder_gone { w.b.vnic } else { w.a.vnic };
        let kept = w.mem.0.remove(&gone).expect("a region");
        w.run();
        w.mem.0.insert(gone, kept);
        let c = w.cqes();
        let send = c
            .iter()
            .find(|(cq, _)| *cq == w.a.cq)
            .expect("a send completion")
            .1;
        assert_eq!((send.wr_id, send.status), (1, want), "{op:?}");
        if op == SendOpcode::Send {
            let recv = c
                .iter()
                .find(|(cq, _)| *cq == w.b.cq)
                .expect("the receive")
                .1;
            assert_eq!((recv.wr_id, recv.status), (9, WcStatus::GeneralErr));
        }
        assert!(
            c.iter().all(|(_, x)| x.status != WcStatus::Success),
            "{op:?}: nothing completes with success: {c:?}"
        );
    }
}

// ---- ATOMIC WRITE (IBA 1.5) -----------------------------------------------------------------

/// An ATOMIC WRITE work request as the driver's `ibv_wr_atomic_write` writes it: its 8 bytes
/// inline.
fn atomic_write(wr_id: u64, data: [u8; 8], remote_addr: u64, rkey: u32) -> SendWqe {
    let mut w = wqe(wr_id, SendOpcode::AtomicWrite, vec![], remote_addr, rkey);
    w.flags = SendFlags::SIGNALED | SendFlags::INLINE;
    w.payload = SendPayload::Inline(data.as_slice().into());
    w
}

/// Records the engine's atomic stores, and refuses to let it write the word any other way.
struct Stores<'a> {
    inner: &'a mut VecMem,
    word: Loc,
    stores: Vec<(Loc, [u8; 8])>,
}

impl Memory for Stores<'_> {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        self.inner.copy(src, dst, len)
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        let hits = dst.vnic == self.word.vnic
            && dst.off < self.word.off + 8
            && self.word.off < dst.off + data.len() as u64;
        assert!(!hits, "the word written by a plain write at {dst:?}");
        self.inner.write(dst, data)
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        self.inner.read(src, out)
    }
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        self.stores.push((dst, value));
        self.inner.store_u64(dst, value)
    }
}

impl World {
    /// Runs the engine over a [`Stores`] watching the word at `a` of `m`; returns its stores.
    fn run_watching(&mut self, m: &Mapping, a: u64) -> Vec<(Loc, [u8; 8])> {
        let (vnic, off) = self.loc(m, a);
        let mut mem = Stores {
            inner: &mut self.mem,
            word: Loc {
                vnic,
                off: off as u64,
            },
            stores: Vec::new(),
        };
        for _ in 0..1000 {
            if !self.e.process(self.now, &mut mem) {
                break;
            }
        }
        mem.stores
    }
}

/// ATOMIC WRITE stores its 8 bytes at the responder by one atomic store (never a plain
/// write), touches nothing around them, and completes `IBV_WC_ATOMIC_WRITE` with 8 bytes; a
/// WRITE posted before it has landed by then.
#[test]
fn an_atomic_write_lands_its_eight_bytes_by_one_atomic_store() {
    let mut w = World::new();
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
    w.set(&dst, 0x9000 + 0x100, &[0xee; 24]);
    w.set(&src, 0x1000, &pattern(64, 3));
    w.send(
        true,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 64, src.keys.lkey)],
            0x9000 + 0x200,
            dst.keys.rkey,
        ),
    );
    let data = 0x1122_3344_5566_7788u64.to_le_bytes();
    w.send(true, atomic_write(2, data, 0x9000 + 0x108, dst.keys.rkey));
    let stores = w.run_watching(&dst, 0x9000 + 0x108);
    let (vnic, off) = w.loc(&dst, 0x9000 + 0x108);
    assert_eq!(
        stores,
        vec![(
            Loc {
                vnic,
                off: off as u64
            },
            data
        )]
    );
    assert_eq!(w.get(&dst, 0x9000 + 0x100, 8), [0xee; 8]);
    assert_eq!(w.get(&dst, 0x9000 + 0x108, 8), data);
    assert_eq!(w.get(&dst, 0x9000 + 0x110, 8), [0xee; 8]);
    assert_eq!(w.get(&dst, 0x9000 + 0x200, 64), pattern(64, 3));
    let c: Vec<_> = w
        .cqes()
        .into_iter()
        .map(|(_, c)| (c.wr_id, c.status, c.opcode, c.byte_len))
        .collect();
    assert_eq!(
        c,
        vec![
            (1, WcStatus::Success, WcOpcode::RdmaWrite, 64),
            (2, WcStatus::Success, WcOpcode::AtomicWrite, 8),
        ]
    );
    assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Rts));
}

/// The access an ATOMIC WRITE needs is remote *write* (rxe's `check_rkey`): an MR or a QP
/// granting remote atomics and reads but not writes refuses it with `REM_ACCESS_ERR`, and the
/// word is untouched.
#[test]
fn an_atomic_write_needs_remote_write_on_the_mr_and_the_qp() {
    let no_write = access::REMOTE_ATOMIC | access::REMOTE_READ;
    for (mr_access, qp_access) in [
        (
            access::LOCAL_WRITE | no_write,
            no_write | access::REMOTE_WRITE,
        ),
        (
            access::LOCAL_WRITE | access::REMOTE_WRITE | no_write,
            no_write,
        ),
    ] {
        let mut w = World::with(qp_access, 7);
        let dst = w.map(false, 0x9000, 4096, mr_access);
        w.set(&dst, 0x9000 + 0x40, &[0xee; 8]);
        w.send(true, atomic_write(1, [7; 8], 0x9000 + 0x40, dst.keys.rkey));
        let stores = w.run_watching(&dst, 0x9000 + 0x40);
        assert!(stores.is_empty(), "{mr_access:#x} {qp_access:#x}");
        assert_eq!(w.get(&dst, 0x9000 + 0x40, 8), [0xee; 8]);
        let c: Vec<_> = w
            .cqes()
            .into_iter()
            .map(|(_, c)| (c.wr_id, c.status))
            .collect();
        assert_eq!(c, vec![(1, WcStatus::RemAccessErr)]);
        assert_eq!(w.e.qp_state(w.a.qp), Some(QpState::Err));
        assert_eq!(w.e.qp_state(w.b.qp), Some(QpState::Err));
    }
}

/// A misaligned ATOMIC WRITE is an invalid request (rxe: `RESPST_ERR_MISALIGNED_ATOMIC`, class
/// C): `REM_INV_REQ_ERR` and nothing stored. The R_Key is checked first: a misaligned word
/// that also runs past the MR is a remote access error.
#[test]
fn a_misaligned_atomic_write_is_rem_inv_req_err_after_the_rkey_check() {
    for (at, want) in [
        (0x9000 + 0x44, WcStatus::RemInvReqErr),
        (0x9000 + 0x41, WcStatus::RemInvReqErr),
        // Crosses a page of the MR: still one MR, still misaligned.
        (0x9000 + 4092, WcStatus::RemInvReqErr),
        (0x9000 + 8188, WcStatus::RemAccessErr),
        (0x9000 + 8192, WcStatus::RemAccessErr),
    ] {
        let mut w = World::new();
        let dst = w.map(
            false,
            0x9000,
            8192,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
        );
        w.send(true, atomic_write(1, [7; 8], at, dst.keys.rkey));
        let stores = w.run_watching(&dst, 0x9000);
        assert!(stores.is_empty(), "{at:#x}");
        assert_eq!(w.get(&dst, 0x9000, 8192), vec![0; 8192], "{at:#x}");
        let c: Vec<_> = w
            .cqes()
            .into_iter()
            .map(|(_, c)| (c.wr_id, c.status))
            .collect();
        assert_eq!(c, vec![(1, want)], "{at:#x}");
    }
}

/// An ATOMIC WRITE slot that does not carry exactly 8 inline bytes (the driver never writes
/// one) is a malformed work request: `LOC_QP_OP_ERR`, nothing sent. On UC, which has no
/// acknowledgements, ATOMIC WRITE does not exist: `LOC_QP_OP_ERR` too.
#[test]
fn an_atomic_write_without_eight_inline_bytes_or_on_uc_is_loc_qp_op_err() {
    // Eight bytes gathered from an SGE instead of carried inline.
    fails_locally(World::new(), |w, rkey| {
        let src = w.map(true, 0x1000, 4096, access::LOCAL_WRITE);
        wqe(
            1,
            SendOpcode::AtomicWrite,
            vec![sge(0x1000, 8, src.keys.lkey)],
            0x9000,
            rkey,
        )
    });
    // Four inline bytes.
    fails_locally(World::new(), |_, rkey| {
        let mut x = atomic_write(1, [1; 8], 0x9000, rkey);
        x.payload = SendPayload::Inline([1u8; 4].as_slice().into());
        x
    });
    // A well-formed one on UC.
    fails_locally(uc_world(), |_, rkey| atomic_write(1, [1; 8], 0x9000, rkey));
}

/// Posts the work request `make` builds (given the R_Key of a writable MR at 0x9000 of b) on
/// a: it fails with `LOC_QP_OP_ERR`, and nothing is stored.
fn fails_locally(mut w: World, make: impl FnOnce(&mut World, u32) -> SendWqe) {
    let dst = w.map(
        false,
        0x9000,
        4096,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    let x = make(&mut w, dst.keys.rkey);
    w.send(true, x);
    let stores = w.run_watching(&dst, 0x9000);
    assert!(stores.is_empty());
    let c: Vec<_> = w
        .cqes()
        .into_iter()
        .filter(|(cq, _)| *cq == w.a.cq)
        .map(|(_, c)| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, vec![(1, WcStatus::LocQpOpErr)]);
    assert_eq!(w.get(&dst, 0x9000, 8), [0; 8]);
}
