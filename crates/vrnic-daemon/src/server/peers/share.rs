//! What one host of a static host list owns, and how much of it a peer may make this daemon
//! hold: the checks every announcement over a peer link passes before the directory, the
//! engine's routes or the CM broker see it.
//!
//! - **LIDs**: host `h` of `n` gives out the LIDs of its share ([`lid_share`], the rule this
//!   host's own directory uses), so a vRNIC announced with a LID outside the announcer's share
//!   is refused: no host can take over another's LID routes.
//! - **GIDs**: a vRNIC's GID is link-local with a GUID that carries its host's index
//!   ([`guid`]); one that does not carry the announcer's is refused ([`gid_is_hosts`]).
//! - **One vRNIC per LID**: a host announcing a LID it already announced replaces that vRNIC
//!   (as the host's own directory never gives a LID twice), so what a host announces is at
//!   most its share, and never more than [`MAX_ANNOUNCED_VNICS`].
//! - **Count**: at most [`MAX_ANNOUNCED_VNICS`] vRNICs and [`MAX_ANNOUNCED_ADDRS`] host
//!   addresses per host: beyond, the link is closed as broken (an honest host announces no
//!   more: the first bound is above any host's vRNIC count in practice and keeps `vrnic ls
//!   --all` within an admin reply, the second is what a host sends, as in cluster records).
//! - **Addresses** (for rdma_cm): an address is kept for the first host that announced it.
//!   One that is this host's own, another configured host's peer-link address, already
//!   another host's, or a loopback address other than the announcer's own peer-link address
//!   is dropped (not an error: hosts on one machine, or with the same bridge address, announce
//!   the same ones honestly); see [`addr_verdict`].
//!
//! Virtual IPs are chosen by tenants (`--ip`) as well as from a host's share, so they cannot
//! be checked against a share: a virtual IP is kept for its first owner in its group, and a
//! host's later announcements release only its own (`directory.rs`).
//!
//! In cluster mode none of this applies: the directory is etcd's, whose records are claimed
//! by one transaction each (`cluster/`), and announcements over a link close it.

use std::net::IpAddr;
use std::ops::Range;

use tracing::warn;
use vrnic_api::gid_string;
use vrnic_proto::HostId;

use super::Close;
use crate::server::Server;
use crate::server::announce::{Entry, parse};

/// Most vRNICs one host may announce. A reply of `vrnic ls --all` with this many from each of
/// a few hosts stays well within an admin reply (`admin_socket.rs`).
pub(in crate::server) const MAX_ANNOUNCED_VNICS: usize = 8192;
/// Most addresses one host may announce (and this host announces at most this many).
pub(in crate::server) const MAX_ANNOUNCED_ADDRS: usize = 64;

/// Host `host`'s share of the unicast LIDs when there are `hosts` (a static host list; 1 when
/// alone): an equal slice of `1..0xbfff` each.
pub(in crate::server) fn lid_share(host: usize, hosts: usize) -> Range<u16> {
    let n = hosts.max(1) as u32;
    let span = 0xbffe / n;
    let base = 1 + (host as u32).min(n - 1) * span;
    base as u16..(base + span) as u16
}

/// The GUID of host `host`'s vRNIC number `serial` (host order): vrnic's prefix, the host's
/// index, the serial's low 24 bits.
pub(in crate::server) fn guid(host: u64, serial: u32) -> u64 {
    0x0256_5200_0000_0000 | (host << 24) | u64::from(serial & 0xff_ffff)
}

/// Whether `gid` is one host `host` gives out: link-local, with a GUID of [`guid`]'s form that
/// carries `host`.
pub(in crate::server) fn gid_is_hosts(gid: &[u8; 16], host: u64) -> bool {
    let mut g = [0u8; 8];
    g.copy_from_slice(&gid[8..]);
    gid[..8] == [0xfe, 0x80, 0, 0, 0, 0, 0, 0]
        && u64::from_be_bytes(g) & !0xff_ffff == guid(host, 0)
}

/// What becomes of an address a host announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::server) enum AddrVerdict {
    /// Recorded as the host's.
    Keep,
    /// Already recorded as the host's.
    Known,
    /// Not the host's to claim: dropped.
    Drop(&'static str),
}

/// What is known about an address announced by a host: who holds it now, and what the host
/// set says.
pub(in crate::server) struct AddrFacts {
    /// It is one of this host's addresses (or its peer-link address).
    pub(in crate::server) ours: bool,
    /// It is the announcer's own peer-link address.
    pub(in crate::server) announcers_link: bool,
    /// It is another configured host's peer-link address.
    pub(in crate::server) others_link: bool,
    /// Which host holds it now: `Some(true)` the announcer, `Some(false)` another one.
    pub(in crate::server) held_by_announcer: Option<bool>,
}

/// The rule for an announced address (see the module documentation).
pub(in crate::server) fn addr_verdict(ip: IpAddr, f: &AddrFacts) -> AddrVerdict {
    if f.held_by_announcer == Some(true) {
        return AddrVerdict::Known;
    }
    if f.announcers_link {
        return AddrVerdict::Keep;
    }
    if ip.is_loopback() {
        AddrVerdict::Drop("a loopback address not its own")
    } else if f.ours {
        AddrVerdict::Drop("an address of this host")
    } else if f.others_link {
        AddrVerdict::Drop("another host's peer-link address")
    } else if f.held_by_announcer == Some(false) {
        AddrVerdict::Drop("an address another host announced first")
    } else {
        AddrVerdict::Keep
    }
}

impl Server {
    /// An announce frame's body from host `host` of a static host list: each entry checked
    /// against the host's share and the bounds (see the module documentation), then recorded.
    /// A malformed body, a vRNIC outside the host's share or past the bound, or too many
    /// addresses close the link; an address not the host's to claim is dropped.
    pub(super) fn take_announcement(&mut self, host: HostId, body: &[u8]) -> Result<(), Close> {
        let entries =
            parse(body).map_err(|e| Close::Broken(format!("a malformed announcement: {e}")))?;
        let Some(p) = &self.peers else { return Ok(()) };
        let share = lid_share(host.0 as usize, p.hello_count());
        let owns =
            |lid: u16, gid: &[u8; 16]| share.contains(&lid) && gid_is_hosts(gid, u64::from(host.0));
        let links: Vec<(HostId, IpAddr)> = p
            .links
            .iter()
            .flatten()
            .map(|l| (l.host, l.addr.ip()))
            .collect();
        let listen = p.listen.ip();
        let mut ours: Option<Vec<IpAddr>> = None;
        let mut dropped: Option<(IpAddr, &'static str)> = None;
        for e in entries {
            match e {
                Entry::Added {
                    lid,
                    gid,
                    vip,
                    name,
                    group,
                } => {
                    if !owns(lid, &gid) {
                        return Err(Close::Broken(format!(
                            "a vRNIC announced outside its host's share (LID {lid}, GID {}; its LIDs \
                             are {share:?})",
                            gid_string(&gid)
                        )));
                    }
                    let (count, known) = self.directory.announced(host, lid);
                    if !known && count >= MAX_ANNOUNCED_VNICS {
                        return Err(Close::Broken(format!(
                            "more than {MAX_ANNOUNCED_VNICS} vRNICs announced"
                        )));
                    }
                    if !self.directory_vnic(host, lid, gid, Some((name, group, vip))) {
                        return Err(Close::Broken("too many groups announced".into()));
                    }
                }
                Entry::Complete => self.directory_swept(host),
                Entry::Removed { lid, gid } => {
                    if !owns(lid, &gid) {
                        return Err(Close::Broken(format!(
                            "a vRNIC's removal announced outside its host's share (LID {lid})"
                        )));
                    }
                    self.directory_vnic(host, lid, gid, None);
                }
                Entry::Addr(ip) => {
                    let (count, holder) = self.directory.addr_holder(host, ip);
                    if holder != Some(host) && count >= MAX_ANNOUNCED_ADDRS {
                        return Err(Close::Broken(format!(
                            "more than {MAX_ANNOUNCED_ADDRS} addresses announced"
                        )));
                    }
                    let ours = ours.get_or_insert_with(crate::sys::host_addrs);
                    let facts = AddrFacts {
                        ours: ip == listen || ours.contains(&ip),
                        announcers_link: links.iter().any(|&(h, a)| h == host && a == ip),
                        others_link: links.iter().any(|&(h, a)| h != host && a == ip),
                        held_by_announcer: holder.map(|h| h == host),
                    };
                    if let Some(why) = self.directory_addr(host, ip, &facts) {
                        dropped = Some((ip, why));
                    }
                }
            }
        }
        if let Some((ip, why)) = dropped
            && let Some(Some(l)) = self
                .peers
                .as_ref()
                .and_then(|p| p.links.get(host.0 as usize))
        {
            // One line per announce frame at most: a peer cannot flood the log faster than it
            // sends frames, and an honest one announces its addresses once per link.
            warn!(peer = %l.addr, %ip, "an announced address was dropped: {why}");
        }
        Ok(())
    }
}

/// The addresses this host announces: its own (at most [`MAX_ANNOUNCED_ADDRS`]), its
/// peer-link address first when it has one of its own.
pub(super) fn own_addrs(listen: Option<IpAddr>) -> Vec<IpAddr> {
    let mut addrs = Vec::new();
    if let Some(l) = listen.filter(|l| !l.is_unspecified()) {
        addrs.push(l);
    }
    for ip in crate::sys::host_addrs() {
        if !addrs.contains(&ip) {
            addrs.push(ip);
        }
    }
    addrs.truncate(MAX_ANNOUNCED_ADDRS);
    addrs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lid_shares_are_disjoint_and_cover_no_reserved_lid() {
        for n in [1usize, 2, 3, 7, 64] {
            let shares: Vec<_> = (0..n).map(|h| lid_share(h, n)).collect();
            for (h, s) in shares.iter().enumerate() {
                assert!(
                    s.start >= 1 && s.end <= 0xbfff && !s.is_empty(),
                    "{n} {h} {s:?}"
                );
                if h > 0 {
                    assert_eq!(shares[h - 1].end, s.start, "contiguous, disjoint");
                }
            }
        }
        assert_eq!(lid_share(0, 1), 1..0xbfff);
        assert_eq!(
            lid_share(5, 2),
            lid_share(1, 2),
            "an index past the list is clamped"
        );
    }

    #[test]
    fn a_gid_carries_its_hosts_index_and_no_other() {
        let gid_of = |host: u64, serial: u32| {
            let mut g = [0u8; 16];
            g[..2].copy_from_slice(&[0xfe, 0x80]);
            g[8..].copy_from_slice(&guid(host, serial).to_be_bytes());
            g
        };
        let g = gid_of(2, 77);
        assert!(gid_is_hosts(&g, 2));
        assert!(!gid_is_hosts(&g, 1));
        assert!(!gid_is_hosts(&g, 3));
        assert!(gid_is_hosts(&gid_of(1023, 0xff_ffff), 1023));
        let mut global = g;
        global[0] = 0x20;
        assert!(!gid_is_hosts(&global, 2), "not link-local");
        let mut other_prefix = g;
        other_prefix[8] = 0x12;
        assert!(!gid_is_hosts(&other_prefix, 2), "not vrnic's GUID prefix");
    }

    #[test]
    fn an_address_stays_with_its_first_owner_and_a_hosts_own_link_address_is_its() {
        let facts = |ours, announcers_link, others_link, held| AddrFacts {
            ours,
            announcers_link,
            others_link,
            held_by_announcer: held,
        };
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let lo: IpAddr = "127.0.0.3".parse().unwrap();
        assert_eq!(
            addr_verdict(ip, &facts(false, false, false, None)),
            AddrVerdict::Keep
        );
        assert_eq!(
            addr_verdict(ip, &facts(false, false, false, Some(true))),
            AddrVerdict::Known
        );
        for f in [
            facts(true, false, false, None),
            facts(false, false, true, None),
            facts(false, false, false, Some(false)),
        ] {
            assert!(matches!(addr_verdict(ip, &f), AddrVerdict::Drop(_)));
        }
        assert!(matches!(
            addr_verdict(lo, &facts(false, false, false, None)),
            AddrVerdict::Drop(_)
        ));
        assert_eq!(
            addr_verdict(lo, &facts(true, true, false, None)),
            AddrVerdict::Keep,
            "a host whose peer-link address is loopback announces it"
        );
    }
}
