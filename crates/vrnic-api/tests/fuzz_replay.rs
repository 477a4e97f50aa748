//! The fuzz targets' checks (`fuzz/fuzz_targets/checks.rs`) on stable, as ordinary tests: every
//! input of the committed corpora (`fuzz/corpus/TARGET/`, grown by `cargo +nightly fuzz run`),
//! then a deterministic stream of random and mutated inputs. A panic here is a bug a fuzzer
//! found or would find.

#[path = "../../../fuzz/fuzz_targets/checks.rs"]
mod checks;

use std::path::PathBuf;

/// Every file of a target's corpus.
fn corpus(target: &str) -> Vec<Vec<u8>> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .filter_map(|f| std::fs::read(f.ok()?.path()).ok())
        .collect();
    assert!(!out.is_empty(), "empty corpus {}", dir.display());
    out.sort();
    out
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// The corpus, then `n` inputs: random bytes, and corpus entries with random bytes flipped,
/// truncated or extended.
fn replay(target: &str, n: usize, check: fn(&[u8])) {
    let seeds = corpus(target);
    for s in &seeds {
        check(s);
    }
    let mut r = Rng(0xf022 ^ target.len() as u64);
    for i in 0..n {
        let mut input = if i % 3 == 0 {
            (0..r.next() % 600)
                .map(|_| r.next() as u8)
                .collect::<Vec<u8>>()
        } else {
            seeds[(r.next() as usize) % seeds.len()].clone()
        };
        for _ in 0..(r.next() % 8) {
            if input.is_empty() {
                break;
            }
            let at = (r.next() as usize) % input.len();
            match r.next() % 4 {
                0 => input[at] = r.next() as u8,
                1 => input.truncate(at),
                2 => input.insert(at, r.next() as u8),
                _ => input[at] ^= 1 << (r.next() % 8),
            }
        }
        check(&input);
    }
}

#[test]
fn wqe_slots() {
    replay("wqe_slots", 50_000, checks::wqe_slots);
}

#[test]
fn control_request() {
    replay("control_request", 50_000, checks::control_request);
}

#[test]
fn mailbox() {
    replay("mailbox", 5_000, checks::mailbox);
}

#[test]
fn frame() {
    replay("frame", 50_000, checks::frame);
}

#[test]
fn link_control() {
    replay("link_control", 50_000, checks::link_control);
}

/// The frame corpus reaches the connection manager's codec: each of its five messages is
/// there and decodes (so the mutated inputs above exercise it).
#[test]
fn frame_corpus_holds_every_cm_message() {
    use vrnic_wire::frame::{CmMessage, ControlKind, Frame, FrameRepr};
    let mut seen = std::collections::HashSet::new();
    for f in corpus("frame") {
        let Ok(frame) = Frame::new_checked(&f[..]) else {
            continue;
        };
        if let Ok(FrameRepr::Control(c)) = FrameRepr::parse(&frame)
            && c.kind == ControlKind::Cm
            && let Ok(m) = CmMessage::parse(&f[8..])
        {
            seen.insert(std::mem::discriminant(&m));
        }
    }
    assert_eq!(seen.len(), 5);
}
