//! A client that skips the driver library: it attaches to a vRNIC, creates objects through the
//! control mailbox, then writes garbage where the daemon reads (producer indices, WQE slots,
//! control requests). Each time the daemon fails only what the garbage touched, and an
//! unrelated pair of unmodified apps keeps passing `ibv_rc_pingpong -c`.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Daemon, port, require, run_pair};
use vrnic_api::{AdminReply, AdminRequest, Reply, Request};
use vrnic_shm::{Mailbox, Region, Ring};
use vrnic_wire::{QpCap, QpState, QpType, RQ_SLOT, SQ_SLOT};

struct Hostile {
    region: Region,
    sock: UnixStream,
    mailbox: Mailbox,
    seq: u32,
    _hold: UnixStream,
}

impl Hostile {
    fn attach(d: &Daemon, name: &str) -> Hostile {
        let mut hold = UnixStream::connect(d.dir.join("vrnic.sock")).expect("admin socket");
        let req = serde_json::to_vec(&AdminRequest::Hold {
            name: Some(name.into()),
        })
        .unwrap();
        hold.write_all(&req).unwrap();
        hold.write_all(b"\n").unwrap();
        let mut line = Vec::new();
        let mut b = [0u8; 1];
        while hold.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        let AdminReply::Vnic(v) = serde_json::from_slice(&line).unwrap() else {
            panic!("hold")
        };
        let mut sock = UnixStream::connect(format!("{}/sock", v.dir)).expect("vnic socket");
        let mut idx = [0u8; 4];
        sock.read_exact(&mut idx).unwrap();
        let region = Region::open(std::path::Path::new(&format!("{}/region", v.dir))).unwrap();
        Hostile {
            region,
            sock,
            mailbox: Mailbox::new(u32::from_le_bytes(idx)).unwrap(),
            seq: 0,
            _hold: hold,
        }
    }

    fn raw_call(&mut self, bytes: &[u8]) -> Reply {
        self.seq += 1;
        let sock = &self.sock;
        let out = self
            .mailbox
            .call(
                &self.region,
                self.seq,
                bytes,
                &mut || drop((&*sock).write(&[0])),
                &mut || true,
                Duration::from_secs(10),
            )
            .expect("daemon answers");
        serde_json::from_slice(&out).expect("reply parses")
    }

    fn call(&mut self, req: &Request) -> Reply {
        self.raw_call(&serde_json::to_vec(req).unwrap())
    }

    fn kick(&self) {
        let _ = (&self.sock).write(&[0]);
    }
}

fn rc_qp(h: &mut Hostile) -> (u32, Ring, Ring) {
    let Reply::Handle(pd) = h.call(&Request::AllocPd) else {
        panic!("pd")
    };
    let Reply::Cq { cq, .. } = h.call(&Request::CreateCq { cqe: 16 }) else {
        panic!("cq")
    };
    let cap = QpCap {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let req = Request::CreateQp {
        pd,
        send_cq: cq,
        recv_cq: cq,
        qp_type: QpType::Rc,
        cap,
        sq_sig_all: false,
        srq: None,
    };
    let Reply::Qp {
        qp,
        sq,
        sq_depth,
        rq,
        rq_depth,
        ..
    } = h.call(&req)
    else {
        panic!("qp")
    };
    let sq = Ring::new(&h.region, sq, sq_depth, SQ_SLOT).unwrap();
    let rq = Ring::new(&h.region, rq, rq_depth, RQ_SLOT).unwrap();
    let mut attr = vrnic_wire::QpAttr {
        qp_state: QpState::Init,
        port_num: 1,
        ..Default::default()
    };
    attr.qp_access_flags = 0;
    use vrnic_wire::qp_attr::*;
    assert_eq!(
        h.call(&Request::ModifyQp {
            qp,
            mask: STATE | PKEY_INDEX | PORT | ACCESS_FLAGS,
            attr: Box::new(attr)
        }),
        Reply::Ok
    );
    (qp, sq, rq)
}

fn state(h: &mut Hostile, qp: u32) -> QpState {
    match h.call(&Request::QueryQp { qp }) {
        Reply::QpAttr(a) => a.qp_state,
        r => panic!("query: {r:?}"),
    }
}

fn wait_state(h: &mut Hostile, qp: u32, want: QpState) {
    let start = std::time::Instant::now();
    while state(h, qp) != want {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "QP never reached {want:?}"
        );
        h.kick();
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn garbage_from_a_client_fails_only_its_own_objects() {
    require("ibv_rc_pingpong");
    let mut d = Daemon::start();
    let mut h = Hostile::attach(&d, "hostile0");

    // Control requests that are not JSON, name bad handles, or ask for absurd sizes.
    assert!(matches!(
        h.raw_call(b"\xff\x00garbage{{{"),
        Reply::Err { errno: 22, .. }
    ));
    assert!(matches!(
        h.call(&Request::DestroyQp { qp: 0xdead }),
        Reply::Err { .. }
    ));
    assert!(matches!(
        h.call(&Request::DeregMr { mr: 7 }),
        Reply::Err { .. }
    ));
    assert!(matches!(
        h.call(&Request::CreateCq { cqe: u32::MAX }),
        Reply::Err { errno: 22, .. }
    ));
    assert!(matches!(
        h.call(&Request::RegMr {
            pd: 1,
            addr: u64::MAX - 10,
            len: 100,
            iova: 0,
            access: 1
        }),
        Reply::Err { .. }
    ));
    assert!(matches!(
        h.call(&Request::RegMr {
            pd: 0xbad,
            addr: 0x1000,
            len: 1 << 40,
            iova: 0x1000,
            access: 1
        }),
        Reply::Err { .. }
    ));

    // A receive ring whose producer index runs far ahead of what the ring holds.
    let (qp1, _sq1, rq1) = rc_qp(&mut h);
    rq1.prod(&h.region).store(0x8000_0000, Ordering::Release);
    h.kick();
    wait_state(&mut h, qp1, QpState::Err);

    // A receive WQE slot full of garbage (SGE count far past the limit).
    let (qp2, _sq2, rq2) = rc_qp(&mut h);
    rq2.write_slot(&h.region, 0, &[0xff; RQ_SLOT]);
    rq2.prod(&h.region).store(1, Ordering::Release);
    h.kick();
    wait_state(&mut h, qp2, QpState::Err);

    // A fresh QP of the same client is still fine: the errors stayed on their QPs.
    let (qp3, _, _) = rc_qp(&mut h);
    assert_eq!(state(&mut h, qp3), QpState::Init);

    // The daemon lives, and unmodified apps on other vRNICs work.
    assert!(d.alive());
    let p = port().to_string();
    let pair = run_pair(
        &d,
        &["ibv_rc_pingpong", "-p", &p, "-c"],
        &["ibv_rc_pingpong", "-p", &p, "-c", "localhost"],
        Duration::from_secs(60),
    );
    pair.assert_ok();
}
