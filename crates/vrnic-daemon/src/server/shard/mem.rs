//! Region memory as the engine sees it during a pass ([`Mem`]): the regions of the shard's
//! vRNICs, and, while a pass executes a request on a sibling shard, that shard's too, every
//! copy counted on the lane it writes.

use crate::server::*;

use super::Lane;
use std::sync::atomic::AtomicU64;
use vrnic_proto::MemoryRefused;

/// The engine's view of region memory: every vRNIC's region of its shard, by id, and, while
/// a pass executes a request on a sibling shard, that shard's too. It remembers the last
/// region it found for a source and for a destination, so the runs of one segment (often many,
/// all in the same two regions) cost no lookups after the first. Each copy, write or read is
/// counted on the lane of the region it writes into (a read, on the one it reads): what
/// `vrnic stats` calls the bytes the engine copied.
pub(in crate::server) struct Mem<'a> {
    lanes: &'a FxHashMap<VnicId, Lane>,
    /// A sibling shard's lanes (looked up when a vRNIC is not in `lanes`).
    more: Option<&'a FxHashMap<VnicId, Lane>>,
    src: Option<(VnicId, &'a Lane)>,
    dst: Option<(VnicId, &'a Lane)>,
}

impl<'a> Mem<'a> {
    pub(in crate::server) fn new(lanes: &'a FxHashMap<VnicId, Lane>) -> Self {
        Mem {
            lanes,
            more: None,
            src: None,
            dst: None,
        }
    }

    /// The regions of two shards: this pass's and a sibling's it holds.
    pub(in crate::server) fn pair(
        lanes: &'a FxHashMap<VnicId, Lane>,
        more: &'a FxHashMap<VnicId, Lane>,
    ) -> Self {
        Mem {
            more: Some(more),
            ..Mem::new(lanes)
        }
    }

    /// The region of `vnic`, as a source of bytes.
    pub(in crate::server) fn source(&mut self, vnic: VnicId) -> Option<&'a Arc<Region>> {
        Self::lane(self.lanes, self.more, &mut self.src, vnic).map(|l| &l.region)
    }

    fn lane(
        lanes: &'a FxHashMap<VnicId, Lane>,
        more: Option<&'a FxHashMap<VnicId, Lane>>,
        last: &mut Option<(VnicId, &'a Lane)>,
        id: VnicId,
    ) -> Option<&'a Lane> {
        match *last {
            Some((v, l)) if v == id => Some(l),
            _ => {
                let l = lanes.get(&id).or_else(|| more?.get(&id))?;
                *last = Some((id, l));
                Some(l)
            }
        }
    }
}

impl Memory for Mem<'_> {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        let s = Self::lane(self.lanes, self.more, &mut self.src, src.vnic);
        let d = Self::lane(self.lanes, self.more, &mut self.dst, dst.vnic);
        let (Some(s), Some(d)) = (s, d) else {
            return refused(&format!("copy between unknown vRNICs {src:?} -> {dst:?}"));
        };
        d.count_copy(len);
        Region::copy(&s.region, src.off, &d.region, dst.off, len as u64)
            .or_else(|e| refused(&format!("engine copy refused: {e}")))
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        let Some(d) = Self::lane(self.lanes, self.more, &mut self.dst, dst.vnic) else {
            return refused(&format!("write to an unknown vRNIC {dst:?}"));
        };
        d.count_copy(data.len());
        d.region
            .write_bytes(dst.off, data)
            .or_else(|e| refused(&format!("engine write refused: {e}")))
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        let Some(s) = Self::lane(self.lanes, self.more, &mut self.src, src.vnic) else {
            return refused(&format!("read of an unknown vRNIC {src:?}"));
        };
        s.count_copy(out.len());
        s.region
            .read_bytes(src.off, out)
            .or_else(|e| refused(&format!("engine read refused: {e}")))
    }
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        let Some(d) = Self::lane(self.lanes, self.more, &mut self.dst, dst.vnic) else {
            return refused(&format!("atomic store to an unknown vRNIC {dst:?}"));
        };
        d.count_copy(8);
        d.region
            .store_u64(dst.off, value)
            .or_else(|e| refused(&format!("engine atomic store refused: {e}")))
    }
}

/// Copies refused since the last warning, and when that was (seconds of the monotonic clock): a
/// tenant that makes every copy fail gets one line a second.
static REFUSED: AtomicU64 = AtomicU64::new(0);
static REFUSED_LOGGED: AtomicU64 = AtomicU64::new(0);

/// A refused copy: counted, and logged at most once a second (with how many since); the
/// engine completes the work request it served with an error.
#[cold]
fn refused(what: &str) -> Result<(), MemoryRefused> {
    let n = REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
    let now = crate::sys::monotonic_ns() / 1_000_000_000;
    let last = REFUSED_LOGGED.load(Ordering::Relaxed);
    if now > last
        && REFUSED_LOGGED
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    {
        REFUSED.store(0, Ordering::Relaxed);
        warn!(
            refused = n,
            "{what} (the work request fails; at most one such line a second)"
        );
    }
    Err(MemoryRefused)
}
