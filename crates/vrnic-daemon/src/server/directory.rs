//! The directory: who is where in the virtual network.
//!
//! It gives this host's vRNICs their identities (a LID from the host's share of the range, a
//! GUID and a link-local GID that carry the host's index, so both are unique across the
//! configured hosts with no numbering by the user), and it keeps what the other hosts
//! announced over their peer links (their vRNICs' LIDs and GIDs, their IP addresses). Those
//! feed the engine's routes (`Route::Remote`, resolved at RTR and AH creation) and the CM
//! broker's address resolution. A host's entries are replaced wholesale when its link comes
//! up again, since it then announces everything anew: nothing stale survives a reconnect.
//!
//! This is the embedded directory of a static host list; a cluster store would feed the same
//! calls.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::IpAddr;
use std::ops::Range;

use vrnic_proto::HostId;

use super::Server;

/// A vRNIC's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Identity {
    pub(super) lid: u16,
    pub(super) gid: [u8; 16],
    /// Big-endian, as `ibv_query_device` reports it.
    pub(super) guid: u64,
}

/// What one other host announced.
#[derive(Debug, Default)]
struct Announced {
    vnics: HashSet<(u16, [u8; 16])>,
    addrs: HashSet<IpAddr>,
}

/// See the module documentation.
#[derive(Debug)]
pub(super) struct Directory {
    /// This host's index in the host list (0 alone).
    host: u64,
    /// This host's share of the unicast LIDs.
    lids: Range<u16>,
    used: BTreeSet<u16>,
    /// Where the search for a free LID starts (LIDs are not reused at once).
    next: u16,
    remote: HashMap<HostId, Announced>,
}

impl Directory {
    /// A directory for host `host` of the list, giving out LIDs from `lids`.
    pub(super) fn new(host: usize, lids: Range<u16>) -> Directory {
        Directory {
            host: host as u64,
            next: lids.start,
            lids,
            used: BTreeSet::new(),
            remote: HashMap::new(),
        }
    }

    /// Addresses for this host's vRNIC number `serial`: a LID no vRNIC here holds, and a GUID
    /// and GID from the host's index and the serial. `None` when the LID share is used up.
    pub(super) fn assign(&mut self, serial: u32) -> Option<Identity> {
        let span = self.lids.end.checked_sub(self.lids.start)?;
        let lid = (0..span)
            .map(|k| {
                let off = (self.next - self.lids.start + k) % span;
                self.lids.start + off
            })
            .find(|l| !self.used.contains(l))?;
        self.used.insert(lid);
        self.next = if lid + 1 >= self.lids.end {
            self.lids.start
        } else {
            lid + 1
        };
        let guid_host: u64 =
            0x0256_5200_0000_0000 | (self.host << 24) | u64::from(serial & 0xff_ffff);
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[8..].copy_from_slice(&guid_host.to_be_bytes());
        Some(Identity {
            lid,
            gid,
            guid: guid_host.to_be(),
        })
    }

    /// A removed vRNIC's LID is free again.
    pub(super) fn release(&mut self, lid: u16) {
        self.used.remove(&lid);
    }
}

impl Server {
    /// Host `host` announced a vRNIC (`add`) or its removal.
    pub(super) fn directory_vnic(&mut self, host: HostId, add: bool, lid: u16, gid: [u8; 16]) {
        let known = self.directory.remote.entry(host).or_default();
        if add {
            known.vnics.insert((lid, gid));
            self.engine.add_remote_vnic(host, lid, gid);
        } else if known.vnics.remove(&(lid, gid)) {
            self.engine.remove_remote_vnic(lid, gid);
        }
    }

    /// Host `host` announced one of its IP addresses.
    pub(super) fn directory_addr(&mut self, host: HostId, ip: IpAddr) {
        self.directory
            .remote
            .entry(host)
            .or_default()
            .addrs
            .insert(ip);
        self.cm.add_host_addr(host, ip);
    }

    /// Forgets what `host` announced (its link is up again and announces it all anew, or it
    /// broke). Connections already routed to it keep their routes.
    pub(super) fn directory_forget(&mut self, host: HostId) {
        if let Some(known) = self.directory.remote.remove(&host) {
            for (lid, gid) in known.vnics {
                self.engine.remove_remote_vnic(lid, gid);
            }
        }
        self.cm.clear_host_addrs(host);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lids_come_from_the_share_and_are_not_reused_at_once() {
        let mut d = Directory::new(2, 10..13);
        let a = d.assign(1).unwrap();
        let b = d.assign(2).unwrap();
        assert_eq!((a.lid, b.lid), (10, 11));
        d.release(10);
        assert_eq!(d.assign(3).unwrap().lid, 12, "the next one first");
        assert_eq!(d.assign(4).unwrap().lid, 10, "then a freed one");
        assert!(d.assign(5).is_none(), "the share is used up");
        // The host index is in the GUID and the GID.
        assert_eq!((u64::from_be(a.guid) >> 24) & 0xff, 2);
        assert_eq!(&a.gid[..2], &[0xfe, 0x80]);
        assert_eq!(a.gid[8..], u64::from_be(a.guid).to_be_bytes());
        assert_ne!(a.gid, b.gid);
    }
}
