//! The engine as the trust boundary, driven by a hostile requester: hundreds of thousands of
//! random work requests (random opcodes and flags, remote addresses around and inside the
//! victim's MR, guessed rkeys, random SGEs and lengths, and raw slots of random bytes) from a
//! QP connected to a victim's QP whose access flags allow everything. Only an rkey protects the
//! victim, and the attacker never has it. The engine must not panic, must complete every WQE,
//! and must never read or write a byte of the victim's region; the attacker's own accesses stay
//! inside the pages it registered. Deterministic (a fixed seed), so a failure reproduces.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use vrnic_proto::{CtxId, Engine, Loc, Memory, MemoryRefused, PdId, QpId, VnicId};
use vrnic_wire::{
    AhAttr, QpAttr, QpCap, QpState, QpType, SQ_SLOT, SendFlags, SendOpcode, SendPayload, SendWqe,
    Sge, UdAddr, access, qp_attr,
};

const PAGE: u64 = 4096;

/// Regions that refuse (panic on) any access the engine should never make.
struct Guarded {
    regions: HashMap<VnicId, Vec<u8>>,
    victim: VnicId,
    /// Region pages the attacker registered.
    attacker_pages: Vec<u64>,
}

impl Guarded {
    fn check(&self, at: Loc, len: usize) {
        assert!(
            at.vnic != self.victim,
            "the victim's region was touched at {:?}",
            at
        );
        let first = at.off / PAGE;
        let last = (at.off + len as u64).div_ceil(PAGE);
        for p in first..last.max(first + 1) {
            if len > 0 {
                assert!(
                    self.attacker_pages.contains(&(p * PAGE)),
                    "access outside the attacker's registered pages at {:?}+{len}",
                    at
                );
            }
        }
    }
}

impl Memory for Guarded {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        self.check(src, len);
        self.check(dst, len);
        let data = self.regions[&src.vnic][src.off as usize..][..len].to_vec();
        self.write(dst, &data)
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        self.check(dst, data.len());
        let r = self.regions.get_mut(&dst.vnic).expect("vnic");
        r[dst.off as usize..][..data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        self.check(src, out.len());
        out.copy_from_slice(&self.regions[&src.vnic][src.off as usize..][..out.len()]);
        Ok(())
    }
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        assert!(
            dst.off.is_multiple_of(8),
            "misaligned atomic store at {dst:?}"
        );
        self.write(dst, &value)
    }
}

/// splitmix64: a deterministic stream of random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Side {
    ctx: CtxId,
    qp: QpId,
    qpn: u32,
    lid: u16,
}

fn side(e: &mut Engine, id: u32, lid: u16) -> (Side, PdId) {
    let (vnic, ctx) = (VnicId(id), CtxId(id));
    e.add_vnic(vnic, lid, [id as u8; 16]);
    let pd = e.alloc_pd(vnic, ctx).unwrap();
    let cq = e.create_cq(vnic, ctx, 4096).unwrap();
    let cap = QpCap {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 16,
        max_recv_sge: 16,
        max_inline_data: 256,
    };
    let (qp, qpn) = e
        .create_qp(ctx, pd, cq, cq, QpType::Rc, cap, false)
        .unwrap();
    (Side { ctx, qp, qpn, lid }, pd)
}

/// RESET -> INIT -> RTR -> RTS toward `peer`, allowing every remote access.
fn connect(e: &mut Engine, now: Instant, s: &Side, peer: &Side) {
    let all = access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    let mut a = QpAttr {
        qp_state: QpState::Reset,
        ..Default::default()
    };
    e.modify_qp(now, s.ctx, s.qp, qp_attr::STATE, &a).unwrap();
    a.qp_state = QpState::Init;
    a.port_num = 1;
    a.qp_access_flags = all;
    let init = qp_attr::STATE | qp_attr::PKEY_INDEX | qp_attr::PORT | qp_attr::ACCESS_FLAGS;
    e.modify_qp(now, s.ctx, s.qp, init, &a).unwrap();
    a.qp_state = QpState::Rtr;
    a.path_mtu = 5;
    a.dest_qp_num = peer.qpn;
    a.min_rnr_timer = 1;
    a.max_dest_rd_atomic = 16;
    a.ah_attr = AhAttr {
        dlid: peer.lid,
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
    a.timeout = 1;
    a.retry_cnt = 0;
    a.rnr_retry = 0;
    a.max_rd_atomic = 16;
    let rts = qp_attr::STATE
        | qp_attr::SQ_PSN
        | qp_attr::TIMEOUT
        | qp_attr::RETRY_CNT
        | qp_attr::RNR_RETRY
        | qp_attr::MAX_QP_RD_ATOMIC;
    e.modify_qp(now, s.ctx, s.qp, rts, &a).unwrap();
}

fn random_wqe(r: &mut Rng, attacker_lkey: u32, victim_addr: u64, victim_key: u32) -> SendWqe {
    let opcode = [
        SendOpcode::Send,
        SendOpcode::SendWithImm,
        SendOpcode::RdmaWrite,
        SendOpcode::RdmaWriteWithImm,
        SendOpcode::RdmaRead,
        SendOpcode::AtomicCmpAndSwp,
        SendOpcode::AtomicFetchAndAdd,
    ][r.below(7) as usize];
    // Guess keys: random, near the real one, or keys of nothing; never the real one.
    let mut rkey = match r.below(4) {
        0 => r.next() as u32,
        1 => victim_key ^ (1 << r.below(32)),
        2 => victim_key.wrapping_add(r.below(16) as u32 + 1),
        _ => attacker_lkey,
    };
    if rkey == victim_key {
        rkey ^= 1;
    }
    let remote_addr = match r.below(4) {
        0 => victim_addr + r.below(1 << 20),
        1 => victim_addr.wrapping_sub(r.below(8192)),
        2 => r.next(),
        _ => victim_addr,
    };
    let n = r.below(18) as usize; // may exceed MAX_SGE
    let sges = (0..n)
        .map(|_| Sge {
            addr: if r.below(2) == 0 {
                0x10_0000 + r.below(3 * PAGE)
            } else {
                r.next()
            },
            length: match r.below(4) {
                0 => r.below(64) as u32,
                1 => r.below(2 * PAGE) as u32,
                2 => r.next() as u32,
                _ => 8,
            },
            lkey: if r.below(4) == 0 {
                r.next() as u32
            } else {
                attacker_lkey
            },
        })
        .collect::<Vec<_>>();
    let payload = if r.below(5) == 0 {
        SendPayload::Inline(vec![0xAB; r.below(300) as usize].into())
    } else {
        SendPayload::Sges(sges.into())
    };
    SendWqe {
        wr_id: r.next(),
        opcode,
        flags: SendFlags((r.next() & 0xf) as u8),
        imm_data: r.next() as u32,
        remote_addr,
        rkey,
        compare_add: r.next(),
        swap: r.next(),
        ud: UdAddr {
            ah: r.next() as u32,
            remote_qpn: r.next() as u32,
            remote_qkey: r.next() as u32,
        },
        xrc_srqn: 0,
        payload,
    }
}

#[test]
fn random_work_requests_never_reach_the_victim() {
    let mut e = Engine::new(99);
    let mut now = Instant::now();
    let (a, apd) = side(&mut e, 1, 10);
    let (b, bpd) = side(&mut e, 2, 20);
    // The attacker's MR: three pages at 0x10_0000 (region pages 1..=3).
    let attacker_pages = vec![PAGE, 2 * PAGE, 3 * PAGE];
    let ak = e
        .reg_mr(
            a.ctx,
            apd,
            0x10_0000,
            3 * PAGE,
            0x10_0000,
            access::LOCAL_WRITE,
            &[(PAGE, 3)],
        )
        .unwrap();
    // The victim's MR allows every remote access: only its rkey protects it.
    let victim_addr = 0x7000_0000;
    let all =
        access::LOCAL_WRITE | access::REMOTE_WRITE | access::REMOTE_READ | access::REMOTE_ATOMIC;
    let vk = e
        .reg_mr(
            b.ctx,
            bpd,
            victim_addr,
            64 * PAGE,
            victim_addr,
            all,
            &[(PAGE, 64)],
        )
        .unwrap();
    connect(&mut e, now, &a, &b);
    connect(&mut e, now, &b, &a);
    let mut mem = Guarded {
        regions: [
            (VnicId(1), vec![0u8; 8 << 20]),
            (VnicId(2), vec![0x5Au8; 8 << 20]),
        ]
        .into_iter()
        .collect(),
        victim: VnicId(2),
        attacker_pages,
    };
    let mut r = Rng(0x5eed);
    let (mut posted, mut completed, mut reconnects) = (0u64, 0u64, 0u64);
    let rounds: u64 = std::env::var("VRNIC_HOSTILE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    for i in 0..rounds {
        let w = if r.below(8) == 0 {
            // A raw slot of random bytes, parsed as the daemon parses it.
            let mut slot = [0u8; SQ_SLOT];
            for chunk in slot.chunks_mut(8) {
                chunk.copy_from_slice(&r.next().to_le_bytes());
            }
            SendWqe::parse(&slot)
        } else {
            Ok(random_wqe(&mut r, ak.lkey, victim_addr, vk.rkey))
        };
        e.handle_send_wqe(now, a.qp, w);
        posted += 1;
        for _ in 0..64 {
            if !e.process(now, &mut mem) {
                break;
            }
        }
        if i % 16 == 0 {
            now += Duration::from_millis(50);
            e.handle_timeout(now);
            while e.process(now, &mut mem) {}
        }
        while e.poll_completion().is_some() {
            completed += 1;
        }
        while e.poll_event().is_some() {}
        if e.qp_state(a.qp) != Some(QpState::Rts) || e.qp_state(b.qp) != Some(QpState::Rts) {
            connect(&mut e, now, &a, &b);
            connect(&mut e, now, &b, &a);
            reconnects += 1;
        }
    }
    // Drain: every WQE completes (flushed or failed), nothing is left queued.
    now += Duration::from_secs(10);
    e.handle_timeout(now);
    while e.process(now, &mut mem) {}
    let mut a_err = QpAttr {
        qp_state: QpState::Err,
        ..Default::default()
    };
    a_err.qp_state = QpState::Err;
    e.modify_qp(now, a.ctx, a.qp, qp_attr::STATE, &a_err)
        .unwrap();
    while e.poll_completion().is_some() {
        completed += 1;
    }
    assert!(
        mem.regions[&VnicId(2)].iter().all(|&b| b == 0x5A),
        "victim bytes changed"
    );
    assert!(
        reconnects > 100,
        "the attack hardly ran: {reconnects} reconnects"
    );
    // Unsignaled successes give no completion; every failure does (errors are always reported).
    assert!(
        completed > 0 && completed <= posted,
        "{completed} of {posted}"
    );
}
