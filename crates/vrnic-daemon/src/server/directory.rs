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
//! It also keeps the tenants' groups: each vRNIC belongs to one (named; `default` unless
//! given), and gets a virtual IPv4 address that is unique within its group only, so two
//! tenants may use the same addresses. Group names are numbered here ([`GroupId`]) for the
//! engine's routes and the CM broker, which both refuse to join vRNICs of different groups.
//!
//! This is the embedded directory of a static host list; a cluster store would feed the same
//! calls.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr};
use std::ops::Range;

use anyhow::{Result, bail};
use tracing::warn;
use vrnic_proto::{GroupId, HostId, Refused, VnicId};

use super::Server;
use crate::cm::{DEFAULT_GROUP, VipAt};

/// Most group names a daemon keeps (its own vRNICs' and those other hosts announced).
pub(super) const MAX_GROUPS: usize = 65536;
/// Every group's virtual addresses come from this /10 (each group is an address space of its
/// own): host index `h` gives out `100.(64+h).x.y`.
const VIP_BASE: u32 = u32::from_be_bytes([100, 64, 0, 0]);

/// A vRNIC's addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Identity {
    pub(super) lid: u16,
    pub(super) gid: [u8; 16],
    /// Big-endian, as `ibv_query_device` reports it.
    pub(super) guid: u64,
}

/// A vRNIC another host announced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RemoteVnic {
    pub(super) name: String,
    pub(super) group: GroupId,
    pub(super) vip: Ipv4Addr,
}

/// What one other host announced.
#[derive(Debug, Default)]
struct Announced {
    /// By LID: a host gives a LID to one vRNIC at a time (`peers/share.rs`).
    vnics: HashMap<u16, ([u8; 16], RemoteVnic)>,
    addrs: HashSet<IpAddr>,
    /// While the host's link is announcing its full set anew (from link up to its
    /// `Complete` entry): the LIDs and addresses announced again so far. What was known before
    /// stays usable meanwhile (routes and rdma_cm addresses survive a link that flaps); what
    /// is not announced again is forgotten at the end.
    fresh: Option<(HashSet<u16>, HashSet<IpAddr>)>,
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
    /// Group names and their numbers (0 is [`DEFAULT_GROUP`]).
    groups: HashMap<String, GroupId>,
    group_names: Vec<String>,
    /// Virtual IPs in use, by group.
    vips: HashMap<(GroupId, Ipv4Addr), VipAt>,
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
            groups: HashMap::from([(DEFAULT_GROUP.to_string(), GroupId(0))]),
            group_names: vec![DEFAULT_GROUP.to_string()],
            vips: HashMap::new(),
        }
    }

    /// The number of group `name`, numbering it if new; `None` past [`MAX_GROUPS`].
    pub(super) fn group(&mut self, name: &str) -> Option<GroupId> {
        if let Some(&g) = self.groups.get(name) {
            return Some(g);
        }
        if self.group_names.len() >= MAX_GROUPS {
            return None;
        }
        let g = GroupId(self.group_names.len() as u32);
        self.groups.insert(name.to_string(), g);
        self.group_names.push(name.to_string());
        Some(g)
    }

    /// The name of group `g`.
    pub(super) fn group_name(&self, g: GroupId) -> &str {
        self.group_names
            .get(g.0 as usize)
            .map_or("?", String::as_str)
    }

    /// A virtual IP in `group` for this host's vRNIC `vnic`: `want`, if it is a unicast
    /// address nobody in the group uses, or the first free one of this host's share of the
    /// group's subnet.
    pub(super) fn take_vip(
        &mut self,
        group: GroupId,
        want: Option<Ipv4Addr>,
        vnic: VnicId,
    ) -> Result<Ipv4Addr> {
        let ip = match want {
            Some(ip) => {
                if ip.is_unspecified()
                    || ip.is_loopback()
                    || ip.is_multicast()
                    || ip.is_broadcast()
                    || ip.octets()[0] == 0
                {
                    bail!("{ip} is not a unicast address a vRNIC can have");
                }
                if self.vips.contains_key(&(group, ip)) {
                    bail!("{ip} is already used in group {}", self.group_name(group));
                }
                ip
            }
            None => {
                let share = VIP_BASE | ((self.host as u32 & 0x3f) << 16);
                (1..0xffffu32)
                    .filter(|k| !matches!(k & 0xff, 0 | 0xff))
                    .map(|k| Ipv4Addr::from(share | k))
                    .find(|ip| !self.vips.contains_key(&(group, *ip)))
                    .ok_or_else(|| {
                        anyhow::anyhow!(
                            "group {} has no free address left in this host's share",
                            self.group_name(group)
                        )
                    })?
            }
        };
        self.vips.insert((group, ip), VipAt::Here(vnic));
        Ok(ip)
    }

    /// Records virtual IP `ip` in `group` as this host's vRNIC `vnic`'s (etcd granted it).
    pub(super) fn hold_vip(&mut self, group: GroupId, ip: Ipv4Addr, vnic: VnicId) {
        self.vips.insert((group, ip), VipAt::Here(vnic));
    }

    /// Whether virtual IP `ip` of `group` is one of this host's vRNICs'.
    pub(super) fn vip_here(&self, group: GroupId, ip: Ipv4Addr) -> bool {
        matches!(self.vips.get(&(group, ip)), Some(VipAt::Here(_)))
    }

    /// A removed vRNIC's virtual IP is free again.
    pub(super) fn release_vip(&mut self, group: GroupId, ip: Ipv4Addr) {
        self.vips.remove(&(group, ip));
    }

    /// Every vRNIC other hosts announced, with its host.
    pub(super) fn remote_vnics(
        &self,
    ) -> impl Iterator<Item = (HostId, u16, [u8; 16], &RemoteVnic)> {
        self.remote.iter().flat_map(|(&h, a)| {
            a.vnics
                .iter()
                .map(move |(&lid, (gid, v))| (h, lid, *gid, v))
        })
    }

    /// The announced vRNIC of `host` with LID `lid`.
    pub(super) fn remote_vnic(&self, host: HostId, lid: u16) -> Option<&RemoteVnic> {
        self.remote.get(&host)?.vnics.get(&lid).map(|(_, v)| v)
    }

    /// How many vRNICs `host` announced, and whether one of them has LID `lid`.
    pub(super) fn announced(&self, host: HostId, lid: u16) -> (usize, bool) {
        self.remote
            .get(&host)
            .map_or((0, false), |a| (a.vnics.len(), a.vnics.contains_key(&lid)))
    }

    /// How many addresses `host` announced, and which host (if any) holds `ip`.
    pub(super) fn addr_holder(&self, host: HostId, ip: IpAddr) -> (usize, Option<HostId>) {
        let n = self.remote.get(&host).map_or(0, |a| a.addrs.len());
        let holder = self
            .remote
            .iter()
            .find(|(_, a)| a.addrs.contains(&ip))
            .map(|(&h, _)| h);
        (n, holder)
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
        let guid_host = super::peers::guid(self.host, serial);
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
    /// Host `host` announced a vRNIC (`Some`: its name, group and virtual IP) or its removal
    /// (`None`). False if it names one group too many.
    pub(super) fn directory_vnic(
        &mut self,
        host: HostId,
        lid: u16,
        gid: [u8; 16],
        added: Option<(&str, &str, Ipv4Addr)>,
    ) -> bool {
        match added {
            Some((name, group, vip)) => {
                let Some(g) = self.directory.group(group) else {
                    return false;
                };
                self.cm.name_group(g, group);
                let v = RemoteVnic {
                    name: name.to_string(),
                    group: g,
                    vip,
                };
                let known = self.directory.remote.entry(host).or_default();
                if let Some((lids, _)) = &mut known.fresh {
                    lids.insert(lid);
                }
                if let Some((old_gid, old)) = known.vnics.insert(lid, (gid, v)) {
                    // Its earlier vRNIC of this LID is replaced; only a virtual IP that
                    // vRNIC held is released (never another host's).
                    if self.directory.vips.get(&(old.group, old.vip)) == Some(&VipAt::There(host)) {
                        self.directory.vips.remove(&(old.group, old.vip));
                        self.cm.remove_vip(old.group, old.vip);
                    }
                    if old_gid != gid {
                        for cell in &self.shards {
                            cell.lock().engine.remove_remote_vnic(lid, old_gid);
                        }
                    }
                }
                // A clash (the same address given on two hosts, or this one) leaves the first
                // owner, in the directory and the CM broker alike.
                let first = match self.directory.vips.entry((g, vip)) {
                    std::collections::hash_map::Entry::Vacant(e) => {
                        e.insert(VipAt::There(host));
                        true
                    }
                    std::collections::hash_map::Entry::Occupied(e) => {
                        *e.get() == VipAt::There(host)
                    }
                };
                if first {
                    self.cm.add_vip(g, vip, VipAt::There(host));
                }
                for cell in &self.shards {
                    cell.lock()
                        .engine
                        .add_remote_vnic_in_group(host, lid, gid, g);
                    // Its QPs that found no route may have one now.
                    cell.wake();
                }
            }
            None => {
                let known = self.directory.remote.entry(host).or_default();
                if known.vnics.get(&lid).is_some_and(|(g, _)| *g == gid)
                    && let Some((_, old)) = known.vnics.remove(&lid)
                {
                    if self.directory.vips.get(&(old.group, old.vip)) == Some(&VipAt::There(host)) {
                        self.directory.vips.remove(&(old.group, old.vip));
                        self.cm.remove_vip(old.group, old.vip);
                    }
                    for cell in &self.shards {
                        cell.lock().engine.remove_remote_vnic(lid, gid);
                    }
                }
            }
        }
        true
    }

    /// The whole directory: this host's vRNICs, then what other hosts announced, at most
    /// [`vrnic_api::DIRECTORY_LISTING_MAX`] entries (this host's first).
    pub(super) fn directory_listing(&self) -> Vec<vrnic_api::DirectoryEntry> {
        let mut out: Vec<vrnic_api::DirectoryEntry> = self
            .vnics
            .iter()
            .map(|(&id, v)| vrnic_api::DirectoryEntry {
                host: "local".into(),
                name: v.name.clone(),
                lid: v.lid,
                gid: v.gid,
                ip: v.vip.to_string(),
                group: self.directory.group_name(v.group).to_string(),
                qps: Some(
                    self.cell_of(id)
                        .map_or(0, |cell| cell.lock().engine.qp_count(id)),
                ),
            })
            .collect();
        let host_name = |h: HostId| {
            self.peers
                .as_ref()
                .and_then(|p| p.host_addr(h))
                .map_or_else(|| format!("host {}", h.0), |a| a.to_string())
        };
        let mut remote: Vec<_> = self.directory.remote_vnics().collect();
        remote.sort_by_key(|&(h, lid, _, _)| (h, lid));
        out.truncate(vrnic_api::DIRECTORY_LISTING_MAX);
        let room = vrnic_api::DIRECTORY_LISTING_MAX - out.len();
        out.extend(remote.into_iter().take(room).map(|(h, lid, gid, v)| {
            vrnic_api::DirectoryEntry {
                host: host_name(h),
                name: v.name.clone(),
                lid,
                gid,
                ip: v.vip.to_string(),
                group: self.directory.group_name(v.group).to_string(),
                qps: None,
            }
        }));
        out.sort_by(|a, b| {
            (a.host != "local", &a.host, a.lid).cmp(&(b.host != "local", &b.host, b.lid))
        });
        out
    }

    /// The name a refusal's log line gives a vRNIC: its name here, or `NAME@HOST` for one of
    /// another host.
    fn refused_name(&self, r: Refused) -> String {
        match r {
            Refused::Local(v) => self
                .vnics
                .get(&v)
                .map_or_else(|| format!("#{}", v.0), |x| x.name.clone()),
            // A vRNIC of this daemon on another engine thread (its shard's host id).
            Refused::Remote { host, lid } if super::shard::host_shard(host).is_some() => self
                .vnics
                .values()
                .find(|v| v.lid == lid)
                .map_or_else(|| format!("lid {lid}"), |v| v.name.clone()),
            Refused::Remote { host, lid } => {
                let n = self
                    .directory
                    .remote_vnic(host, lid)
                    .map_or_else(|| format!("lid {lid}"), |x| x.name.clone());
                let h = self
                    .peers
                    .as_ref()
                    .and_then(|p| p.host_addr(host))
                    .map_or_else(|| format!("host {}", host.0), |a| a.ip().to_string());
                format!("{n}@{h}")
            }
        }
    }

    /// Logs routes an engine refused across groups (`list`, the first of `n`), as a shard's
    /// outbox brought them: one line each, naming both vRNICs and both groups.
    pub(super) fn log_refusals(&self, list: &[vrnic_proto::Refusal], n: u64) {
        for r in list {
            warn!(
                "route refused across groups: vRNIC {} (group {}) -> vRNIC {} (group {})",
                self.refused_name(Refused::Local(r.from)),
                self.directory.group_name(r.from_group),
                self.refused_name(r.to),
                self.directory.group_name(r.to_group),
            );
        }
        if n > list.len() as u64 {
            warn!(
                "{} more routes refused across groups",
                n - list.len() as u64
            );
        }
    }

    /// Logs the connection requests the connection manager refused across groups since the
    /// last call: one line each, naming both vRNICs and both groups.
    pub(super) fn log_cm_refusals(&mut self) {
        for r in self.cm.take_refusals() {
            warn!(
                "connection request refused across groups: vRNIC {} (group {}) -> vRNIC {} (group {})",
                self.refused_name(r.requester),
                r.requester_group,
                self.refused_name(Refused::Local(r.listener)),
                r.listener_group,
            );
        }
    }

    /// Host `host` announced one of its IP addresses, which is recorded as its for rdma_cm if
    /// it passes `peers/share.rs`'s rule (an address another host held first is taken from
    /// that host only when it is the announcer's own peer-link address). Returns why it was
    /// dropped, if it was.
    pub(super) fn directory_addr(
        &mut self,
        host: HostId,
        ip: IpAddr,
        facts: &super::peers::AddrFacts,
    ) -> Option<&'static str> {
        use super::peers::AddrVerdict;
        match super::peers::addr_verdict(ip, facts) {
            AddrVerdict::Known => None,
            AddrVerdict::Drop(why) => Some(why),
            AddrVerdict::Keep => {
                for (h, a) in &mut self.directory.remote {
                    if *h != host {
                        a.addrs.remove(&ip);
                    }
                }
                self.record_addr(host, ip);
                None
            }
        }
    }

    /// Records `ip` as host `host`'s (for rdma_cm).
    pub(super) fn record_addr(&mut self, host: HostId, ip: IpAddr) {
        let known = self.directory.remote.entry(host).or_default();
        known.addrs.insert(ip);
        if let Some((_, addrs)) = &mut known.fresh {
            addrs.insert(ip);
        }
        self.cm.add_host_addr(host, ip);
    }

    /// Host `host`'s link is up and about to announce its full set again: what it announced
    /// before stays until the set ends ([`directory_swept`](Self::directory_swept)).
    pub(super) fn directory_refresh(&mut self, host: HostId) {
        self.directory.remote.entry(host).or_default().fresh =
            Some((HashSet::new(), HashSet::new()));
    }

    /// Host `host` ended its full set: its vRNICs and addresses not announced again since its
    /// link came up are forgotten. An end with no refresh under way (a second one) does nothing.
    pub(super) fn directory_swept(&mut self, host: HostId) {
        let Some(known) = self.directory.remote.get_mut(&host) else {
            return;
        };
        let Some((lids, addrs)) = known.fresh.take() else {
            return;
        };
        let stale: Vec<(u16, [u8; 16])> = known
            .vnics
            .iter()
            .filter(|(lid, _)| !lids.contains(lid))
            .map(|(&lid, (gid, _))| (lid, *gid))
            .collect();
        if known.addrs.iter().any(|ip| !addrs.contains(ip)) {
            known.addrs.retain(|ip| addrs.contains(ip));
            self.cm.clear_host_addrs(host);
            for &ip in &known.addrs {
                self.cm.add_host_addr(host, ip);
            }
        }
        for (lid, gid) in stale {
            self.directory_vnic(host, lid, gid, None);
        }
    }

    /// Forgets what `host` announced (its link broke, or, in a cluster, its etcd record went).
    /// Connections already routed to it keep their routes.
    pub(super) fn directory_forget(&mut self, host: HostId) {
        if let Some(known) = self.directory.remote.remove(&host) {
            for (lid, (gid, v)) in known.vnics {
                if self.directory.vips.get(&(v.group, v.vip)) == Some(&VipAt::There(host)) {
                    self.directory.vips.remove(&(v.group, v.vip));
                    self.cm.remove_vip(v.group, v.vip);
                }
                for cell in &self.shards {
                    cell.lock().engine.remove_remote_vnic(lid, gid);
                }
            }
        }
        self.cm.clear_host_addrs(host);
    }
}

/// The most bytes one `vrnic ls --all` entry takes in a reply (longest host, names, GID).
const LISTING_ENTRY_MAX: usize = 400;
const _: () = assert!(
    vrnic_api::DIRECTORY_LISTING_MAX * LISTING_ENTRY_MAX
        <= super::admin_socket::ADMIN_OUT_MAX - (64 << 10)
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_directory_listing_fits_in_one_admin_reply() {
        let long = "x".repeat(63);
        let e = vrnic_api::DirectoryEntry {
            host: "[ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff]:65535".into(),
            name: long.clone(),
            lid: u16::MAX,
            gid: [255; 16],
            ip: "255.255.255.255".into(),
            group: long,
            qps: Some(usize::MAX),
        };
        let one = serde_json::to_vec(&e).unwrap().len() + 1;
        assert!(one <= LISTING_ENTRY_MAX, "{one} bytes");
    }

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

    #[test]
    fn virtual_ips_are_unique_within_a_group_only() {
        let mut d = Directory::new(3, 10..13);
        let red = d.group("red").unwrap();
        let blue = d.group("blue").unwrap();
        assert_eq!(d.group("red"), Some(red), "a name keeps its number");
        assert_eq!(d.group(DEFAULT_GROUP), Some(GroupId(0)));
        let a = d.take_vip(red, None, VnicId(1)).unwrap();
        assert_eq!(a, Ipv4Addr::new(100, 67, 0, 1), "host 3's share");
        let b = d.take_vip(red, None, VnicId(2)).unwrap();
        assert_eq!(b, Ipv4Addr::new(100, 67, 0, 2));
        assert_eq!(
            d.take_vip(blue, None, VnicId(3)).unwrap(),
            a,
            "another group, same address"
        );
        let want = Ipv4Addr::new(10, 9, 0, 1);
        assert_eq!(d.take_vip(red, Some(want), VnicId(4)).unwrap(), want);
        assert!(
            d.take_vip(red, Some(want), VnicId(5)).is_err(),
            "taken in red"
        );
        assert_eq!(
            d.take_vip(blue, Some(want), VnicId(6)).unwrap(),
            want,
            "free in blue"
        );
        assert!(
            d.take_vip(red, Some(Ipv4Addr::LOCALHOST), VnicId(7))
                .is_err()
        );
        d.release_vip(red, want);
        assert_eq!(
            d.take_vip(red, Some(want), VnicId(8)).unwrap(),
            want,
            "released"
        );
    }
}
