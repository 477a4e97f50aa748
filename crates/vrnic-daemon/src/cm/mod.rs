//! The connection-manager broker: what the IB CM and the kernel's `rdma_cm` do between two
//! nodes, done inside the daemon for the ids of every context it serves.
//!
//! An id binds and listens on IP addresses of this host and TCP-like ports per port space; a
//! connect finds the listener that serves the destination address and port, creates the
//! passive side's new id and queues `CONNECT_REQUEST` on the listener; accept, reject,
//! establish and disconnect queue the peer's event. Each queued event is announced to its
//! context ([`Cm::take_notes`]: the server pushes an `event::CM` entry on the context's event
//! ring); the driver fetches it with `CmTakeEvent`. A dying context destroys its ids, and
//! their peers see what a real stack shows: `DISCONNECTED` for connections, `REJECTED` for
//! pending requests.
//!
//! An address of another configured host (announced over its peer link) resolves to that
//! host, and the two brokers carry the connection between them as IB CM messages
//! (`remote.rs`): the id's peer is then a [`Peer::Remote`] id, and each step that would queue
//! the peer's event sends the message that queues it there.
//!
//! Ids belong to a vRNIC and its tenants' group (`groups.rs`): a group is a network of its
//! own, with its ports, its virtual IPs and its listeners.
//!
//! Not here: QP transitions. The driver moves its QPs (INIT/RTR/RTS from the peer's numbers in
//! the events, ERR on disconnect), exactly as librdmacm does over the kernel.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use vrnic_api::{CmEvent, CmParam, cm_event};
use vrnic_proto::{CtxId, GroupId, HostId, Refused, VnicId};
use vrnic_wire::frame::CmMessage;

mod groups;
mod remote;

pub use groups::{CmRefusal, DEFAULT_GROUP, Owner, VipAt};

/// `RDMA_PS_UDP`: its ids use UD QPs and SIDR-style resolution (no connection).
pub const PS_UDP: u16 = 0x111;
/// IB CM reject reason for "no listener on this service ID".
pub const REJ_INVALID_SERVICE_ID: i32 = 8;
/// IB CM reject reason for a rejection by the peer's consumer (`rdma_reject`).
pub const REJ_CONSUMER_DEFINED: i32 = 28;
/// First ephemeral port handed out for port 0.
const EPHEMERAL: u16 = 49152;
/// How long a connection request waits for a listener before it is rejected: the time a REQ
/// is in flight on a fabric while the passive side brings its listener up. Programs that set
/// up both sides at once (perftest's data connection after its control connection) rely on
/// it; a port nobody listens on is still `REJECTED`, this much later.
pub const CONNECT_HOLD: Duration = Duration::from_millis(1000);
/// How long a request sent to another host waits for its answer (REP or REJ) before the
/// requester gets `UNREACHABLE` (`-ETIMEDOUT`), as an IB CM's REQ retries run out. The other
/// host answers a request with no listener after [`CONNECT_HOLD`].
pub const REMOTE_ANSWER: Duration = Duration::from_secs(10);
/// Most ids per context (an app creating ids in a loop gets `ENOMEM`).
pub const MAX_IDS_PER_CTX: usize = 4096;

type Errno = i32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    Bound,
    Listening,
    AddrResolved,
    RouteResolved,
    /// Active side: request sent.
    Connecting,
    /// Passive side: request received, not yet accepted or rejected.
    Requested,
    /// Passive side: accepted, waiting for the active side's establish.
    Accepted,
    /// Active side: accepted by the peer, not yet established.
    Responded,
    Connected,
    Disconnected,
}

/// The other end of an id's connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    /// An id of this broker.
    Local(u32),
    /// An id of the broker on `host`; `id` is 0 until its answer names it.
    Remote { host: HostId, id: u32 },
}

#[derive(Debug)]
struct Id {
    ctx: CtxId,
    /// Its vRNIC, group and virtual IP.
    owner: Owner,
    ps: u16,
    lid: u16,
    gid: [u8; 16],
    state: State,
    local: Option<SocketAddr>,
    /// It took its local port by binding (explicitly or by resolving an address). The new ids
    /// of connection requests share their listener's address without holding the port, as in
    /// the kernel's rdma_cm.
    holds_port: bool,
    remote: Option<SocketAddr>,
    /// The host its resolved destination address belongs to, if not this one.
    route: Option<HostId>,
    peer: Option<Peer>,
    /// A remote peer's LID and GID (a local peer's are read from its id).
    peer_addr: (u16, [u8; 16]),
    /// For a passive id: the listener that got its request.
    listener: Option<u32>,
    param: CmParam,
    events: VecDeque<CmEvent>,
}

/// A connection request as a listener receives it, from an id here or on another host.
#[derive(Debug, Clone)]
struct Offer {
    /// The requester's group (`None`: a group no vRNIC here is in).
    group: Option<GroupId>,
    /// The requester, for the log.
    who: Refused,
    ps: u16,
    src: Option<SocketAddr>,
    dst: SocketAddr,
    lid: u16,
    gid: [u8; 16],
    param: CmParam,
    from: Peer,
}

/// Something waiting for a deadline.
#[derive(Debug)]
enum Parked {
    /// A local id's request, waiting for a listener here.
    Local(u32),
    /// Another host's request, waiting for a listener here.
    Remote(Offer),
    /// A local id's request sent to another host, waiting for its answer.
    Sent(u32),
}

/// The broker's state. See the module documentation.
#[derive(Debug, Default)]
pub struct Cm {
    ids: HashMap<u32, Id>,
    next: u32,
    next_port: u16,
    notes: Vec<(CtxId, u32)>,
    parked: Vec<(Parked, Instant)>,
    /// Other hosts' addresses, as their peer links announced them.
    remote_ips: HashMap<IpAddr, HostId>,
    /// Messages for other hosts' brokers.
    outgoing: Vec<(HostId, CmMessage)>,
    /// Group names by number and numbers by name.
    group_names: HashMap<GroupId, String>,
    groups: HashMap<String, GroupId>,
    /// Virtual IPs, by group.
    vips: HashMap<(GroupId, Ipv4Addr), VipAt>,
    /// Requests refused across groups, for the log.
    refusals: Vec<CmRefusal>,
    /// Each vRNIC's connections so far (`vrnic stats`), until it goes.
    counts: HashMap<VnicId, vrnic_api::CmStats>,
}

/// Why a request found no listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Miss {
    /// None serves it (yet).
    None,
    /// Only a listener of another group would: this one.
    OtherGroup(u32),
}

/// Whether `ip` is an address of this host (or unspecified): binding a socket to it works.
pub fn is_local(ip: IpAddr) -> bool {
    ip.is_unspecified() || ip.is_loopback() || UdpSocket::bind((ip, 0)).is_ok()
}

/// The address this host sends from to reach `dst` (the kernel's route choice).
fn source_for(dst: SocketAddr) -> Option<IpAddr> {
    let any: IpAddr = if dst.is_ipv4() {
        Ipv4Addr::UNSPECIFIED.into()
    } else {
        Ipv6Addr::UNSPECIFIED.into()
    };
    let s = UdpSocket::bind((any, 0)).ok()?;
    s.connect(dst).ok()?;
    Some(s.local_addr().ok()?.ip())
}

fn overlaps(a: &SocketAddr, b: &SocketAddr) -> bool {
    if a.port() != b.port() {
        return false;
    }
    let (x, y) = (a.ip(), b.ip());
    x == y
        || (x.is_unspecified() && (x.is_ipv6() || y.is_ipv4()))
        || (y.is_unspecified() && (y.is_ipv6() || x.is_ipv4()))
}

/// Whether a listener bound to `l` takes connections to `dst`.
fn serves(l: &SocketAddr, dst: &SocketAddr) -> bool {
    l.port() == dst.port()
        && (l.ip() == dst.ip()
            || (l.ip().is_unspecified() && (l.ip().is_ipv6() || dst.ip().is_ipv4())))
}

/// The peer's view of connection parameters: its responder resources are our initiator
/// depth and vice versa (IB CM REQ/REP).
fn swapped(p: &CmParam) -> CmParam {
    CmParam {
        responder_resources: p.initiator_depth,
        initiator_depth: p.responder_resources,
        ..p.clone()
    }
}

fn text(a: Option<SocketAddr>) -> String {
    a.map(|a| a.to_string()).unwrap_or_default()
}

impl Cm {
    /// A broker with no ids.
    pub fn new() -> Cm {
        let mut cm = Cm {
            next: 1,
            next_port: EPHEMERAL,
            ..Cm::default()
        };
        cm.name_group(GroupId(0), DEFAULT_GROUP);
        cm
    }

    /// vRNIC `vnic`'s connections so far (`vrnic stats`).
    pub fn counts(&self, vnic: VnicId) -> vrnic_api::CmStats {
        self.counts.get(&vnic).copied().unwrap_or_default()
    }

    /// Forgets vRNIC `vnic`'s counts (it is gone: a vRNIC made again starts from zero).
    pub fn forget_counts(&mut self, vnic: VnicId) {
        self.counts.remove(&vnic);
    }

    /// `(context, id)` pairs with new events since the last call.
    pub fn take_notes(&mut self) -> Vec<(CtxId, u32)> {
        std::mem::take(&mut self.notes)
    }

    /// Whether events wait to be announced.
    pub fn has_notes(&self) -> bool {
        !self.notes.is_empty()
    }

    fn own(&mut self, ctx: CtxId, id: u32) -> Result<&mut Id, Errno> {
        match self.ids.get_mut(&id) {
            Some(i) if i.ctx == ctx => Ok(i),
            _ => Err(libc::EINVAL),
        }
    }

    fn push(&mut self, id: u32, mut ev: CmEvent) {
        let Some(i) = self.ids.get_mut(&id) else {
            return;
        };
        let c = self.counts.entry(i.owner.vnic).or_default();
        match ev.kind {
            // The active side learns its connection from the response (the driver library
            // answers it and reports ESTABLISHED, as librdmacm does); the passive side from
            // ESTABLISHED itself.
            cm_event::ESTABLISHED | cm_event::CONNECT_RESPONSE => c.established += 1,
            cm_event::REJECTED => c.rejected += 1,
            _ => {}
        }
        ev.local = text(i.local);
        ev.remote = text(i.remote);
        i.events.push_back(ev);
        self.notes.push((i.ctx, id));
    }

    fn event(
        &self,
        kind: u32,
        status: i32,
        from: Option<(u16, [u8; 16])>,
        param: CmParam,
    ) -> CmEvent {
        let (peer_lid, peer_gid) = from.unwrap_or_default();
        CmEvent {
            kind,
            status,
            param,
            peer_lid,
            peer_gid,
            ..CmEvent::default()
        }
    }

    /// `rdma_create_id` in the default group, for tests.
    #[cfg(test)]
    pub fn create(&mut self, ctx: CtxId, ps: u16, lid: u16, gid: [u8; 16]) -> Result<u32, Errno> {
        let owner = Owner {
            vnic: VnicId(u32::from(lid)),
            group: GroupId(0),
            vip: Ipv4Addr::UNSPECIFIED,
        };
        self.create_owned(ctx, ps, lid, gid, owner)
    }

    /// `rdma_create_id` for a context on the vRNIC with `lid`/`gid`, `owner`.
    pub fn create_owned(
        &mut self,
        ctx: CtxId,
        ps: u16,
        lid: u16,
        gid: [u8; 16],
        owner: Owner,
    ) -> Result<u32, Errno> {
        if !matches!(ps, 0x106 | 0x111 | 0x13f | 0x0002) {
            return Err(libc::EINVAL);
        }
        if self.ids.values().filter(|i| i.ctx == ctx).count() >= MAX_IDS_PER_CTX {
            return Err(libc::ENOMEM);
        }
        self.create_unlimited(ctx, ps, lid, gid, owner)
    }

    fn create_unlimited(
        &mut self,
        ctx: CtxId,
        ps: u16,
        lid: u16,
        gid: [u8; 16],
        owner: Owner,
    ) -> Result<u32, Errno> {
        let mut id = self.next;
        while id == 0 || self.ids.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        self.next = id.wrapping_add(1);
        self.ids.insert(
            id,
            Id {
                ctx,
                owner,
                ps,
                lid,
                gid,
                state: State::Idle,
                local: None,
                holds_port: false,
                remote: None,
                route: None,
                peer: None,
                peer_addr: (0, [0; 16]),
                listener: None,
                param: CmParam::default(),
                events: VecDeque::new(),
            },
        );
        Ok(id)
    }

    fn free_port(&mut self, ps: u16, group: GroupId, ip: IpAddr) -> Option<u16> {
        for _ in 0..(u16::MAX - EPHEMERAL) {
            let p = self.next_port;
            self.next_port = if p == u16::MAX { EPHEMERAL } else { p + 1 };
            let a = SocketAddr::new(ip, p);
            if !self.in_use(ps, group, &a) {
                return Some(p);
            }
        }
        None
    }

    /// Whether group `group` holds port `a` in port space `ps` (each group has its own).
    fn in_use(&self, ps: u16, group: GroupId, a: &SocketAddr) -> bool {
        self.ids.values().any(|i| {
            i.ps == ps
                && i.owner.group == group
                && i.holds_port
                && i.local.is_some_and(|l| overlaps(&l, a))
        })
    }

    /// `rdma_bind_addr`: `EADDRNOTAVAIL` for an address neither of this host nor the id's
    /// vRNIC's virtual IP, `EADDRINUSE` for a port its group took in this port space, `EINVAL`
    /// if already bound.
    pub fn bind(&mut self, ctx: CtxId, id: u32, addr: SocketAddr) -> Result<SocketAddr, Errno> {
        let (ps, owner) = {
            let i = self.own(ctx, id)?;
            if i.state != State::Idle {
                return Err(libc::EINVAL);
            }
            (i.ps, i.owner)
        };
        let own_vip =
            addr.ip().to_canonical() == IpAddr::V4(owner.vip) && !owner.vip.is_unspecified();
        if !own_vip && !is_local(addr.ip()) {
            return Err(libc::EADDRNOTAVAIL);
        }
        let port = match addr.port() {
            0 => self
                .free_port(ps, owner.group, addr.ip())
                .ok_or(libc::EADDRINUSE)?,
            p => p,
        };
        let bound = SocketAddr::new(addr.ip(), port);
        if self.in_use(ps, owner.group, &bound) {
            return Err(libc::EADDRINUSE);
        }
        let i = self.own(ctx, id)?;
        i.local = Some(bound);
        i.holds_port = true;
        i.state = State::Bound;
        Ok(bound)
    }

    /// `rdma_listen` (an unbound id listens on the IPv6 wildcard address, any port).
    pub fn listen(&mut self, ctx: CtxId, id: u32) -> Result<(), Errno> {
        let state = self.own(ctx, id)?.state;
        match state {
            State::Bound => {}
            State::Idle => {
                self.bind(ctx, id, SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), 0))?;
            }
            State::Listening => return Ok(()),
            _ => return Err(libc::EINVAL),
        }
        self.own(ctx, id)?.state = State::Listening;
        let parked = std::mem::take(&mut self.parked);
        for (p, t) in parked {
            let served = match &p {
                Parked::Local(a) => self.request(*a).is_ok(),
                Parked::Remote(offer) => self.offer(offer.clone()).is_ok(),
                Parked::Sent(_) => false,
            };
            if !served {
                self.parked.push((p, t));
            }
        }
        Ok(())
    }

    /// `rdma_resolve_addr`: binds the id (to `src`, to its own virtual IP for a virtual IP of
    /// its group, to the destination's own address if it is this host's, or to the address
    /// this host reaches another host's from) and queues `ADDR_RESOLVED`, or `ADDR_ERROR`
    /// (status `-EHOSTUNREACH`) for an address that is neither a virtual IP of its group, nor
    /// this host's, nor an announced one of another configured host.
    pub fn resolve_addr(
        &mut self,
        ctx: CtxId,
        id: u32,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Result<SocketAddr, Errno> {
        let (state, owner) = {
            let i = self.own(ctx, id)?;
            (i.state, i.owner)
        };
        if !matches!(state, State::Idle | State::Bound) {
            return Err(libc::EINVAL);
        }
        let vip = self.vip(owner.group, dst.ip());
        let (here, route) = match vip {
            Some(VipAt::Here(_)) => (true, None),
            Some(VipAt::There(h)) => (false, Some(h)),
            None => {
                let here = !dst.ip().is_unspecified() && is_local(dst.ip());
                (here, if here { None } else { self.host_of(dst.ip()) })
            }
        };
        let reachable = here || route.is_some();
        if state == State::Idle {
            let ip = match src {
                Some(s) if !s.ip().is_unspecified() => s.ip(),
                _ if vip.is_some() => IpAddr::V4(owner.vip),
                _ if here => dst.ip(),
                _ if route.is_some() => source_for(dst).unwrap_or(if dst.is_ipv4() {
                    Ipv4Addr::UNSPECIFIED.into()
                } else {
                    Ipv6Addr::UNSPECIFIED.into()
                }),
                _ if dst.is_ipv4() => Ipv4Addr::LOCALHOST.into(),
                _ => Ipv6Addr::LOCALHOST.into(),
            };
            let port = src.map(|s| s.port()).unwrap_or(0);
            self.bind(ctx, id, SocketAddr::new(ip, port))?;
        }
        let i = self.own(ctx, id)?;
        i.remote = Some(dst);
        i.route = route;
        let local = i.local.unwrap_or(dst);
        if reachable {
            i.state = State::AddrResolved;
            let ev = self.event(cm_event::ADDR_RESOLVED, 0, None, CmParam::default());
            self.push(id, ev);
        } else {
            let ev = self.event(
                cm_event::ADDR_ERROR,
                -libc::EHOSTUNREACH,
                None,
                CmParam::default(),
            );
            self.push(id, ev);
        }
        Ok(local)
    }

    /// `rdma_resolve_route`: queues `ROUTE_RESOLVED`.
    pub fn resolve_route(&mut self, ctx: CtxId, id: u32) -> Result<(), Errno> {
        let i = self.own(ctx, id)?;
        if i.state != State::AddrResolved {
            return Err(libc::EINVAL);
        }
        i.state = State::RouteResolved;
        let ev = self.event(cm_event::ROUTE_RESOLVED, 0, None, CmParam::default());
        self.push(id, ev);
        Ok(())
    }

    /// `rdma_connect`: a `CONNECT_REQUEST` (with a new id) on the listener that serves the
    /// destination; with none, the request waits up to [`CONNECT_HOLD`] for one, then the
    /// requester gets `REJECTED` (invalid service ID), as an IB CM answers. A destination on
    /// another host gets the request over its peer link, and the same answers come back.
    pub fn connect(
        &mut self,
        ctx: CtxId,
        id: u32,
        param: CmParam,
        now: Instant,
    ) -> Result<(), Errno> {
        let route = {
            let i = self.own(ctx, id)?;
            if !matches!(i.state, State::RouteResolved | State::AddrResolved) {
                return Err(libc::EINVAL);
            }
            if i.remote.is_none() {
                return Err(libc::EINVAL);
            }
            i.param = param;
            i.state = State::Connecting;
            let vnic = i.owner.vnic;
            self.counts.entry(vnic).or_default().connects += 1;
            let i = self.own(ctx, id)?;
            i.route
        };
        if let Some(host) = route {
            self.send_request(host, id);
            self.parked.push((Parked::Sent(id), now + REMOTE_ANSWER));
        } else if let Err(miss) = self.request(id) {
            if let Miss::OtherGroup(l) = miss
                && let Some(o) = self.offer_of(id)
            {
                self.refuse_across(&o, l);
            }
            self.parked.push((Parked::Local(id), now + CONNECT_HOLD));
        }
        Ok(())
    }

    /// The earliest time something parked gives up.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.parked.iter().map(|&(_, t)| t).min()
    }

    /// Gives up on what waited past its time: a request with no listener here is rejected
    /// (invalid service ID), one another host never answered is unreachable.
    pub fn expire(&mut self, now: Instant) {
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.parked)
            .into_iter()
            .partition(|(_, t)| now >= *t);
        self.parked = keep;
        for (p, _) in due {
            match p {
                Parked::Local(id) => {
                    if let Some(i) = self.ids.get_mut(&id) {
                        i.state = State::Disconnected;
                        // As a refusal across groups is: the app sees only REJECTED.
                        tracing::info!(
                            id,
                            from = %i.local.map_or("?".to_string(), |a| a.to_string()),
                            to = %i.remote.map_or("?".to_string(), |a| a.to_string()),
                            "rdma_cm connect refused: nothing listens there (REJECTED, invalid \
                             service ID)"
                        );
                    }
                    let ev = self.event(
                        cm_event::REJECTED,
                        REJ_INVALID_SERVICE_ID,
                        None,
                        CmParam::default(),
                    );
                    self.push(id, ev);
                }
                Parked::Remote(offer) => self.refuse_offer(&offer),
                Parked::Sent(id) => self.unanswered(id),
            }
        }
    }

    /// The request connecting id `id` makes.
    fn offer_of(&self, id: u32) -> Option<Offer> {
        let i = self.ids.get(&id)?;
        Some(Offer {
            group: Some(i.owner.group),
            who: Refused::Local(i.owner.vnic),
            ps: i.ps,
            src: i.local,
            dst: i.remote?,
            lid: i.lid,
            gid: i.gid,
            param: i.param.clone(),
            from: Peer::Local(id),
        })
    }

    /// Delivers the request of connecting id `id` to the listener here that serves its
    /// destination; why not if none does (yet).
    fn request(&mut self, id: u32) -> Result<(), Miss> {
        let offer = self.offer_of(id).ok_or(Miss::None)?;
        let child = self.offer(offer)?;
        if let Some(i) = self.ids.get_mut(&id) {
            i.peer = Some(Peer::Local(child));
        }
        Ok(())
    }

    /// Logs a request that only listener `l`, of another group, would have served.
    fn refuse_across(&mut self, o: &Offer, l: u32) {
        let Some(lst) = self.ids.get(&l) else { return };
        let r = CmRefusal {
            requester: o.who,
            requester_group: o.group.map_or_else(|| "?".into(), |g| self.group_name(g)),
            listener: lst.owner.vnic,
            listener_group: self.group_name(lst.owner.group),
        };
        self.refused(r);
    }

    /// Hands a connection request to the listener of its group that serves its destination
    /// (for a virtual IP, a listener of the vRNIC that has it): a new id in the listener's
    /// context, and `CONNECT_REQUEST` on the listener. A [`Miss`] if no listener serves it
    /// (yet), or only one of another group.
    fn offer(&mut self, o: Offer) -> Result<u32, Miss> {
        let target = o.group.and_then(|g| self.vip(g, o.dst.ip()));
        let serving = |l: &Id| {
            l.ps == o.ps
                && l.state == State::Listening
                && l.local.is_some_and(|a| serves(&a, &o.dst))
        };
        let found = self
            .ids
            .iter()
            .filter(|(_, l)| serving(l) && Some(l.owner.group) == o.group)
            .find(|(_, l)| match target {
                Some(VipAt::Here(v)) => l.owner.vnic == v,
                _ => true,
            })
            .map(|(&k, l)| (k, l.ctx, l.lid, l.gid, l.owner));
        let Some((lid_handle, lctx, llid, lgid, lowner)) = found else {
            if target.is_none()
                && let Some((&k, _)) = self
                    .ids
                    .iter()
                    .find(|(_, l)| serving(l) && Some(l.owner.group) != o.group)
            {
                return Err(Miss::OtherGroup(k));
            }
            return Err(Miss::None);
        };
        // The new id belongs to the listener's context; its id limit does not refuse a peer.
        let child = self
            .create_unlimited(lctx, o.ps, llid, lgid, lowner)
            .map_err(|_| Miss::None)?;
        if let Some(c) = self.ids.get_mut(&child) {
            c.state = State::Requested;
            c.local = Some(o.dst);
            c.remote = o.src;
            c.peer = Some(o.from);
            c.peer_addr = (o.lid, o.gid);
            c.listener = Some(lid_handle);
        }
        let mut ev = self.event(
            cm_event::CONNECT_REQUEST,
            0,
            Some((o.lid, o.gid)),
            swapped(&o.param),
        );
        ev.new_id = child;
        // The event describes the new id's addresses, but is queued on the listener.
        ev.local = text(Some(o.dst));
        ev.remote = text(o.src);
        if let Some(l) = self.ids.get_mut(&lid_handle) {
            self.counts.entry(l.owner.vnic).or_default().requests += 1;
            l.events.push_back(ev);
            self.notes.push((lctx, lid_handle));
        }
        Ok(child)
    }

    /// `rdma_accept` on a requested id: the requester gets `CONNECT_RESPONSE` (the driver
    /// establishes and reports `ESTABLISHED`), or, on the UDP port space, `ESTABLISHED` with
    /// the UD parameters at once.
    pub fn accept(&mut self, ctx: CtxId, id: u32, param: CmParam) -> Result<(), Errno> {
        let (state, peer, ps, me) = {
            let i = self.own(ctx, id)?;
            (i.state, i.peer, i.ps, (i.lid, i.gid))
        };
        if state != State::Requested {
            return Err(libc::EINVAL);
        }
        let next = if ps == PS_UDP {
            State::Connected
        } else {
            State::Accepted
        };
        let peer = match peer {
            Some(Peer::Local(p))
                if self
                    .ids
                    .get(&p)
                    .is_some_and(|a| a.state == State::Connecting) =>
            {
                p
            }
            Some(Peer::Remote { host, id: to }) => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.param = param.clone();
                    i.state = next;
                }
                self.send_reply(host, id, to, me, &param);
                return Ok(());
            }
            _ => return Err(libc::ECONNREFUSED),
        };
        if let Some(i) = self.ids.get_mut(&id) {
            i.param = param.clone();
            i.state = next;
        }
        if ps == PS_UDP {
            if let Some(a) = self.ids.get_mut(&peer) {
                a.state = State::Connected;
            }
            let ev = self.event(cm_event::ESTABLISHED, 0, Some(me), swapped(&param));
            self.push(peer, ev);
            return Ok(());
        }
        if let Some(a) = self.ids.get_mut(&peer) {
            a.state = State::Responded;
        }
        let ev = self.event(cm_event::CONNECT_RESPONSE, 0, Some(me), swapped(&param));
        self.push(peer, ev);
        Ok(())
    }

    /// `rdma_reject` on a requested id: the requester gets `REJECTED` (consumer defined) with
    /// the private data.
    pub fn reject(&mut self, ctx: CtxId, id: u32, private_data: Vec<u8>) -> Result<(), Errno> {
        let (state, peer, me) = {
            let i = self.own(ctx, id)?;
            (i.state, i.peer, (i.lid, i.gid))
        };
        if state != State::Requested {
            return Err(libc::EINVAL);
        }
        if let Some(i) = self.ids.get_mut(&id) {
            i.state = State::Disconnected;
            i.peer = None;
        }
        let param = CmParam {
            private_data,
            ..CmParam::default()
        };
        match peer {
            Some(Peer::Local(p)) => {
                if let Some(a) = self.ids.get_mut(&p) {
                    a.state = State::Disconnected;
                    a.peer = None;
                    let ev = self.event(cm_event::REJECTED, REJ_CONSUMER_DEFINED, Some(me), param);
                    self.push(p, ev);
                }
            }
            Some(Peer::Remote { host, id: to }) => {
                self.send_reject(host, id, to, REJ_CONSUMER_DEFINED, &param);
            }
            None => {}
        }
        Ok(())
    }

    /// `rdma_establish` on the active side: both ids are connected; the passive one gets
    /// `ESTABLISHED`.
    pub fn establish(&mut self, ctx: CtxId, id: u32) -> Result<(), Errno> {
        let (state, peer, me) = {
            let i = self.own(ctx, id)?;
            (i.state, i.peer, (i.lid, i.gid))
        };
        if state != State::Responded {
            return Err(libc::EINVAL);
        }
        let peer = peer.ok_or(libc::ECONNRESET)?;
        let param = self
            .ids
            .get(&id)
            .map(|i| i.param.clone())
            .unwrap_or_default();
        let peer = match peer {
            Peer::Local(p) => p,
            Peer::Remote { host, id: to } => {
                if let Some(i) = self.ids.get_mut(&id) {
                    i.state = State::Connected;
                }
                self.send_ready(host, id, to, &param);
                return Ok(());
            }
        };
        if let Some(i) = self.ids.get_mut(&id) {
            i.state = State::Connected;
        }
        match self.ids.get_mut(&peer) {
            Some(p) if p.state == State::Accepted => p.state = State::Connected,
            _ => return Err(libc::ECONNRESET),
        }
        let ev = self.event(cm_event::ESTABLISHED, 0, Some(me), swapped(&param));
        self.push(peer, ev);
        Ok(())
    }

    /// `rdma_disconnect`: both sides of a connection get `DISCONNECTED`, once. On an id that
    /// is not connected it does nothing, as librdmacm returns success then too.
    pub fn disconnect(&mut self, ctx: CtxId, id: u32) -> Result<(), Errno> {
        let (state, peer) = {
            let i = self.own(ctx, id)?;
            (i.state, i.peer)
        };
        if !matches!(
            state,
            State::Connected | State::Accepted | State::Responded | State::Connecting
        ) {
            return Ok(());
        }
        self.parked
            .retain(|(p, _)| !matches!(p, Parked::Sent(x) | Parked::Local(x) if *x == id));
        let local_peer = match peer {
            Some(Peer::Local(p)) => Some(p),
            Some(Peer::Remote { host, id: to }) => {
                self.send_gone(host, id, to);
                None
            }
            None => None,
        };
        for x in std::iter::once(id).chain(local_peer) {
            if let Some(i) = self.ids.get_mut(&x) {
                i.state = State::Disconnected;
                i.peer = None;
            }
            let ev = self.event(cm_event::DISCONNECTED, 0, None, CmParam::default());
            self.push(x, ev);
        }
        Ok(())
    }

    /// The next event queued on `id`.
    pub fn take_event(&mut self, ctx: CtxId, id: u32) -> Result<Option<CmEvent>, Errno> {
        Ok(self.own(ctx, id)?.events.pop_front())
    }

    /// `rdma_destroy_id`: a connected peer gets `DISCONNECTED`, a requester waiting on this id
    /// (or on this listener) gets `REJECTED`; the port is free again.
    pub fn destroy(&mut self, ctx: CtxId, id: u32) -> Result<(), Errno> {
        self.own(ctx, id)?;
        self.remove(id);
        Ok(())
    }

    fn remove(&mut self, id: u32) {
        self.parked
            .retain(|(p, _)| !matches!(p, Parked::Sent(x) | Parked::Local(x) if *x == id));
        let Some(i) = self.ids.remove(&id) else {
            return;
        };
        if i.state == State::Listening {
            // Requests not yet accepted or rejected die with their listener.
            let orphans: Vec<u32> = self
                .ids
                .iter()
                .filter(|(_, c)| c.state == State::Requested && c.listener == Some(id))
                .map(|(&k, _)| k)
                .collect();
            for o in orphans {
                self.remove(o);
            }
        }
        let peer = match i.peer {
            None => return,
            Some(Peer::Remote { host, id: to }) => {
                if i.state == State::Requested {
                    self.send_reject(host, id, to, REJ_CONSUMER_DEFINED, &CmParam::default());
                } else if i.state != State::Disconnected {
                    self.send_gone(host, id, to);
                }
                return;
            }
            Some(Peer::Local(p)) => p,
        };
        let Some(p) = self.ids.get_mut(&peer) else {
            return;
        };
        p.peer = None;
        let prev = std::mem::replace(&mut p.state, State::Disconnected);
        let ev = match (i.state, prev) {
            (State::Requested, State::Connecting) => self.event(
                cm_event::REJECTED,
                REJ_CONSUMER_DEFINED,
                None,
                CmParam::default(),
            ),
            (_, State::Disconnected) => return,
            _ => self.event(cm_event::DISCONNECTED, 0, None, CmParam::default()),
        };
        self.push(peer, ev);
    }

    /// A context went away: its ids are destroyed, and their peers told.
    pub fn drop_context(&mut self, ctx: CtxId) {
        let mine: Vec<u32> = self
            .ids
            .iter()
            .filter(|(_, i)| i.ctx == ctx)
            .map(|(&k, _)| k)
            .collect();
        for id in mine {
            self.remove(id);
        }
        self.notes.retain(|(c, _)| *c != ctx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn kinds(cm: &mut Cm, ctx: CtxId, id: u32) -> Vec<u32> {
        std::iter::from_fn(|| cm.take_event(ctx, id).unwrap())
            .map(|e| e.kind)
            .collect()
    }

    #[test]
    fn ports_behave_like_tcp() {
        let mut cm = Cm::new();
        let (c1, c2) = (CtxId(1), CtxId(2));
        let x = cm.create(c1, 0x106, 1, [1; 16]).unwrap();
        let y = cm.create(c2, 0x106, 2, [2; 16]).unwrap();
        let z = cm.create(c2, 0x111, 2, [2; 16]).unwrap();
        let b = cm.bind(c1, x, a("0.0.0.0:0")).unwrap();
        assert!(b.port() >= EPHEMERAL);
        assert_eq!(
            cm.bind(c2, y, a(&format!("127.0.0.1:{}", b.port()))),
            Err(libc::EADDRINUSE)
        );
        // Another port space is another namespace.
        assert!(
            cm.bind(c2, z, a(&format!("127.0.0.1:{}", b.port())))
                .is_ok()
        );
        assert_eq!(cm.bind(c2, y, a("192.0.2.1:1")), Err(libc::EADDRNOTAVAIL));
        assert_eq!(
            cm.bind(c1, y, a("127.0.0.1:7")),
            Err(libc::EINVAL),
            "not its id"
        );
    }

    #[test]
    fn connect_accept_establish_disconnect() {
        let mut cm = Cm::new();
        let (s, c) = (CtxId(1), CtxId(2));
        let l = cm.create(s, 0x106, 1, [1; 16]).unwrap();
        cm.bind(s, l, a("[::]:7471")).unwrap();
        cm.listen(s, l).unwrap();
        let x = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        cm.resolve_addr(c, x, None, a("127.0.0.1:7471")).unwrap();
        cm.resolve_route(c, x).unwrap();
        assert_eq!(
            kinds(&mut cm, c, x),
            [cm_event::ADDR_RESOLVED, cm_event::ROUTE_RESOLVED]
        );
        let p = CmParam {
            private_data: b"hi".to_vec(),
            initiator_depth: 3,
            qp_num: 0x42,
            ..CmParam::default()
        };
        cm.connect(c, x, p, Instant::now()).unwrap();
        let req = cm.take_event(s, l).unwrap().unwrap();
        assert_eq!(req.kind, cm_event::CONNECT_REQUEST);
        assert_eq!((req.param.qp_num, req.param.responder_resources), (0x42, 3));
        assert_eq!(
            (req.peer_lid, req.param.private_data.as_slice()),
            (2, &b"hi"[..])
        );
        let child = req.new_id;
        cm.accept(
            s,
            child,
            CmParam {
                qp_num: 0x43,
                ..CmParam::default()
            },
        )
        .unwrap();
        let rep = cm.take_event(c, x).unwrap().unwrap();
        assert_eq!(
            (rep.kind, rep.param.qp_num, rep.peer_lid),
            (cm_event::CONNECT_RESPONSE, 0x43, 1)
        );
        cm.establish(c, x).unwrap();
        assert_eq!(kinds(&mut cm, s, child), [cm_event::ESTABLISHED]);
        cm.disconnect(s, child).unwrap();
        assert_eq!(kinds(&mut cm, s, child), [cm_event::DISCONNECTED]);
        assert_eq!(kinds(&mut cm, c, x), [cm_event::DISCONNECTED]);
        cm.disconnect(c, x).unwrap();
        assert!(kinds(&mut cm, c, x).is_empty(), "only once");
    }

    #[test]
    fn no_listener_is_rejected_and_reject_carries_private_data() {
        let mut cm = Cm::new();
        let (s, c) = (CtxId(1), CtxId(2));
        let x = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        cm.resolve_addr(c, x, None, a("127.0.0.1:9")).unwrap();
        cm.resolve_route(c, x).unwrap();
        let t0 = Instant::now();
        cm.connect(c, x, CmParam::default(), t0).unwrap();
        cm.expire(t0 + CONNECT_HOLD / 2);
        assert_eq!(
            kinds(&mut cm, c, x).len(),
            2,
            "still waiting for a listener"
        );
        cm.expire(t0 + CONNECT_HOLD);
        let evs: Vec<CmEvent> = std::iter::from_fn(|| cm.take_event(c, x).unwrap()).collect();
        assert_eq!(evs[0].kind, cm_event::REJECTED);
        assert_eq!(evs[0].status, REJ_INVALID_SERVICE_ID);

        let l = cm.create(s, 0x106, 1, [1; 16]).unwrap();
        cm.bind(s, l, a("127.0.0.1:0")).unwrap();
        cm.listen(s, l).unwrap();
        let port = cm.ids[&l].local.unwrap().port();
        let y = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        cm.resolve_addr(c, y, None, a(&format!("127.0.0.1:{port}")))
            .unwrap();
        cm.resolve_route(c, y).unwrap();
        cm.connect(c, y, CmParam::default(), Instant::now())
            .unwrap();
        let child = cm.take_event(s, l).unwrap().unwrap().new_id;
        cm.reject(s, child, b"busy".to_vec()).unwrap();
        let rej = std::iter::from_fn(|| cm.take_event(c, y).unwrap())
            .last()
            .unwrap();
        assert_eq!(
            (rej.kind, rej.status),
            (cm_event::REJECTED, REJ_CONSUMER_DEFINED)
        );
        assert_eq!(rej.param.private_data, b"busy");
    }

    #[test]
    fn a_request_waits_for_a_listener_that_comes_up() {
        let mut cm = Cm::new();
        let (s, c) = (CtxId(1), CtxId(2));
        let x = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        cm.resolve_addr(c, x, None, a("127.0.0.1:7300")).unwrap();
        cm.resolve_route(c, x).unwrap();
        cm.connect(c, x, CmParam::default(), Instant::now())
            .unwrap();
        let l = cm.create(s, 0x106, 1, [1; 16]).unwrap();
        cm.bind(s, l, a("0.0.0.0:7300")).unwrap();
        cm.listen(s, l).unwrap();
        let req = cm.take_event(s, l).unwrap().unwrap();
        assert_eq!(req.kind, cm_event::CONNECT_REQUEST);
        assert!(cm.next_deadline().is_none());
    }

    #[test]
    fn a_dead_context_disconnects_its_peers() {
        let mut cm = Cm::new();
        let (s, c) = (CtxId(1), CtxId(2));
        let l = cm.create(s, 0x106, 1, [1; 16]).unwrap();
        cm.bind(s, l, a("127.0.0.1:7000")).unwrap();
        cm.listen(s, l).unwrap();
        let x = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        cm.resolve_addr(c, x, None, a("127.0.0.1:7000")).unwrap();
        cm.resolve_route(c, x).unwrap();
        cm.connect(c, x, CmParam::default(), Instant::now())
            .unwrap();
        let child = cm.take_event(s, l).unwrap().unwrap().new_id;
        cm.accept(s, child, CmParam::default()).unwrap();
        cm.establish(c, x).unwrap();
        let _ = kinds(&mut cm, c, x);
        cm.drop_context(s);
        assert_eq!(kinds(&mut cm, c, x), [cm_event::DISCONNECTED]);
        // The port is free again.
        let y = cm.create(c, 0x106, 2, [2; 16]).unwrap();
        assert!(cm.bind(c, y, a("127.0.0.1:7000")).is_ok());
    }
}
