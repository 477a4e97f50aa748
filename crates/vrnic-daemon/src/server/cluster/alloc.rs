//! Choosing what a daemon tries to claim in etcd: a host index, a LID, a virtual IP, and the
//! GUID and GID that go with a LID.
//!
//! These are candidates only. What makes a LID, GID or IP unique across the cluster is the
//! transaction that claims it (`session.rs`: the claim keys must not exist yet); a candidate
//! another daemon took first fails that transaction and the next one is tried. Candidates start
//! at a point of the daemon's own (its host index, a seed), so daemons creating vRNICs at the
//! same time rarely try the same one.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use super::records::LIDS;

/// The GUIDs of cluster vRNICs: this prefix and the LID (unique in the cluster, so the GUID
/// and the link-local GID made of it are too; the GID is claimed all the same).
const GUID_BASE: u64 = 0x0256_52c0_0000_0000;
/// Every group's virtual addresses come from 100.64.0.0/10, as on one host.
const VIP_BASE: u32 = u32::from_be_bytes([100, 64, 0, 0]);
const VIP_SPAN: u32 = 1 << 22;

/// The lowest free host index below `max`, `prefer` if it is free.
pub(super) fn pick_host(used: &BTreeSet<u32>, prefer: Option<u32>, max: u32) -> Option<u32> {
    if let Some(p) = prefer
        && p < max
        && !used.contains(&p)
    {
        return Some(p);
    }
    (0..max).find(|i| !used.contains(i))
}

/// The first free unicast LID from `start` on (wrapping).
pub(super) fn pick_lid(used: &BTreeSet<u16>, start: u16) -> Option<u16> {
    let span = LIDS.end - LIDS.start;
    let first = start.saturating_sub(LIDS.start) % span;
    (0..span)
        .map(|k| LIDS.start + (first + k) % span)
        .find(|l| !used.contains(l))
}

/// The first free virtual IP of 100.64.0.0/10 from host `host`'s share (`100.(64+h).0.1`
/// for the first 64 hosts) on, wrapping; addresses ending in .0 or .255 are skipped.
pub(super) fn pick_vip(used: &BTreeSet<Ipv4Addr>, host: u32) -> Option<Ipv4Addr> {
    let first = ((host & 0x3f) << 16) | 1;
    (0..VIP_SPAN)
        .map(|k| (first + k) % VIP_SPAN)
        .filter(|k| !matches!(k & 0xff, 0 | 0xff))
        .map(|k| Ipv4Addr::from(VIP_BASE | k))
        .find(|ip| !used.contains(ip))
}

/// The GUID (big-endian, as `ibv_query_device` reports it) and the link-local GID of the
/// vRNIC with LID `lid`.
pub(super) fn guid_gid(lid: u16) -> (u64, [u8; 16]) {
    let guid = GUID_BASE | u64::from(lid);
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[8..].copy_from_slice(&guid.to_be_bytes());
    (guid.to_be(), gid)
}

/// A LID to start the search at, from a seed that differs between daemons and tries.
pub(super) fn start_lid(seed: u64) -> u16 {
    let span = u64::from(LIDS.end - LIDS.start);
    // A multiplicative hash spreads nearby seeds over the range.
    let h = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 16;
    LIDS.start + (h % span) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_takes_its_old_index_if_free_else_the_lowest() {
        let used = BTreeSet::from([0, 1, 3]);
        assert_eq!(pick_host(&used, Some(5), 8), Some(5));
        assert_eq!(pick_host(&used, Some(3), 8), Some(2), "taken");
        assert_eq!(pick_host(&used, None, 8), Some(2));
        assert_eq!(pick_host(&used, Some(9), 8), Some(2), "out of range");
        assert_eq!(pick_host(&BTreeSet::from([0, 1]), None, 2), None, "full");
    }

    #[test]
    fn lids_are_unicast_free_and_wrap() {
        let used = BTreeSet::from([5, 6, 0xbfff]);
        assert_eq!(pick_lid(&used, 5), Some(7));
        assert_eq!(
            pick_lid(&used, 0xbfff),
            Some(1),
            "wraps past the last unicast LID"
        );
        assert_eq!(pick_lid(&used, 0), Some(1), "0 is no LID");
        assert_eq!(pick_lid(&used, 0xffff), Some(0x4000));
        let all: BTreeSet<u16> = LIDS.collect();
        assert_eq!(pick_lid(&all, 1), None);
        for seed in 0..1000 {
            assert!(LIDS.contains(&start_lid(seed)));
        }
        let starts: BTreeSet<u16> = (0..64).map(start_lid).collect();
        assert!(starts.len() > 60, "seeds spread: {}", starts.len());
    }

    #[test]
    fn virtual_ips_come_from_the_host_share_and_skip_network_and_broadcast() {
        let none = BTreeSet::new();
        assert_eq!(pick_vip(&none, 0), Some(Ipv4Addr::new(100, 64, 0, 1)));
        assert_eq!(pick_vip(&none, 3), Some(Ipv4Addr::new(100, 67, 0, 1)));
        let used: BTreeSet<Ipv4Addr> = (1..=254).map(|d| Ipv4Addr::new(100, 67, 0, d)).collect();
        assert_eq!(pick_vip(&used, 3), Some(Ipv4Addr::new(100, 67, 1, 1)));
        let last = BTreeSet::from([Ipv4Addr::new(100, 127, 255, 254)]);
        assert_eq!(pick_vip(&last, 63).map(|ip| ip.octets()[1]), Some(127));
    }

    #[test]
    fn gids_are_link_local_and_carry_the_guid() {
        let (guid, gid) = guid_gid(0x1234);
        assert_eq!(&gid[..8], &[0xfe, 0x80, 0, 0, 0, 0, 0, 0]);
        assert_eq!(gid[8..], u64::from_be(guid).to_be_bytes());
        assert_ne!(guid_gid(1).1, guid_gid(2).1);
    }
}
