//! Tenants' groups in the broker: each id belongs to a vRNIC ([`Owner`]), and so to its group
//! and its virtual IP. A group is a network of its own: ports are taken per group, a virtual
//! IP resolves within the group only (two groups may use the same addresses), and a request
//! reaches only listeners of its own group. A request whose address only another group's
//! listener serves is treated as one that nothing serves (`REJECTED` once the hold runs out,
//! so that nothing of the other group shows), and kept as a [`CmRefusal`] for the log.

use std::net::{IpAddr, Ipv4Addr};

use vrnic_proto::{GroupId, HostId, Refused, VnicId};

use super::Cm;

/// The group of a vRNIC created without one (number 0).
pub const DEFAULT_GROUP: &str = "default";

/// The vRNIC an id belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    /// The vRNIC.
    pub vnic: VnicId,
    /// Its group.
    pub group: GroupId,
    /// Its virtual IP in the group.
    pub vip: Ipv4Addr,
}

/// Where a virtual IP of a group lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VipAt {
    /// This host's vRNIC.
    Here(VnicId),
    /// A vRNIC of that host.
    There(HostId),
}

/// A connection request that only another group's listener would have served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmRefusal {
    /// Who asked.
    pub requester: Refused,
    /// Its group's name.
    pub requester_group: String,
    /// The vRNIC whose listener serves the address.
    pub listener: VnicId,
    /// That listener's group's name.
    pub listener_group: String,
}

/// Most refusals kept between two [`Cm::take_refusals`] calls.
const MAX_REFUSALS: usize = 256;

impl Cm {
    /// Group `g` is called `name` (the daemon numbers the names, and tells the broker so that
    /// requests to and from other hosts can carry them).
    pub fn name_group(&mut self, g: GroupId, name: &str) {
        self.group_names
            .entry(g)
            .or_insert_with(|| name.to_string());
        self.groups.entry(name.to_string()).or_insert(g);
    }

    /// The name of group `g` (known once named).
    pub(super) fn group_name(&self, g: GroupId) -> String {
        self.group_names
            .get(&g)
            .cloned()
            .unwrap_or_else(|| g.0.to_string())
    }

    /// The number of the group called `name`, if any vRNIC here or announced is in it.
    pub(super) fn group_named(&self, name: &str) -> Option<GroupId> {
        self.groups.get(name).copied()
    }

    /// Virtual IP `ip` of group `g` lives `at`.
    pub fn add_vip(&mut self, g: GroupId, ip: Ipv4Addr, at: VipAt) {
        self.vips.entry((g, ip)).or_insert(at);
    }

    /// Virtual IP `ip` of group `g` is gone.
    pub fn remove_vip(&mut self, g: GroupId, ip: Ipv4Addr) {
        self.vips.remove(&(g, ip));
    }

    /// Where `ip` lives if it is a virtual IP of group `g`.
    pub(super) fn vip(&self, g: GroupId, ip: IpAddr) -> Option<VipAt> {
        match ip.to_canonical() {
            IpAddr::V4(v4) => self.vips.get(&(g, v4)).copied(),
            IpAddr::V6(_) => None,
        }
    }

    /// Keeps a refusal for the log.
    pub(super) fn refused(&mut self, r: CmRefusal) {
        if self.refusals.len() < MAX_REFUSALS {
            self.refusals.push(r);
        }
    }

    /// Whether refusals wait to be taken.
    pub fn has_refusals(&self) -> bool {
        !self.refusals.is_empty()
    }

    /// The requests refused across groups since the last call.
    pub fn take_refusals(&mut self) -> Vec<CmRefusal> {
        std::mem::take(&mut self.refusals)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::time::Instant;

    use vrnic_api::{CmParam, cm_event};
    use vrnic_proto::CtxId;

    use super::super::CONNECT_HOLD;
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn kinds(cm: &mut Cm, ctx: CtxId, id: u32) -> Vec<u32> {
        std::iter::from_fn(|| cm.take_event(ctx, id).unwrap())
            .map(|e| e.kind)
            .collect()
    }

    const RED: GroupId = GroupId(1);
    const BLUE: GroupId = GroupId(2);

    /// An id of vRNIC `v` (its LID is `v` too) in `group` with virtual IP `vip`.
    fn id(cm: &mut Cm, ctx: u32, v: u32, group: GroupId, vip: &str) -> (CtxId, u32) {
        let owner = Owner {
            vnic: VnicId(v),
            group,
            vip: vip.parse().unwrap(),
        };
        let ctx = CtxId(ctx);
        let h = cm
            .create_owned(ctx, 0x106, v as u16, [v as u8; 16], owner)
            .unwrap();
        (ctx, h)
    }

    fn world() -> Cm {
        let mut cm = Cm::new();
        cm.name_group(RED, "red");
        cm.name_group(BLUE, "blue");
        // Two tenants with the same addresses: vRNICs 1, 2 red; 3, 4 blue.
        for (g, v, ip) in [
            (RED, 1, "10.9.0.1"),
            (RED, 2, "10.9.0.2"),
            (BLUE, 3, "10.9.0.1"),
            (BLUE, 4, "10.9.0.2"),
        ] {
            cm.add_vip(g, ip.parse().unwrap(), VipAt::Here(VnicId(v)));
        }
        cm
    }

    /// Two groups listen on the same virtual IP and port, each client reaches its own
    /// group's listener, and neither sees the other.
    #[test]
    fn the_same_virtual_address_in_two_groups_reaches_each_groups_own_listener() {
        let mut cm = world();
        let now = Instant::now();
        let (rs, rl) = id(&mut cm, 1, 1, RED, "10.9.0.1");
        let (bs, bl) = id(&mut cm, 3, 3, BLUE, "10.9.0.1");
        cm.bind(rs, rl, a("10.9.0.1:7000")).unwrap();
        cm.bind(bs, bl, a("10.9.0.1:7000"))
            .expect("ports are per group");
        let (x, xl) = id(&mut cm, 9, 9, RED, "10.9.0.9");
        assert_eq!(
            cm.bind(x, xl, a("10.9.0.1:7001")),
            Err(libc::EADDRNOTAVAIL),
            "another vRNIC's virtual IP is not mine"
        );
        cm.listen(rs, rl).unwrap();
        cm.listen(bs, bl).unwrap();
        for (ctx, v, g, vip, lctx, l) in [
            (2, 2, RED, "10.9.0.2", rs, rl),
            (4, 4, BLUE, "10.9.0.2", bs, bl),
        ] {
            let (c, x) = id(&mut cm, ctx, v, g, vip);
            let local = cm.resolve_addr(c, x, None, a("10.9.0.1:7000")).unwrap();
            assert_eq!(local.ip().to_string(), vip, "bound to its own virtual IP");
            cm.connect(c, x, CmParam::default(), now).unwrap();
            let req = cm
                .take_event(lctx, l)
                .unwrap()
                .expect("its own group's listener");
            assert_eq!(req.kind, cm_event::CONNECT_REQUEST);
            assert_eq!(req.peer_lid, v as u16);
            assert!(req.remote.starts_with(vip));
        }
        assert!(cm.take_refusals().is_empty());
    }

    /// A host address that only another group's listener serves: the request waits as for
    /// no listener and is `REJECTED`, the listener sees nothing, and the refusal names both
    /// vRNICs and both groups.
    #[test]
    fn a_request_only_another_group_would_serve_is_rejected_and_kept_for_the_log() {
        let mut cm = world();
        let now = Instant::now();
        let (bs, bl) = id(&mut cm, 3, 3, BLUE, "10.9.0.1");
        cm.bind(bs, bl, a("0.0.0.0:7100")).unwrap();
        cm.listen(bs, bl).unwrap();
        let (c, x) = id(&mut cm, 2, 2, RED, "10.9.0.2");
        cm.resolve_addr(c, x, None, a("127.0.0.1:7100")).unwrap();
        cm.connect(c, x, CmParam::default(), now).unwrap();
        assert!(kinds(&mut cm, bs, bl).is_empty(), "blue sees nothing");
        assert_eq!(
            cm.take_refusals(),
            vec![CmRefusal {
                requester: Refused::Local(VnicId(2)),
                requester_group: "red".into(),
                listener: VnicId(3),
                listener_group: "blue".into(),
            }]
        );
        cm.expire(now + CONNECT_HOLD);
        assert_eq!(
            kinds(&mut cm, c, x),
            [cm_event::ADDR_RESOLVED, cm_event::REJECTED]
        );
        // A virtual IP of the other group only does not resolve.
        cm.remove_vip(RED, "10.9.0.1".parse().unwrap());
        let (c, y) = id(&mut cm, 5, 5, RED, "10.9.0.5");
        cm.resolve_addr(c, y, None, a("10.9.0.1:7100")).unwrap();
        let ev = cm.take_event(c, y).unwrap().unwrap();
        assert_eq!(
            (ev.kind, ev.status),
            (cm_event::ADDR_ERROR, -libc::EHOSTUNREACH)
        );
    }
}
