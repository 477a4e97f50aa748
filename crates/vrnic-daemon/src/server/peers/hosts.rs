//! The host set of a cluster (`vrnic serve --etcd`): links added as hosts register in etcd and
//! removed when they leave (their lease expired or they deregistered). A host that leaves
//! takes its link with it: the QPs routed to it fail at once and its connection-manager ids
//! are failed, as for a peer that broke its link; nothing else is touched.

use std::net::SocketAddr;
use std::time::Instant;

use tracing::{info, warn};
use vrnic_proto::HostId;

use super::{Link, Peers};
use crate::server::{Server, Tok};

/// Most hosts a cluster may have (host indices claimed in etcd are below it).
pub(in crate::server) const MAX_HOSTS: u32 = 1024;

impl Peers {
    /// Forgets every link (this host's index changed: each must be dialed or accepted anew
    /// under the rule that the lower index dials); returns their tokens and streams.
    fn take_links(&mut self) -> Vec<Link> {
        self.links.drain(..).flatten().collect()
    }
}

impl Server {
    /// This host claimed index `me` in etcd. Links made under another index are dropped (the
    /// cluster's hosts are added again by the caller).
    pub(in crate::server) fn cluster_set_me(&mut self, me: HostId) {
        let Some(p) = &mut self.peers else { return };
        if p.me == Some(me.0 as usize) {
            return;
        }
        p.me = Some(me.0 as usize);
        for l in p.take_links() {
            self.drop_link(l);
        }
        info!(index = me.0, "this host's index in the cluster");
    }

    /// Host `host` registered in etcd (or changed its address): a link to it, dialed by the
    /// lower index.
    pub(in crate::server) fn cluster_host_added(&mut self, host: HostId, addr: SocketAddr) {
        let Some(me) = self.peers.as_ref().and_then(|p| p.me) else {
            return;
        };
        if host.0 as usize == me || host.0 >= MAX_HOSTS {
            return;
        }
        let now = Instant::now();
        let i = host.0 as usize;
        if let Some(p) = &self.peers
            && let Some(Some(l)) = p.links.get(i)
        {
            if l.addr == addr {
                return;
            }
            self.cluster_host_removed(host);
        }
        let token = self.token(Tok::Peer);
        let Some(p) = &mut self.peers else { return };
        if p.links.len() <= i {
            p.links.resize_with(i + 1, || None);
        }
        p.links[i] = Some(Link::new(host, addr, i > me, token, now));
        info!(peer = %addr, index = host.0, "cluster host joined");
        if let Some(sec) = &p.security
            && sec.key_of(addr).is_none()
        {
            warn!(
                peer = %addr,
                index = host.0,
                "no --peer-key for this cluster host: no link to it until its key is given"
            );
        }
    }

    /// Host `host` left the cluster: its link goes, its QPs and connection-manager ids fail.
    pub(in crate::server) fn cluster_host_removed(&mut self, host: HostId) {
        let Some(p) = &mut self.peers else { return };
        let Some(l) = p.links.get_mut(host.0 as usize).and_then(Option::take) else {
            return;
        };
        warn!(peer = %l.addr, index = host.0, "cluster host left; its QPs fail");
        let now = Instant::now();
        self.drop_link(l);
        for cell in &self.shards {
            cell.lock().engine.fail_host(now, host);
            cell.wake();
        }
        self.cm.fail_host(host);
    }

    /// Closes a link taken out of the set and forgets its token.
    fn drop_link(&mut self, mut l: Link) {
        if let Some(mut s) = l.stream.take() {
            let _ = self.poll.registry().deregister(&mut s);
        }
        self.tokens.remove(&l.token);
    }
}
