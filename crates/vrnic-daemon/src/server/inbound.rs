//! What a peer link reads into place: the rest of the payload of a large segment that the
//! engine can take where it lands (an RDMA WRITE segment, a READ response:
//! `Engine::placement`), read from the socket straight into the destination vRNIC's registered
//! memory by `readv`, so that the daemon copies only the bytes that came in with the frame's
//! headers. Each `readv` takes the rest of the payload and, in the same call, up to
//! [`HEADROOM`] bytes of what follows into the link's byte queue (the next frame's headers).
//!
//! Only a payload that has not all arrived when its headers are read goes this way: a link
//! reads all the socket holds in one call, and whole frames in that backlog are copied, which
//! costs less than a system call per frame (on the 2-core machine a `readv` per 64 KiB frame
//! lost to one large read and a copy from a buffer in cache). Frames that trickle in, as they
//! do when the daemon keeps up with the network, are read into place.
//!
//! A payload may take several reads, over several passes. Before each, the placement is checked
//! to hold (no memory was deregistered, rebound or given other access since); once it does not,
//! or once the kernel reports `EFAULT` (the tenant truncated the destination region: its pages
//! are then touched, which trips the daemon's `SIGBUS` guard and poisons that vRNIC alone), the
//! rest of the payload is read into a scratch buffer and dropped, and the engine asks the
//! requester for the segment again. The pad after the payload comes with the next bytes into
//! the byte queue and is checked there as the whole-frame decoder checks it.
//!
//! Its one `unsafe` block hands the pieces to `readv`: it is sound because they point into
//! region mappings that the caller's [`Regions`] holds (the server's vRNIC table, which nothing
//! changes during the call), the link's byte queue and the scratch buffer, which nothing refers
//! to during the call.
#![allow(unsafe_code)]

use std::io::ErrorKind;
use std::os::fd::RawFd;

use vrnic_proto::{Loc, Placement, VnicId};
use vrnic_shm::Region;
use vrnic_wire::frame::{AddrRepr, SegmentRepr};

use super::linkbuf::LinkBuf;
use super::shard::Lane;
use crate::sys;

/// Where payloads go: the region of each vRNIC.
pub(super) trait Regions {
    fn region(&self, vnic: VnicId) -> Option<&Region>;
}

impl Regions for rustc_hash::FxHashMap<VnicId, Lane> {
    fn region(&self, vnic: VnicId) -> Option<&Region> {
        self.get(&vnic).map(|v| &*v.region)
    }
}

/// Segments with payloads of at least this many bytes are read into place; smaller ones are
/// copied from the frame (a read of their own would cost more than the copy).
pub(super) const PLACE_MIN: usize = 16 << 10;
/// What a read into place takes of the bytes that follow the payload, into the byte queue.
pub(super) const HEADROOM: usize = 1024;

/// A segment whose payload is being read into place.
#[derive(Debug)]
pub(super) struct Placing {
    /// The segment's address word and headers, decoded.
    pub(super) addr: AddrRepr,
    pub(super) seg: SegmentRepr,
    pub(super) placement: Placement,
    /// Where its payload goes (summing to `total`).
    runs: Vec<(Loc, u64)>,
    /// Payload bytes in place (or dropped) so far, and in all.
    got: usize,
    total: usize,
    /// Pad bytes after the payload.
    pub(super) pad: usize,
    /// The rest is read into the scratch buffer and dropped: the placement stopped holding, or
    /// its memory could not be written.
    pub(super) broken: bool,
    /// Payload bytes the kernel put in place (not copied, not dropped).
    pub(super) placed: u64,
}

impl Placing {
    /// A placement of `seg`'s payload into `runs`, with its first bytes, those that came in with
    /// the headers, copied into place.
    pub(super) fn start(
        addr: AddrRepr,
        seg: SegmentRepr,
        placement: Placement,
        runs: Vec<(Loc, u64)>,
        pad: usize,
        first: &[u8],
        regions: &impl Regions,
    ) -> Placing {
        let mut p = Placing {
            total: seg.payload_len,
            addr,
            seg,
            placement,
            runs,
            got: 0,
            pad,
            broken: false,
            placed: 0,
        };
        p.put(first, regions);
        p
    }

    /// Whether the whole payload is in (or dropped).
    pub(super) fn payload_done(&self) -> bool {
        self.got == self.total
    }

    /// Its runs back, for the next placement's use.
    pub(super) fn into_runs(self) -> Vec<(Loc, u64)> {
        self.runs
    }

    /// Copies the next payload bytes into place (a region that cannot take them: the rest of
    /// the payload is dropped).
    fn put(&mut self, bytes: &[u8], regions: &impl Regions) {
        let bytes = &bytes[..bytes.len().min(self.total - self.got)];
        let mut skip = self.got as u64;
        let mut at = 0usize;
        for &(loc, n) in &self.runs {
            if at == bytes.len() {
                break;
            }
            if skip >= n {
                skip -= n;
                continue;
            }
            let k = ((n - skip) as usize).min(bytes.len() - at);
            let wrote = regions
                .region(loc.vnic)
                .is_some_and(|r| r.write_bytes(loc.off + skip, &bytes[at..at + k]).is_ok());
            self.broken |= !wrote;
            at += k;
            skip = 0;
        }
        self.got += bytes.len();
    }

    /// The pieces of the payload still to come: region ranges, or, once broken, `discard`;
    /// whether they hold all of it (a payload in more runs than one `readv` takes does not).
    fn payload_pieces(
        &mut self,
        regions: &impl Regions,
        discard: &mut [u8],
        pieces: &mut Vec<(usize, usize)>,
    ) -> bool {
        pieces.clear();
        let left = self.total - self.got;
        if !self.broken {
            let mut skip = self.got as u64;
            for &(loc, n) in &self.runs {
                if skip >= n {
                    skip -= n;
                    continue;
                }
                if pieces.len() == sys::WRITEV_MAX - 1 {
                    return false;
                }
                let range = regions
                    .region(loc.vnic)
                    .and_then(|r| r.io_range(loc.off + skip, n - skip).ok());
                let Some(r) = range else {
                    // Its vRNIC is gone (a removal also changes the memory generation).
                    self.broken = true;
                    break;
                };
                pieces.push(r);
                skip = 0;
            }
            if !self.broken {
                return true;
            }
        }
        pieces.clear();
        pieces.push((discard.as_mut_ptr() as usize, left.min(discard.len())));
        left <= discard.len()
    }

    /// Reads one byte of each page of the payload's rest: a region its tenant truncated trips
    /// the `SIGBUS` guard (zero pages, the vRNIC poisoned).
    fn touch(&self, regions: &impl Regions) {
        let mut skip = self.got as u64;
        for &(loc, n) in &self.runs {
            if skip >= n {
                skip -= n;
                continue;
            }
            if let Some(r) = regions.region(loc.vnic) {
                let (mut at, end) = (loc.off + skip, loc.off + n);
                while at < end {
                    let _ = r.touch(at);
                    at = (at | 4095) + 1;
                }
            }
            skip = 0;
        }
    }

    /// One `readv` from `fd`: the rest of the payload into place (or into `discard`), then, if
    /// that was all of it, up to [`HEADROOM`] bytes into `inbuf`. `Ok(None)`: nothing to read
    /// now; `Ok(Some(0))`: the end of the stream.
    pub(super) fn read(
        &mut self,
        fd: RawFd,
        regions: &impl Regions,
        inbuf: &mut LinkBuf,
        discard: &mut [u8],
        pieces: &mut Vec<(usize, usize)>,
    ) -> std::io::Result<Option<usize>> {
        for _ in 0..2 {
            let all = self.payload_pieces(regions, discard, pieces);
            let payload: usize = pieces.iter().map(|&(_, n)| n).sum();
            if all {
                let room = inbuf.spare(HEADROOM);
                pieces.push((room.as_mut_ptr() as usize, HEADROOM));
            }
            // SAFETY: the pieces are region ranges of mappings held by `regions` (checked by
            // io_range), the scratch buffer and the byte queue's spare room, lent to the call;
            // nothing refers to or changes any of them until it returns.
            match unsafe { sys::readv(fd, pieces) } {
                Ok(n) => {
                    let k = n.min(payload);
                    self.got += k;
                    if !self.broken {
                        self.placed += k as u64;
                    }
                    if n > k {
                        inbuf.commit(n - k);
                    }
                    return Ok(Some(n));
                }
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) && !self.broken => {
                    // Once per payload, and the vRNIC goes with its poisoned region.
                    tracing::warn!(
                        qpn = self.seg.dest_qpn,
                        "a payload read into place met a truncated region; the rest is dropped"
                    );
                    self.touch(regions);
                    self.broken = true;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::from_raw_os_error(libc::EFAULT))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Arc;

    use vrnic_wire::frame::{Op, Opcode, Transport};

    use super::*;

    /// One vRNIC's region, as the daemon's table would give it.
    struct One(Arc<Region>);

    impl Regions for One {
        fn region(&self, vnic: VnicId) -> Option<&Region> {
            (vnic == VnicId(1)).then_some(&*self.0)
        }
    }

    fn region(name: &str) -> (std::path::PathBuf, One) {
        let dir = std::env::temp_dir().join(format!("vrnic-inbound-{name}-{}", std::process::id()));
        // An earlier run's, whose process had this pid, would make the create fail.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("region");
        let r = Region::create(&path, 4 << 20, "t", 1, [0; 16], 0).unwrap();
        (path, One(Arc::new(r)))
    }

    fn placing(runs: Vec<(Loc, u64)>, first: &[u8], regions: &One) -> Placing {
        let total: u64 = runs.iter().map(|&(_, n)| n).sum();
        let op = Opcode::new(Transport::Rc, Op::RdmaWriteMiddle).unwrap();
        let mut seg = SegmentRepr::new(op, 5, 7);
        seg.payload_len = total as usize;
        Placing::start(
            AddrRepr::default(),
            seg,
            Placement::stale(),
            runs,
            0,
            first,
            regions,
        )
    }

    fn at(off: u64) -> Loc {
        Loc {
            vnic: VnicId(1),
            off,
        }
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    /// Reads until the payload is in, the peer writing it in pieces, then the next headers.
    fn read_all(p: &mut Placing, regions: &One, b: &UnixStream, inbuf: &mut LinkBuf) {
        let mut discard = vec![0; 65536];
        let mut pieces = Vec::new();
        while !p.payload_done() {
            match p.read(b.as_raw_fd(), regions, inbuf, &mut discard, &mut pieces) {
                Ok(Some(n)) => assert!(n > 0),
                Ok(None) => std::thread::yield_now(),
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn a_payload_lands_in_place_over_several_reads_and_what_follows_in_the_queue() {
        let (_path, regions) = region("place");
        let payload = pattern(150_000);
        // Two runs, not adjacent; its first 1000 bytes came with the headers.
        let runs = vec![(at(65536), 100_000), (at(1 << 20), 50_000)];
        let mut p = placing(runs, &payload[..1000], &regions);
        let (mut a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let rest = payload[1000..].to_vec();
        let writer = std::thread::spawn(move || {
            for c in rest.chunks(7000) {
                a.write_all(c).unwrap();
            }
            a.write_all(b"NEXT").unwrap();
            a
        });
        let mut inbuf = LinkBuf::default();
        read_all(&mut p, &regions, &b, &mut inbuf);
        let _a = writer.join().unwrap();
        let mut got = vec![0; 150_000];
        regions.0.read_bytes(65536, &mut got[..100_000]).unwrap();
        regions.0.read_bytes(1 << 20, &mut got[100_000..]).unwrap();
        assert!(got == payload, "every byte in place");
        assert!(!p.broken);
        assert_eq!(p.placed, 149_000, "all but the first bytes by the kernel");
        // What follows the payload went to the byte queue (now, or on the next plain read).
        let mut tail = inbuf.data().to_vec();
        let mut buf = [0u8; 16];
        while tail.len() < 4 {
            if let Ok(n) = (&b).read(&mut buf) {
                tail.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(tail, b"NEXT");
    }

    #[test]
    fn a_payload_in_more_runs_than_one_readv_takes_still_lands_whole() {
        let (_path, regions) = region("runs");
        // 200 runs of 100 bytes, every other page.
        let runs: Vec<(Loc, u64)> = (0..200).map(|i| (at(65536 + i * 8192), 100)).collect();
        let payload = pattern(20_000);
        let mut p = placing(runs, &[], &regions);
        let (mut a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        a.write_all(&payload).unwrap();
        a.write_all(b"HDR").unwrap();
        let mut inbuf = LinkBuf::default();
        read_all(&mut p, &regions, &b, &mut inbuf);
        for i in 0..200usize {
            let mut got = [0u8; 100];
            regions
                .0
                .read_bytes(65536 + i as u64 * 8192, &mut got)
                .unwrap();
            assert_eq!(got[..], payload[i * 100..i * 100 + 100], "run {i}");
        }
        // No payload byte reached the queue (the reads that could not hold the whole rest left
        // it out), and what follows the payload came after it.
        let mut tail = inbuf.data().to_vec();
        let mut buf = [0u8; 16];
        while tail.len() < 3 {
            if let Ok(n) = (&b).read(&mut buf) {
                tail.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(tail, b"HDR");
    }

    /// The tenant truncates its region with a payload on its way into it: `readv` gets `EFAULT`,
    /// the rest is read and dropped (the stream stays whole), and the region is poisoned by the
    /// daemon's guard.
    #[test]
    fn a_region_truncated_under_a_payload_drops_the_rest_and_is_poisoned() {
        vrnic_shm::fault::install().unwrap();
        let (path, regions) = region("trunc");
        let payload = pattern(120_000);
        let runs = vec![(at(65536), 120_000)];
        let mut p = placing(runs, &payload[..500], &regions);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        let (mut a, b) = UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let rest = payload[500..].to_vec();
        let writer = std::thread::spawn(move || {
            a.write_all(&rest).unwrap();
            a.write_all(b"NEXT").unwrap();
            a
        });
        let mut inbuf = LinkBuf::default();
        read_all(&mut p, &regions, &b, &mut inbuf);
        let _a = writer.join().unwrap();
        assert!(p.broken, "the rest was dropped");
        assert!(regions.0.poisoned(), "the guard took the region");
        let mut tail = inbuf.data().to_vec();
        let mut buf = [0u8; 16];
        while tail.len() < 4 {
            if let Ok(n) = (&b).read(&mut buf) {
                tail.extend_from_slice(&buf[..n]);
            }
        }
        assert_eq!(tail, b"NEXT", "the stream stayed whole");
    }
}
