//! A peer link's byte queue: frames are written in place at its tail and taken from its
//! head, with no zeroing and no shifting per operation (bytes move only when the tail runs
//! out of room while the head has advanced).
//!
//! A link carries gigabytes per second through two of these (what it reads, what it has yet
//! to write); a `Vec` used as a queue would zero every frame's room before filling it and
//! shift the rest down after every partial write.

/// A queue grows to its peak and goes back to nothing once empty past this size.
const SHRINK_ABOVE: usize = 16 << 20;

/// See the module documentation.
#[derive(Debug, Default)]
pub(super) struct LinkBuf {
    buf: Vec<u8>,
    head: usize,
    tail: usize,
}

impl LinkBuf {
    /// The queued bytes.
    pub(super) fn data(&self) -> &[u8] {
        &self.buf[self.head..self.tail]
    }

    /// Drops the first `n` queued bytes.
    pub(super) fn consume(&mut self, n: usize) {
        self.head = self.head.saturating_add(n).min(self.tail);
        if self.head == self.tail {
            self.clear();
        }
    }

    /// Drops everything.
    pub(super) fn clear(&mut self) {
        self.head = 0;
        self.tail = 0;
        if self.buf.len() > SHRINK_ABOVE {
            self.buf = Vec::new();
        }
    }

    /// Room for at least `n` more bytes after the tail: the slice to fill (it holds stale
    /// bytes), then [`commit`](Self::commit) what was written.
    pub(super) fn spare(&mut self, n: usize) -> &mut [u8] {
        if self.buf.len() - self.tail < n {
            if self.head > 0 {
                self.buf.copy_within(self.head..self.tail, 0);
                self.tail -= self.head;
                self.head = 0;
            }
            if self.buf.len() - self.tail < n {
                let want = (self.tail + n).next_power_of_two();
                self.buf.resize(want, 0);
            }
        }
        &mut self.buf[self.tail..]
    }

    /// Appends the first `n` bytes of the last [`spare`](Self::spare) slice (at most that
    /// slice); returns how many it appended.
    pub(super) fn commit(&mut self, n: usize) -> usize {
        let end = self.tail.saturating_add(n).min(self.buf.len());
        let added = end - self.tail;
        self.tail = end;
        added
    }

    /// Appends `bytes`.
    pub(super) fn extend(&mut self, bytes: &[u8]) {
        self.spare(bytes.len())[..bytes.len()].copy_from_slice(bytes);
        self.commit(bytes.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_come_out_in_order_across_partial_takes_and_growth() {
        let mut q = LinkBuf::default();
        let mut model = std::collections::VecDeque::new();
        let mut next = 0u8;
        for round in 0..2000usize {
            let n = (round * 7919) % 5000;
            let chunk: Vec<u8> = (0..n)
                .map(|_| {
                    next = next.wrapping_add(1);
                    next
                })
                .collect();
            q.extend(&chunk);
            model.extend(chunk);
            let take = (round * 104_729) % (q.data().len() + 1);
            let got: Vec<u8> = q.data()[..take].to_vec();
            let want: Vec<u8> = model.drain(..take).collect();
            assert_eq!(got, want);
            q.consume(take);
            assert_eq!(q.data().len(), model.len());
        }
        q.consume(usize::MAX);
        assert!(q.data().is_empty());
    }

    #[test]
    fn a_spare_slice_written_in_part_appends_only_that_part() {
        let mut q = LinkBuf::default();
        q.extend(b"ab");
        let s = q.spare(10);
        assert!(s.len() >= 10);
        s[..3].copy_from_slice(b"cde");
        q.commit(3);
        assert_eq!(q.data(), b"abcde");
        q.consume(5);
        assert!(q.data().is_empty());
    }
}
