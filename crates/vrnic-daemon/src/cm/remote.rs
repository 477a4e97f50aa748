//! The broker's side of a connection whose other end is on another host: the IB CM messages
//! ([`CmMessage`]) it sends the other host's broker, and what it does with theirs.
//!
//! Every message from a peer is hostile until checked: it acts only on an id whose peer is the
//! sending host's id it names (or, for an answer to a request, the request's own id, whose
//! peer the answer names for the first time), in the state the step needs. Anything else is
//! dropped. A host's requests are bounded like a context's ids ([`super::MAX_IDS_PER_CTX`]).

use std::net::IpAddr;
use std::time::Instant;

use vrnic_api::{CmParam, cm_event};
use vrnic_proto::{GroupId, HostId, Refused};
use vrnic_wire::frame::{CmMessage, CmParams, MAX_PRIVATE_DATA};

use super::{
    CONNECT_HOLD, Cm, MAX_IDS_PER_CTX, Miss, Offer, PS_UDP, Parked, Peer, REJ_INVALID_SERVICE_ID,
    State, swapped,
};

/// The wire form of connection parameters (private data past the CM's limit is cut).
fn wire(p: &CmParam) -> CmParams {
    let mut private_data = p.private_data.clone();
    private_data.truncate(MAX_PRIVATE_DATA);
    CmParams {
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        qp_num: p.qp_num & 0xff_ffff,
        qkey: p.qkey,
        private_data,
    }
}

fn unwire(p: CmParams) -> CmParam {
    CmParam {
        private_data: p.private_data,
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        qp_num: p.qp_num,
        qkey: p.qkey,
    }
}

impl Cm {
    /// Messages for other hosts' brokers, since the last call.
    pub fn take_outgoing(&mut self) -> Vec<(HostId, CmMessage)> {
        std::mem::take(&mut self.outgoing)
    }

    /// `ip` is an address of `host` (announced over its link).
    pub fn add_host_addr(&mut self, host: HostId, ip: IpAddr) {
        self.remote_ips.insert(ip.to_canonical(), host);
    }

    /// Forgets `host`'s addresses (it is gone, or what it announced anew replaces them).
    pub fn clear_host_addrs(&mut self, host: HostId) {
        self.remote_ips.retain(|_, h| *h != host);
    }

    /// The configured host that announced `ip`.
    pub(super) fn host_of(&self, ip: IpAddr) -> Option<HostId> {
        self.remote_ips.get(&ip.to_canonical()).copied()
    }

    pub(super) fn send_request(&mut self, host: HostId, id: u32) {
        let Some(i) = self.ids.get_mut(&id) else {
            return;
        };
        let (Some(src), Some(dst)) = (i.local, i.remote) else {
            return;
        };
        i.peer = Some(Peer::Remote { host, id: 0 });
        let (ps, lid, gid, param, group) = (i.ps, i.lid, i.gid, wire(&i.param), i.owner.group);
        let m = CmMessage::Req {
            from: id,
            ps,
            src,
            dst,
            lid,
            gid,
            group: self.group_name(group),
            param,
        };
        self.outgoing.push((host, m));
    }

    pub(super) fn send_reply(
        &mut self,
        host: HostId,
        from: u32,
        to: u32,
        (lid, gid): (u16, [u8; 16]),
        param: &CmParam,
    ) {
        let param = wire(param);
        self.outgoing.push((
            host,
            CmMessage::Rep {
                from,
                to,
                lid,
                gid,
                param,
            },
        ));
    }

    pub(super) fn send_reject(
        &mut self,
        host: HostId,
        from: u32,
        to: u32,
        status: i32,
        param: &CmParam,
    ) {
        let param = CmParams {
            private_data: wire(param).private_data,
            ..CmParams::default()
        };
        self.outgoing.push((
            host,
            CmMessage::Rej {
                from,
                to,
                status,
                param,
            },
        ));
    }

    pub(super) fn send_ready(&mut self, host: HostId, from: u32, to: u32, param: &CmParam) {
        let param = wire(param);
        self.outgoing
            .push((host, CmMessage::Rtu { from, to, param }));
    }

    pub(super) fn send_gone(&mut self, host: HostId, from: u32, to: u32) {
        self.outgoing.push((host, CmMessage::Dreq { from, to }));
    }

    /// A request from another host that no listener here took in time.
    pub(super) fn refuse_offer(&mut self, o: &Offer) {
        if let Peer::Remote { host, id } = o.from {
            tracing::info!(
                host = host.0,
                "rdma_cm connect from another host refused: nothing listens there (REJECTED, \
                 invalid service ID)"
            );
            self.send_reject(host, 0, id, REJ_INVALID_SERVICE_ID, &CmParam::default());
        }
    }

    /// A request sent to another host that got no answer in time: `UNREACHABLE`, and the
    /// other host is told to drop whatever it made of it.
    pub(super) fn unanswered(&mut self, id: u32) {
        let Some(i) = self.ids.get_mut(&id) else {
            return;
        };
        if i.state != State::Connecting {
            return;
        }
        i.state = State::Disconnected;
        let peer = i.peer.take();
        if let Some(Peer::Remote { host, id: to }) = peer {
            self.send_gone(host, id, to);
        }
        tracing::debug!(id, "CM connect: no answer from the other host");
        let ev = self.event(
            cm_event::UNREACHABLE,
            -libc::ETIMEDOUT,
            None,
            CmParam::default(),
        );
        self.push(id, ev);
    }

    /// The local id that `host`'s id `from` talks to: `to` if the sender named it and it is
    /// connected to that id (or waits for its first answer), else the id whose peer `from` is.
    fn find(&self, host: HostId, from: u32, to: u32) -> Option<u32> {
        if to != 0 {
            let i = self.ids.get(&to)?;
            return match i.peer {
                Some(Peer::Remote { host: h, id }) if h == host && (id == from || id == 0) => {
                    Some(to)
                }
                _ => None,
            };
        }
        if from == 0 {
            return None;
        }
        self.ids
            .iter()
            .find(|(_, i)| i.peer == Some(Peer::Remote { host, id: from }))
            .map(|(&k, _)| k)
    }

    /// The request `to` that waits for its answer from `host`'s id `from`: named by the
    /// sender, connecting, and connected to that host.
    fn waiting(&self, host: HostId, from: u32, to: u32) -> Option<u32> {
        self.find(host, from, to).filter(|&x| x == to).filter(|x| {
            self.ids
                .get(x)
                .is_some_and(|i| i.state == State::Connecting)
        })
    }

    fn answered(&mut self, id: u32) {
        self.parked
            .retain(|(p, _)| !matches!(p, Parked::Sent(x) if *x == id));
    }

    /// A message from `host`'s broker.
    pub fn handle_remote(&mut self, host: HostId, m: CmMessage, now: Instant) {
        match m {
            CmMessage::Req {
                from,
                ps,
                src,
                dst,
                lid,
                gid,
                group,
                param,
            } => {
                let group = self.group_named(&group);
                self.remote_request(host, from, ps, src, dst, (lid, gid), group, param, now)
            }
            CmMessage::Rep {
                from,
                to,
                lid,
                gid,
                param,
            } => {
                let Some(id) = self.waiting(host, from, to).filter(|_| from != 0) else {
                    return;
                };
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                i.peer = Some(Peer::Remote { host, id: from });
                i.peer_addr = (lid, gid);
                let (kind, next) = if i.ps == PS_UDP {
                    (cm_event::ESTABLISHED, State::Connected)
                } else {
                    (cm_event::CONNECT_RESPONSE, State::Responded)
                };
                i.state = next;
                self.answered(id);
                let ev = self.event(kind, 0, Some((lid, gid)), swapped(&unwire(param)));
                self.push(id, ev);
            }
            CmMessage::Rej {
                from,
                to,
                status,
                param,
            } => {
                let Some(id) = self.waiting(host, from, to) else {
                    return;
                };
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                i.state = State::Disconnected;
                i.peer = None;
                let who = i.peer_addr;
                self.answered(id);
                let param = CmParam {
                    private_data: param.private_data,
                    ..CmParam::default()
                };
                let ev = self.event(cm_event::REJECTED, status, Some(who), param);
                self.push(id, ev);
            }
            CmMessage::Rtu { from, to, param } => {
                let Some(id) = self.find(host, from, to) else {
                    return;
                };
                let Some(i) = self.ids.get_mut(&id) else {
                    return;
                };
                if i.state != State::Accepted {
                    return;
                }
                i.state = State::Connected;
                let who = i.peer_addr;
                let ev = self.event(cm_event::ESTABLISHED, 0, Some(who), swapped(&unwire(param)));
                self.push(id, ev);
            }
            CmMessage::Dreq { from, to } => {
                // A request still waiting for a listener here is simply dropped.
                self.parked.retain(|(p, _)| {
                    !matches!(p, Parked::Remote(o) if o.from == Peer::Remote { host, id: from })
                });
                let Some(id) = self.find(host, from, to) else {
                    return;
                };
                self.peer_gone(id);
            }
        }
    }

    /// `id`'s remote peer disconnected or went away.
    fn peer_gone(&mut self, id: u32) {
        let Some(i) = self.ids.get_mut(&id) else {
            return;
        };
        i.peer = None;
        let prev = std::mem::replace(&mut i.state, State::Disconnected);
        self.answered(id);
        let ev = match prev {
            State::Disconnected => return,
            State::Connecting => self.event(
                cm_event::UNREACHABLE,
                -libc::ECONNRESET,
                None,
                CmParam::default(),
            ),
            _ => self.event(cm_event::DISCONNECTED, 0, None, CmParam::default()),
        };
        self.push(id, ev);
    }

    #[allow(clippy::too_many_arguments)]
    fn remote_request(
        &mut self,
        host: HostId,
        from: u32,
        ps: u16,
        src: std::net::SocketAddr,
        dst: std::net::SocketAddr,
        (lid, gid): (u16, [u8; 16]),
        group: Option<GroupId>,
        param: CmParams,
        now: Instant,
    ) {
        let me = Peer::Remote { host, id: from };
        let known = self.ids.values().filter(|i| match i.peer {
            Some(Peer::Remote { host: h, .. }) => h == host,
            _ => false,
        });
        let known = known.count()
            + self
                .parked
                .iter()
                .filter(|(p, _)| matches!(p, Parked::Remote(o) if matches!(o.from, Peer::Remote { host: h, .. } if h == host)))
                .count();
        let duplicate = self.ids.values().any(|i| i.peer == Some(me))
            || self
                .parked
                .iter()
                .any(|(p, _)| matches!(p, Parked::Remote(o) if o.from == me));
        if from == 0 || duplicate {
            return;
        }
        if !matches!(ps, 0x106 | 0x111 | 0x13f | 0x0002) || known >= MAX_IDS_PER_CTX {
            self.send_reject(host, 0, from, REJ_INVALID_SERVICE_ID, &CmParam::default());
            return;
        }
        let offer = Offer {
            group,
            who: Refused::Remote { host, lid },
            ps,
            src: Some(src),
            dst,
            lid,
            gid,
            param: unwire(param),
            from: me,
        };
        if let Err(miss) = self.offer(offer.clone()) {
            if let Miss::OtherGroup(l) = miss {
                self.refuse_across(&offer, l);
            }
            self.parked
                .push((Parked::Remote(offer), now + CONNECT_HOLD));
        }
    }

    /// `host`'s link broke (a protocol error, not a drop it may come back from): its requests
    /// are forgotten, requests to it are unreachable, connections with it disconnected.
    pub fn fail_host(&mut self, host: HostId) {
        self.parked.retain(|(p, _)| {
            !matches!(p, Parked::Remote(o) if matches!(o.from, Peer::Remote { host: h, .. } if h == host))
        });
        let ids: Vec<u32> = self
            .ids
            .iter()
            .filter(|(_, i)| matches!(i.peer, Some(Peer::Remote { host: h, .. }) if h == host))
            .map(|(&k, _)| k)
            .collect();
        for id in ids {
            self.peer_gone(id);
        }
        self.clear_host_addrs(host);
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use vrnic_proto::CtxId;

    use super::*;

    const A: HostId = HostId(0);
    const B: HostId = HostId(1);
    /// An address of host B that is no address of this machine.
    const B_IP: &str = "192.0.2.7";

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn kinds(cm: &mut Cm, ctx: CtxId, id: u32) -> Vec<(u32, i32)> {
        std::iter::from_fn(|| cm.take_event(ctx, id).unwrap())
            .map(|e| (e.kind, e.status))
            .collect()
    }

    /// Delivers every message each broker has for the other until both are quiet.
    fn exchange(ha: &mut Cm, hb: &mut Cm, now: Instant) {
        loop {
            let to_b = ha.take_outgoing();
            let to_a = hb.take_outgoing();
            if to_a.is_empty() && to_b.is_empty() {
                return;
            }
            for (h, m) in to_b {
                assert_eq!(h, B);
                hb.handle_remote(A, m, now);
            }
            for (h, m) in to_a {
                assert_eq!(h, A);
                ha.handle_remote(B, m, now);
            }
        }
    }

    /// Host A's client id resolved and routed to host B's listener port `port`.
    fn client(ha: &mut Cm, c: CtxId, port: u16) -> u32 {
        ha.add_host_addr(B, B_IP.parse().unwrap());
        let x = ha.create(c, 0x106, 2, [2; 16]).unwrap();
        ha.resolve_addr(c, x, Some(a("127.0.0.1:0")), a(&format!("{B_IP}:{port}")))
            .unwrap();
        ha.resolve_route(c, x).unwrap();
        assert_eq!(
            kinds(ha, c, x),
            [(cm_event::ADDR_RESOLVED, 0), (cm_event::ROUTE_RESOLVED, 0)]
        );
        x
    }

    fn listener(hb: &mut Cm, s: CtxId, port: u16) -> u32 {
        let l = hb.create(s, 0x106, 1, [1; 16]).unwrap();
        hb.bind(s, l, a(&format!("0.0.0.0:{port}"))).unwrap();
        hb.listen(s, l).unwrap();
        l
    }

    #[test]
    fn a_connection_across_two_brokers_connects_and_disconnects() {
        let (mut ha, mut hb) = (Cm::new(), Cm::new());
        let (c, s) = (CtxId(1), CtxId(2));
        let now = Instant::now();
        let l = listener(&mut hb, s, 7471);
        let x = client(&mut ha, c, 7471);
        let p = CmParam {
            private_data: b"hello".to_vec(),
            initiator_depth: 3,
            qp_num: 0x42,
            ..CmParam::default()
        };
        ha.connect(c, x, p, now).unwrap();
        exchange(&mut ha, &mut hb, now);
        let req = hb.take_event(s, l).unwrap().unwrap();
        assert_eq!(req.kind, cm_event::CONNECT_REQUEST);
        assert_eq!(
            (
                req.param.qp_num,
                req.param.responder_resources,
                req.peer_lid
            ),
            (0x42, 3, 2)
        );
        assert_eq!(req.param.private_data, b"hello");
        assert_eq!(req.local, format!("{B_IP}:7471"));
        let child = req.new_id;
        hb.accept(
            s,
            child,
            CmParam {
                qp_num: 0x43,
                ..CmParam::default()
            },
        )
        .unwrap();
        exchange(&mut ha, &mut hb, now);
        let rep = ha.take_event(c, x).unwrap().unwrap();
        assert_eq!(
            (rep.kind, rep.param.qp_num, rep.peer_lid, rep.peer_gid),
            (cm_event::CONNECT_RESPONSE, 0x43, 1, [1; 16])
        );
        ha.establish(c, x).unwrap();
        exchange(&mut ha, &mut hb, now);
        assert_eq!(kinds(&mut hb, s, child), [(cm_event::ESTABLISHED, 0)]);
        assert!(ha.next_deadline().is_none(), "the answer ended the wait");
        ha.disconnect(c, x).unwrap();
        exchange(&mut ha, &mut hb, now);
        assert_eq!(kinds(&mut ha, c, x), [(cm_event::DISCONNECTED, 0)]);
        assert_eq!(kinds(&mut hb, s, child), [(cm_event::DISCONNECTED, 0)]);
        hb.disconnect(s, child).unwrap();
        exchange(&mut ha, &mut hb, now);
        assert!(kinds(&mut ha, c, x).is_empty(), "only once");
    }

    #[test]
    fn no_listener_there_is_rejected_and_a_silent_host_is_unreachable() {
        let (mut ha, mut hb) = (Cm::new(), Cm::new());
        let c = CtxId(1);
        let t0 = Instant::now();
        let x = client(&mut ha, c, 9);
        ha.connect(c, x, CmParam::default(), t0).unwrap();
        exchange(&mut ha, &mut hb, t0);
        hb.expire(t0 + CONNECT_HOLD);
        exchange(&mut ha, &mut hb, t0);
        assert_eq!(
            kinds(&mut ha, c, x),
            [(cm_event::REJECTED, REJ_INVALID_SERVICE_ID)]
        );
        // A request nobody answers (the messages are lost): unreachable after the wait.
        let y = client(&mut ha, c, 10);
        ha.connect(c, y, CmParam::default(), t0).unwrap();
        ha.take_outgoing();
        ha.expire(t0 + super::super::REMOTE_ANSWER / 2);
        assert!(kinds(&mut ha, c, y).is_empty());
        ha.expire(t0 + super::super::REMOTE_ANSWER);
        assert_eq!(
            kinds(&mut ha, c, y),
            [(cm_event::UNREACHABLE, -libc::ETIMEDOUT)]
        );
    }

    #[test]
    fn a_request_waits_there_for_a_listener_and_a_reject_carries_private_data() {
        let (mut ha, mut hb) = (Cm::new(), Cm::new());
        let (c, s) = (CtxId(1), CtxId(2));
        let now = Instant::now();
        let x = client(&mut ha, c, 7300);
        ha.connect(c, x, CmParam::default(), now).unwrap();
        exchange(&mut ha, &mut hb, now);
        let l = listener(&mut hb, s, 7300);
        let child = hb.take_event(s, l).unwrap().unwrap().new_id;
        hb.reject(s, child, b"busy".to_vec()).unwrap();
        exchange(&mut ha, &mut hb, now);
        let rej = ha.take_event(c, x).unwrap().unwrap();
        assert_eq!(
            (rej.kind, rej.status),
            (cm_event::REJECTED, super::super::REJ_CONSUMER_DEFINED)
        );
        assert_eq!(rej.param.private_data, b"busy");
    }

    #[test]
    fn a_dead_context_or_a_broken_host_ends_the_other_sides_connections() {
        let (mut ha, mut hb) = (Cm::new(), Cm::new());
        let (c, s) = (CtxId(1), CtxId(2));
        let now = Instant::now();
        let l = listener(&mut hb, s, 7000);
        let x = client(&mut ha, c, 7000);
        ha.connect(c, x, CmParam::default(), now).unwrap();
        exchange(&mut ha, &mut hb, now);
        let child = hb.take_event(s, l).unwrap().unwrap().new_id;
        hb.accept(s, child, CmParam::default()).unwrap();
        exchange(&mut ha, &mut hb, now);
        ha.establish(c, x).unwrap();
        exchange(&mut ha, &mut hb, now);
        let _ = kinds(&mut ha, c, x);
        hb.drop_context(s);
        exchange(&mut ha, &mut hb, now);
        assert_eq!(kinds(&mut ha, c, x), [(cm_event::DISCONNECTED, 0)]);

        // A pending request to a host whose link breaks is unreachable at once.
        let y = client(&mut ha, c, 7001);
        ha.connect(c, y, CmParam::default(), now).unwrap();
        ha.take_outgoing();
        ha.fail_host(B);
        assert_eq!(
            kinds(&mut ha, c, y),
            [(cm_event::UNREACHABLE, -libc::ECONNRESET)]
        );
        assert!(ha.host_of(B_IP.parse().unwrap()).is_none());
    }

    #[test]
    fn forged_messages_touch_nothing() {
        let (mut ha, mut hb) = (Cm::new(), Cm::new());
        let (c, s, other) = (CtxId(1), CtxId(2), CtxId(3));
        let now = Instant::now();
        // A connection local to host B, and one from A to B.
        let l = listener(&mut hb, s, 7000);
        let y = hb.create(other, 0x106, 3, [3; 16]).unwrap();
        hb.resolve_addr(other, y, None, a("127.0.0.1:7000"))
            .unwrap();
        hb.resolve_route(other, y).unwrap();
        hb.connect(other, y, CmParam::default(), now).unwrap();
        let local_child = hb.take_event(s, l).unwrap().unwrap().new_id;
        hb.accept(s, local_child, CmParam::default()).unwrap();
        hb.establish(other, y).unwrap();
        let _ = kinds(&mut hb, other, y);
        let _ = kinds(&mut hb, s, local_child);
        let x = client(&mut ha, c, 7000);
        ha.connect(c, x, CmParam::default(), now).unwrap();
        exchange(&mut ha, &mut hb, now);
        let child = hb.take_event(s, l).unwrap().unwrap().new_id;

        // Host A (or a host posing as another) names ids it is not connected to.
        let p = CmParams::default();
        for (host, m) in [
            (A, CmMessage::Dreq { from: 99, to: y }),
            (
                A,
                CmMessage::Dreq {
                    from: 99,
                    to: local_child,
                },
            ),
            (A, CmMessage::Dreq { from: 0, to: 0 }),
            (HostId(2), CmMessage::Dreq { from: x, to: child }),
            (
                A,
                CmMessage::Rtu {
                    from: x,
                    to: local_child,
                    param: p.clone(),
                },
            ),
            (
                A,
                CmMessage::Rep {
                    from: 5,
                    to: y,
                    lid: 9,
                    gid: [9; 16],
                    param: p.clone(),
                },
            ),
            (
                A,
                CmMessage::Rej {
                    from: 5,
                    to: y,
                    status: 1,
                    param: p.clone(),
                },
            ),
            // Accept's answer before the accept: the child is Requested, not Accepted.
            (
                A,
                CmMessage::Rtu {
                    from: x,
                    to: child,
                    param: p.clone(),
                },
            ),
        ] {
            hb.handle_remote(host, m, now);
        }
        assert!(kinds(&mut hb, other, y).is_empty());
        assert!(kinds(&mut hb, s, local_child).is_empty());
        assert!(kinds(&mut hb, s, child).is_empty());
        // The real requester still gets its connection.
        hb.accept(s, child, CmParam::default()).unwrap();
        exchange(&mut ha, &mut hb, now);
        assert_eq!(kinds(&mut ha, c, x)[0].0, cm_event::CONNECT_RESPONSE);
        // A duplicate request makes no second id; a flood is bounded.
        let req = CmMessage::Req {
            from: 77,
            ps: 0x106,
            src: a("10.0.0.1:1"),
            dst: a("10.0.0.2:7000"),
            lid: 5,
            gid: [5; 16],
            group: "default".into(),
            param: p.clone(),
        };
        hb.handle_remote(A, req.clone(), now);
        hb.handle_remote(A, req, now);
        assert_eq!(kinds(&mut hb, s, l).len(), 1);
        for from in 1000..1000 + MAX_IDS_PER_CTX as u32 + 10 {
            let m = CmMessage::Req {
                from,
                ps: 0x106,
                src: a("10.0.0.1:1"),
                dst: a("10.0.0.2:7000"),
                lid: 5,
                gid: [5; 16],
                group: "default".into(),
                param: p.clone(),
            };
            hb.handle_remote(A, m, now);
        }
        assert!(hb.ids.len() <= MAX_IDS_PER_CTX + 8);
        let refused = hb
            .take_outgoing()
            .into_iter()
            .filter(|(_, m)| matches!(m, CmMessage::Rej { status, .. } if *status == REJ_INVALID_SERVICE_ID))
            .count();
        assert!(refused >= 10);
    }
}
