//! What each fuzz target checks, shared with the corpus replay on stable
//! (`crates/vrnic-api/tests/fuzz_replay.rs` includes this file). Every function takes untrusted
//! bytes as the daemon would meet them and must return without panicking, looping without end
//! or allocating more than the input bounds.
#![allow(dead_code)] // each target uses one of these

use vrnic_shm::Mailbox;
use vrnic_shm::Region;
use vrnic_wire::frame::{
    AnnounceEntry, CmMessage, ControlKind, Frame, FrameError, FrameRepr, HandshakeRepr, HelloRepr,
    KeepaliveRepr, MAX_PAYLOAD, MIN_PMTU, RECORD_HEADER_LEN, TAG_LEN, pad_bytes_ok, peek_len,
    peek_record,
};
use vrnic_wire::{CQ_SLOT, Cqe, RQ_SLOT, RecvWqe, SQ_SLOT, SendWqe};

/// Copies `data` into a fixed-size slot (zero padded or truncated), as the daemon copies a ring
/// slot out of the region.
fn slot<const N: usize>(data: &[u8]) -> [u8; N] {
    let mut s = [0u8; N];
    let n = data.len().min(N);
    s[..n].copy_from_slice(&data[..n]);
    s
}

/// WQE and CQE slot decoding: parse never panics, and what parses encodes back to a slot that
/// parses to the same value.
pub fn wqe_slots(data: &[u8]) {
    if let Ok(w) = SendWqe::parse(&slot::<SQ_SLOT>(data)) {
        let mut again = [0u8; SQ_SLOT];
        w.encode(&mut again);
        assert_eq!(SendWqe::parse(&again).as_ref(), Ok(&w));
    }
    if let Ok(w) = RecvWqe::parse(&slot::<RQ_SLOT>(data)) {
        let mut again = [0u8; RQ_SLOT];
        w.encode(&mut again);
        assert_eq!(RecvWqe::parse(&again).as_ref(), Ok(&w));
    }
    if let Ok(c) = Cqe::parse(&slot::<CQ_SLOT>(data)) {
        let mut again = [0u8; CQ_SLOT];
        c.encode(&mut again);
        assert_eq!(Cqe::parse(&again), Ok(c));
    }
}

/// Peer-link frames as a daemon reads them from a TCP stream: any bytes are an error or a
/// frame, the link header's length agrees with the frame, and a frame that parses emits back
/// to exactly its bytes (decoding is strict: one encoding per value).
pub fn frame(data: &[u8]) {
    let peeked = peek_len(data);
    // What a receiver reading payloads into place parses: never a frame the whole parse
    // refuses for anything but its pad, and the same value when both parse.
    let head = FrameRepr::parse_head(data);
    let Ok(frame) = Frame::new_checked(data) else {
        return;
    };
    assert_eq!(
        peeked,
        Ok(Some(data.len())),
        "a checked frame's header names its length"
    );
    let repr = match FrameRepr::parse(&frame) {
        Ok(r) => r,
        Err(FrameError::PadBytes) => {
            let h = head.expect("a frame refused for its pad alone has a head");
            assert!(
                !pad_bytes_ok(&data[h.payload_range().end..]),
                "its pad is refused"
            );
            return;
        }
        Err(_) => {
            assert!(head.is_err(), "a head of a refused frame: {head:?}");
            return;
        }
    };
    assert_eq!(head, Ok(repr), "the head parses as the whole");
    assert_eq!(repr.check(), Ok(()));
    assert_eq!(repr.buffer_len(), data.len());
    let payload = repr.payload_range();
    // Every byte but the payload comes from emit: start from bytes that match nothing.
    let mut again = vec![0xa5; repr.buffer_len()];
    again[payload.clone()].copy_from_slice(&data[payload]);
    repr.emit(&mut Frame::new_unchecked(&mut again[..]));
    assert_eq!(again, data, "{repr:?} re-emits to the same bytes");
    if let FrameRepr::Control(c) = repr
        && c.kind == ControlKind::Cm
    {
        let body = &data[repr.payload_range()];
        if let Ok(m) = CmMessage::parse(body) {
            let mut again = Vec::new();
            m.emit(&mut again);
            assert_eq!(again, body, "{m:?} re-emits to the same bytes");
        }
    }
    if let FrameRepr::Segment { segment, .. } = repr {
        let mut pmtu = MIN_PMTU;
        while pmtu <= MAX_PAYLOAD {
            let _ = segment.check_pmtu(pmtu);
            pmtu *= 2;
        }
        let _ = segment.check_pmtu(data.len());
    }
}

/// Link-control frames (hello, keepalive, handshake, announce) as a daemon reads them from a
/// peer link: any bytes are an error or a frame, and a body its kind's decoder takes emits back
/// to exactly its bytes; an announce body that checks whole iterates to as many entries, which
/// emit back to it. The same bytes read as an encrypted link's record length: a record is at
/// least a tag, and its length is its field's.
pub fn link_control(data: &[u8]) {
    if let Ok(Some(len)) = peek_record(data) {
        assert!(len >= RECORD_HEADER_LEN + TAG_LEN);
        assert_eq!(
            len,
            RECORD_HEADER_LEN + usize::from(u16::from_be_bytes([data[0], data[1]]))
        );
    }
    let Ok(frame) = Frame::new_checked(data) else {
        return;
    };
    let Ok(FrameRepr::Control(c)) = FrameRepr::parse(&frame) else {
        return;
    };
    let body = &data[8..];
    match c.kind {
        ControlKind::Hello => {
            if let Ok(h) = HelloRepr::parse(body) {
                assert_eq!(
                    h.emit().as_slice(),
                    body,
                    "{h:?} re-emits to the same bytes"
                );
            }
        }
        ControlKind::Keepalive => {
            if let Ok(k) = KeepaliveRepr::parse(body) {
                assert_eq!(
                    k.emit().as_slice(),
                    body,
                    "{k:?} re-emits to the same bytes"
                );
            }
        }
        ControlKind::Handshake => {
            if let Ok(h) = HandshakeRepr::parse(body) {
                assert_eq!(HandshakeRepr::message_len(h.step), Some(h.message.len()));
                let mut again = vec![0u8; h.buffer_len()];
                h.emit(&mut again);
                assert_eq!(again, body, "{h:?} re-emits to the same bytes");
            }
        }
        ControlKind::Announce => {
            let checked = AnnounceEntry::check_body(body);
            let mut again = Vec::new();
            let mut n = 0;
            let mut failed = false;
            for e in AnnounceEntry::iter(body) {
                match e {
                    Ok(e) => {
                        assert_eq!(e.check(), Ok(()), "{e:?} decodes, so it checks");
                        e.emit(&mut again);
                        n += 1;
                    }
                    Err(_) => failed = true,
                }
            }
            match checked {
                Ok(count) => {
                    assert!(!failed);
                    assert_eq!(count, n);
                    assert_eq!(again, body, "the entries re-emit to the same bytes");
                }
                Err(_) => assert!(failed || body.is_empty()),
            }
        }
        ControlKind::Cm => {}
    }
}

/// Control requests as the daemon decodes them from a mailbox: any bytes are an error or a
/// request, and a request survives a round trip.
pub fn control_request(data: &[u8]) {
    if let Ok(r) = serde_json::from_slice::<vrnic_api::Request>(data) {
        let bytes = serde_json::to_vec(&r).expect("a decoded request encodes");
        let back: vrnic_api::Request = serde_json::from_slice(&bytes).expect("and decodes again");
        assert_eq!(back, r);
    }
}

/// The region the mailbox check writes into (one per process, made on first use).
fn region() -> &'static Region {
    static R: std::sync::OnceLock<Region> = std::sync::OnceLock::new();
    R.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("vrnic-fuzz-region-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let r = Region::create(
            &path,
            vrnic_shm::layout::MIN_REGION_SIZE,
            "fuzz",
            1,
            [0; 16],
            1,
        )
        .expect("create a region for the mailbox check");
        let _ = std::fs::remove_file(&path);
        r
    })
}

/// A control mailbox whose every byte a hostile client wrote: `data` is laid over the
/// mailbox's header and payload; the daemon's `take` and the event ring's `pop_event` must
/// stay in bounds and return.
pub fn mailbox(data: &[u8]) {
    let r = region();
    let Some(mb) = Mailbox::new(u32::from(data.first().copied().unwrap_or(0)) % 64) else {
        return;
    };
    let base = vrnic_shm::layout::CTRL_OFF
        + u64::from(mb.index()) * u64::from(vrnic_shm::layout::CTRL_SLOT_SIZE);
    let n = data.len().min(vrnic_shm::layout::CTRL_SLOT_SIZE as usize);
    r.write_bytes(base, &data[..n]).expect("inside the mailbox");
    if let Some((_, Ok(bytes))) = mb.take(r) {
        assert!(bytes.len() <= vrnic_shm::layout::CTRL_PAYLOAD_MAX);
        control_request(&bytes);
    }
    for _ in 0..1024 {
        if mb.pop_event(r).is_none() {
            break;
        }
    }
}
