//! Two engines, as two daemons, joined by a link that carries real frames: every segment
//! the requester emits is encoded (`Transmit::encode`), decoded strictly
//! (`vrnic_wire::frame`), and handed to the other engine (`Engine::handle_segment`). Each
//! test names the rule it checks and asserts bytes and completions. The link can be cut
//! (frames dropped) and restored.

mod common;

use common::{VecMem, bind, inc, per_page};

use std::time::{Duration, Instant};

use vrnic_proto::{
    CtxId, Engine, HostId, Memory, MrKeys, PdId, QpId, SEGMENT, Sender, VnicId, WINDOW_FULL,
};
use vrnic_wire::frame::{AddrRepr, Deth, Frame, FrameRepr, Op, Opcode, SegmentRepr, Transport};
use vrnic_wire::{
    AhAttr, Cqe, GlobalRoute, QpAttr, QpCap, QpState, QpType, RecvWqe, SendFlags, SendOpcode,
    SendPayload, SendWqe, Sge, UdAddr, WC_GRH, WC_WITH_IMM, WC_WITH_INV, WcOpcode, WcStatus,
    access, qp_attr,
};

const REGION: usize = 8 << 20;

/// One daemon with one vRNIC and one QP.
struct Host {
    e: Engine,
    mem: VecMem,
    id: HostId,
    vnic: VnicId,
    ctx: CtxId,
    pd: PdId,
    qp: QpId,
    qpn: u32,
    lid: u16,
    gid: [u8; 16],
    next_page: u64,
    /// The first MR registered, and its access (for a re-registration that changes nothing).
    first_mr: u32,
    first_mr_access: u32,
}

fn host(id: u32, ty: QpType) -> Host {
    let mut e = Engine::new(u64::from(id) * 77);
    let vnic = VnicId(id);
    let ctx = CtxId(id);
    let (lid, gid) = (id as u16 * 10, [id as u8; 16]);
    e.add_vnic(vnic, lid, gid);
    let pd = e.alloc_pd(vnic, ctx).unwrap();
    let cq = e.create_cq(vnic, ctx, 4096).unwrap();
    let cap = QpCap {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 64,
    };
    let (qp, qpn) = e.create_qp(ctx, pd, cq, cq, ty, cap, false).unwrap();
    Host {
        e,
        mem: VecMem([(vnic, vec![0u8; REGION])].into_iter().collect()),
        id: HostId(id),
        vnic,
        ctx,
        pd,
        qp,
        qpn,
        lid,
        gid,
        next_page: 1,
        first_mr: 0,
        first_mr_access: 0,
    }
}

impl Host {
    fn map(&mut self, addr: u64, len: u64, acc: u32) -> (MrKeys, Vec<u64>) {
        let n = (addr + len).div_ceil(4096) - addr / 4096;
        let base = self.next_page;
        self.next_page += n + 1;
        let pages: Vec<u64> = (0..n).rev().map(|i| (base + i) * 4096).collect();
        let keys = self
            .e
            .reg_mr(self.ctx, self.pd, addr, len, addr, acc, &per_page(&pages))
            .unwrap();
        if self.first_mr == 0 {
            (self.first_mr, self.first_mr_access) = (keys.mr.0, acc);
        }
        (keys, pages)
    }

    fn loc(&self, m: &(MrKeys, Vec<u64>), base: u64, a: u64) -> usize {
        let page = (a / 4096 - base / 4096) as usize;
        (m.1[page] + a % 4096) as usize
    }

    fn set(&mut self, m: &(MrKeys, Vec<u64>), base: u64, a: u64, data: &[u8]) {
        for (i, b) in data.iter().enumerate() {
            let off = self.loc(m, base, a + i as u64);
            self.mem.0.get_mut(&self.vnic).unwrap()[off] = *b;
        }
    }

    fn get(&self, m: &(MrKeys, Vec<u64>), base: u64, a: u64, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| self.mem.0[&self.vnic][self.loc(m, base, a + i as u64)])
            .collect()
    }

    fn connect(&mut self, now: Instant, peer_qpn: u32, peer_lid: u16, qp_access: u32) {
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qp_access_flags: qp_access,
            ..Default::default()
        };
        let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
        self.e.modify_qp(now, self.ctx, self.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        a.path_mtu = 5;
        a.dest_qp_num = peer_qpn;
        a.rq_psn = 0x77;
        a.min_rnr_timer = 1;
        a.ah_attr = AhAttr {
            dlid: peer_lid,
            port_num: 1,
            ..Default::default()
        };
        // UC has no responder resources, RNR timer or retries.
        let uc = qp_access & access::REMOTE_READ == 0;
        let mut rtr =
            qp_attr::STATE | qp_attr::AV | qp_attr::PATH_MTU | qp_attr::DEST_QPN | qp_attr::RQ_PSN;
        if !uc {
            rtr |= qp_attr::MAX_DEST_RD_ATOMIC | qp_attr::MIN_RNR_TIMER;
        }
        self.e.modify_qp(now, self.ctx, self.qp, rtr, &a).unwrap();
        a.qp_state = QpState::Rts;
        a.sq_psn = 0x77;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        let mut rts = qp_attr::STATE | qp_attr::SQ_PSN;
        if !uc {
            rts |= qp_attr::TIMEOUT
                | qp_attr::RETRY_CNT
                | qp_attr::RNR_RETRY
                | qp_attr::MAX_QP_RD_ATOMIC;
        }
        self.e.modify_qp(now, self.ctx, self.qp, rts, &a).unwrap();
    }

    fn post(&mut self, now: Instant, w: SendWqe) {
        self.e.handle_send_wqe(now, self.qp, Ok(w));
    }

    fn recv(&mut self, now: Instant, wr_id: u64, sges: Vec<Sge>) {
        self.e.handle_recv_wqe(
            now,
            self.qp,
            Ok(RecvWqe {
                wr_id,
                sges: sges.into(),
            }),
        );
    }

    fn cqes(&mut self) -> Vec<Cqe> {
        std::iter::from_fn(|| self.e.poll_completion().map(|(_, c, _)| c)).collect()
    }
}

/// Two hosts and the link between them.
struct Net {
    a: Host,
    b: Host,
    now: Instant,
    /// Frames are dropped while set.
    cut: bool,
    /// Frames delivered, a to b and b to a.
    sent: [usize; 2],
    /// How receivers take payloads in, a to b and b to a.
    into: [Into; 2],
    /// Frames lost on the way, a to b and b to a: by their number in that direction (counted
    /// from 0 over every frame sent, lost or not).
    lose: [Vec<usize>; 2],
    /// Frames sent so far, a to b and b to a (lost ones included).
    offered: [usize; 2],
}

/// How a receiver takes a segment's payload in.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Into {
    /// Straight into the memory `Engine::placement` names wherever it names some (as the
    /// daemon reads it from the socket), else copied from the frame.
    place: bool,
    /// Segments taken in that way so far.
    placed: usize,
    /// Breaks the placement with this number (0 = the first): `Half` hands it over with half
    /// of its payload in place, `Stale` changes the receiver's memory generation (an access
    /// re-registration that changes nothing else) before it is handed over.
    break_at: Option<(usize, Break)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Break {
    Half,
    Stale,
}

impl Net {
    fn new(ty: QpType) -> Net {
        Net::announced(ty, true)
    }

    /// Two hosts whose QPs are connected; with `announce` false, before either knows the
    /// other's vRNIC (their routes lead nowhere until `add_remote_vnic`).
    fn announced(ty: QpType, announce: bool) -> Net {
        let mut a = host(1, ty);
        let mut b = host(2, ty);
        if announce {
            a.e.add_remote_vnic(b.id, b.lid, b.gid);
            b.e.add_remote_vnic(a.id, a.lid, a.gid);
        }
        let now = Instant::now();
        let all = match ty {
            QpType::Uc => access::REMOTE_WRITE,
            _ => access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
        };
        if ty != QpType::Ud {
            let (bq, bl, aq, al) = (b.qpn, b.lid, a.qpn, a.lid);
            a.connect(now, bq, bl, all);
            b.connect(now, aq, al, all);
        }
        Net {
            a,
            b,
            now,
            cut: false,
            sent: [0, 0],
            into: [Into::default(); 2],
            lose: [Vec::new(), Vec::new()],
            offered: [0, 0],
        }
    }

    /// Moves frames both ways and runs both engines until nothing moves.
    fn run(&mut self) {
        for _ in 0..100_000 {
            let mut moved = false;
            moved |= self.a.e.process(self.now, &mut self.a.mem);
            moved |= self.b.e.process(self.now, &mut self.b.mem);
            moved |= carry(
                &mut self.a,
                &mut self.b,
                self.now,
                Loss {
                    cut: self.cut,
                    lose: &self.lose[0],
                    offered: &mut self.offered[0],
                },
                &mut self.sent[0],
                &mut self.into[0],
            );
            moved |= carry(
                &mut self.b,
                &mut self.a,
                self.now,
                Loss {
                    cut: self.cut,
                    lose: &self.lose[1],
                    offered: &mut self.offered[1],
                },
                &mut self.sent[1],
                &mut self.into[1],
            );
            if !moved {
                return;
            }
        }
        panic!("the hosts never settle");
    }

    /// The address word of a segment from a's QP to b's.
    fn a_to_b(&self) -> AddrRepr {
        AddrRepr {
            dlid: self.b.lid,
            slid: self.a.lid,
            src_qpn: self.a.qpn,
        }
    }

    /// What a frame from a's QP to b's says of its sender.
    fn a_sends(&self) -> Sender<'static> {
        Sender {
            addr: self.a_to_b(),
            grh: None,
        }
    }

    fn advance(&mut self, d: Duration) {
        self.now += d;
        self.a.e.handle_timeout(self.now);
        self.b.e.handle_timeout(self.now);
        self.run();
    }
}

/// What a direction of the link loses: everything while `cut`, and the frames numbered in
/// `lose` (`offered` counts them).
struct Loss<'a> {
    cut: bool,
    lose: &'a [usize],
    offered: &'a mut usize,
}

/// Every frame `from` has to send, encoded, decoded and handed to `to` (unless lost).
fn carry(
    from: &mut Host,
    to: &mut Host,
    now: Instant,
    loss: Loss,
    count: &mut usize,
    into: &mut Into,
) -> bool {
    let mut moved = false;
    let mut buf = Vec::new();
    while let Some(t) = from.e.poll_transmit() {
        moved = true;
        assert_eq!(t.host, to.id, "addressed to the peer");
        buf.clear();
        assert!(t.encode(&mut from.mem, &mut buf), "a consistent frame");
        let n = *loss.offered;
        *loss.offered += 1;
        if loss.cut || loss.lose.contains(&n) {
            continue;
        }
        let frame = Frame::new_checked(&buf[..]).expect("a whole frame");
        let repr = FrameRepr::parse(&frame).expect("a valid frame");
        let FrameRepr::Segment { addr, grh, segment } = repr else {
            panic!("a segment");
        };
        let payload = &buf[repr.payload_range()];
        *count += 1;
        let mut runs = Vec::new();
        let placement = into
            .place
            .then(|| to.e.placement(from.id, &addr, &segment, &mut runs))
            .flatten();
        let Some(p) = placement else {
            let sender = Sender {
                addr,
                grh: grh.as_ref(),
            };
            to.e.handle_segment(now, from.id, sender, &segment, payload, &mut to.mem);
            continue;
        };
        assert!(grh.is_none(), "a UD datagram is never read into place");
        assert_eq!(
            runs.iter().map(|&(_, n)| n).sum::<u64>(),
            payload.len() as u64
        );
        let broken = into
            .break_at
            .filter(|&(k, _)| k == into.placed)
            .map(|(_, b)| b);
        into.placed += 1;
        // What a readv into the runs does; half of it for a broken read.
        let upto = if broken == Some(Break::Half) {
            payload.len() / 2
        } else {
            payload.len()
        };
        let mut at = 0usize;
        for (loc, n) in runs {
            let n = (n as usize).min(upto.saturating_sub(at));
            to.mem
                .write(loc, &payload[at..at + n])
                .expect("a placement names memory");
            at += n;
        }
        if broken == Some(Break::Stale) {
            // An access re-registration of the vRNIC's first MR: nothing it names changes.
            let mr = vrnic_proto::MrId(to.first_mr);
            to.e.rereg_mr(to.ctx, mr, None, Some(to.first_mr_access))
                .expect("rereg");
        }
        let whole = broken != Some(Break::Half);
        to.e.handle_placed_segment(now, from.id, &addr, &segment, p, whole, &mut to.mem);
    }
    moved
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed) ^ (i >> 12) as u8)
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
        imm_data: 0xabcd_0123,
        remote_addr,
        rkey,
        compare_add: 0,
        swap: 0,
        ud: Default::default(),
        xrc_srqn: 0,
        payload: SendPayload::Sges(sges.into()),
    }
}

/// Asserts two byte strings are equal, naming the first difference rather than printing them.
#[track_caller]
fn same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: byte {i} is {:#x}, not {:#x}", got[i], want[i]);
    }
}

fn statuses(c: &[Cqe]) -> Vec<(u64, WcStatus)> {
    c.iter().map(|c| (c.wr_id, c.status)).collect()
}

/// RC QPs brought to RTR before either host knew the other's vRNIC (the apps swapped
/// addresses over TCP faster than the daemons' announcements): once the announcements arrive,
/// a WRITE and a SEND cross, within the retry budget, byte-exact.
#[test]
fn rc_qps_connected_before_their_hosts_announced_each_other_work_once_they_do() {
    let mut n = Net::announced(QpType::Rc, false);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst =
        n.b.map(0x9000, 8192, access::LOCAL_WRITE | access::REMOTE_WRITE);
    n.a.set(&src, 0x1000, 0x1000, &pattern(4096, 3));
    let (a_id, a_lid, a_gid) = (n.a.id, n.a.lid, n.a.gid);
    let (b_id, b_lid, b_gid) = (n.b.id, n.b.lid, n.b.gid);
    n.a.e.add_remote_vnic(b_id, b_lid, b_gid);
    n.b.e.add_remote_vnic(a_id, a_lid, a_gid);
    n.b.recv(now, 9, vec![sge(0x9000 + 4096, 4096, dst.0.lkey)]);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 4096, src.0.lkey)],
            0x9000,
            dst.0.rkey,
        ),
    );
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::Send,
            vec![sge(0x1000, 100, src.0.lkey)],
            0,
            0,
        ),
    );
    n.run();
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!(statuses(&n.b.cqes()), vec![(9, WcStatus::Success)]);
    assert_eq!(n.b.get(&dst, 0x9000, 0x9000, 4096), pattern(4096, 3));
    assert_eq!(n.b.get(&dst, 0x9000, 0x9000 + 4096, 100), pattern(100, 3));
}

/// A WRITE posted while its destination is not yet known here (the announcement that names
/// it was lost with a link that dropped, and the next link has not said it yet): the
/// requester waits for an answer, and when the announcement arrives it sends at once, and
/// completes; it does not wait out, and fail at the end of, the budget it began with.
#[test]
fn a_send_posted_before_its_destination_is_announced_goes_when_it_is() {
    let mut n = Net::announced(QpType::Rc, false);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst =
        n.b.map(0x9000, 8192, access::LOCAL_WRITE | access::REMOTE_WRITE);
    n.a.set(&src, 0x1000, 0x1000, &pattern(4096, 7));
    n.b.e.add_remote_vnic(n.a.id, n.a.lid, n.a.gid);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 4096, src.0.lkey)],
            0x9000,
            dst.0.rkey,
        ),
    );
    n.run();
    assert!(n.a.cqes().is_empty(), "nothing answers yet");
    // Most of the budget (retry_cnt + 1 local ACK timeouts) goes by, then b is announced.
    let budget = n.a.e.poll_timeout().expect("a waits for an answer") - n.now;
    n.advance(budget * 3 / 4);
    let (b_id, b_lid, b_gid) = (n.b.id, n.b.lid, n.b.gid);
    n.a.e.add_remote_vnic(b_id, b_lid, b_gid);
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert_eq!(n.b.get(&dst, 0x9000, 0x9000, 4096), pattern(4096, 7));
    // Past the end of the first budget: nothing fails.
    n.advance(budget);
    n.run();
    assert!(n.a.cqes().is_empty());
    n.a.post(
        n.now,
        wqe(
            2,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 100, src.0.lkey)],
            0x9000 + 4096,
            dst.0.rkey,
        ),
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(2, WcStatus::Success)]);
}

#[test]
fn rc_send_write_read_and_atomics_cross_the_link_byte_exact() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let big = (1 << 20) + 7;
    let src = n.a.map(0x10_0000, 4 << 20, access::LOCAL_WRITE);
    let dst = n.b.map(
        0x80_0000,
        4 << 20,
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC,
    );
    let data = pattern(big, 5);
    n.a.set(&src, 0x10_0000, 0x10_0000, &data);
    n.b.recv(now, 70, vec![sge(0x80_0000, big as u32 + 100, dst.0.lkey)]);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::Send,
            vec![sge(0x10_0000, big as u32, src.0.lkey)],
            0,
            0,
        ),
    );
    // A WRITE with immediate of 300 KiB to 2 MiB into the destination.
    let w = pattern(300 << 10, 9);
    n.a.set(&src, 0x10_0000, 0x30_0000, &w);
    n.b.recv(now, 71, vec![]);
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::RdmaWriteWithImm,
            vec![sge(0x30_0000, 300 << 10, src.0.lkey)],
            0xa0_0000,
            dst.0.rkey,
        ),
    );
    // A READ of 200 KiB back from there.
    n.a.post(
        now,
        wqe(
            3,
            SendOpcode::RdmaRead,
            vec![sge(0x40_0000, 200 << 10, src.0.lkey)],
            0xa0_0000,
            dst.0.rkey,
        ),
    );
    // Fetch-and-add and compare-and-swap on a word there.
    n.b.set(&dst, 0x80_0000, 0xb0_0000, &40u64.to_le_bytes());
    let mut fa = wqe(
        4,
        SendOpcode::AtomicFetchAndAdd,
        vec![sge(0x48_0000, 8, src.0.lkey)],
        0xb0_0000,
        dst.0.rkey,
    );
    fa.compare_add = 2;
    n.a.post(now, fa);
    let mut cs = wqe(
        5,
        SendOpcode::AtomicCmpAndSwp,
        vec![sge(0x48_0008, 8, src.0.lkey)],
        0xb0_0000,
        dst.0.rkey,
    );
    cs.compare_add = 42;
    cs.swap = 7;
    n.a.post(now, cs);
    n.run();

    same(
        &n.b.get(&dst, 0x80_0000, 0x80_0000, big),
        &data,
        "SEND bytes",
    );
    same(
        &n.b.get(&dst, 0x80_0000, 0xa0_0000, 300 << 10),
        &w,
        "WRITE bytes",
    );
    same(
        &n.a.get(&src, 0x10_0000, 0x40_0000, 200 << 10),
        &w[..200 << 10],
        "READ",
    );
    assert_eq!(
        n.a.get(&src, 0x10_0000, 0x48_0000, 8),
        40u64.to_le_bytes(),
        "FA old"
    );
    assert_eq!(
        n.a.get(&src, 0x10_0000, 0x48_0008, 8),
        42u64.to_le_bytes(),
        "CS old"
    );
    assert_eq!(
        n.b.get(&dst, 0x80_0000, 0xb0_0000, 8),
        7u64.to_le_bytes(),
        "CS new"
    );
    let ca = n.a.cqes();
    assert_eq!(
        statuses(&ca),
        (1..=5).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>(),
        "requester completions, in order"
    );
    assert_eq!(ca[0].byte_len, big as u32);
    let cb = n.b.cqes();
    assert_eq!(
        statuses(&cb),
        vec![(70, WcStatus::Success), (71, WcStatus::Success)]
    );
    assert_eq!((cb[0].opcode, cb[0].byte_len), (WcOpcode::Recv, big as u32));
    assert_eq!((cb[0].src_qp, cb[0].slid), (n.a.qpn, n.a.lid));
    assert_eq!(
        (
            cb[1].opcode,
            cb[1].byte_len,
            cb[1].imm_data,
            cb[1].wc_flags & WC_WITH_IMM
        ),
        (
            WcOpcode::RecvRdmaWithImm,
            300 << 10,
            0xabcd_0123,
            WC_WITH_IMM
        )
    );
}

#[test]
fn small_sends_pipeline_and_their_acks_coalesce() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 64 * 64, access::LOCAL_WRITE);
    n.a.set(&src, 0x1000, 0x1000, &pattern(64, 1));
    for i in 0..64u64 {
        n.b.recv(now, 100 + i, vec![sge(0x9000 + i * 64, 64, dst.0.lkey)]);
        n.a.post(
            now,
            wqe(i, SendOpcode::Send, vec![sge(0x1000, 64, src.0.lkey)], 0, 0),
        );
    }
    n.run();
    assert_eq!(n.a.cqes().len(), 64);
    assert_eq!(n.b.cqes().len(), 64);
    for i in 0..64u64 {
        same(
            &n.b.get(&dst, 0x9000, 0x9000 + i * 64, 64),
            &pattern(64, 1),
            "bytes",
        );
    }
    assert_eq!(n.sent[0], 64, "one frame per message");
    assert!(
        n.sent[1] < 16,
        "ACKs coalesce: {} for 64 messages",
        n.sent[1]
    );
}

#[test]
fn rnr_over_the_link_waits_for_the_responders_timer_then_lands() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 4096, access::LOCAL_WRITE);
    n.a.set(&src, 0x1000, 0x1000, b"late");
    n.a.post(
        now,
        wqe(1, SendOpcode::Send, vec![sge(0x1000, 4, src.0.lkey)], 0, 0),
    );
    n.run();
    assert!(n.a.cqes().is_empty(), "RNR NAK: the requester waits");
    n.b.recv(now, 9, vec![sge(0x9000, 64, dst.0.lkey)]);
    n.run();
    assert!(n.a.cqes().is_empty(), "nothing sends before the RNR timer");
    n.advance(Duration::from_millis(1));
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert_eq!(n.b.get(&dst, 0x9000, 0x9000, 4), b"late");
    assert_eq!(statuses(&n.b.cqes()), vec![(9, WcStatus::Success)]);
}

#[test]
fn a_bad_rkey_over_the_link_is_rem_access_err_and_changes_nothing() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst =
        n.b.map(0x9000, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE);
    n.a.set(&src, 0x1000, 0x1000, &[0x5a; 64]);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 64, src.0.lkey)],
            0x9000,
            dst.0.rkey ^ 1,
        ),
    );
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 64, src.0.lkey)],
            0x9000,
            dst.0.rkey,
        ),
    );
    n.run();
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(1, WcStatus::RemAccessErr), (2, WcStatus::WrFlushErr)]
    );
    assert_eq!(n.b.get(&dst, 0x9000, 0x9000, 64), vec![0; 64]);
    assert_eq!(n.a.e.qp_state(n.a.qp), Some(QpState::Err));
    assert_eq!(n.b.e.qp_state(n.b.qp), Some(QpState::Err));
}

#[test]
fn a_link_cut_shorter_than_the_retry_budget_loses_and_repeats_nothing() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x10_0000, 1 << 20, access::LOCAL_WRITE);
    let dst = n.b.map(0x80_0000, 3 << 20, access::LOCAL_WRITE);
    let data = pattern(700 << 10, 3);
    n.a.set(&src, 0x10_0000, 0x10_0000, &data);
    for i in 0..3u64 {
        n.b.recv(
            now,
            10 + i,
            vec![sge(0x80_0000 + i * (700 << 10), 700 << 10, dst.0.lkey)],
        );
    }
    // The first message goes through; the second is half sent when the link drops.
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::Send,
            vec![sge(0x10_0000, 700 << 10, src.0.lkey)],
            0,
            0,
        ),
    );
    n.run();
    n.cut = true;
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::Send,
            vec![sge(0x10_0000, 700 << 10, src.0.lkey)],
            0,
            0,
        ),
    );
    n.a.post(
        now,
        wqe(
            3,
            SendOpcode::Send,
            vec![sge(0x10_0000, 700 << 10, src.0.lkey)],
            0,
            0,
        ),
    );
    n.run();
    n.advance(Duration::from_millis(20));
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    n.cut = false;
    n.a.e.handle_link_up(n.b.id);
    n.b.e.handle_link_up(n.a.id);
    n.run();
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(2, WcStatus::Success), (3, WcStatus::Success)]
    );
    assert_eq!(
        statuses(&n.b.cqes()),
        vec![
            (10, WcStatus::Success),
            (11, WcStatus::Success),
            (12, WcStatus::Success)
        ],
        "each message landed once"
    );
    for i in 0..3u64 {
        let at = 0x80_0000 + i * (700 << 10);
        same(&n.b.get(&dst, 0x80_0000, at, 700 << 10), &data, "message");
    }
}

#[test]
fn a_peer_silent_past_the_retry_budget_is_retry_exc_err() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    n.cut = true;
    n.a.post(now, wqe(1, SendOpcode::Send, vec![], 0, 0));
    n.a.post(now, wqe(2, SendOpcode::Send, vec![], 0, 0));
    n.run();
    // timeout 14 (67 ms) x (retry_cnt 7 + 1) = 537 ms.
    n.advance(Duration::from_millis(500));
    assert!(n.a.cqes().is_empty(), "still within the budget");
    n.advance(Duration::from_millis(100));
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(1, WcStatus::RetryExcErr), (2, WcStatus::WrFlushErr)]
    );
}

#[test]
fn uc_over_the_link_completes_when_sent() {
    let mut n = Net::new(QpType::Uc);
    let now = n.now;
    let src = n.a.map(0x10_0000, 1 << 20, access::LOCAL_WRITE);
    let dst = n.b.map(0x80_0000, 1 << 20, access::LOCAL_WRITE);
    let data = pattern(200 << 10, 8);
    n.a.set(&src, 0x10_0000, 0x10_0000, &data);
    n.b.recv(now, 5, vec![sge(0x80_0000, 1 << 20, dst.0.lkey)]);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::Send,
            vec![sge(0x10_0000, 200 << 10, src.0.lkey)],
            0,
            0,
        ),
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert_eq!(statuses(&n.b.cqes()), vec![(5, WcStatus::Success)]);
    same(
        &n.b.get(&dst, 0x80_0000, 0x80_0000, 200 << 10),
        &data,
        "bytes",
    );
    assert_eq!(n.sent[1], 0, "nothing answers UC");
}

/// A UD SEND of `s` through address handle `ah` to QP `qpn` with Q_Key `qkey`.
fn ud_send(wr_id: u64, s: Sge, ah: u32, qpn: u32, qkey: u32) -> SendWqe {
    let mut w = wqe(wr_id, SendOpcode::Send, vec![s], 0, 0);
    w.ud = UdAddr {
        ah,
        remote_qpn: qpn,
        remote_qkey: qkey,
    };
    w
}

/// Both UD QPs of `n` to RTS with Q_Key 0x1111.
fn ud_up(n: &mut Net) {
    let now = n.now;
    for h in [&mut n.a, &mut n.b] {
        let mut a = QpAttr {
            qp_state: QpState::Init,
            port_num: 1,
            qkey: 0x1111,
            ..Default::default()
        };
        let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::QKEY;
        h.e.modify_qp(now, h.ctx, h.qp, init, &a).unwrap();
        a.qp_state = QpState::Rtr;
        h.e.modify_qp(now, h.ctx, h.qp, qp_attr::STATE, &a).unwrap();
        a.qp_state = QpState::Rts;
        h.e.modify_qp(now, h.ctx, h.qp, qp_attr::STATE | qp_attr::SQ_PSN, &a)
            .unwrap();
    }
}

/// An address handle made before its destination's host announced it (the app learnt the
/// address over TCP first): what is sent then is lost, as on a fabric without that port, and
/// once the destination is known here the same handle reaches it.
#[test]
fn a_ud_address_handle_made_before_its_destination_was_announced_reaches_it_after() {
    let mut n = Net::new(QpType::Ud);
    let now = n.now;
    ud_up(&mut n);
    n.a.e.remove_remote_vnic(n.b.lid, n.b.gid);
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 8192, access::LOCAL_WRITE);
    n.a.set(&src, 0x1000, 0x1000, b"datagram");
    let attr = AhAttr {
        dlid: n.b.lid,
        port_num: 1,
        ..Default::default()
    };
    let ah = n.a.e.create_ah(n.a.ctx, n.a.pd, attr).unwrap();
    n.b.recv(now, 7, vec![sge(0x9000, 4096, dst.0.lkey)]);
    let send = |n: &mut Net, wr_id| {
        let w = ud_send(wr_id, sge(0x1000, 8, src.0.lkey), ah.0, n.b.qpn, 0x1111);
        n.a.post(now, w);
        n.run();
    };
    send(&mut n, 1);
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert!(n.b.cqes().is_empty(), "nobody here answers that LID yet");
    n.a.e.add_remote_vnic(n.b.id, n.b.lid, n.b.gid);
    send(&mut n, 2);
    assert_eq!(statuses(&n.a.cqes()), vec![(2, WcStatus::Success)]);
    let cb = n.b.cqes();
    assert_eq!(statuses(&cb), vec![(7, WcStatus::Success)]);
    assert_eq!(
        n.b.get(&dst, 0x9000, 0x9000 + 40, 8),
        b"datagram",
        "after the GRH's room"
    );
    assert_eq!(
        (cb[0].src_qp, cb[0].slid, cb[0].wc_flags & WC_GRH),
        (n.a.qpn, n.a.lid, 0),
        "no GRH: the sender's LID from its frame's address word"
    );
}

/// A datagram from a link reaches a UD QP only as its address word allows: DLID the QP's own
/// vRNIC (a QP number never reaches another vRNIC's QP), SLID a vRNIC that link's host
/// announced, in the QP's group, and the DETH's source QP the word's. Anything else is dropped
/// and counted; the receive stays posted for the honest datagram, whose `slid` is its sender's.
#[test]
fn a_datagram_is_taken_only_for_its_vrnic_from_a_vrnic_its_link_speaks_for() {
    let mut n = Net::new(QpType::Ud);
    let now = n.now;
    ud_up(&mut n);
    let dst = n.b.map(0x9000, 4096, access::LOCAL_WRITE);
    // Another vRNIC on b, of b's group (its own QP numbers), and vRNICs behind other links.
    n.b.e.add_vnic(VnicId(7), 0x0707, [7; 16]);
    n.b.e.add_remote_vnic(HostId(9), 0x4242, [0x42; 16]);
    n.b.e
        .add_remote_vnic_in_group(n.a.id, 0x5151, [0x51; 16], vrnic_proto::GroupId(3));
    let mut seg = SegmentRepr::new(
        Opcode::new(Transport::Ud, Op::SendOnly).unwrap(),
        n.b.qpn,
        0,
    );
    seg.deth = Some(Deth {
        qkey: 0x1111,
        src_qpn: n.a.qpn,
    });
    seg.payload_len = 4;
    n.b.recv(now, 1, vec![sge(0x9000, 4096, dst.0.lkey)]);
    let good = n.a_to_b();
    for (what, addr) in [
        (
            "routed to another vRNIC of b",
            AddrRepr {
                dlid: 0x0707,
                ..good
            },
        ),
        (
            "from a vRNIC of another host",
            AddrRepr {
                slid: 0x4242,
                ..good
            },
        ),
        (
            "from a LID nobody announced",
            AddrRepr {
                slid: 0x7777,
                ..good
            },
        ),
        (
            "from a vRNIC of another group",
            AddrRepr {
                slid: 0x5151,
                ..good
            },
        ),
        (
            "a source QP other than the DETH's",
            AddrRepr {
                src_qpn: n.a.qpn + 1,
                ..good
            },
        ),
    ] {
        let before = n.b.e.segments_refused();
        let from = Sender { addr, grh: None };
        n.b.e
            .handle_segment(now, n.a.id, from, &seg, b"evil", &mut n.b.mem);
        n.run();
        assert!(n.b.cqes().is_empty(), "{what}: nothing delivered");
        assert_eq!(n.b.e.segments_refused(), before + 1, "{what}: counted");
    }
    n.b.e
        .handle_segment(now, n.a.id, n.a_sends(), &seg, b"dgrm", &mut n.b.mem);
    n.run();
    let cb = n.b.cqes();
    assert_eq!(statuses(&cb), vec![(1, WcStatus::Success)]);
    assert_eq!((cb[0].src_qp, cb[0].slid), (n.a.qpn, n.a.lid));
    assert_eq!(
        n.b.get(&dst, 0x9000, 0x9000 + 40, 4),
        b"dgrm",
        "after the GRH space"
    );
}

/// A connected QP takes segments from a link only from its peer: the vRNIC and QP it was
/// connected to, over that link, routed to its own vRNIC. A tenant who names the QP's number
/// from another QP (of its own vRNIC, or with its own vRNIC as the route's destination) moves
/// no byte and gets no answer, and the QP's connection is untouched: its peer's WRITE lands.
#[test]
fn a_connected_qp_takes_segments_only_from_its_peer() {
    for ty in [QpType::Rc, QpType::Uc] {
        let mut n = Net::new(ty);
        let dst = n.b.map(
            0x80_0000,
            1 << 16,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
        );
        n.b.e.add_vnic(VnicId(7), 0x0707, [7; 16]);
        let mut seg = SegmentRepr::new(
            Opcode::new(
                if ty == QpType::Rc {
                    Transport::Rc
                } else {
                    Transport::Uc
                },
                Op::RdmaWriteOnly,
            )
            .unwrap(),
            n.b.qpn,
            0x77,
        );
        seg.reth = Some(vrnic_wire::frame::Reth {
            va: 0x80_0000,
            rkey: dst.0.rkey,
            dma_len: 4,
        });
        seg.payload_len = 4;
        let good = n.a_to_b();
        for (what, host, addr) in [
            (
                "another QP of the peer's vRNIC",
                n.a.id,
                AddrRepr {
                    src_qpn: n.a.qpn + 1,
                    ..good
                },
            ),
            (
                "routed to another vRNIC",
                n.a.id,
                AddrRepr {
                    dlid: 0x0707,
                    ..good
                },
            ),
            (
                "the peer's QP number from another vRNIC",
                n.a.id,
                AddrRepr {
                    slid: 0x0a0a,
                    ..good
                },
            ),
            ("the peer's address over another link", HostId(9), good),
        ] {
            if addr.slid == 0x0a0a {
                n.b.e.add_remote_vnic(n.a.id, 0x0a0a, [0x0a; 16]);
            }
            let before = n.b.e.segments_refused();
            let mut runs = Vec::new();
            assert!(
                n.b.e.placement(host, &addr, &seg, &mut runs).is_none(),
                "{ty:?} {what}: not read into place"
            );
            let from = Sender { addr, grh: None };
            n.b.e
                .handle_segment(n.now, host, from, &seg, b"evil", &mut n.b.mem);
            assert_eq!(n.b.e.segments_refused(), before + 1, "{ty:?} {what}");
            assert!(n.b.e.poll_transmit().is_none(), "{ty:?} {what}: no answer");
            assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0000, 4), [0; 4], "{what}");
        }
        n.b.e
            .handle_segment(n.now, n.a.id, n.a_sends(), &seg, b"good", &mut n.b.mem);
        assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0000, 4), b"good", "{ty:?}");
    }
}

#[test]
fn ud_over_the_link_carries_the_grh_and_obeys_the_qkey() {
    let mut n = Net::new(QpType::Ud);
    let now = n.now;
    ud_up(&mut n);
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 8192, access::LOCAL_WRITE);
    n.a.set(&src, 0x1000, 0x1000, b"datagram");
    let ah =
        n.a.e
            .create_ah(
                n.a.ctx,
                n.a.pd,
                AhAttr {
                    is_global: true,
                    grh: GlobalRoute {
                        dgid: n.b.gid,
                        hop_limit: 9,
                        ..Default::default()
                    },
                    dlid: n.b.lid,
                    port_num: 1,
                    ..Default::default()
                },
            )
            .unwrap();
    n.b.recv(now, 1, vec![sge(0x9000, 4096, dst.0.lkey)]);
    n.b.recv(now, 2, vec![sge(0x9000 + 4096, 4096, dst.0.lkey)]);
    for (wr_id, qkey) in [(1, 0x2222), (2, 0x1111)] {
        let w = ud_send(wr_id, sge(0x1000, 8, src.0.lkey), ah.0, n.b.qpn, qkey);
        n.a.post(now, w);
    }
    n.run();
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let cb = n.b.cqes();
    assert_eq!(
        statuses(&cb),
        vec![(1, WcStatus::Success)],
        "the wrong Q_Key is dropped"
    );
    assert_eq!((cb[0].byte_len, cb[0].src_qp), (48, n.a.qpn));
    assert_eq!(cb[0].wc_flags & WC_GRH, WC_GRH);
    let got = n.b.get(&dst, 0x9000, 0x9000, 48);
    assert_eq!(&got[8..24], &n.a.gid, "GRH source GID");
    assert_eq!(&got[24..40], &n.b.gid, "GRH destination GID");
    assert_eq!(&got[40..48], b"datagram");
}

#[test]
fn pipelined_sends_past_the_posted_receives_wait_out_rnr_and_all_land_in_order() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 20 * 128, access::LOCAL_WRITE);
    n.a.set(&src, 0x1000, 0x1000, &pattern(128, 4));
    for i in 0..10u64 {
        n.b.recv(now, 100 + i, vec![sge(0x9000 + i * 128, 128, dst.0.lkey)]);
    }
    for i in 0..20u64 {
        n.a.post(
            now,
            wqe(
                i,
                SendOpcode::Send,
                vec![sge(0x1000, 128, src.0.lkey)],
                0,
                0,
            ),
        );
    }
    n.run();
    assert_eq!(
        n.a.cqes().len(),
        10,
        "the first ten are ACKed, the rest RNR NAKed"
    );
    assert_eq!(n.b.cqes().len(), 10);
    for i in 10..20u64 {
        n.b.recv(now, 100 + i, vec![sge(0x9000 + i * 128, 128, dst.0.lkey)]);
    }
    n.advance(Duration::from_millis(1));
    n.advance(Duration::from_millis(1));
    let ca = n.a.cqes();
    assert_eq!(
        statuses(&ca),
        (10..20).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    let cb = n.b.cqes();
    assert_eq!(
        statuses(&cb),
        (110..120)
            .map(|i| (i, WcStatus::Success))
            .collect::<Vec<_>>()
    );
    for i in 0..20u64 {
        same(
            &n.b.get(&dst, 0x9000, 0x9000 + i * 128, 128),
            &pattern(128, 4),
            "SEND",
        );
    }
}

/// Memory windows over a peer link: a type 2 bind on the responder's link-routed QP opens a
/// window the peer writes through (and only within); on the requester, a bind queued behind a
/// WRITE in flight waits for its answer and then runs; a SEND with Invalidate crosses the link
/// with its IETH and closes the window (a bad key: REM_INV_REQ_ERR on both sides).
#[test]
fn memory_windows_and_send_with_invalidate_work_over_the_link() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 8192, access::LOCAL_WRITE | access::MW_BIND);
    let dst = n.b.map(0x9000, 8192, access::LOCAL_WRITE | access::MW_BIND);
    n.a.set(&src, 0x1000, 0x1000, &pattern(8192, 3));
    let (mw, rkey) =
        n.b.e
            .alloc_mw(n.b.ctx, n.b.pd, vrnic_proto::MW_TYPE_2)
            .unwrap();
    let key = (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff);
    let bind =
        |wr_id: u64, mw: vrnic_proto::MwId, key: u32, lkey: u32, addr: u64, len: u64| SendWqe {
            imm_data: access::REMOTE_WRITE,
            compare_add: len,
            swap: u64::from(mw.0) << 32 | u64::from(lkey),
            ..wqe(wr_id, SendOpcode::BindMw, vec![], addr, key)
        };
    n.b.post(now, bind(1, mw, key, dst.0.lkey, 0x9800, 1024));
    n.run();
    let c = n.b.cqes();
    assert_eq!(statuses(&c), vec![(1, WcStatus::Success)]);
    assert_eq!(c[0].opcode, WcOpcode::BindMw);
    // A write inside the window, then a bind on a's side queued behind it.
    let (amw, arkey) =
        n.a.e
            .alloc_mw(n.a.ctx, n.a.pd, vrnic_proto::MW_TYPE_2)
            .unwrap();
    let akey = (arkey & !0xff) | (arkey.wrapping_add(1) & 0xff);
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 1000, src.0.lkey)],
            0x9810,
            key,
        ),
    );
    n.a.post(now, bind(3, amw, akey, src.0.lkey, 0x1000, 4096));
    n.run();
    assert_eq!(
        statuses(&n.a.cqes()),
        vec![(2, WcStatus::Success), (3, WcStatus::Success)]
    );
    same(
        &n.b.get(&dst, 0x9000, 0x9810, 1000),
        &pattern(1000, 3),
        "through the window",
    );
    assert_eq!(n.b.get(&dst, 0x9000, 0x9800, 16), vec![0; 16]);
    // Past the window's end (inside the MR): refused, nothing written.
    n.a.post(
        now,
        wqe(
            4,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 64, src.0.lkey)],
            0x9800 + 1000,
            key,
        ),
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(4, WcStatus::RemAccessErr)]);
    assert_eq!(
        n.b.get(&dst, 0x9000, 0x9800 + 1000, 64)[..8],
        pattern(1000, 3)[984..992]
    );
    assert_eq!(n.b.get(&dst, 0x9000, 0x9c00, 64), vec![0; 64]);
    // SEND with Invalidate over the link (the IETH carries the key), on a fresh pair (a's QP
    // is in ERR after the refused WRITE): b's receive completes WITH_INV naming the window's
    // key, and the window is closed: a WRITE through it fails.
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 8192, access::LOCAL_WRITE);
    let dst = n.b.map(0x9000, 8192, access::LOCAL_WRITE | access::MW_BIND);
    n.a.set(&src, 0x1000, 0x1000, &pattern(8192, 3));
    let (mw, rkey) =
        n.b.e
            .alloc_mw(n.b.ctx, n.b.pd, vrnic_proto::MW_TYPE_2)
            .unwrap();
    let key = (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff);
    n.b.post(now, bind(1, mw, key, dst.0.lkey, 0x9800, 1024));
    n.run();
    assert_eq!(statuses(&n.b.cqes()), vec![(1, WcStatus::Success)]);
    let rbuf = n.b.map(0x20000, 4096, access::LOCAL_WRITE);
    n.b.recv(now, 6, vec![sge(0x20000, 64, rbuf.0.lkey)]);
    n.a.post(
        now,
        SendWqe {
            imm_data: key,
            ..wqe(
                5,
                SendOpcode::SendWithInv,
                vec![sge(0x1000, 8, src.0.lkey)],
                0,
                0,
            )
        },
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(5, WcStatus::Success)]);
    let c = n.b.cqes();
    assert_eq!(statuses(&c), vec![(6, WcStatus::Success)]);
    assert_eq!(c[0].wc_flags & WC_WITH_INV, WC_WITH_INV);
    assert_eq!(c[0].imm_data, key);
    same(
        &n.b.get(&rbuf, 0x20000, 0x20000, 8),
        &pattern(8, 3),
        "the SEND's bytes",
    );
    n.a.post(
        now,
        wqe(
            7,
            SendOpcode::RdmaWrite,
            vec![sge(0x1000, 8, src.0.lkey)],
            0x9810,
            key,
        ),
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(7, WcStatus::RemAccessErr)]);
    // A key that names no window bound to that QP: REM_INV_REQ_ERR on both sides.
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x1000, 4096, access::LOCAL_WRITE);
    let rbuf = n.b.map(0x20000, 4096, access::LOCAL_WRITE);
    n.b.recv(now, 9, vec![sge(0x20000, 64, rbuf.0.lkey)]);
    n.a.post(
        now,
        SendWqe {
            imm_data: 0x1234,
            ..wqe(
                8,
                SendOpcode::SendWithInv,
                vec![sge(0x1000, 8, src.0.lkey)],
                0,
                0,
            )
        },
    );
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(8, WcStatus::RemInvReqErr)]);
    assert_eq!(statuses(&n.b.cqes()), vec![(9, WcStatus::RemInvReqErr)]);
}

// ---- payloads read straight into place -----------------------------------------------------

/// The traffic of the payload tests: from a, a plain WRITE of 1 MiB + 5 to an odd address of
/// b, a READ of 300 KiB + 1 from b, a SEND of 100 KiB and a WRITE with immediate of 70 KiB.
/// Checks every byte and completion; returns (a to b, b to a) placements.
fn traffic_read_into_place(n: &mut Net) -> (usize, usize) {
    let now = n.now;
    let src = n.a.map(0x10_0000, 4 << 20, access::LOCAL_WRITE);
    let dst = n.b.map(
        0x80_0000,
        4 << 20,
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ,
    );
    let (wlen, rlen, slen, ilen) = ((1 << 20) + 5, (300 << 10) + 1, 100 << 10, 70 << 10);
    let w = pattern(wlen, 3);
    n.a.set(&src, 0x10_0000, 0x10_0000, &w);
    let r = pattern(rlen, 4);
    n.b.set(&dst, 0x80_0000, 0xa4_0000, &r);
    let sd = pattern(slen, 5);
    n.a.set(&src, 0x10_0000, 0x30_0000, &sd);
    let id = pattern(ilen, 6);
    n.a.set(&src, 0x10_0000, 0x38_0000, &id);
    n.b.recv(now, 70, vec![sge(0xb0_0000, slen as u32, dst.0.lkey)]);
    n.b.recv(now, 71, vec![]);
    let lk = src.0.lkey;
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x10_0000, wlen as u32, lk)],
            0x90_0003,
            dst.0.rkey,
        ),
    );
    n.a.post(
        now,
        wqe(
            2,
            SendOpcode::RdmaRead,
            vec![sge(0x20_0007, rlen as u32, lk)],
            0xa4_0000,
            dst.0.rkey,
        ),
    );
    n.a.post(
        now,
        wqe(
            3,
            SendOpcode::Send,
            vec![sge(0x30_0000, slen as u32, lk)],
            0,
            0,
        ),
    );
    n.a.post(
        now,
        wqe(
            4,
            SendOpcode::RdmaWriteWithImm,
            vec![sge(0x38_0000, ilen as u32, lk)],
            0xb8_0000,
            dst.0.rkey,
        ),
    );
    n.run();
    same(&n.b.get(&dst, 0x80_0000, 0x90_0003, wlen), &w, "WRITE");
    same(&n.a.get(&src, 0x10_0000, 0x20_0007, rlen), &r, "READ");
    same(&n.b.get(&dst, 0x80_0000, 0xb0_0000, slen), &sd, "SEND");
    same(
        &n.b.get(&dst, 0x80_0000, 0xb8_0000, ilen),
        &id,
        "WRITE with immediate",
    );
    assert_eq!(
        statuses(&n.a.cqes()),
        (1..=4).map(|i| (i, WcStatus::Success)).collect::<Vec<_>>()
    );
    assert_eq!(
        statuses(&n.b.cqes()),
        vec![(70, WcStatus::Success), (71, WcStatus::Success)]
    );
    (n.into[0].placed, n.into[1].placed)
}

#[test]
fn writes_and_read_responses_read_into_place_land_exact_bytes_and_the_rest_is_copied() {
    let mut n = Net::new(QpType::Rc);
    n.into = [Into {
        place: true,
        ..Default::default()
    }; 2];
    let (to_b, to_a) = traffic_read_into_place(&mut n);
    // The WRITE's 17 segments (16 of 64 KiB and one of 5 bytes), the first 64 KiB of the
    // WRITE with immediate, and the READ's 5 responses; the SEND and the last segment of the
    // WRITE with immediate (which takes a receive) were copied.
    assert_eq!((to_b, to_a), (18, 5));
    assert_eq!(n.a.e.retransmits(n.b.id), 0);
}

#[test]
fn a_payload_read_into_place_in_part_or_past_a_memory_change_is_asked_for_again() {
    for brk in [Break::Half, Break::Stale] {
        for (dir, k) in [(0, 3), (1, 2)] {
            let mut n = Net::new(QpType::Rc);
            n.into = [Into {
                place: true,
                ..Default::default()
            }; 2];
            // Break the k-th placement of one direction: a WRITE segment (a to b) or a READ
            // response (b to a).
            n.into[dir].break_at = Some((k, brk));
            let (to_b, to_a) = traffic_read_into_place(&mut n);
            assert!(
                n.a.e.retransmits(n.b.id) > 0,
                "{brk:?} {dir}: the requester sent again"
            );
            // The broken segment was read into place a second time (after a rewind, any
            // segments of the same WRITE after it too).
            let placed = [to_b, to_a][dir];
            assert!(placed > [18, 5][dir], "{brk:?} {dir}: {placed} placements");
        }
    }
}

#[test]
fn placement_is_offered_only_where_the_responder_would_take_the_segment_and_changes_nothing() {
    use vrnic_wire::frame::{Op, Opcode, Reth, SegmentRepr, Transport};
    let mut n = Net::new(QpType::Rc);
    let dst = n.b.map(
        0x80_0000,
        1 << 20,
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::MW_BIND,
    );
    // A window over the whole MR: its grant may change in another engine (see `mw`).
    let (mw, r) =
        n.b.e
            .alloc_mw(n.b.ctx, n.b.pd, vrnic_proto::MW_TYPE_1)
            .unwrap();
    let wkey = inc(r);
    let acc = access::REMOTE_WRITE;
    n.b.post(
        n.now,
        bind(1, mw, wkey, dst.0.lkey, 0x80_0000, 1 << 20, acc),
    );
    n.run();
    assert_eq!(statuses(&n.b.cqes()), vec![(1, WcStatus::Success)]);
    let write = |op: Op, psn: u32, rkey: u32, len: usize| {
        let mut s = SegmentRepr::new(Opcode::new(Transport::Rc, op).unwrap(), n.b.qpn, psn);
        s.reth = Some(Reth {
            va: 0x80_0100,
            rkey,
            dma_len: len as u32,
        });
        if op == Op::RdmaWriteOnlyWithImm {
            s.imm = Some(1);
        }
        s.payload_len = len;
        s
    };
    let from = n.a.id;
    let ab = n.a_to_b();
    let mut runs = Vec::new();
    // In sequence (the QP expects PSN 0x77), a valid key: the runs of those bytes.
    let ok = write(Op::RdmaWriteOnly, 0x77, dst.0.rkey, 4096);
    assert!(n.b.e.placement(from, &ab, &ok, &mut runs).is_some());
    let first = runs.clone();
    assert_eq!(first.iter().map(|&(_, l)| l).sum::<u64>(), 4096);
    // Asking again gives the same: nothing was taken or moved on.
    runs.clear();
    assert!(n.b.e.placement(from, &ab, &ok, &mut runs).is_some());
    assert_eq!(runs, first);
    // Not offered: out of sequence, a wrong key, a key past the MR, a window's key (checked
    // when handled), with immediate data (it takes a receive), from another host, for no QP.
    for (what, seg, host) in [
        (
            "ahead",
            write(Op::RdmaWriteOnly, 0x78, dst.0.rkey, 4096),
            from,
        ),
        (
            "behind",
            write(Op::RdmaWriteOnly, 0x76, dst.0.rkey, 4096),
            from,
        ),
        (
            "wrong key",
            write(Op::RdmaWriteOnly, 0x77, dst.0.rkey ^ 0x100, 4096),
            from,
        ),
        (
            "past the MR",
            write(Op::RdmaWriteOnly, 0x77, dst.0.rkey, 1 << 20),
            from,
        ),
        (
            "through a window",
            write(Op::RdmaWriteOnly, 0x77, wkey, 64),
            from,
        ),
        (
            "with immediate",
            write(Op::RdmaWriteOnlyWithImm, 0x77, dst.0.rkey, 64),
            from,
        ),
        (
            "another host",
            write(Op::RdmaWriteOnly, 0x77, dst.0.rkey, 64),
            HostId(9),
        ),
    ] {
        runs.clear();
        assert!(
            n.b.e.placement(host, &ab, &seg, &mut runs).is_none(),
            "{what}"
        );
        assert!(runs.is_empty(), "{what}: nothing appended");
    }
    // Then the same segment handled as usual (its payload copied) is taken as the first.
    let data = pattern(4096, 8);
    n.b.e
        .handle_segment(n.now, from, n.a_sends(), &ok, &data, &mut n.b.mem);
    same(&n.b.get(&dst, 0x80_0000, 0x80_0100, 4096), &data, "bytes");
    runs.clear();
    assert!(
        n.b.e.placement(from, &ab, &ok, &mut runs).is_none(),
        "PSN 0x77 is taken now"
    );
}

/// A responder not yet at RTR drops what comes, as a fabric loses it; the requester sends it
/// again when its local ACK timeout (timeout 14: 67 ms) expires, and it lands once the
/// responder is up (`ibv_xsrq_pingpong`'s server sends before its client reaches RTR).
#[test]
fn a_request_dropped_before_the_responder_reached_rtr_is_sent_again_after_the_ack_timeout() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let (bctx, bqp) = (n.b.ctx, n.b.qp);
    n.b.e
        .modify_qp(now, bctx, bqp, qp_attr::STATE, &QpAttr::default())
        .unwrap();
    let src = n.a.map(0x10_0000, 4096, access::LOCAL_WRITE);
    let dst = n.b.map(0x80_0000, 4096, access::LOCAL_WRITE);
    n.a.set(&src, 0x10_0000, 0x10_0000, b"late");
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::Send,
            vec![sge(0x10_0000, 4, src.0.lkey)],
            0,
            0,
        ),
    );
    n.run();
    let (aq, al) = (n.a.qpn, n.a.lid);
    let all = access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    n.b.connect(now, aq, al, all);
    n.b.recv(now, 7, vec![sge(0x80_0000, 4096, dst.0.lkey)]);
    n.run();
    assert!(n.a.cqes().is_empty(), "dropped, not sent again yet");
    n.advance(Duration::from_millis(70));
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0000, 4), b"late");
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert_eq!(statuses(&n.b.cqes()), vec![(7, WcStatus::Success)]);
}

/// A context that dies names its QPs that were connected over a link (once), and the engine
/// at the other end, told, fails the QP connected to that one at once, even with nothing
/// posted (a peer that only waits for receives has no timer to find out by); a name that is
/// not its peer's (another QP number, another host) fails nothing.
#[test]
fn a_context_that_dies_names_its_linked_qps_and_the_peer_told_fails() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    // In ERR already (a garbage slot in its send ring failed it, as a tenant whose region
    // was truncated reads zeros, before its context went): named all the same, since its peer
    // still waits on it.
    n.b.e
        .handle_send_wqe(now, n.b.qp, Err(vrnic_wire::ParseError::Opcode(0xee)));
    n.run();
    assert_eq!(n.b.e.qp_state(n.b.qp), Some(QpState::Err));
    n.b.e.destroy_context(now, n.b.ctx);
    assert_eq!(n.b.e.take_died_remote(), vec![(n.a.id, n.b.qpn)]);
    assert!(n.b.e.take_died_remote().is_empty(), "taken once");
    n.a.e.peer_died(n.b.id, n.b.qpn ^ 1);
    n.a.e.peer_died(HostId(9), n.b.qpn);
    assert_eq!(n.a.e.qp_state(n.a.qp), Some(QpState::Rts), "not its peer");
    n.a.e.peer_died(n.b.id, n.b.qpn);
    assert_eq!(n.a.e.qp_state(n.a.qp), Some(QpState::Err));
}

/// A message of many segments (SEND, RDMA WRITE, RDMA WRITE with immediate) that loses some
/// on the way (a middle one, the last one, the first one, ACKs, several), and is sent again
/// from where the responder stopped (sequence NAK) or after the local ACK timeout: it lands
/// whole, once (with immediate: in its one receive), and both sides complete with success.
#[test]
fn a_multi_segment_message_that_loses_segments_lands_whole_once() {
    for op in [
        SendOpcode::Send,
        SendOpcode::RdmaWrite,
        SendOpcode::RdmaWriteWithImm,
    ] {
        for (what, a_to_b, b_to_a) in [
            ("a middle segment", vec![3], vec![]),
            ("the last segment", vec![15], vec![]),
            ("the first segment", vec![0], vec![]),
            ("two segments", vec![2, 9], vec![]),
            ("the ACKs", vec![], vec![0, 1, 2]),
            ("segments and ACKs", vec![5], vec![0]),
            ("a retransmitted segment", vec![3, 16, 17], vec![]),
        ] {
            let what = format!("{op:?}, losing {what}");
            let mut n = Net::new(QpType::Rc);
            n.lose = [a_to_b, b_to_a];
            let m = Message::post(&mut n, op);
            n.run();
            m.landed_once(&mut n, &what);
        }
    }
}

/// A READ of many response segments that loses some of them on the way back (a middle one,
/// the first, the last, two): the responses after a lost one are not taken (the READ never
/// completes with a hole in it), the READ is asked for again from the missing segment, and it
/// completes once with every byte read.
#[test]
fn a_read_that_loses_response_segments_completes_whole() {
    for (what, b_to_a) in [
        ("a middle response", vec![3]),
        ("the first response", vec![0]),
        ("the last response", vec![15]),
        ("two responses", vec![2, 9]),
    ] {
        let mut n = Net::new(QpType::Rc);
        n.lose = [vec![], b_to_a];
        let len = Message::LEN;
        let now = n.now;
        let local = n.a.map(0x10_0000, len, access::LOCAL_WRITE);
        let remote =
            n.b.map(0x80_0000, len, access::LOCAL_WRITE | access::REMOTE_READ);
        let data = pattern(len as usize, 11);
        n.b.set(&remote, 0x80_0000, 0x80_0000, &data);
        let sges = vec![sge(0x10_0000, len as u32, local.0.lkey)];
        n.a.post(
            now,
            wqe(1, SendOpcode::RdmaRead, sges, 0x80_0000, remote.0.rkey),
        );
        n.run();
        for _ in 0..20 {
            n.advance(Duration::from_millis(100));
        }
        assert_eq!(
            statuses(&n.a.cqes()),
            vec![(1, WcStatus::Success)],
            "losing {what}"
        );
        let got = n.a.get(&local, 0x10_0000, 0x10_0000, len as usize);
        same(&got, &data, &format!("losing {what}"));
    }
}

/// A message of [`Message::LEN`] bytes from a to b, the WR posted (with a receive on b).
struct Message {
    op: SendOpcode,
    dst: (MrKeys, Vec<u64>),
    data: Vec<u8>,
}

impl Message {
    const LEN: u64 = 1024 * 1024;

    /// Its source written, a receive of twice its length posted on b, its WR (id 1) on a:
    /// SEND, or an RDMA WRITE (with or without immediate) to the receive buffer's start.
    fn post(n: &mut Net, op: SendOpcode) -> Message {
        let len = Self::LEN;
        let now = n.now;
        let src = n.a.map(0x10_0000, len, access::LOCAL_WRITE);
        let dst = n.b.map(
            0x80_0000,
            2 * len,
            access::LOCAL_WRITE | access::REMOTE_WRITE,
        );
        let data = pattern(len as usize, 5);
        n.a.set(&src, 0x10_0000, 0x10_0000, &data);
        n.b.recv(now, 7, vec![sge(0x80_0000, 2 * len as u32, dst.0.lkey)]);
        let sges = vec![sge(0x10_0000, len as u32, src.0.lkey)];
        n.a.post(now, wqe(1, op, sges, 0x80_0000, dst.0.rkey));
        Message { op, dst, data }
    }

    /// After two seconds of timers: the requester succeeded, b's receive completed once with
    /// the whole length (not for a plain WRITE), and every byte is where it belongs.
    fn landed_once(&self, n: &mut Net, what: &str) {
        for _ in 0..20 {
            n.advance(Duration::from_millis(100));
        }
        assert_eq!(
            statuses(&n.a.cqes()),
            vec![(1, WcStatus::Success)],
            "{what}: the requester"
        );
        let cb = n.b.cqes();
        if self.op == SendOpcode::RdmaWrite {
            assert!(cb.is_empty(), "{what}: {cb:?}");
        } else {
            assert_eq!(
                statuses(&cb),
                vec![(7, WcStatus::Success)],
                "{what}: one receive"
            );
            assert_eq!(u64::from(cb[0].byte_len), Self::LEN, "{what}");
        }
        let got = n.b.get(&self.dst, 0x80_0000, 0x80_0000, Self::LEN as usize);
        same(&got, &self.data, what);
    }
}

/// Hands frames (encoded, in order) that `from` sent to `to`, as a link that was slow.
fn deliver_late(to: &mut Host, from: HostId, now: Instant, frames: &[Vec<u8>]) {
    for buf in frames {
        let frame = Frame::new_checked(&buf[..]).expect("a whole frame");
        let repr = FrameRepr::parse(&frame).expect("a valid frame");
        let FrameRepr::Segment { addr, grh, segment } = repr else {
            panic!("a segment");
        };
        let sender = Sender {
            addr,
            grh: grh.as_ref(),
        };
        let payload = &buf[repr.payload_range()];
        to.e.handle_segment(now, from, sender, &segment, payload, &mut to.mem);
    }
}

/// Everything `h` has to send now, encoded, kept back (a slow link).
fn hold(h: &mut Host, now: Instant, held: &mut Vec<Vec<u8>>) {
    while h.e.process(now, &mut h.mem) {}
    while let Some(t) = h.e.poll_transmit() {
        let mut buf = Vec::new();
        assert!(t.encode(&mut h.mem, &mut buf), "a consistent frame");
        held.push(buf);
    }
}

/// A slow link, not a lossy one: the requester's local ACK timeout expires while its segments
/// are still on the way, so it sends them again behind the first copies (as an engine thread
/// starved of CPU does between shards, or a congested link). Every copy arrives, in order:
/// the message still lands whole and once, in its one receive, and both sides succeed.
#[test]
fn segments_sent_again_behind_their_slow_first_copies_land_once() {
    for op in [
        SendOpcode::Send,
        SendOpcode::RdmaWrite,
        SendOpcode::RdmaWriteWithImm,
    ] {
        for timeouts in [1, 2, 3] {
            let what = format!("{op:?}, {timeouts} timeouts");
            let mut n = Net::new(QpType::Rc);
            let m = Message::post(&mut n, op);
            let mut held = Vec::new();
            hold(&mut n.a, n.now, &mut held);
            for _ in 0..timeouts {
                n.now += Duration::from_millis(100);
                n.a.e.handle_timeout(n.now);
                hold(&mut n.a, n.now, &mut held);
            }
            let a_id = n.a.id;
            deliver_late(&mut n.b, a_id, n.now, &held);
            n.run();
            m.landed_once(&mut n, &what);
        }
    }
}

/// An RDMA WRITE with immediate of many segments whose last one finds no receive (RNR NAK):
/// sent again once a receive is posted, it lands whole, completes both sides, and its bytes
/// went where its RETH said (the cursor of the WRITE was kept across the RNR wait).
#[test]
fn a_multi_segment_write_with_immediate_waits_out_rnr_and_lands_whole() {
    let len = 1024 * 1024u64;
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let src = n.a.map(0x10_0000, len, access::LOCAL_WRITE);
    let dst =
        n.b.map(0x80_0000, len, access::LOCAL_WRITE | access::REMOTE_WRITE);
    let data = pattern(len as usize, 9);
    n.a.set(&src, 0x10_0000, 0x10_0000, &data);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWriteWithImm,
            vec![sge(0x10_0000, len as u32, src.0.lkey)],
            0x80_0000,
            dst.0.rkey,
        ),
    );
    n.run();
    assert!(n.a.cqes().is_empty(), "waiting for a receive");
    n.b.recv(n.now, 7, vec![sge(0x80_0000, 16, dst.0.lkey)]);
    for _ in 0..20 {
        n.advance(Duration::from_millis(100));
    }
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    let cb = n.b.cqes();
    assert_eq!(statuses(&cb), vec![(7, WcStatus::Success)]);
    assert_eq!(cb[0].byte_len as u64, len);
    same(
        &n.b.get(&dst, 0x80_0000, 0x80_0000, len as usize),
        &data,
        "the WRITE after its RNR wait",
    );
}

/// An ATOMIC WRITE work request as `ibv_wr_atomic_write` writes it: 8 bytes inline.
fn atomic_write(wr_id: u64, data: [u8; 8], remote_addr: u64, rkey: u32) -> SendWqe {
    let mut w = wqe(wr_id, SendOpcode::AtomicWrite, vec![], remote_addr, rkey);
    w.flags = SendFlags::SIGNALED | SendFlags::INLINE;
    w.payload = SendPayload::Inline(data.as_slice().into());
    w
}

/// ATOMIC WRITE crosses the link as IBA 1.5's opcode (a RETH, 8 bytes of payload), is never
/// read into place (the receiver copies the word in with one atomic store), lands exactly,
/// and completes `IBV_WC_ATOMIC_WRITE` once the ACK comes, in order with a WRITE before it.
#[test]
fn an_atomic_write_crosses_the_link_and_lands_its_eight_bytes() {
    let mut n = Net::new(QpType::Rc);
    n.into[0].place = true;
    let now = n.now;
    let src = n.a.map(0x10_0000, 64 << 10, access::LOCAL_WRITE);
    let dst = n.b.map(
        0x80_0000,
        64 << 10,
        access::LOCAL_WRITE | access::REMOTE_WRITE,
    );
    n.b.set(&dst, 0x80_0000, 0x80_0ff8, &[0xee; 24]);
    let w = pattern(20 << 10, 4);
    n.a.set(&src, 0x10_0000, 0x10_0000, &w);
    n.a.post(
        now,
        wqe(
            1,
            SendOpcode::RdmaWrite,
            vec![sge(0x10_0000, 20 << 10, src.0.lkey)],
            0x80_2000,
            dst.0.rkey,
        ),
    );
    let data = 0xfedc_ba98_7654_3210u64.to_le_bytes();
    n.a.post(now, atomic_write(2, data, 0x80_1000, dst.0.rkey));
    n.run();
    let c = n.a.cqes();
    assert_eq!(
        statuses(&c),
        vec![(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    assert_eq!((c[1].opcode, c[1].byte_len), (WcOpcode::AtomicWrite, 8));
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0ff8, 8), [0xee; 8]);
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_1000, 8), data);
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_1008, 8), [0xee; 8]);
    same(&n.b.get(&dst, 0x80_0000, 0x80_2000, 20 << 10), &w, "WRITE");
    // The WRITE's segment was read into place; the ATOMIC WRITE's was not.
    assert_eq!(n.into[0].placed, 1);
    assert!(n.b.cqes().is_empty(), "no receive taken");
}

/// An ATOMIC WRITE sent again (its ACK lost, the local ACK timer expired) is a duplicate at
/// the responder: acknowledged, not stored again, so a value the app wrote since stays
/// (IB 9.7.5.1.2, as a duplicate WRITE).
#[test]
fn an_atomic_write_sent_again_is_acked_without_storing_twice() {
    let mut n = Net::new(QpType::Rc);
    let now = n.now;
    let dst =
        n.b.map(0x80_0000, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE);
    // b's first answer (the ACK) is lost.
    n.lose[1] = vec![0];
    n.a.post(now, atomic_write(1, [0x11; 8], 0x80_0040, dst.0.rkey));
    n.run();
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0040, 8), [0x11; 8]);
    assert!(n.a.cqes().is_empty(), "unanswered");
    // The app at b writes the word meanwhile.
    n.b.set(&dst, 0x80_0000, 0x80_0040, &[0x22; 8]);
    n.advance(Duration::from_millis(100));
    assert_eq!(n.offered[0], 2, "the ATOMIC WRITE went twice");
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::Success)]);
    assert_eq!(
        n.b.get(&dst, 0x80_0000, 0x80_0040, 8),
        [0x22; 8],
        "the duplicate stored nothing"
    );
}

/// Over the link as on one engine: an MR without remote write refuses an ATOMIC WRITE with
/// `REM_ACCESS_ERR` (remote atomic access is not what it needs), a misaligned one is
/// `REM_INV_REQ_ERR`; nothing is stored.
#[test]
fn an_atomic_write_over_the_link_is_refused_as_on_one_engine() {
    for (acc, at, want) in [
        (
            access::LOCAL_WRITE | access::REMOTE_ATOMIC | access::REMOTE_READ,
            0x80_0040,
            WcStatus::RemAccessErr,
        ),
        (
            access::LOCAL_WRITE | access::REMOTE_WRITE,
            0x80_0044,
            WcStatus::RemInvReqErr,
        ),
    ] {
        let mut n = Net::new(QpType::Rc);
        let now = n.now;
        let dst = n.b.map(0x80_0000, 4096, acc);
        n.a.post(now, atomic_write(1, [0x33; 8], at, dst.0.rkey));
        n.run();
        assert_eq!(statuses(&n.a.cqes()), vec![(1, want)], "{acc:#x} {at:#x}");
        assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0000, 4096), vec![0; 4096]);
        assert_eq!(n.a.e.qp_state(n.a.qp), Some(QpState::Err));
        assert_eq!(n.b.e.qp_state(n.b.qp), Some(QpState::Err));
    }
}

/// A UC QP has no ATOMIC WRITE (no such opcode on UC): it fails locally, nothing is sent.
#[test]
fn an_atomic_write_on_uc_over_the_link_is_loc_qp_op_err_and_sends_nothing() {
    let mut n = Net::new(QpType::Uc);
    let now = n.now;
    let dst =
        n.b.map(0x80_0000, 4096, access::LOCAL_WRITE | access::REMOTE_WRITE);
    n.a.post(now, atomic_write(1, [0x44; 8], 0x80_0040, dst.0.rkey));
    n.run();
    assert_eq!(statuses(&n.a.cqes()), vec![(1, WcStatus::LocQpOpErr)]);
    assert_eq!(n.offered[0], 0);
    assert_eq!(n.b.get(&dst, 0x80_0000, 0x80_0040, 8), [0; 8]);
}

/// A message longer than the window over a link (6 MiB: 96 full segments, against
/// [`WINDOW_FULL`]): no more than the window leaves before an answer (what is in flight
/// crosses the link well within an ACK timeout, and a timeout sends no more than that again),
/// and the message goes on as its segments are answered, to one successful completion with
/// every byte in place. SEND, WRITE and READ; with its first window delivered, and lost whole.
#[test]
fn a_message_longer_than_the_window_goes_a_window_at_a_time_and_lands_whole() {
    const LEN: u64 = 6 << 20;
    const VA: u64 = 0x100_0000;
    assert!(
        LEN > u64::from(WINDOW_FULL) * SEGMENT,
        "longer than the window"
    );
    for op in [
        SendOpcode::Send,
        SendOpcode::RdmaWrite,
        SendOpcode::RdmaRead,
    ] {
        for lost in [false, true] {
            let what = format!(
                "{op:?}, first window {}",
                if lost { "lost" } else { "delivered" }
            );
            let mut n = Net::new(QpType::Rc);
            let now = n.now;
            let data = pattern(LEN as usize, 23);
            let read = op == SendOpcode::RdmaRead;
            // The source is b's for a READ, a's otherwise; the destination the other's.
            let (src_acc, dst_acc) = if read {
                (
                    access::LOCAL_WRITE | access::REMOTE_READ,
                    access::LOCAL_WRITE,
                )
            } else {
                (
                    access::LOCAL_WRITE,
                    access::LOCAL_WRITE | access::REMOTE_WRITE,
                )
            };
            let (local, remote) = if read {
                let local = n.a.map(VA, LEN, dst_acc);
                let remote = n.b.map(VA, LEN, src_acc);
                n.b.set(&remote, VA, VA, &data);
                (local, remote)
            } else {
                let local = n.a.map(VA, LEN, src_acc);
                let remote = n.b.map(VA, LEN, dst_acc);
                n.a.set(&local, VA, VA, &data);
                (local, remote)
            };
            if op == SendOpcode::Send {
                n.b.recv(now, 7, vec![sge(VA, LEN as u32, remote.0.lkey)]);
            }
            let sges = vec![sge(VA, LEN as u32, local.0.lkey)];
            n.a.post(now, wqe(1, op, sges, VA, remote.0.rkey));
            let mut held = Vec::new();
            hold(&mut n.a, now, &mut held);
            assert!(
                !held.is_empty() && held.len() as u32 <= WINDOW_FULL,
                "{what}: {} segments before any answer",
                held.len()
            );
            if !lost {
                deliver_late(&mut n.b, n.a.id, now, &held);
            }
            n.run();
            for _ in 0..20 {
                n.advance(Duration::from_millis(100));
            }
            assert_eq!(
                statuses(&n.a.cqes()),
                vec![(1, WcStatus::Success)],
                "{what}"
            );
            let got = if read {
                n.a.get(&local, VA, VA, LEN as usize)
            } else {
                n.b.get(&remote, VA, VA, LEN as usize)
            };
            same(&got, &data, &what);
            if op == SendOpcode::Send {
                let cb = n.b.cqes();
                assert_eq!(statuses(&cb), vec![(7, WcStatus::Success)], "{what}");
                assert_eq!(u64::from(cb[0].byte_len), LEN, "{what}");
            }
        }
    }
}

/// A vRNIC's meter counts what its QPs did (the data path counts on the QP alone), and keeps
/// it when the QP is destroyed: a WRITE's requester and responder sides, and its completion.
#[test]
fn a_vrnics_meter_keeps_its_qps_counts_after_they_are_destroyed() {
    let mut n = Net::new(QpType::Rc);
    let m = Message::post(&mut n, SendOpcode::RdmaWrite);
    n.run();
    m.landed_once(&mut n, "a WRITE");
    let write = vrnic_proto::CLASSES
        .iter()
        .position(|&c| c == "write")
        .unwrap();
    let check = |n: &Net, what: &str| {
        let a = n.a.e.meter(n.a.vnic).expect("a's vRNIC");
        let b = n.b.e.meter(n.b.vnic).expect("b's vRNIC");
        assert_eq!(
            (a.sent[write].wrs, a.sent[write].bytes),
            (1, Message::LEN),
            "{what}"
        );
        assert_eq!(a.completions[0], 1, "{what}: one successful completion");
        assert_eq!(
            (b.received[write].wrs, b.received[write].bytes),
            (1, Message::LEN),
            "{what}"
        );
    };
    check(&n, "with its QPs");
    let now = n.now;
    n.a.e.destroy_qp(now, n.a.ctx, n.a.qp).unwrap();
    n.b.e.destroy_qp(now, n.b.ctx, n.b.qp).unwrap();
    check(&n, "after its QPs were destroyed");
}
