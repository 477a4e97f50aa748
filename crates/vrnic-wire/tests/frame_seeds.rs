//! The seed corpus of the `frame` fuzz target (`fuzz/corpus/frame/seed-*`): one valid frame
//! of each shape a peer link carries. This test checks that the files are these frames and
//! that each parses; `VRNIC_WRITE_SEEDS=1 cargo test -p vrnic-wire --test frame_seeds`
//! (re)writes them after a format change.

use std::path::PathBuf;

use vrnic_wire::frame::{
    AddrRepr, Aeth, AtomicAckEth, AtomicEth, ControlKind, ControlRepr, Deth, Frame, FrameRepr,
    GrhRepr, NakCode, Op, Opcode, Reth, SegmentRepr, Syndrome, Transport,
};

/// The address word of every seed: from LID 0x11's QP 0x22 to LID 0x33.
const ADDR: AddrRepr = AddrRepr {
    dlid: 0x33,
    slid: 0x11,
    src_qpn: 0x22,
};

/// A segment of `op` on `t` to QP 0x11 at PSN 0x100, with `f` filling in its headers.
fn seg(t: Transport, op: Op, payload_len: usize, f: impl FnOnce(&mut SegmentRepr)) -> FrameRepr {
    let opcode = Opcode::new(t, op).expect("the seed names an opcode that exists");
    let mut s = SegmentRepr::new(opcode, 0x11, 0x100);
    s.payload_len = payload_len;
    f(&mut s);
    FrameRepr::Segment {
        addr: ADDR,
        grh: None,
        segment: s,
    }
}

fn reth(s: &mut SegmentRepr) {
    s.reth = Some(Reth {
        va: 0x7f12_3456_0000,
        rkey: 0x203,
        dma_len: 0x300,
    });
}

fn aeth(syndrome: Syndrome) -> impl FnOnce(&mut SegmentRepr) {
    move |s| {
        s.aeth = Some(Aeth { syndrome, msn: 3 });
    }
}

fn atomic(s: &mut SegmentRepr) {
    s.ack_req = true;
    s.atomic = Some(AtomicEth {
        va: 0x7f00_0000_0040,
        rkey: 0x204,
        swap_add: 1,
        compare: 0,
    });
}

/// An ATOMIC WRITE's RETH: an aligned word, DMA length 8 (its 8 bytes follow).
fn atomic_write(s: &mut SegmentRepr) {
    s.ack_req = true;
    s.reth = Some(Reth {
        va: 0x7f00_0000_0048,
        rkey: 0x205,
        dma_len: 8,
    });
}

fn control(kind: ControlKind, body_len: usize) -> FrameRepr {
    FrameRepr::Control(ControlRepr { kind, body_len })
}

/// The seeds, by name.
fn seeds() -> Vec<(&'static str, FrameRepr)> {
    use Op::*;
    use Transport::*;
    let ack = Syndrome::Ack { credits: 31 };
    vec![
        ("rc-send-first", seg(Rc, SendFirst, 256, |_| {})),
        ("rc-send-middle", seg(Rc, SendMiddle, 256, |_| {})),
        (
            "rc-send-last-imm",
            seg(Rc, SendLastWithImm, 3, |s| {
                s.solicited = true;
                s.ack_req = true;
                s.imm = Some(0x1234_5678);
            }),
        ),
        (
            "rc-send-only-empty",
            seg(Rc, SendOnly, 0, |s| s.ack_req = true),
        ),
        (
            "rc-send-only-inv",
            seg(Rc, SendOnlyWithInvalidate, 9, |s| {
                s.invalidate_rkey = Some(0x203);
            }),
        ),
        ("rc-write-first", seg(Rc, RdmaWriteFirst, 256, reth)),
        ("rc-write-last", seg(Rc, RdmaWriteLast, 44, |_| {})),
        (
            "rc-write-only-imm",
            seg(Rc, RdmaWriteOnlyWithImm, 5, |s| {
                reth(s);
                s.imm = Some(7);
            }),
        ),
        ("rc-read-request", seg(Rc, RdmaReadRequest, 0, reth)),
        (
            "rc-read-response-first",
            seg(Rc, RdmaReadResponseFirst, 256, aeth(ack)),
        ),
        (
            "rc-read-response-middle",
            seg(Rc, RdmaReadResponseMiddle, 256, |_| {}),
        ),
        (
            "rc-read-response-only",
            seg(Rc, RdmaReadResponseOnly, 7, aeth(ack)),
        ),
        ("rc-ack", seg(Rc, Acknowledge, 0, aeth(ack))),
        (
            "rc-rnr-nak",
            seg(Rc, Acknowledge, 0, aeth(Syndrome::RnrNak { timer: 12 })),
        ),
        (
            "rc-nak-access",
            seg(
                Rc,
                Acknowledge,
                0,
                aeth(Syndrome::Nak(NakCode::RemoteAccessError)),
            ),
        ),
        ("rc-cmp-swap", seg(Rc, CompareSwap, 0, atomic)),
        ("rc-atomic-write", seg(Rc, AtomicWrite, 8, atomic_write)),
        ("rc-fetch-add", seg(Rc, FetchAdd, 0, atomic)),
        (
            "rc-atomic-ack",
            seg(Rc, AtomicAcknowledge, 0, |s| {
                aeth(ack)(s);
                s.atomic_ack = Some(AtomicAckEth { orig: 41 });
            }),
        ),
        ("uc-send-last", seg(Uc, SendLast, 1, |_| {})),
        ("uc-write-only", seg(Uc, RdmaWriteOnly, 12, reth)),
        (
            "ud-send-only",
            seg(Ud, SendOnly, 16, |s| {
                s.deth = Some(Deth {
                    qkey: 0x1111_1111,
                    src_qpn: 0x12,
                });
            }),
        ),
        ("ud-send-only-imm-grh", {
            let FrameRepr::Segment { segment, .. } = seg(Ud, SendOnlyWithImm, 4, |s| {
                s.deth = Some(Deth {
                    qkey: 0x1111_1111,
                    src_qpn: 0x12,
                });
                s.imm = Some(0xdead_beef);
            }) else {
                unreachable!("seg makes segments")
            };
            FrameRepr::Segment {
                addr: ADDR,
                grh: Some(GrhRepr {
                    traffic_class: 0,
                    flow_label: 0,
                    hop_limit: 1,
                    sgid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                    dgid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2],
                }),
                segment,
            }
        }),
        (
            "xrc-send-only",
            seg(Xrc, SendOnly, 66, |s| {
                s.ack_req = true;
                s.xrc_srqn = Some(0x2a);
            }),
        ),
        (
            "xrc-send-first",
            seg(Xrc, SendFirst, 256, |s| s.xrc_srqn = Some(0x2a)),
        ),
        (
            "xrc-write-only-imm",
            seg(Xrc, RdmaWriteOnlyWithImm, 5, |s| {
                s.xrc_srqn = Some(0x2a);
                reth(s);
                s.imm = Some(7);
            }),
        ),
        (
            "xrc-read-request",
            seg(Xrc, RdmaReadRequest, 0, |s| {
                s.xrc_srqn = Some(0x2a);
                reth(s);
            }),
        ),
        (
            "xrc-fetch-add",
            seg(Xrc, FetchAdd, 0, |s| {
                s.xrc_srqn = Some(0x2a);
                atomic(s);
            }),
        ),
        (
            "xrc-atomic-write",
            seg(Xrc, AtomicWrite, 8, |s| {
                s.ack_req = true;
                s.xrc_srqn = Some(0x2a);
                atomic_write(s);
            }),
        ),
        (
            "xrc-read-response-only",
            seg(Xrc, RdmaReadResponseOnly, 7, aeth(ack)),
        ),
        (
            "xrc-nak-invalid",
            seg(
                Xrc,
                Acknowledge,
                0,
                aeth(Syndrome::Nak(NakCode::InvalidRequest)),
            ),
        ),
        ("control-hello", control(ControlKind::Hello, 16)),
        ("control-keepalive", control(ControlKind::Keepalive, 0)),
        ("control-announce", control(ControlKind::Announce, 40)),
    ]
}

/// The bytes of a seed: its headers, and a payload counting up from 1.
fn bytes(repr: &FrameRepr) -> Vec<u8> {
    let mut b = vec![0; repr.buffer_len()];
    for (i, v) in b[repr.payload_range()].iter_mut().enumerate() {
        *v = (i % 255) as u8 + 1;
    }
    repr.emit(&mut Frame::new_unchecked(&mut b[..]));
    b
}

#[test]
fn the_fuzz_corpus_holds_these_seeds_and_each_parses() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/frame");
    let write = std::env::var_os("VRNIC_WRITE_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
    }
    for (name, repr) in seeds() {
        let b = bytes(&repr);
        let frame = Frame::new_checked(&b[..]).expect("a seed is a whole frame");
        assert_eq!(FrameRepr::parse(&frame), Ok(repr), "{name}");
        let path = dir.join(format!("seed-{name}"));
        if write {
            std::fs::write(&path, &b).expect("write a seed");
        }
        let on_disk = std::fs::read(&path).unwrap_or_default();
        assert!(
            on_disk == b,
            "{} is stale or missing: rerun with VRNIC_WRITE_SEEDS=1",
            path.display()
        );
    }
}
