//! Whole frames: round trips for every opcode, byte-exact layouts, and every malformation.

use super::segment::tests::sample;
use super::*;

/// Emits `repr` into a fresh buffer whose payload bytes are nonzero.
fn emit(repr: &FrameRepr) -> Vec<u8> {
    let mut b = vec![0xee; repr.buffer_len()];
    for (i, v) in b[repr.payload_range()].iter_mut().enumerate() {
        *v = (i % 251) as u8 + 1;
    }
    repr.emit(&mut Frame::new_unchecked(&mut b[..]));
    b
}

fn parse(b: &[u8]) -> Result<FrameRepr, FrameError> {
    FrameRepr::parse(&Frame::new_unchecked(b))
}

fn segment(opcode: u8, payload_len: usize) -> FrameRepr {
    FrameRepr::Segment {
        addr: ADDR,
        grh: None,
        segment: sample(Opcode::from_u8(opcode).unwrap(), payload_len),
    }
}

fn grh() -> GrhRepr {
    GrhRepr {
        traffic_class: 3,
        flow_label: 0x1_2345,
        hop_limit: 255,
        sgid: [0xfe; 16],
        dgid: [0x80; 16],
    }
}

fn ud_with_grh(opcode: u8, payload_len: usize) -> FrameRepr {
    FrameRepr::Segment {
        addr: ADDR,
        grh: Some(grh()),
        segment: sample(Opcode::from_u8(opcode).unwrap(), payload_len),
    }
}

/// Makes the link header's length field match the buffer's.
fn relen(b: &mut [u8]) {
    let len = b.len() as u32;
    put24(b, 5, len);
}

/// Offset of the BTH in a frame without GRH.
const BTH: usize = LINK_HEADER_LEN + ADDR_LEN;

/// The address word of the test frames.
const ADDR: AddrRepr = AddrRepr {
    dlid: 0x1234,
    slid: 0xbeef,
    src_qpn: 0xab_cdef,
};

#[test]
fn every_opcode_round_trips_through_emit_and_parse() {
    let mut seen = 0;
    for v in 0..=255u8 {
        let Some(op) = Opcode::from_u8(v) else {
            continue;
        };
        seen += 1;
        let lens: &[usize] = if op.has_payload() {
            &[0, 1, 2, 3, 4, 5, 256, 4095, 4096]
        } else {
            &[0]
        };
        for &len in lens {
            let other = AddrRepr {
                dlid: 7,
                slid: 0,
                src_qpn: 1,
            };
            let routes: &[(AddrRepr, Option<GrhRepr>)] = if op.transport() == Transport::Ud {
                &[(ADDR, None), (ADDR, Some(grh())), (other, Some(grh()))]
            } else {
                &[(ADDR, None), (other, None)]
            };
            for &(addr, g) in routes {
                let repr = FrameRepr::Segment {
                    addr,
                    grh: g,
                    segment: sample(op, len),
                };
                let b = emit(&repr);
                assert_eq!(b.len() % 4, 0, "{v:#04x}: frames stay 4-byte aligned");
                assert_eq!(peek_len(&b), Ok(Some(b.len())));
                let back = parse(&b).unwrap_or_else(|e| panic!("{v:#04x} len {len}: {e}"));
                assert_eq!(back, repr);
                let payload = &b[back.payload_range()];
                assert!(
                    payload
                        .iter()
                        .enumerate()
                        .all(|(i, &x)| x == (i % 251) as u8 + 1)
                );
                let mut again = vec![0; b.len()];
                again[back.payload_range()].copy_from_slice(payload);
                back.emit(&mut Frame::new_unchecked(&mut again[..]));
                assert_eq!(again, b);
            }
        }
    }
    assert_eq!(seen, 62);
}

#[test]
fn control_frames_round_trip_with_opaque_bodies() {
    for kind in [
        ControlKind::Hello,
        ControlKind::Keepalive,
        ControlKind::Announce,
        ControlKind::Cm,
        ControlKind::Handshake,
    ] {
        for body_len in [0, 1, 7, 1000] {
            let repr = FrameRepr::Control(ControlRepr { kind, body_len });
            let b = emit(&repr);
            assert_eq!(b.len(), 8 + body_len);
            assert_eq!(parse(&b), Ok(repr));
            assert_eq!(repr.payload_range(), 8..8 + body_len);
        }
    }
}

#[test]
fn link_header_bytes_are_magic_version_kind_flags_length() {
    let repr = FrameRepr::Control(ControlRepr {
        kind: ControlKind::Keepalive,
        body_len: 3,
    });
    assert_eq!(&emit(&repr)[..8], &[0x76, 0x52, 2, 3, 0, 0, 0, 11]);
    let b = emit(&ud_with_grh(0x64, 0x100));
    let len = 8 + 8 + 40 + 12 + 8 + 0x100;
    assert_eq!(
        &b[..8],
        &[0x76, 0x52, 2, 1, 1, 0, (len >> 8) as u8, len as u8]
    );
    // The GRH's PayLen counts BTH, DETH and payload.
    assert_eq!(&b[16..24], &[0x60, 0x31, 0x23, 0x45, 0x01, 0x14, 0x1b, 255]);
    assert_eq!(b[56], 0x64, "the BTH follows the GRH");
}

#[test]
fn an_rdma_write_only_with_immediate_frame_byte_for_byte() {
    let op = Opcode::new(Transport::Rc, Op::RdmaWriteOnlyWithImm).unwrap();
    let mut s = SegmentRepr::new(op, 0x12, 0x34);
    s.ack_req = true;
    s.reth = Some(Reth {
        va: 0x1000,
        rkey: 0x2a,
        dma_len: 2,
    });
    s.imm = Some(0x0102_0304);
    s.payload_len = 2;
    let repr = FrameRepr::Segment {
        addr: ADDR,
        grh: None,
        segment: s,
    };
    let mut b = vec![0; repr.buffer_len()];
    b[repr.payload_range()].copy_from_slice(&[0xaa, 0xbb]);
    repr.emit(&mut Frame::new_unchecked(&mut b[..]));
    #[rustfmt::skip]
    let expected = [
        0x76, 0x52, 0x02, 0x01, 0x00, 0x00, 0x00, 52,          // link header
        0x12, 0x34, 0xbe, 0xef, 0x00, 0xab, 0xcd, 0xef,        // DLID, SLID, source QP
        0x0b, 0x20, 0xff, 0xff, 0x00, 0x00, 0x00, 0x12,        // BTH: opcode, pad 2, P_Key, QP
        0x80, 0x00, 0x00, 0x34,                                // AckReq, PSN
        0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0x2a, 0, 0, 0, 2,  // RETH
        0x01, 0x02, 0x03, 0x04,                                // ImmDt
        0xaa, 0xbb, 0x00, 0x00,                                // payload, pad
    ];
    assert_eq!(b, expected);
    assert_eq!(parse(&expected), Ok(repr));
}

#[test]
fn an_atomic_acknowledge_frame_byte_for_byte() {
    let op = Opcode::new(Transport::Rc, Op::AtomicAcknowledge).unwrap();
    let mut s = SegmentRepr::new(op, 0xab_cdef, 0x00_0100);
    s.aeth = Some(Aeth {
        syndrome: Syndrome::Ack { credits: 31 },
        msn: 5,
    });
    s.atomic_ack = Some(AtomicAckEth {
        orig: 0x0102_0304_0506_0708,
    });
    let repr = FrameRepr::Segment {
        addr: ADDR,
        grh: None,
        segment: s,
    };
    #[rustfmt::skip]
    let expected = [
        0x76, 0x52, 2, 1, 0, 0, 0, 40,
        0x12, 0x34, 0xbe, 0xef, 0, 0xab, 0xcd, 0xef,
        0x12, 0x00, 0xff, 0xff, 0, 0xab, 0xcd, 0xef, 0, 0, 0x01, 0x00,
        0x1f, 0, 0, 5,
        1, 2, 3, 4, 5, 6, 7, 8,
    ];
    assert_eq!(emit(&repr), expected);
    assert_eq!(parse(&expected), Ok(repr));
}

#[test]
fn short_buffers_are_refused_at_every_length() {
    for repr in [segment(0x13, 0), segment(0x0b, 9), ud_with_grh(0x65, 3)] {
        let b = emit(&repr);
        assert!(matches!(
            parse(&b[..7]),
            Err(FrameError::Truncated { needed: 8, got: 7 })
        ));
        for n in 0..b.len() {
            assert!(parse(&b[..n]).is_err(), "{n} of {} bytes", b.len());
        }
        assert_eq!(peek_len(&b[..7]), Ok(None));
        assert_eq!(peek_len(&b[..8]), Ok(Some(b.len())));
    }
}

#[test]
fn bytes_past_the_frame_are_trailing_garbage() {
    let mut b = emit(&segment(0x04, 4));
    b.push(0);
    assert_eq!(parse(&b), Err(FrameError::Trailing(1)));
}

#[test]
fn bad_magic_version_kind_and_flags_are_refused() {
    let good = emit(&segment(0x04, 4));
    let with = |at: usize, v: u8| {
        let mut b = good.clone();
        b[at] = v;
        parse(&b)
    };
    assert_eq!(with(0, b'V'), Err(FrameError::Magic(*b"VR")));
    assert_eq!(with(1, 0), Err(FrameError::Magic([b'v', 0])));
    assert_eq!(with(2, 0), Err(FrameError::Version(0)));
    assert_eq!(with(2, 1), Err(FrameError::Version(1)));
    assert_eq!(with(2, 3), Err(FrameError::Version(3)));
    for kind in [0, 7, 0x80, 0xff] {
        assert_eq!(with(3, kind), Err(FrameError::Kind(kind)));
    }
    for flags in [0x02, 0x04, 0x80, 0xfc] {
        assert_eq!(with(4, flags), Err(FrameError::Reserved("link flags")));
    }
    let control = emit(&FrameRepr::Control(ControlRepr {
        kind: ControlKind::Hello,
        body_len: 40,
    }));
    let mut b = control.clone();
    b[4] = FLAG_GRH;
    assert_eq!(parse(&b), Err(FrameError::GrhNotAllowed));
}

#[test]
fn lengths_below_the_kind_or_above_max_frame_are_refused() {
    let mut b = emit(&segment(0x11, 0));
    b[7] = 27; // less than link header + address word + BTH
    assert_eq!(peek_len(&b), Err(FrameError::Length(27)));
    let mut h = [0x76, 0x52, VERSION, 1, 0, 0, 0, 0];
    put24(&mut h, 5, (MAX_FRAME + 1) as u32);
    assert_eq!(peek_len(&h), Err(FrameError::Length(MAX_FRAME + 1)));
    put24(&mut h, 5, 0xff_ffff);
    assert_eq!(peek_len(&h), Err(FrameError::Length(0xff_ffff)));
    h[4] = FLAG_GRH;
    put24(&mut h, 5, 8 + 8 + 40 + 11);
    assert_eq!(peek_len(&h), Err(FrameError::Length(67)));
    // A frame of MAX_FRAME bytes passes the link header but not the payload bound.
    let mut big = vec![0; MAX_FRAME];
    big[..8].copy_from_slice(&[0x76, 0x52, VERSION, 1, 0, 0, 0, 0]);
    put24(&mut big, 5, MAX_FRAME as u32);
    big[16..28].copy_from_slice(&[0x04, 0, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1]);
    assert_eq!(
        parse(&big),
        Err(FrameError::PayloadTooLong {
            len: MAX_FRAME - 28,
            max: MAX_PAYLOAD
        })
    );
    // The largest real segment fits.
    let most = segment(0x0b, MAX_PAYLOAD);
    assert!(most.buffer_len() <= MAX_FRAME);
    assert_eq!(parse(&emit(&most)), Ok(most));
}

#[test]
fn unknown_and_impossible_opcodes_are_refused() {
    let good = emit(&segment(0x04, 0));
    for op in [0x15, 0x18, 0x2c, 0x31, 0x40, 0x44, 0x60, 0x66, 0x81, 0xe4] {
        let mut b = good.clone();
        b[BTH] = op;
        assert_eq!(parse(&b), Err(FrameError::Opcode(op)), "{op:#04x}");
    }
}

#[test]
fn reserved_bits_and_versions_are_refused() {
    let good = emit(&segment(0x64, 8));
    let with = |at: usize, v: u8| {
        let mut b = good.clone();
        b[at] |= v;
        parse(&b)
    };
    assert_eq!(with(BTH + 1, 0x01), Err(FrameError::TransportVersion(1)));
    assert_eq!(with(BTH + 1, 0x0f), Err(FrameError::TransportVersion(15)));
    assert_eq!(
        with(BTH + 4, 0x80),
        Err(FrameError::Reserved("BTH before DestQP"))
    );
    assert_eq!(
        with(BTH + 8, 0x01),
        Err(FrameError::Reserved("BTH after AckReq"))
    );
    assert_eq!(with(BTH + 12 + 4, 0x10), Err(FrameError::Reserved("DETH")));
}

#[test]
fn invalid_pkeys_are_refused() {
    let good = emit(&segment(0x04, 0));
    for pkey in [0x0000u16, 0x8000] {
        let mut b = good.clone();
        b[BTH + 2..BTH + 4].copy_from_slice(&pkey.to_be_bytes());
        assert_eq!(parse(&b), Err(FrameError::PKey(pkey)));
    }
}

#[test]
fn reserved_aeth_syndromes_are_refused() {
    let good = emit(&segment(0x11, 0));
    for s in [0x40, 0x80, 0x65] {
        let mut b = good.clone();
        b[BTH + 12] = s;
        assert_eq!(parse(&b), Err(FrameError::Syndrome(s)));
    }
}

#[test]
fn a_pad_count_that_does_not_fit_is_refused() {
    // SEND Only with 5 bytes: 8 bytes after the BTH, pad count 3.
    let good = emit(&segment(0x04, 5));
    assert_eq!(good[BTH + 1] & 0x30, 0x30);
    // Pad count 0 would make the last pad bytes payload: fine in itself, still zero bytes...
    let mut b = good.clone();
    b[BTH + 1] &= !0x30;
    assert!(
        matches!(parse(&b), Ok(FrameRepr::Segment { segment, .. }) if segment.payload_len == 8)
    );
    // ... but nonzero pad bytes are refused.
    let mut b = good.clone();
    *b.last_mut().unwrap() = 1;
    assert_eq!(parse(&b), Err(FrameError::PadBytes));
    // A payload area that is not a multiple of 4.
    let mut b = good.clone();
    b.push(0);
    relen(&mut b);
    assert_eq!(parse(&b), Err(FrameError::Pad { pad: 3, len: 9 }));
    // A pad count larger than the payload area.
    let mut b = emit(&segment(0x04, 0));
    b[BTH + 1] |= 0x20;
    assert_eq!(parse(&b), Err(FrameError::Pad { pad: 2, len: 0 }));
    // A pad count on an opcode without payload.
    let mut b = emit(&segment(0x0c, 0));
    b[BTH + 1] |= 0x10;
    assert_eq!(parse(&b), Err(FrameError::Pad { pad: 1, len: 0 }));
}

#[test]
fn a_missing_extension_header_is_refused() {
    // RDMA WRITE Only needs a 16-byte RETH; cut the frame to 8 bytes after the BTH.
    let good = emit(&segment(0x0a, 0));
    let mut b = good[..BTH + 12 + 8].to_vec();
    relen(&mut b);
    assert_eq!(
        parse(&b),
        Err(FrameError::Headers {
            opcode: 0x0a,
            needed: 28,
            got: 20
        })
    );
    // An AtomicETH cut short, and a UD SEND with no DETH at all.
    let good = emit(&segment(0x14, 0));
    let mut b = good[..good.len() - 4].to_vec();
    relen(&mut b);
    assert!(matches!(
        parse(&b),
        Err(FrameError::Headers { opcode: 0x14, .. })
    ));
    let mut b = emit(&segment(0x04, 0));
    b[BTH] = 0x64;
    assert!(matches!(
        parse(&b),
        Err(FrameError::Headers { opcode: 0x64, .. })
    ));
}

#[test]
fn a_payload_on_an_opcode_without_one_is_refused() {
    let good = emit(&segment(0x11, 0));
    let mut b = good.clone();
    b.extend_from_slice(&[0; 4]);
    relen(&mut b);
    assert_eq!(
        parse(&b),
        Err(FrameError::UnexpectedPayload {
            opcode: 0x11,
            len: 4
        })
    );
}

#[test]
fn an_address_word_byte_for_byte_on_every_segment() {
    let ud = ud_with_grh(0x64, 4);
    let b = emit(&ud);
    assert_eq!(b[4], FLAG_GRH, "the GRH flag alone");
    assert_eq!(
        b[8..16],
        [0x12, 0x34, 0xbe, 0xef, 0, 0xab, 0xcd, 0xef],
        "the address word comes first: DLID, SLID, zero, source QP"
    );
    let FrameRepr::Segment { grh, .. } = ud else {
        unreachable!()
    };
    assert_eq!(
        b[16..56],
        grh.unwrap().to_bytes(b.len() - 56),
        "then the GRH"
    );
    assert_eq!(parse(&b), Ok(ud));
    assert_eq!(FrameRepr::parse_head(&b[..b.len() - 4]), Ok(ud));
    // Its reserved byte must be zero.
    let mut r = b.clone();
    r[12] = 1;
    assert_eq!(parse(&r), Err(FrameError::Reserved("address word")));
    // Cut short: a segment frame too short for the word and a BTH.
    let mut short = b[..8].to_vec();
    short[4] = 0;
    short.extend_from_slice(&[0, 1, 0, 2, 0, 0, 0, 3, 0, 0]);
    relen(&mut short);
    assert_eq!(peek_len(&short), Err(FrameError::Length(18)));
    // A source QP past 24 bits cannot be emitted.
    let bad = FrameRepr::Segment {
        addr: AddrRepr {
            src_qpn: 1 << 24,
            ..ADDR
        },
        grh: None,
        segment: sample(Opcode::from_u8(0x04).unwrap(), 4),
    };
    assert_eq!(bad.check(), Err(FrameError::Inconsistent("source QP")));
    // The old SLID flag is a reserved bit now, on segments and control frames.
    let mut old = emit(&segment(0x04, 4));
    old[4] = 0x02;
    assert_eq!(parse(&old), Err(FrameError::Reserved("link flags")));
    let ctl = [
        0x76,
        0x52,
        VERSION,
        ControlKind::Keepalive as u8,
        0x02,
        0,
        0,
        8,
    ];
    assert_eq!(peek_len(&ctl), Err(FrameError::Reserved("link flags")));
    // A frame of the version before the address word is refused whole.
    let mut v1 = emit(&segment(0x04, 4));
    v1[2] = 1;
    assert_eq!(peek_len(&v1), Err(FrameError::Version(1)));
}

#[test]
fn a_grh_is_for_ud_segments_only_and_must_be_consistent() {
    // A GRH in front of an RC SEND.
    let rc = emit(&segment(0x04, 4));
    let mut b = rc[..BTH].to_vec();
    b[4] = FLAG_GRH;
    b.extend_from_slice(&grh().to_bytes(rc.len() - BTH));
    b.extend_from_slice(&rc[BTH..]);
    relen(&mut b);
    assert_eq!(parse(&b), Err(FrameError::GrhNotAllowed));
    let bad = FrameRepr::Segment {
        addr: ADDR,
        grh: Some(grh()),
        segment: sample(Opcode::from_u8(0x04).unwrap(), 4),
    };
    assert_eq!(bad.check(), Err(FrameError::GrhNotAllowed));
    // PayLen, version and next header of a UD one.
    let good = emit(&ud_with_grh(0x65, 4));
    for (at, v, what) in [
        (BTH + 5, 0, "payload length"),
        (BTH, 0x40, "IP version"),
        (BTH + 6, 0x11, "next header"),
    ] {
        let mut b = good.clone();
        b[at] = v;
        assert_eq!(parse(&b), Err(FrameError::Grh(what)));
    }
}

#[test]
fn ud_payloads_stop_at_the_port_mtu() {
    let mut b = emit(&segment(0x64, MAX_UD_PAYLOAD));
    assert!(parse(&b).is_ok());
    b.extend_from_slice(&[0; 4]);
    relen(&mut b);
    assert_eq!(
        parse(&b),
        Err(FrameError::PayloadTooLong {
            len: MAX_UD_PAYLOAD + 4,
            max: MAX_UD_PAYLOAD
        })
    );
}

#[test]
fn every_single_bit_flip_is_refused_or_round_trips() {
    let frames = [
        emit(&segment(0x00, 256)),
        emit(&segment(0x0b, 7)),
        emit(&segment(0x12, 0)),
        emit(&segment(0x13, 0)),
        emit(&segment(0x17, 1)),
        emit(&ud_with_grh(0x65, 2)),
        emit(&FrameRepr::Control(ControlRepr {
            kind: ControlKind::Announce,
            body_len: 16,
        })),
    ];
    for good in frames {
        for bit in 0..good.len() * 8 {
            let mut b = good.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            if let Ok(repr) = parse(&b) {
                let mut again = vec![0; repr.buffer_len()];
                again[repr.payload_range()].copy_from_slice(&b[repr.payload_range()]);
                repr.emit(&mut Frame::new_unchecked(&mut again[..]));
                assert_eq!(again, b, "bit {bit}");
            }
        }
    }
}

#[test]
fn accessors_of_a_checked_frame_name_its_parts() {
    let b = emit(&ud_with_grh(0x64, 4));
    let f = Frame::new_checked(&b[..]).unwrap();
    assert_eq!(
        (f.magic(), f.version(), f.kind(), f.flags(), f.frame_len()),
        (MAGIC, VERSION, FrameKind::SEGMENT, FLAG_GRH, b.len())
    );
    assert_eq!(f.grh().map(|g| g[6]), Some(GRH_NEXT_HEADER));
    let p = Packet::new_checked(f.segment()).unwrap();
    assert_eq!((p.opcode(), p.dest_qpn()), (0x64, 0xab_cdef));
    assert_eq!(p.payload(), &[1, 2, 3, 4]);
    assert_eq!(p.ext(ExtHeader::Deth).map(<[u8]>::len), Some(DETH_LEN));
    // Views of nothing do not panic on their slices.
    let empty = Frame::new_unchecked(&[][..]);
    assert_eq!(
        (empty.body(), empty.segment(), empty.grh()),
        (&[][..], &[][..], None)
    );
}

#[test]
fn a_head_parses_as_the_whole_frame_from_any_prefix_that_holds_its_headers() {
    for v in 0..=255u8 {
        let Some(op) = Opcode::from_u8(v) else {
            continue;
        };
        let lens: &[usize] = if op.has_payload() {
            &[0, 1, 3, 4, 4095, 4096]
        } else {
            &[0]
        };
        for &len in lens {
            let repr = if op.transport() == Transport::Ud {
                ud_with_grh(v, len)
            } else {
                segment(v, len)
            };
            let b = emit(&repr);
            let whole = parse(&b).unwrap();
            let headers = whole.header_len();
            for cut in 0..=b.len() {
                let got = FrameRepr::parse_head(&b[..cut]);
                if cut < headers {
                    assert!(
                        got.is_err(),
                        "{v:#04x} len {len}: {cut} bytes are not its headers"
                    );
                } else {
                    assert_eq!(got, Ok(whole), "{v:#04x} len {len} from {cut} bytes");
                }
            }
            // Bytes past the frame (the next frame's) are not its own.
            let mut more = b.clone();
            more.extend_from_slice(&[0xff; 8]);
            assert_eq!(FrameRepr::parse_head(&more), Ok(whole));
        }
    }
}

#[test]
fn a_head_refuses_every_corruption_the_whole_parse_refuses_but_the_pad() {
    let frames = [
        emit(&segment(0x00, 256)),
        emit(&segment(0x0a, 4096)),
        emit(&segment(0x0b, 7)),
        emit(&segment(0x10, 1)),
        emit(&segment(0x12, 0)),
        emit(&segment(0x16, 5)),
        emit(&ud_with_grh(0x65, 2)),
    ];
    for good in frames {
        let repr = parse(&good).unwrap();
        let (headers, pad_at) = (repr.header_len(), repr.payload_range().end);
        // Every bit of the link header, GRH and transport headers, and of the pad.
        let bits = (0..headers * 8).chain(pad_at * 8..good.len() * 8);
        for bit in bits {
            let mut b = good.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            let head = FrameRepr::parse_head(&b);
            if bit / 8 >= pad_at {
                assert_eq!(parse(&b), Err(FrameError::PadBytes), "bit {bit}");
                assert!(head.is_ok() && !pad_bytes_ok(&b[pad_at..]), "bit {bit}");
                continue;
            }
            match (parse(&b), head) {
                (Ok(whole), Ok(h)) => assert_eq!(whole, h, "bit {bit}"),
                (Err(_), Err(_)) => {}
                // A length that now cuts into or runs past the buffer: the head may parse
                // (it does not need the rest), the whole cannot.
                (Err(FrameError::Truncated { .. } | FrameError::Trailing(_)), Ok(_)) => {}
                // A pad count that makes payload bytes pad: the receiver's pad check refuses it.
                (Err(FrameError::PadBytes), Ok(h)) => {
                    assert!(!pad_bytes_ok(&b[h.payload_range().end..]), "bit {bit}");
                }
                (w, h) => panic!("bit {bit}: whole {w:?}, head {h:?}"),
            }
        }
        assert!(pad_bytes_ok(&good[pad_at..]));
    }
}
