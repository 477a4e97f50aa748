//! What a peer link has yet to write: frame bytes (headers, control frames, small payloads) in
//! a [`LinkBuf`], and large payloads as ranges of the source vRNIC's region, which the kernel
//! reads straight from the tenant's registered memory when the link writes them (`writev`), so
//! the daemon copies none of those bytes. Each range holds its region (an `Arc`): a vRNIC
//! removed meanwhile stays mapped until its queued bytes are out.
//!
//! A tenant that truncates its region under a queued range makes `writev` fail with `EFAULT`.
//! The queue then reads one byte of each page of the ranges it tried, which trips the daemon's
//! `SIGBUS` guard on the truncated region only (it becomes zero pages and is marked poisoned,
//! and the loop removes that vRNIC), and writes again: the frame goes out with zeros in it and
//! the stream stays whole. Should that not help, the ranges tried are sent as zeros.
//!
//! It has no bound of its own: what a link's peer can make it hold is bounded by the link
//! (`peers/mod.rs`: replies to a peer's keepalives are queued only while it holds little, and
//! a link whose queue makes no progress for a few seconds is closed); the engine's frames are
//! bounded by its windows and per-pass budget, and a busy link that writes is never cut.
//!
//! Its one `unsafe` block hands the pieces to `writev`: it is sound because the queue owns
//! what they point at (its byte buffer, the regions' `Arc`s, a static).
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::Arc;

use vrnic_shm::Region;

use super::linkbuf::LinkBuf;
use crate::sys;

/// Zero bytes to send in place of memory that cannot be read.
static ZEROS: [u8; 65536] = [0; 65536];

enum Piece {
    /// The next bytes of the byte queue.
    Bytes(usize),
    /// A range of a region.
    Region {
        region: Arc<Region>,
        off: u64,
        len: usize,
    },
    /// Zeros.
    Zeros(usize),
}

/// See the module documentation.
#[derive(Default)]
pub(super) struct OutQueue {
    bytes: LinkBuf,
    pieces: VecDeque<Piece>,
}

impl OutQueue {
    pub(super) fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The bytes it holds in its own memory (region ranges and zeros not counted: they are the
    /// tenants' memory, or none).
    pub(super) fn held(&self) -> usize {
        self.bytes.data().len()
    }

    /// Drops everything queued.
    pub(super) fn clear(&mut self) {
        self.bytes.clear();
        self.pieces.clear();
    }

    fn add_bytes(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        match self.pieces.back_mut() {
            Some(Piece::Bytes(m)) => *m += n,
            _ => self.pieces.push_back(Piece::Bytes(n)),
        }
    }

    /// Queues `data`.
    pub(super) fn extend(&mut self, data: &[u8]) {
        self.bytes.extend(data);
        self.add_bytes(data.len());
    }

    /// Room for at least `n` bytes to write in place (see [`LinkBuf::spare`]).
    pub(super) fn spare(&mut self, n: usize) -> &mut [u8] {
        self.bytes.spare(n)
    }

    /// Queues the first `n` bytes of the last [`spare`](Self::spare) slice.
    pub(super) fn commit(&mut self, n: usize) {
        let added = self.bytes.commit(n);
        self.add_bytes(added);
    }

    /// Queues `len` bytes of `region` at `off`, to be read when they are written.
    pub(super) fn push_region(&mut self, region: Arc<Region>, off: u64, len: usize) {
        if len > 0 {
            self.pieces.push_back(Piece::Region { region, off, len });
        }
    }

    /// Queues `n` zero bytes.
    pub(super) fn push_zeros(&mut self, n: usize) {
        if n > 0 {
            self.pieces.push_back(Piece::Zeros(n));
        }
    }

    /// Queues everything `other` holds, in its order, after what this queue holds, and
    /// empties `other` (its bytes are copied; its region ranges and zeros move as they are).
    /// How an engine thread's frames, queued off the loop thread, join their link's queue.
    pub(super) fn append(&mut self, other: &mut OutQueue) {
        for piece in other.pieces.drain(..) {
            match piece {
                Piece::Bytes(n) => {
                    self.extend(&other.bytes.data()[..n]);
                    other.bytes.consume(n);
                }
                p => self.pieces.push_back(p),
            }
        }
        other.bytes.clear();
    }

    /// The first pieces as `(address, length)`, at most [`sys::WRITEV_MAX`].
    fn gather(&self, out: &mut Vec<(usize, usize)>) {
        out.clear();
        let data = self.bytes.data();
        let mut at = 0usize;
        for p in self.pieces.iter().take(sys::WRITEV_MAX) {
            match p {
                Piece::Bytes(n) => {
                    let s = &data[at..at + n];
                    out.push((s.as_ptr() as usize, *n));
                    at += n;
                }
                Piece::Region { region, off, len } => match region.io_range(*off, *len as u64) {
                    Ok(r) => out.push(r),
                    // Cannot happen (ranges come from checked translations): send zeros.
                    Err(_) => out.push((ZEROS.as_ptr() as usize, (*len).min(ZEROS.len()))),
                },
                Piece::Zeros(n) => out.push((ZEROS.as_ptr() as usize, (*n).min(ZEROS.len()))),
            }
        }
    }

    /// Drops the first `n` bytes written.
    fn consume(&mut self, mut n: usize) {
        while n > 0 {
            let Some(p) = self.pieces.front_mut() else {
                return;
            };
            let left = match p {
                Piece::Bytes(m) => {
                    let k = n.min(*m);
                    self.bytes.consume(k);
                    *m -= k;
                    n -= k;
                    *m
                }
                Piece::Region { off, len, .. } => {
                    let k = n.min(*len);
                    *off += k as u64;
                    *len -= k;
                    n -= k;
                    *len
                }
                Piece::Zeros(m) => {
                    let k = n.min(*m);
                    *m -= k;
                    n -= k;
                    *m
                }
            };
            if left == 0 {
                self.pieces.pop_front();
            }
        }
    }

    /// Region ranges among the first pieces become zeros (after reading them failed twice).
    fn zero_regions(&mut self) {
        for p in self.pieces.iter_mut().take(sys::WRITEV_MAX) {
            if let Piece::Region { len, .. } = p {
                *p = Piece::Zeros(*len);
            }
        }
    }

    /// Reads one byte of every page of the region ranges among the first pieces: a truncated
    /// one trips the `SIGBUS` guard, which maps zero pages over it.
    fn touch_regions(&self) {
        for p in self.pieces.iter().take(sys::WRITEV_MAX) {
            if let Piece::Region { region, off, len } = p {
                let mut at = *off;
                while at < off + *len as u64 {
                    let _ = region.touch(at);
                    at = (at | 4095) + 1;
                }
            }
        }
    }

    /// Copies the first queued bytes into `dst` and drops them from the queue (an encrypted
    /// link seals them): region ranges are read through the region (a truncated one trips the
    /// `SIGBUS` guard and reads as zeros). Returns how many bytes it copied.
    pub(super) fn take_into(&mut self, dst: &mut [u8]) -> usize {
        let mut at = 0usize;
        let mut from_bytes = 0usize;
        for p in &self.pieces {
            if at == dst.len() {
                break;
            }
            let room = dst.len() - at;
            match p {
                Piece::Bytes(n) => {
                    let k = (*n).min(room);
                    let data = self.bytes.data();
                    dst[at..at + k].copy_from_slice(&data[from_bytes..from_bytes + k]);
                    from_bytes += k;
                    at += k;
                }
                Piece::Region { region, off, len } => {
                    let k = (*len).min(room);
                    if region.read_bytes(*off, &mut dst[at..at + k]).is_err() {
                        dst[at..at + k].fill(0);
                    }
                    at += k;
                }
                Piece::Zeros(n) => {
                    let k = (*n).min(room);
                    dst[at..at + k].fill(0);
                    at += k;
                }
            }
        }
        self.consume(at);
        at
    }

    /// One `writev` of the first pieces to `fd`: bytes written (0 with nothing queued), or
    /// the socket's error (`WouldBlock` when it is full).
    pub(super) fn write_to(
        &mut self,
        fd: RawFd,
        scratch: &mut Vec<(usize, usize)>,
    ) -> std::io::Result<usize> {
        if self.pieces.is_empty() {
            return Ok(0);
        }
        for attempt in 0..3 {
            self.gather(scratch);
            // SAFETY: byte pieces point into self.bytes, region pieces into mappings their
            // Arcs keep alive, zeros into a static; nothing changes them during the call.
            match unsafe { sys::writev(fd, scratch) } {
                Ok(n) => {
                    self.consume(n);
                    return Ok(n);
                }
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => match attempt {
                    0 => self.touch_regions(),
                    _ => self.zero_regions(),
                },
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::from_raw_os_error(libc::EFAULT))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    fn region(dir: &std::path::Path, fill: u8) -> Arc<Region> {
        let r = Region::create(&dir.join("region"), 1 << 20, "t", 1, [0; 16], 0).unwrap();
        r.write_bytes(8192, &[fill; 10000]).unwrap();
        Arc::new(r)
    }

    #[test]
    fn bytes_and_region_ranges_go_out_in_order() {
        let dir = std::env::temp_dir().join(format!("vrnic-outq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = region(&dir, 7);
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut q = OutQueue::default();
        q.extend(b"head");
        q.push_region(r.clone(), 8192, 10000);
        let s = q.spare(3);
        s[..3].copy_from_slice(b"mid");
        q.commit(3);
        q.push_zeros(5);
        q.extend(b"tail");
        drop(r);
        let mut scratch = Vec::new();
        let mut sent = 0;
        while !q.is_empty() {
            sent += q.write_to(a.as_raw_fd(), &mut scratch).unwrap();
        }
        assert_eq!(sent, 4 + 10000 + 3 + 5 + 4);
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        let mut want = b"head".to_vec();
        want.extend([7u8; 10000]);
        want.extend(b"mid");
        want.extend([0u8; 5]);
        want.extend(b"tail");
        assert_eq!(got, want, "the region's bytes, read when written");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A queue appended to another goes out after what that one held, in its own order, its
    /// region ranges still read when written; the appended queue is left empty.
    #[test]
    fn an_appended_queue_goes_out_after_what_was_queued_in_its_order() {
        let dir = std::env::temp_dir().join(format!("vrnic-outq-app-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let r = region(&dir, 5);
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut link = OutQueue::default();
        link.extend(b"first");
        let mut from_thread = OutQueue::default();
        from_thread.extend(b"hdr");
        from_thread.push_region(r.clone(), 8192, 10000);
        from_thread.push_zeros(2);
        from_thread.extend(b"end");
        link.append(&mut from_thread);
        assert!(from_thread.is_empty() && from_thread.held() == 0);
        link.extend(b"last");
        drop(r);
        let mut scratch = Vec::new();
        let mut sent = 0;
        while !link.is_empty() {
            sent += link.write_to(a.as_raw_fd(), &mut scratch).unwrap();
        }
        drop(a);
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        let mut want = b"firsthdr".to_vec();
        want.extend([5u8; 10000]);
        want.extend([0u8; 2]);
        want.extend(b"endlast");
        assert_eq!(sent, want.len());
        assert_eq!(got, want);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod truncated {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    /// A range queued from a region its tenant then truncates: `writev` gets `EFAULT`, the
    /// queue's touch trips the guard (zero pages, region poisoned), and the bytes go out as
    /// zeros; the queue and the stream stay whole.
    #[test]
    fn a_truncated_range_goes_out_as_zeros_and_poisons_its_region() {
        vrnic_shm::fault::install().unwrap();
        let dir = std::env::temp_dir().join(format!("vrnic-outq-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("region");
        let r = Arc::new(Region::create(&path, 1 << 20, "t", 1, [0; 16], 0).unwrap());
        r.write_bytes(65536, &[9; 20000]).unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut q = OutQueue::default();
        q.extend(b"<");
        q.push_region(r.clone(), 65536, 20000);
        q.extend(b">");
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            got
        });
        let mut scratch = Vec::new();
        let mut sent = 0;
        while !q.is_empty() {
            sent += q.write_to(a.as_raw_fd(), &mut scratch).unwrap();
        }
        drop(a);
        let got = reader.join().unwrap();
        assert_eq!(sent, 20002);
        assert_eq!(got.len(), 20002);
        assert_eq!((got[0], got[20001]), (b'<', b'>'));
        assert!(
            got[1..20001].iter().all(|&x| x == 0),
            "zeros, never stale bytes"
        );
        assert!(r.poisoned());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
