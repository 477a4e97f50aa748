//! What this process still maps where registered memory was: `/proc/self/maps` read back
//! against the runs of region pages the daemon handed out.
//!
//! Between `ibv_reg_mr` and `ibv_dereg_mr` the application may unmap part of its buffer (UCX's
//! and Open MPI's registration caches do so at `MPI_Finalize`), or unmap it and map something
//! else at the same addresses. A real RNIC deregisters such an MR without touching the
//! process's address space; here deregistration copies the still-registered pages back onto
//! private memory, so it must first know, page by page, which addresses still map the region
//! file at the offset the daemon gave them. Everything else is no longer the registration's:
//! its region pages can be released at once and the addresses are left alone.
//!
//! Safe code only: the areas come from `sys::vmas` (one `PROCMAP_QUERY` per area the runs
//! touch, Linux 6.11), or, on older kernels, from the file read as text.

use std::os::unix::fs::MetadataExt;

use vrnic_api::PageRun;

const PAGE: u64 = vrnic_shm::layout::PAGE;

/// One line of `/proc/self/maps` that maps the region file.
#[derive(Debug, Clone, Copy)]
struct Area {
    lo: u64,
    hi: u64,
    /// File offset mapped at `lo`.
    off: u64,
    readable: bool,
    shared: bool,
}

/// The runs' pages split by what the process maps there now.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    /// Still the region file at the run's offset, shared and readable: the registration's
    /// pages, to be copied back onto private memory.
    pub mapped: Vec<PageRun>,
    /// Still the region file at the run's offset but not readable (the app revoked access):
    /// left as they are, their pages stay reserved.
    pub unreadable: Vec<PageRun>,
    /// Anything else (unmapped, or other memory mapped there since): the registration's pages
    /// are free, the addresses are not ours.
    pub gone: Vec<PageRun>,
}

/// Splits `runs` (region pages behind app addresses) by what `/proc/self/maps` says about
/// each page now. `region` is the region file (its device and inode name it in the maps).
/// If the maps cannot be read, every page counts as mapped (the caller then behaves as before
/// this check existed).
pub fn split(runs: &[PageRun], region: &std::fs::File) -> Split {
    let all_mapped = || Split {
        mapped: runs.to_vec(),
        ..Split::default()
    };
    let Ok(meta) = region.metadata() else {
        return all_mapped();
    };
    let areas = match queried_areas(runs, meta.dev(), meta.ino()) {
        Some(areas) => areas,
        None => match std::fs::read_to_string("/proc/self/maps") {
            Ok(text) => region_areas(&text, meta.dev(), meta.ino()),
            Err(_) => return all_mapped(),
        },
    };
    split_with(runs, &areas)
}

/// The areas over `runs` that map the file `dev`/`ino`, asked of the kernel area by area
/// (`None` where it cannot answer that way).
fn queried_areas(runs: &[PageRun], dev: u64, ino: u64) -> Option<Vec<Area>> {
    let want = (libc::major(dev), libc::minor(dev));
    let mut out: Vec<Area> = Vec::new();
    for r in runs {
        let hi = r.va + u64::from(r.pages) * PAGE;
        for v in crate::sys::vmas(r.va, hi, false)? {
            if v.ino != ino || v.dev != want || out.iter().any(|a| a.lo == v.lo) {
                continue;
            }
            out.push(Area {
                lo: v.lo,
                hi: v.hi,
                off: v.off,
                readable: v.readable,
                shared: v.shared,
            });
        }
    }
    Some(out)
}

fn split_with(runs: &[PageRun], areas: &[Area]) -> Split {
    let mut out = Split::default();
    for r in runs {
        for p in 0..u64::from(r.pages) {
            let va = r.va + p * PAGE;
            let off = r.off + p * PAGE;
            let area = areas
                .iter()
                .find(|a| a.lo <= va && va < a.hi && a.off.wrapping_add(va - a.lo) == off);
            let to = match area {
                Some(a) if a.shared && a.readable => &mut out.mapped,
                Some(a) if a.shared => &mut out.unreadable,
                _ => &mut out.gone,
            };
            push_page(to, va, off);
        }
    }
    out
}

/// Appends one page to `runs`, extending the last run where it continues it.
fn push_page(runs: &mut Vec<PageRun>, va: u64, off: u64) {
    match runs.last_mut() {
        Some(r)
            if r.va + u64::from(r.pages) * PAGE == va
                && r.off + u64::from(r.pages) * PAGE == off =>
        {
            r.pages += 1
        }
        _ => runs.push(PageRun {
            va,
            off,
            pages: 1,
            fresh: false,
        }),
    }
}

/// The areas of `maps` (the text of `/proc/self/maps`) that map the file `dev`/`ino`.
fn region_areas(maps: &str, dev: u64, ino: u64) -> Vec<Area> {
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (range, perms, off, dev_s, ino_s) =
                (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            if ino_s.parse::<u64>().ok()? != ino {
                return None;
            }
            let (ma, mi) = dev_s.split_once(':')?;
            if u32::from_str_radix(ma, 16).ok()? != major
                || u32::from_str_radix(mi, 16).ok()? != minor
            {
                return None;
            }
            let (lo, hi) = range.split_once('-')?;
            let p = perms.as_bytes();
            Some(Area {
                lo: u64::from_str_radix(lo, 16).ok()?,
                hi: u64::from_str_radix(hi, 16).ok()?,
                off: u64::from_str_radix(off, 16).ok()?,
                readable: p.first() == Some(&b'r'),
                shared: p.get(3) == Some(&b's'),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0          [heap]
7f0000000000-7f0000003000 rw-s 00105000 00:1f 42         /run/vrnic/v0/region
7f0000003000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 ---s 00109000 00:1f 42         /run/vrnic/v0/region
7f0000005000-7f0000006000 rw-s 00200000 00:1f 42         /run/vrnic/v0/region
7f0000006000-7f0000007000 rw-s 0010b000 00:1f 43         /run/vrnic/v1/region
";

    fn run(va: u64, off: u64, pages: u32) -> PageRun {
        PageRun {
            va,
            off,
            pages,
            fresh: false,
        }
    }

    #[test]
    fn each_page_is_classified_by_what_maps_it_now() {
        let areas = region_areas(MAPS, libc::makedev(0, 0x1f), 42);
        assert_eq!(areas.len(), 3);
        // Seven pages registered at 0x7f0000000000, region offsets 0x105000.. in order.
        let s = split_with(&[run(0x7f00_0000_0000, 0x105000, 7)], &areas);
        // Pages 0-2: still the region at the right offsets.
        assert_eq!(s.mapped, vec![run(0x7f00_0000_0000, 0x105000, 3)]);
        // Page 4: still the region, but PROT_NONE.
        assert_eq!(s.unreadable, vec![run(0x7f00_0000_4000, 0x109000, 1)]);
        // Page 3: anonymous now; page 5: the region at another offset; page 6: another file
        // with another inode.
        assert_eq!(
            s.gone,
            vec![
                run(0x7f00_0000_3000, 0x108000, 1),
                run(0x7f00_0000_5000, 0x10a000, 2)
            ]
        );
    }

    #[test]
    fn a_file_on_another_device_with_the_same_inode_is_not_the_region() {
        assert!(region_areas(MAPS, libc::makedev(0, 0x20), 42).is_empty());
    }
}
