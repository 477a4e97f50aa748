//! The seed corpus of the `link_control` fuzz target (`fuzz/corpus/link_control/seed-*`): one
//! valid control frame of each link-control shape a peer link carries (hellos, keepalives, the
//! three handshake steps, announcements of each entry). This test checks that the files are
//! these frames and that each body decodes back to its value; the corpus replays on stable in
//! `crates/vrnic-api/tests/fuzz_replay.rs`. `VRNIC_WRITE_SEEDS=1 cargo test -p vrnic-wire
//! --test link_seeds` (re)writes them after a format change.

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use vrnic_wire::frame::{
    AnnounceEntry, ControlKind, Frame, FrameRepr, HANDSHAKE_LENS, HandshakeRepr, HelloRepr,
    KeepaliveRepr, LINK_HEADER_LEN,
};

/// A control frame of `kind` with `body`.
fn control(kind: ControlKind, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    vrnic_wire::frame::emit_control(&mut out, kind, body);
    out
}

fn added<'a>(lid: u16, name: &'a str, group: &'a str) -> AnnounceEntry<'a> {
    let mut gid = [0u8; 16];
    gid[..2].copy_from_slice(&[0xfe, 0x80]);
    gid[8..].copy_from_slice(&(0x0256_5200_0100_0000u64 | u64::from(lid)).to_be_bytes());
    AnnounceEntry::Added {
        lid,
        gid,
        vip: Ipv4Addr::new(10, 9, 0, (lid & 0xff) as u8),
        name,
        group,
    }
}

fn announce(entries: &[AnnounceEntry]) -> Vec<u8> {
    let mut body = Vec::new();
    for e in entries {
        e.emit(&mut body);
    }
    control(ControlKind::Announce, &body)
}

/// The seeds, by name.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let hello = |index, hosts, encrypt| {
        control(
            ControlKind::Hello,
            &HelloRepr {
                index,
                hosts,
                encrypt,
            }
            .emit(),
        )
    };
    let step = |step: u8| {
        let message: Vec<u8> = (0..HANDSHAKE_LENS[usize::from(step) - 1])
            .map(|i| (i * 37 + usize::from(step)) as u8)
            .collect();
        let h = HandshakeRepr {
            step,
            message: &message,
        };
        let mut body = vec![0u8; h.buffer_len()];
        h.emit(&mut body);
        control(ControlKind::Handshake, &body)
    };
    let removed = AnnounceEntry::Removed {
        lid: 0x0101,
        gid: [0xfe; 16],
    };
    let v4 = AnnounceEntry::Addr(IpAddr::V4(Ipv4Addr::new(10, 77, 0, 2)));
    let v6 = AnnounceEntry::Addr("fd00::2".parse().expect("an address"));
    vec![
        ("hello", hello(0, 3, false)),
        ("hello-encrypt", hello(2, 3, true)),
        ("hello-cluster", hello(7, 0, false)),
        (
            "keepalive-ping",
            control(ControlKind::Keepalive, &KeepaliveRepr::Ping(1234).emit()),
        ),
        (
            "keepalive-pong",
            control(ControlKind::Keepalive, &KeepaliveRepr::Pong(1234).emit()),
        ),
        ("handshake-1", step(1)),
        ("handshake-2", step(2)),
        ("handshake-3", step(3)),
        ("announce-added", announce(&[added(0x0101, "a1", "red")])),
        ("announce-removed", announce(&[removed])),
        ("announce-addrs", announce(&[v4, v6])),
        (
            "announce-complete",
            announce(&[v4, AnnounceEntry::Complete]),
        ),
        (
            "announce-mixed",
            announce(&[
                added(0x0102, "vnic_2", "default"),
                removed,
                v4,
                added(0x0103, "b-3", "blue"),
            ]),
        ),
    ]
}

/// Decodes a seed's body by its kind and emits it again.
fn round_trip(frame: &[u8]) -> Vec<u8> {
    let f = Frame::new_checked(frame).expect("a seed is a whole frame");
    let Ok(FrameRepr::Control(c)) = FrameRepr::parse(&f) else {
        panic!("a seed is a control frame");
    };
    let body = &frame[LINK_HEADER_LEN..];
    let again = match c.kind {
        ControlKind::Hello => HelloRepr::parse(body).expect("a hello").emit().to_vec(),
        ControlKind::Keepalive => KeepaliveRepr::parse(body)
            .expect("a keepalive")
            .emit()
            .to_vec(),
        ControlKind::Handshake => {
            let h = HandshakeRepr::parse(body).expect("a handshake step");
            let mut b = vec![0u8; h.buffer_len()];
            h.emit(&mut b);
            b
        }
        ControlKind::Announce => {
            AnnounceEntry::check_body(body).expect("an announce body");
            let mut b = Vec::new();
            for e in AnnounceEntry::iter(body) {
                e.expect("an entry").emit(&mut b);
            }
            b
        }
        ControlKind::Cm => panic!("not a link-control seed"),
    };
    control(c.kind, &again)
}

#[test]
fn the_fuzz_corpus_holds_these_seeds_and_each_decodes() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/link_control");
    let write = std::env::var_os("VRNIC_WRITE_SEEDS").is_some();
    if write {
        std::fs::create_dir_all(&dir).expect("create the corpus directory");
    }
    for (name, b) in seeds() {
        assert_eq!(round_trip(&b), b, "{name}");
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
