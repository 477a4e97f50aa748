//! Peer links: one TCP connection to each other daemon of the configured hosts, carrying the
//! engine's segments as frames (`vrnic_wire::frame`) for every QP between the two hosts, and
//! a little link control: hello, vRNIC announcements, keepalives.
//!
//! The hosts are this daemon's `--listen` address and its `--peer` addresses, sorted: every
//! daemon of a correctly configured set sees the same list, and a host's place in it is its
//! [`HostId`], which also gives it a LID range and GUIDs of its own (so LIDs and GIDs are
//! unique across the hosts with no numbering by the user). The daemon earlier in the list
//! dials the later one. With keys (`--key`, `--peer-key`) the connection first carries a Noise
//! handshake in which each end proves the key configured for the host it claims, its hello
//! (protocol version, its index, the number of hosts, whether it wants encryption) as the
//! handshake's payload (`secure.rs`); without keys (loopback, `--insecure-links`) each side
//! just sends its hello (`hello.rs`). Once it has the other's, each sends the list of its
//! vRNICs (LID, GID), then every vRNIC created or removed. Keepalives every [`KEEPALIVE`]; a link silent for [`DEAD_AFTER`] is
//! closed and dialed again, and the QPs over it send again from their oldest unanswered
//! segment when it is back (the engine's retry budget decides how long they wait).
//!
//! In cluster mode (`vrnic serve --etcd`) the host set is not configured but comes from etcd
//! (`server/cluster`): a host's index is the one it claimed there, links are added and removed
//! as hosts register and their leases expire (`hosts.rs`), the hello carries a host count of 0
//! (a cluster host), and an accepted connection must come from the address its claimed index is
//! registered with. vRNICs are then announced through etcd, not over the links.
//!
//! Everything read from a link is hostile: frames are decoded strictly, and a malformed frame
//! or a control frame out of place closes the link and fails the QPs routed over it; nothing
//! else is touched. Reads are bounded per pass, so a flooding peer costs its own link's share.
//!
//! What a peer can make this daemon hold is bounded:
//!
//! - **Output it causes.** A keepalive ping is answered only while the link's queue holds
//!   less than [`PONG_ROOM`] bytes (a pong is only a liveness sign, and a peer with that much
//!   unread learns its liveness from the rest); so a peer that sends pings and never reads
//!   makes the daemon queue at most that much. And a link whose queue makes no write progress
//!   (not one byte taken by the socket) for [`STALL_AFTER`] is closed: its peer does not
//!   read. There is no bound on the queue's size itself: an honest busy link queues what the
//!   engine's windows let it (large payloads as ranges of regions, or copies with engine
//!   threads), and one that keeps writing is never cut, however much it holds; only a queue
//!   that does not move is the peer's doing.
//! - **Input.** What is read and not yet a whole frame is at most one frame plus a pass's
//!   [`READ_BUDGET`] (on an encrypted link, plus one record); connections not yet past their
//!   hello or handshake are at most [`MAX_PENDING`] (more are closed as they come), each
//!   holding at most [`PENDING_INPUT`] bytes, and go after the handshake's deadline (2 s);
//!   the public-key work a stranger can ask for is rate-limited (`secure.rs`), and none of it
//!   touches a live link, which only a finished handshake replaces. Refused connections are
//!   logged at most once a second.
//! - **Announcements** (`share.rs`): a host announces only its own share of LIDs and GIDs,
//!   one vRNIC per LID, at most [`share::MAX_ANNOUNCED_VNICS`], and at most
//!   [`share::MAX_ANNOUNCED_ADDRS`] addresses, none of another host's; all of it is forgotten
//!   when its link goes down broken or comes up again.
//! - **Connection-manager messages** kept while a link is down: [`CM_BACKLOG`].

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use std::sync::Arc;

use mio::net::{TcpListener, TcpStream};
use mio::{Interest, Token};
use rustc_hash::FxHashMap;
use tracing::{debug, info, warn};
use vrnic_api::PeerSummary;
use vrnic_proto::HostId;
use vrnic_wire::frame::{
    CmMessage, ControlKind, Frame, FrameRepr, KeepaliveRepr, LINK_HEADER_LEN, MAX_FRAME,
    MAX_HANDSHAKE, pad_bytes_ok, peek_len,
};

mod hello;
mod hosts;
mod secure;
mod share;

pub(super) use hosts::MAX_HOSTS;
pub(super) use share::{AddrFacts, AddrVerdict, addr_verdict, guid};

use hello::parse_hello;
use secure::{Cipher, HANDSHAKE_DEADLINE, Handshake, HandshakeBucket, Security};

use crate::keys::{KeyPair, PublicKey};

use super::announce::{Entry, announce};
use super::inbound::{HEADROOM, PLACE_MIN, Placing};
use super::linkbuf::LinkBuf;
use super::outqueue::OutQueue;
use super::shard::ShardCell;
use super::shard::{Frames, Mem};
use super::{Server, Tok};

/// How often a link that sent nothing else sends a keepalive.
const KEEPALIVE: Duration = Duration::from_millis(200);
/// A link that received nothing for this long is closed and dialed again.
const DEAD_AFTER: Duration = Duration::from_secs(2);
/// How soon a failed dial is tried again.
const REDIAL: Duration = Duration::from_millis(100);
/// How soon a dial whose handshake failed is tried again.
const REFUSED_REDIAL: Duration = Duration::from_secs(1);
/// Most bytes read from one link in one pass.
const READ_BUDGET: usize = 4 << 20;
/// Payloads of at least this many bytes go from the region to the socket by `writev`; smaller
/// ones are copied into the frame (an iovec costs more than a small copy).
const ZERO_COPY_MIN: u64 = 16 << 10;
/// Most connection-manager messages kept for a link that is down (the oldest go first).
const CM_BACKLOG: usize = 1024;
/// A keepalive ping is answered only while the link's queue holds fewer bytes than this.
const PONG_ROOM: usize = 64 << 10;
/// A link whose queue has not moved for this long is closed (its peer does not read). Longer
/// than [`DEAD_AFTER`], so a peer that merely stalls is already closed as silent by then.
const STALL_AFTER: Duration = Duration::from_secs(4);
/// Most accepted connections waiting for their hello (or handshake).
const MAX_PENDING: usize = 64;
/// Most bytes an accepted connection may send before its hello or handshake is done: two
/// handshake frames and what an honest dialer sends right after its last one.
const PENDING_INPUT: usize = 4 << 10;

/// Where the daemon listens, which hosts it links to, and with which keys (`vrnic serve
/// --listen/--peer/--key/--peer-key/--encrypt-links/--insecure-links`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerOptions {
    /// This host's address for peer links.
    pub listen: Option<SocketAddr>,
    /// The other hosts' addresses.
    pub peers: Vec<SocketAddr>,
    /// This host's key pair: every link is authenticated (both ends prove their keys).
    pub key: Option<KeyPair>,
    /// The public key each other host must prove, by its peer-link address.
    pub peer_keys: Vec<(SocketAddr, PublicKey)>,
    /// Ask for encrypted frames (a link is encrypted if either end asks).
    pub encrypt: bool,
    /// Allow unauthenticated links on an address other than loopback.
    pub insecure: bool,
}

impl PeerOptions {
    /// The sorted host list and this host's index in it; `None` without peers.
    pub fn hosts(&self) -> Option<(Vec<SocketAddr>, usize)> {
        let listen = self.listen?;
        let mut hosts = self.peers.clone();
        hosts.push(listen);
        hosts.sort();
        hosts.dedup();
        let me = hosts.iter().position(|h| *h == listen)?;
        (hosts.len() > 1).then_some((hosts, me))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// No connection: dial at (or wait for the peer's dial).
    Down { redial: Instant },
    /// Connected, our hello sent, theirs not yet received.
    Hello,
    /// Hellos exchanged.
    Up,
}

struct Link {
    host: HostId,
    addr: SocketAddr,
    /// Whether we dial it (it is later in the host list).
    dials: bool,
    stream: Option<TcpStream>,
    token: Token,
    state: State,
    inbuf: LinkBuf,
    /// A segment whose payload is being read straight into place.
    placing: Option<Placing>,
    out: OutQueue,
    last_rx: Instant,
    last_tx: Instant,
    last_ping: Instant,
    /// When its queue was last empty or last wrote a byte.
    progress: Instant,
    bytes_in: u64,
    /// Payload bytes read straight into place.
    placed_in: u64,
    bytes_out: u64,
    /// Times it went down.
    drops: u64,
    /// The last keepalive round trip.
    rtt: Option<Duration>,
    /// Connection-manager messages (encoded frames) waiting for the link to come up.
    cm_backlog: VecDeque<Vec<u8>>,
    /// The handshake of a connection we dialed, waiting for the listener's step.
    handshake: Option<Handshake>,
    /// The records of an encrypted link.
    cipher: Option<Box<Cipher>>,
    /// The key the peer proved, on an authenticated link.
    proved: Option<PublicKey>,
}

/// A connection accepted before its hello (or handshake) said who it is.
struct Pending {
    stream: TcpStream,
    /// Where it came from.
    addr: SocketAddr,
    inbuf: Vec<u8>,
    since: Instant,
    /// Its handshake, once step 1 was answered.
    handshake: Option<Handshake>,
}

/// Where the host set comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostSet {
    /// A fixed sorted list of this many hosts (`--listen`/`--peer`).
    Static(usize),
    /// etcd: hosts come and go (`hosts.rs`).
    Cluster,
}

/// The peer links of a daemon configured with peers.
pub(super) struct Peers {
    /// This host's index (in cluster mode, none until it has claimed one in etcd).
    me: Option<usize>,
    /// This host's address for peer links.
    listen: SocketAddr,
    set: HostSet,
    listener: TcpListener,
    links: Vec<Option<Link>>,
    pending: HashMap<Token, Pending>,
    /// Keepalive timestamps count from here.
    epoch: Instant,
    /// Scratch for `writev`'s and `readv`'s pieces.
    iov: Vec<(usize, usize)>,
    /// Where payloads that can no longer go into place are read and dropped.
    discard: Vec<u8>,
    /// Room for the next placement's runs.
    runs: Vec<(vrnic_proto::Loc, u64)>,
    /// Links whose writes failed during an engine pass, to be closed after it.
    failed: Vec<(usize, String)>,
    /// Keys: `None` for unauthenticated links.
    security: Option<Security>,
    /// The listener's answers to strangers' handshakes, rate-limited.
    bucket: HandshakeBucket,
    /// Refused connections, logged at most once a second.
    refusals: Refusals,
}

/// Accepted connections refused (failed handshakes, wrong hellos, garbage): counted, and
/// logged at most once a second with the last reason, so a flood costs no more than a line.
struct Refusals {
    count: u64,
    last: Option<(SocketAddr, String)>,
    logged: Instant,
}

impl Refusals {
    /// None yet: the first is logged at once.
    fn new(now: Instant) -> Refusals {
        Refusals {
            count: 0,
            last: None,
            logged: now.checked_sub(Duration::from_secs(1)).unwrap_or(now),
        }
    }

    fn note(&mut self, now: Instant, from: SocketAddr, why: String) {
        self.count += 1;
        self.last = Some((from, why));
        if now.duration_since(self.logged) >= Duration::from_secs(1) {
            self.flush(now);
        }
    }

    fn flush(&mut self, now: Instant) {
        if let Some((from, why)) = self.last.take() {
            warn!(
                refused = self.count,
                last_from = %from,
                "peer connections refused: {why}"
            );
        }
        self.count = 0;
        self.logged = now;
    }
}

impl Link {
    /// A link to `host` at `addr`, down, to be dialed at once if `dials`.
    fn new(host: HostId, addr: SocketAddr, dials: bool, token: Token, now: Instant) -> Link {
        Link {
            host,
            addr,
            dials,
            stream: None,
            token,
            state: State::Down { redial: now },
            inbuf: LinkBuf::default(),
            placed_in: 0,
            placing: None,
            out: OutQueue::default(),
            last_rx: now,
            last_tx: now,
            last_ping: now,
            progress: now,
            bytes_in: 0,
            bytes_out: 0,
            drops: 0,
            rtt: None,
            cm_backlog: VecDeque::new(),
            handshake: None,
            cipher: None,
            proved: None,
        }
    }

    /// Whether nothing waits to be written (sealed records included).
    fn out_empty(&self) -> bool {
        self.out.is_empty() && self.cipher.as_ref().is_none_or(|c| c.held() == 0)
    }

    /// Bytes waiting to be written, in the daemon's own memory.
    fn out_held(&self) -> usize {
        self.out.held() + self.cipher.as_ref().map_or(0, |c| c.held())
    }

    /// Forgets everything read and not yet taken, and the connection's keys (a new or closed
    /// connection).
    fn reset_input(&mut self) {
        self.inbuf.clear();
        self.placing = None;
        self.handshake = None;
        self.cipher = None;
        self.proved = None;
    }
}

impl Peers {
    /// Binds the listening socket; links start down and are dialed by [`Server::peer_pass`].
    pub(super) fn new(
        opts: &PeerOptions,
        poll: &mio::Poll,
        mut token: impl FnMut(Tok) -> Token,
    ) -> anyhow::Result<Option<Peers>> {
        let Some((hosts, me)) = opts.hosts() else {
            if !opts.peers.is_empty() {
                anyhow::bail!("--peer needs --listen (this host's address for peer links)");
            }
            return Ok(None);
        };
        let listen = hosts[me];
        let security = link_security(opts, listen, &opts.peers)?;
        let mut listener = TcpListener::bind(listen)
            .map_err(|e| anyhow::anyhow!("listen for peers on {listen}: {e}"))?;
        let listener_token = token(Tok::PeerListener);
        poll.registry()
            .register(&mut listener, listener_token, Interest::READABLE)?;
        let now = Instant::now();
        let links = hosts
            .iter()
            .enumerate()
            .map(|(i, &addr)| {
                (i != me).then(|| Link::new(HostId(i as u32), addr, i > me, token(Tok::Peer), now))
            })
            .collect();
        info!(%listen, hosts = hosts.len(), index = me, "peer links configured");
        Ok(Some(Peers {
            me: Some(me),
            listen,
            set: HostSet::Static(hosts.len()),
            listener,
            links,
            pending: HashMap::new(),
            epoch: now,
            iov: Vec::with_capacity(crate::sys::WRITEV_MAX),
            discard: vec![0; MAX_FRAME],
            runs: Vec::new(),
            failed: Vec::new(),
            security,
            bucket: HandshakeBucket::new(now),
            refusals: Refusals::new(now),
        }))
    }

    /// Binds the listening socket of a cluster host; links are added as hosts register in
    /// etcd, once this host has its own index ([`Server::cluster_host_added`]).
    pub(super) fn cluster(
        opts: &PeerOptions,
        listen: SocketAddr,
        poll: &mio::Poll,
        mut token: impl FnMut(Tok) -> Token,
    ) -> anyhow::Result<Peers> {
        let security = link_security(opts, listen, &[])?;
        let now = Instant::now();
        let mut listener = TcpListener::bind(listen)
            .map_err(|e| anyhow::anyhow!("listen for peers on {listen}: {e}"))?;
        poll.registry()
            .register(&mut listener, token(Tok::PeerListener), Interest::READABLE)?;
        info!(%listen, "peer links from the cluster's hosts");
        Ok(Peers {
            me: None,
            listen,
            set: HostSet::Cluster,
            listener,
            links: Vec::new(),
            pending: HashMap::new(),
            epoch: now,
            iov: Vec::with_capacity(crate::sys::WRITEV_MAX),
            discard: vec![0; MAX_FRAME],
            runs: Vec::new(),
            failed: Vec::new(),
            security,
            bucket: HandshakeBucket::new(now),
            refusals: Refusals::new(now),
        })
    }

    /// Logs the refused connections not logged yet (the daemon stops).
    pub(super) fn flush_refusals(&mut self) {
        if self.refusals.count > 0 {
            self.refusals.flush(Instant::now());
        }
    }

    /// This host's index in the host list.
    pub(super) fn index(&self) -> usize {
        self.me.unwrap_or(0)
    }

    /// Whether the hosts come from etcd.
    pub(super) fn is_cluster(&self) -> bool {
        self.set == HostSet::Cluster
    }

    /// The host count a hello carries: the static list's length, 0 for a cluster host.
    fn hello_count(&self) -> usize {
        match self.set {
            HostSet::Static(n) => n,
            HostSet::Cluster => 0,
        }
    }

    /// Host `host`'s peer-link address (this host's own included).
    pub(super) fn host_addr(&self, host: HostId) -> Option<SocketAddr> {
        if self.me == Some(host.0 as usize) {
            return Some(self.listen);
        }
        self.links.get(host.0 as usize)?.as_ref().map(|l| l.addr)
    }

    /// The LIDs this host gives out: its share of the unicast range (static host list).
    pub(super) fn lid_range(&self) -> std::ops::Range<u16> {
        share::lid_share(self.index(), self.hello_count())
    }

    /// The links, for `vrnic peers`.
    pub(super) fn status(&self, shards: &[Arc<ShardCell>]) -> Vec<PeerSummary> {
        // Segments sent again to a host, by all shards.
        let retransmits = |host| {
            shards
                .iter()
                .map(|c| c.lock().engine.retransmits(host))
                .sum::<u64>()
        };
        self.links
            .iter()
            .flatten()
            .map(|l| PeerSummary {
                addr: l.addr.to_string(),
                state: match l.state {
                    State::Up => "up",
                    State::Hello => "connecting",
                    State::Down { .. } => "down",
                }
                .to_string(),
                rtt_us: l.rtt.map(|d| d.as_micros() as u64),
                bytes_in: l.bytes_in,
                placed_in: l.placed_in,
                bytes_out: l.bytes_out,
                retransmits: retransmits(l.host),
                drops: l.drops,
                security: l.security().to_string(),
            })
            .collect()
    }
}

/// The links' keys from the options. Without a key, links are not authenticated: allowed on
/// a loopback address (one machine: tests, demos), refused elsewhere unless
/// `--insecure-links` asks for it, and then warned about.
fn link_security(
    opts: &PeerOptions,
    listen: SocketAddr,
    static_peers: &[SocketAddr],
) -> anyhow::Result<Option<Security>> {
    let security = Security::new(
        opts.key.as_ref(),
        &opts.peer_keys,
        opts.encrypt,
        static_peers,
    )?;
    match &security {
        Some(s) => {
            if opts.insecure {
                anyhow::bail!("--insecure-links and --key exclude each other");
            }
            info!(
                encrypt = s.encrypt(),
                "peer links authenticated by key (Noise XX)"
            );
        }
        None if listen.ip().is_loopback() => {
            info!(%listen, "peer links on a loopback address, not authenticated (no --key)");
        }
        None if opts.insecure => {
            warn!(
                %listen,
                "PEER LINKS ARE NOT AUTHENTICATED (--insecure-links): anyone who reaches this \
                 address can pose as a configured host, read and forge its traffic. Give each \
                 host a key (vrnic keygen, --key, --peer-key)"
            );
        }
        None => anyhow::bail!(
            "--listen {listen} is not a loopback address and no --key was given: peer links \
             would not be authenticated. Make a key on each host (vrnic keygen FILE), start \
             with --key FILE and a --peer-key ADDR:PORT=PUBLIC for each other host (README, \
             \"Keys\"), or accept unauthenticated links with --insecure-links"
        ),
    }
    Ok(security)
}

/// A control frame of `kind` with `body`, appended to `out`.
pub(super) fn control(out: &mut Vec<u8>, kind: ControlKind, body: &[u8]) {
    vrnic_wire::frame::emit_control(out, kind, body);
}

/// What an accepted connection's hello or handshake came to.
enum PendingStep {
    /// Not all there yet.
    Wait,
    /// It is host `idx`: its link, with what it sent after its hello or handshake (from byte
    /// `used`), the link's cipher and the key it proved.
    Install {
        idx: usize,
        used: usize,
        cipher: Option<Box<Cipher>>,
        proved: Option<PublicKey>,
    },
    /// Closed: why (`None`: it closed before saying anything worth a log line).
    Refuse(Option<String>),
}

impl Peers {
    /// The host an accepted connection's hello names, if this host takes it from there: a host
    /// earlier in the list (it dials us), of the same host count, and in a cluster from the
    /// address its index is registered with.
    fn accepts(&self, h: vrnic_wire::frame::HelloRepr, from: SocketAddr) -> Result<usize, String> {
        let idx = usize::from(h.index);
        let ok = usize::from(h.hosts) == self.hello_count()
            && self.me.is_some_and(|me| idx < me)
            && self.links.get(idx).is_some_and(|l| {
                l.as_ref().is_some_and(|l| {
                    // A cluster host must come from the address its index is registered with
                    // in etcd.
                    self.set != HostSet::Cluster || l.addr.ip() == from.ip()
                })
            });
        if ok {
            Ok(idx)
        } else {
            Err(format!(
                "a hello (host {idx} of {}) that does not match this host list ({} hosts)",
                h.hosts,
                self.hello_count()
            ))
        }
    }
}

impl Link {
    /// How the link is protected, for logs and `vrnic peers`.
    fn security(&self) -> &'static str {
        match (&self.proved, &self.cipher) {
            (Some(_), Some(_)) => "encrypted",
            (Some(_), None) => "authenticated",
            (None, _) => "none",
        }
    }
}

/// Why a link is closed.
#[derive(Debug)]
enum Close {
    /// The peer closed it, or the socket failed.
    Gone(String),
    /// Its handshake failed (a peer without the right key, or one that does not speak it): the
    /// connection is closed and dialed again; nothing else changes.
    Refused(String),
    /// The peer broke the protocol (a malformed frame, a control frame out of place).
    Broken(String),
}

impl Server {
    /// Appends announcements of every local vRNIC (op 1) and of this host's addresses
    /// (op 3, for rdma_cm) to `out`.
    fn announce_all(&self, out: &mut Vec<u8>) {
        if self.peers.as_ref().is_some_and(Peers::is_cluster) {
            // A cluster's directory is etcd's.
            return;
        }
        let mut entries: Vec<Entry> = self
            .vnics
            .values()
            .map(|v| Entry::Added {
                lid: v.lid,
                gid: v.gid,
                vip: v.vip,
                name: &v.name,
                group: self.directory.group_name(v.group),
            })
            .collect();
        for ip in share::own_addrs(self.peers.as_ref().map(|p| p.listen.ip())) {
            entries.push(Entry::Addr(ip));
        }
        // The set is whole: what the peer knew of this host and did not hear again is gone.
        entries.push(Entry::Complete);
        announce(out, &entries);
    }

    /// Link `host` is up: its vRNICs and addresses are announced anew (those it announced
    /// before stay usable until its set ends, so routes survive a link that flaps), the
    /// connection-manager messages kept for it go out, and its QPs send again what was not
    /// answered.
    fn link_up(&mut self, host: HostId) {
        if !self.peers.as_ref().is_some_and(Peers::is_cluster) {
            self.directory_refresh(host);
        }
        if let Some(Some(l)) = self
            .peers
            .as_mut()
            .and_then(|p| p.links.get_mut(host.0 as usize))
        {
            for f in l.cm_backlog.drain(..) {
                l.out.extend(&f);
            }
        }
        for cell in &self.shards {
            cell.lock().engine.handle_link_up(host);
            cell.wake();
        }
    }

    /// Tells every up link that a vRNIC was created or removed.
    pub(super) fn announce_vnic(&mut self, e: Entry) {
        let Some(p) = &mut self.peers else { return };
        if p.is_cluster() {
            return;
        }
        let mut f = Vec::new();
        announce(&mut f, &[e]);
        for l in p.links.iter_mut().flatten() {
            if l.state == State::Up {
                l.out.extend(&f);
            }
        }
    }

    /// Accepts connections from peers (they say who they are in their hello).
    pub(super) fn accept_peers(&mut self) {
        let Some(p) = &mut self.peers else { return };
        loop {
            match p.listener.accept() {
                Ok((mut stream, addr)) => {
                    if p.pending.len() >= MAX_PENDING {
                        debug!(%addr, "peer connection closed: too many waiting for a hello");
                        continue;
                    }
                    let _ = stream.set_nodelay(true);
                    let token = mio::Token(self.next_token);
                    self.next_token += 1;
                    if self
                        .poll
                        .registry()
                        .register(&mut stream, token, Interest::READABLE)
                        .is_err()
                    {
                        continue;
                    }
                    self.tokens.insert(token, Tok::PeerPending);
                    debug!(%addr, "peer connection accepted");
                    p.pending.insert(
                        token,
                        Pending {
                            stream,
                            addr,
                            inbuf: Vec::new(),
                            since: Instant::now(),
                            handshake: None,
                        },
                    );
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    warn!("accept a peer: {e}");
                    return;
                }
            }
        }
    }

    /// One pass over the peer links: dial what is due, take hellos on accepted connections,
    /// read every link (frames to the engine), keepalives, dead links. Returns whether any
    /// frame arrived.
    pub(super) fn peer_pass(&mut self, now: Instant) -> bool {
        if self.peers.is_none() {
            return false;
        }
        self.dial_due(now);
        self.serve_pending(now);
        let mut moved = false;
        let n = self.peers.as_ref().map_or(0, |p| p.links.len());
        for i in 0..n {
            match self.read_link(now, i) {
                Ok(m) => moved |= m,
                Err(why) => self.close_link(now, i, why),
            }
            self.keepalive(now, i);
        }
        moved
    }

    /// When the next link that is down is due to be dialed again: the loop's sleep ends
    /// then, so a link taken away comes back after [`REDIAL`], not at the next wake-up.
    pub(super) fn next_redial(&self) -> Option<Instant> {
        self.peers
            .as_ref()?
            .links
            .iter()
            .flatten()
            .filter(|l| l.dials)
            .filter_map(|l| match l.state {
                State::Down { redial } => Some(redial),
                _ => None,
            })
            .min()
    }

    fn dial_due(&mut self, now: Instant) {
        // Our hello (or, with keys, the handshake's first step) goes first on every new
        // connection.
        let mut hello = Vec::new();
        self.hello(&mut hello);
        let Some(p) = &mut self.peers else { return };
        let security = p.security.as_ref();
        for l in p.links.iter_mut().flatten() {
            let State::Down { redial } = l.state else {
                continue;
            };
            if !l.dials || now < redial {
                continue;
            }
            match TcpStream::connect(l.addr) {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    if self
                        .poll
                        .registry()
                        .register(&mut s, l.token, Interest::READABLE | Interest::WRITABLE)
                        .is_err()
                    {
                        l.state = State::Down {
                            redial: now + REDIAL,
                        };
                        continue;
                    }
                    l.stream = Some(s);
                    l.state = State::Hello;
                    l.reset_input();
                    l.out.clear();
                    match security {
                        Some(sec) => {
                            let mut first = Vec::new();
                            match sec.dial(&mut first) {
                                Ok(hs) => l.handshake = Some(hs),
                                Err(e) => warn!("start a handshake: {e:#}"),
                            }
                            l.out.extend(&first);
                        }
                        None => l.out.extend(&hello),
                    }
                    l.last_rx = now;
                    l.last_tx = now;
                    l.progress = now;
                }
                Err(e) => {
                    debug!(addr = %l.addr, "dial peer: {e}");
                    l.state = State::Down {
                        redial: now + REDIAL,
                    };
                }
            }
        }
    }

    /// Reads hellos (or handshakes) on accepted connections; one that proves who it is makes
    /// the connection its host's link. Anything else closes only that connection.
    fn serve_pending(&mut self, now: Instant) {
        let Some(p) = &mut self.peers else { return };
        let tokens: Vec<Token> = p.pending.keys().copied().collect();
        for t in tokens {
            let step = self.pending_step(now, t);
            let Some(p) = &mut self.peers else { return };
            match step {
                PendingStep::Wait => {}
                PendingStep::Install {
                    idx,
                    used,
                    cipher,
                    proved,
                } => {
                    let Some(mut pd) = p.pending.remove(&t) else {
                        continue;
                    };
                    self.tokens.remove(&t);
                    let _ = self.poll.registry().deregister(&mut pd.stream);
                    let rest = pd.inbuf.split_off(used.min(pd.inbuf.len()));
                    self.install(now, idx, pd.stream, rest, cipher, proved);
                }
                PendingStep::Refuse(why) => {
                    if let Some(mut pd) = p.pending.remove(&t) {
                        let _ = self.poll.registry().deregister(&mut pd.stream);
                        match why {
                            Some(why) => p.refusals.note(now, pd.addr, why),
                            None => {
                                debug!(from = %pd.addr, "peer connection closed before its hello")
                            }
                        }
                    }
                    self.tokens.remove(&t);
                }
            }
        }
        if let Some(p) = &mut self.peers
            && p.refusals.count > 0
            && now.duration_since(p.refusals.logged) >= Duration::from_secs(1)
        {
            p.refusals.flush(now);
        }
    }

    /// Reads what accepted connection `t` sent (bounded) and takes the next step of its hello
    /// or handshake.
    fn pending_step(&mut self, now: Instant, t: Token) -> PendingStep {
        let ours = self.hello_repr();
        let Some(p) = &mut self.peers else {
            return PendingStep::Wait;
        };
        let Some(pd) = p.pending.get_mut(&t) else {
            return PendingStep::Wait;
        };
        let mut buf = [0u8; 512];
        let mut gone = false;
        while pd.inbuf.len() < PENDING_INPUT {
            let want = (PENDING_INPUT - pd.inbuf.len()).min(buf.len());
            match pd.stream.read(&mut buf[..want]) {
                Ok(0) => {
                    gone = true;
                    break;
                }
                Ok(n) => pd.inbuf.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    gone = true;
                    break;
                }
            }
        }
        let from = pd.addr;
        let late = now.duration_since(pd.since) > HANDSHAKE_DEADLINE;
        let Some(sec) = &p.security else {
            // Unauthenticated links: a hello frame says who it is.
            return match parse_hello(&pd.inbuf) {
                Ok(None) if gone => PendingStep::Refuse(None),
                Ok(None) if late => PendingStep::Refuse(Some("no hello in time".into())),
                Ok(None) => PendingStep::Wait,
                Ok(Some((h, used))) => match p.accepts(h, from) {
                    Ok(idx) => PendingStep::Install {
                        idx,
                        used,
                        cipher: None,
                        proved: None,
                    },
                    Err(why) => PendingStep::Refuse(Some(why)),
                },
                Err(e) => PendingStep::Refuse(Some(format!("not a hello: {e}"))),
            };
        };
        loop {
            let len = match peek_len(&pd.inbuf) {
                Ok(Some(len)) if len > LINK_HEADER_LEN + MAX_HANDSHAKE => {
                    return PendingStep::Refuse(Some(format!(
                        "a frame of {len} bytes where a handshake step was due"
                    )));
                }
                Ok(Some(len)) if pd.inbuf.len() >= len => len,
                Ok(_) if gone => {
                    return PendingStep::Refuse(
                        pd.handshake
                            .is_some()
                            .then(|| "closed mid-handshake".into()),
                    );
                }
                Ok(_) if late => {
                    return PendingStep::Refuse(Some("no handshake in time".into()));
                }
                Ok(_) => return PendingStep::Wait,
                Err(e) => return PendingStep::Refuse(Some(format!("not a handshake: {e}"))),
            };
            let body = match Frame::new_checked(&pd.inbuf[..len]).and_then(|f| FrameRepr::parse(&f))
            {
                Ok(FrameRepr::Control(c)) if c.kind == ControlKind::Handshake => {
                    &pd.inbuf[LINK_HEADER_LEN..len]
                }
                Ok(FrameRepr::Control(c)) if c.kind == ControlKind::Hello => {
                    return PendingStep::Refuse(Some(
                        "an unauthenticated hello (this host takes only authenticated links)"
                            .into(),
                    ));
                }
                Ok(_) => {
                    return PendingStep::Refuse(Some("a frame other than a handshake step".into()));
                }
                Err(e) => return PendingStep::Refuse(Some(format!("not a handshake: {e}"))),
            };
            let Some(ours) = ours else {
                return PendingStep::Refuse(Some("this host has no index yet".into()));
            };
            match pd.handshake.take() {
                None => {
                    // Step 1: the public-key work a stranger can ask for, rate-limited.
                    if !p.bucket.take(now) {
                        return if late {
                            PendingStep::Refuse(Some("handshakes over their rate".into()))
                        } else {
                            PendingStep::Wait
                        };
                    }
                    let mut out = Vec::new();
                    let answered = sec
                        .listen()
                        .map_err(|e| secure::Refused(format!("{e:#}")))
                        .and_then(|mut hs| hs.answer(body, ours, &mut out).map(|()| hs));
                    let hs = match answered {
                        Ok(hs) => hs,
                        Err(e) => return PendingStep::Refuse(Some(format!("handshake: {}", e.0))),
                    };
                    // A fresh socket takes a few hundred bytes at once; one that does not is
                    // not worth waiting for.
                    match std::io::Write::write(&mut pd.stream, &out) {
                        Ok(n) if n == out.len() => {}
                        _ => {
                            return PendingStep::Refuse(Some(
                                "could not answer its handshake".into(),
                            ));
                        }
                    }
                    pd.handshake = Some(hs);
                    pd.inbuf.drain(..len);
                }
                Some(hs) => {
                    let done = match hs.finish_listen(body, sec.encrypt()) {
                        Ok(d) => d,
                        Err(e) => return PendingStep::Refuse(Some(format!("handshake: {}", e.0))),
                    };
                    let idx = match p.accepts(done.hello, from) {
                        Ok(idx) => idx,
                        Err(why) => return PendingStep::Refuse(Some(why)),
                    };
                    let addr = p.links.get(idx).and_then(|l| l.as_ref()).map(|l| l.addr);
                    let expected = addr.and_then(|a| sec.key_of(a));
                    if expected != Some(done.key) {
                        return PendingStep::Refuse(Some(format!(
                            "key {} is not the one of host {idx} ({})",
                            done.key,
                            addr.map_or("-".into(), |a| a.to_string())
                        )));
                    }
                    return PendingStep::Install {
                        idx,
                        used: len,
                        cipher: done.cipher,
                        proved: Some(done.key),
                    };
                }
            }
        }
    }

    /// Makes an accepted connection the link to host `i` (replacing an older one), answers
    /// its hello (unless the handshake carried ours), and announces our vRNICs. `rest`: what
    /// it sent after its hello or handshake (records, if the link is encrypted).
    fn install(
        &mut self,
        now: Instant,
        i: usize,
        mut stream: TcpStream,
        rest: Vec<u8>,
        cipher: Option<Box<Cipher>>,
        proved: Option<PublicKey>,
    ) {
        // Our hello first: on an authenticated link, our word that we took its handshake.
        let mut out = Vec::new();
        self.hello(&mut out);
        self.announce_all(&mut out);
        let Some(p) = &mut self.peers else { return };
        let Some(Some(l)) = p.links.get_mut(i) else {
            return;
        };
        if let Some(mut old) = l.stream.take() {
            let _ = self.poll.registry().deregister(&mut old);
            l.drops += 1;
        }
        if self
            .poll
            .registry()
            .register(
                &mut stream,
                l.token,
                Interest::READABLE | Interest::WRITABLE,
            )
            .is_err()
        {
            return;
        }
        l.stream = Some(stream);
        l.state = State::Up;
        l.reset_input();
        l.out.clear();
        l.proved = proved;
        l.cipher = cipher;
        match l.cipher.as_mut() {
            Some(c) => {
                c.wire_in.extend(&rest);
                // A record that fails here fails again when the link reads: it closes then.
                let _ = c.open(&mut l.inbuf);
            }
            None => l.inbuf.extend(&rest),
        }
        l.out.extend(&out);
        l.last_rx = now;
        l.last_tx = now;
        l.progress = now;
        let host = l.host;
        info!(peer = %l.addr, security = l.security(), "peer link up");
        self.link_up(host);
    }

    /// Reads what link `i` has (bounded), and hands every whole frame on; the payloads of large
    /// segments the engine can take in place are read straight there (`inbound`).
    fn read_link(&mut self, now: Instant, i: usize) -> Result<bool, Close> {
        let mut moved = false;
        let mut read = 0usize;
        loop {
            moved |= self.take_frames(now, i)?;
            let Some(n) = self.read_once(now, i)? else {
                break;
            };
            read += n;
            if read >= READ_BUDGET {
                moved |= self.take_frames(now, i)?;
                break;
            }
        }
        Ok(moved)
    }

    /// One read from link `i`: into place (the rest of a payload, then the bytes after it)
    /// or into its byte queue. `None`: nothing to read now.
    fn read_once(&mut self, now: Instant, i: usize) -> Result<Option<usize>, Close> {
        // The lanes are wanted only to read a payload into place: the lock of the shard of its
        // destination QP is taken for that alone.
        let placing = self
            .peers
            .as_ref()
            .and_then(|p| p.links.get(i))
            .and_then(|l| l.as_ref().and_then(|l| l.placing.as_ref()))
            .map(|p| p.seg.dest_qpn);
        let cell = placing.map(|qpn| self.cell_of_qpn(qpn));
        let sh = cell.as_ref().map(|c| c.lock());
        let none = FxHashMap::default();
        let (Some(p), vnics) = (&mut self.peers, sh.as_ref().map_or(&none, |sh| &sh.lanes)) else {
            return Ok(None);
        };
        let Some(Some(l)) = p.links.get_mut(i) else {
            return Ok(None);
        };
        let Some(stream) = l.stream.as_mut() else {
            return Ok(None);
        };
        loop {
            let r = if let Some(c) = l.cipher.as_mut() {
                // Records in, opened into the link's byte queue.
                let room = c.wire_in.spare(MAX_FRAME);
                match stream.read(room) {
                    Ok(n) => {
                        c.wire_in.commit(n);
                        c.open(&mut l.inbuf).map_err(Close::Broken)?;
                        Ok(Some(n))
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
                    Err(e) => Err(e),
                }
            } else {
                match l.placing.as_mut() {
                    Some(pl) if !pl.payload_done() => pl.read(
                        stream.as_raw_fd(),
                        vnics,
                        &mut l.inbuf,
                        &mut p.discard,
                        &mut p.iov,
                    ),
                    _ => {
                        // A payload waiting only for its pad: the bytes after it are the next
                        // frame's, whose payload may be wanted in place (`HEADROOM`). Otherwise all
                        // there is (a backlog is cheapest taken in one call and copied).
                        let room = l.inbuf.spare(MAX_FRAME);
                        let want = if l.placing.is_some() {
                            HEADROOM
                        } else {
                            room.len()
                        };
                        match stream.read(&mut room[..want]) {
                            Ok(n) => {
                                l.inbuf.commit(n);
                                Ok(Some(n))
                            }
                            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(None),
                            Err(e) => Err(e),
                        }
                    }
                }
            };
            return match r {
                Ok(Some(0)) => Err(Close::Gone("closed by the peer".into())),
                Ok(Some(n)) => {
                    l.bytes_in += n as u64;
                    l.last_rx = now;
                    Ok(Some(n))
                }
                Ok(None) => Ok(None),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => Err(Close::Gone(e.to_string())),
            };
        }
    }

    /// Hands on what link `i` has in full: whole frames in order, and a segment whose payload
    /// is in place once its pad is in. A large segment at the head whose payload has not all
    /// come is set up to be read into place, if the engine can take it there. Returns whether
    /// any frame was taken.
    fn take_frames(&mut self, now: Instant, i: usize) -> Result<bool, Close> {
        let Some(Some(l)) = self.peers.as_mut().and_then(|p| p.links.get_mut(i)) else {
            return Ok(false);
        };
        let mut inbuf = std::mem::take(&mut l.inbuf);
        let mut placing = l.placing.take();
        let (host, mut state) = (l.host, l.state);
        let mut moved = false;
        let mut placed_bytes = 0u64;
        let result = loop {
            if let Some(p) = &placing {
                if !p.payload_done() || inbuf.data().len() < p.pad {
                    break Ok(());
                }
                if !pad_bytes_ok(&inbuf.data()[..p.pad]) {
                    break Err(Close::Broken("malformed frame: pad bytes".into()));
                }
                inbuf.consume(p.pad);
                let Some(p) = placing.take() else {
                    break Ok(());
                };
                {
                    let cell = self.cell_of_qpn(p.seg.dest_qpn);
                    let mut sh = cell.lock();
                    let sh = &mut *sh;
                    sh.engine.handle_placed_segment(
                        now,
                        host,
                        &p.addr,
                        &p.seg,
                        p.placement,
                        !p.broken,
                        &mut Mem::new(&sh.lanes),
                    );
                    cell.wake();
                }
                placed_bytes += p.placed;
                if let Some(peers) = &mut self.peers {
                    peers.runs = p.into_runs();
                }
                moved = true;
                continue;
            }
            let buf = inbuf.data();
            let len = match peek_len(buf) {
                Ok(Some(len)) => len,
                Ok(None) => break Ok(()),
                Err(e) => break Err(Close::Broken(format!("malformed frame: {e}"))),
            };
            if buf.len() >= len {
                let handshake = buf.get(3) == Some(&(ControlKind::Handshake as u8));
                match self.handle_frame(now, host, state, &buf[..len]) {
                    Ok(s) => state = s,
                    Err(e) => break Err(e),
                }
                inbuf.consume(len);
                moved = true;
                if handshake
                    && let Some(Some(l)) = self.peers.as_mut().and_then(|p| p.links.get_mut(i))
                    && let Some(c) = l.cipher.as_mut()
                {
                    // What follows the handshake on an encrypted link is records.
                    c.wire_in.extend(inbuf.data());
                    inbuf.clear();
                    if let Err(e) = c.open(&mut inbuf) {
                        break Err(Close::Broken(e));
                    }
                }
                continue;
            }
            // An encrypted link's payloads come through its records, not in place.
            if state != State::Up || len < PLACE_MIN || self.link_encrypted(i) {
                break Ok(());
            }
            match self.start_placing(host, buf, len) {
                Some((p, used)) => {
                    inbuf.consume(used);
                    placing = Some(p);
                }
                None => break Ok(()),
            }
        };
        if let Some(Some(l)) = self.peers.as_mut().and_then(|p| p.links.get_mut(i)) {
            l.inbuf = inbuf;
            l.placing = placing;
            l.state = state;
            l.placed_in += placed_bytes;
        }
        result.map(|()| moved)
    }

    /// Sets up the payload of the segment at the head of `buf` (a frame of `len` bytes, not all
    /// of it there) to be read into place, with the bytes of it already in `buf` copied there.
    /// Returns the placement and how many bytes of `buf` it took; `None` if the engine takes
    /// this segment only with its payload in a buffer (or its headers are not all in yet).
    fn start_placing(&mut self, host: HostId, buf: &[u8], len: usize) -> Option<(Placing, usize)> {
        // A malformed head is the whole-frame decoder's to refuse once the frame is in.
        let head = FrameRepr::parse_head(buf).ok()?;
        let FrameRepr::Segment {
            addr,
            grh: None,
            segment,
        } = head
        else {
            return None;
        };
        if segment.payload_len < PLACE_MIN {
            return None;
        }
        let mut runs = self
            .peers
            .as_mut()
            .map(|p| std::mem::take(&mut p.runs))
            .unwrap_or_default();
        runs.clear();
        let cell = self.cell_of_qpn(segment.dest_qpn);
        let mut sh = cell.lock();
        let Some(placement) = sh.engine.placement(host, &addr, &segment, &mut runs) else {
            if let Some(p) = &mut self.peers {
                p.runs = runs;
            }
            return None;
        };
        let range = head.payload_range();
        let have = &buf[range.start..buf.len().min(range.end)];
        let pad = len - range.end;
        let p = Placing::start(addr, segment, placement, runs, pad, have, &sh.lanes);
        Some((p, range.start + have.len()))
    }

    /// One whole frame from `host`'s link in state `state`; returns the link's next state.
    fn handle_frame(
        &mut self,
        now: Instant,
        host: HostId,
        state: State,
        bytes: &[u8],
    ) -> Result<State, Close> {
        let frame = Frame::new_checked(bytes)
            .map_err(|e| Close::Broken(format!("malformed frame: {e}")))?;
        let repr =
            FrameRepr::parse(&frame).map_err(|e| Close::Broken(format!("malformed frame: {e}")))?;
        let body = &bytes[repr.payload_range()];
        match (state, repr) {
            (State::Hello, FrameRepr::Control(c)) if c.kind == ControlKind::Handshake => {
                self.finish_dial(host, body)?;
                Ok(State::Hello)
            }
            (State::Hello, FrameRepr::Control(c)) if c.kind == ControlKind::Hello => {
                // With keys, the listener's hello frame is its word that it took our last
                // handshake step: only after one.
                let p = self.peers.as_ref();
                let secured = p.is_some_and(|p| p.security.is_some());
                let proved = p
                    .and_then(|p| p.links.get(host.0 as usize))
                    .is_some_and(|l| l.as_ref().is_some_and(|l| l.proved.is_some()));
                if secured && !proved {
                    return Err(Close::Refused(
                        "an unauthenticated hello (this host takes only authenticated links)"
                            .into(),
                    ));
                }
                let h = parse_hello(bytes)
                    .ok()
                    .flatten()
                    .map(|(h, _)| h)
                    .ok_or_else(|| Close::Broken("a malformed hello".into()))?;
                let fits = self
                    .peers
                    .as_ref()
                    .is_some_and(|p| usize::from(h.hosts) == p.hello_count());
                if usize::from(h.index) != host.0 as usize || !fits {
                    return Err(Close::Broken("a hello from the wrong host".into()));
                }
                let mut out = Vec::new();
                self.announce_all(&mut out);
                if let Some(Some(l)) = self
                    .peers
                    .as_mut()
                    .and_then(|p| p.links.get_mut(host.0 as usize))
                {
                    l.out.extend(&out);
                    info!(peer = %l.addr, security = l.security(), "peer link up");
                }
                self.link_up(host);
                Ok(State::Up)
            }
            (State::Up, repr @ FrameRepr::Segment { segment, .. }) => {
                // Taken by the engine of the shard its destination QP number names, here and
                // now, as that shard's own pass would (its thread, if it has one, woken to
                // send what it answers and publish what it completed).
                let cell = self.cell_of_qpn(segment.dest_qpn);
                cell.lock().take_segment(now, host, repr, body);
                cell.wake();
                Ok(State::Up)
            }
            (State::Up, FrameRepr::Control(c))
                if c.kind == ControlKind::Announce
                    && self.peers.as_ref().is_some_and(Peers::is_cluster) =>
            {
                Err(Close::Broken(
                    "an announcement from a cluster host (etcd holds the directory)".into(),
                ))
            }
            (State::Up, FrameRepr::Control(c)) if c.kind == ControlKind::Announce => {
                self.take_announcement(host, body)?;
                Ok(State::Up)
            }
            (State::Up, FrameRepr::Control(c)) if c.kind == ControlKind::Cm => {
                let m = CmMessage::parse(body)
                    .map_err(|e| Close::Broken(format!("a malformed CM message: {e}")))?;
                self.cm.handle_remote(host, m, now);
                Ok(State::Up)
            }
            (State::Up, FrameRepr::Control(c)) if c.kind == ControlKind::Keepalive => {
                let k = KeepaliveRepr::parse(body)
                    .map_err(|e| Close::Broken(format!("a malformed keepalive: {e}")))?;
                if let Some(p) = &mut self.peers
                    && let Some(Some(l)) = p.links.get_mut(host.0 as usize)
                {
                    match k {
                        // A pong carries the ping's timestamp back, while the link has room.
                        KeepaliveRepr::Ping(t) if l.out_held() < PONG_ROOM => {
                            let mut f = Vec::new();
                            control(
                                &mut f,
                                ControlKind::Keepalive,
                                &KeepaliveRepr::Pong(t).emit(),
                            );
                            l.out.extend(&f);
                        }
                        KeepaliveRepr::Ping(_) => {}
                        KeepaliveRepr::Pong(t) => {
                            let sent = Duration::from_nanos(t);
                            let at = now.duration_since(p.epoch);
                            l.rtt = at.checked_sub(sent);
                        }
                    }
                }
                Ok(state)
            }
            _ => Err(Close::Broken("a frame out of place".into())),
        }
    }

    /// The listener's handshake step on a link we dialed: its key must be the one configured
    /// for the address we dialed, its hello that host's; then our last step goes out (first,
    /// and in clear, on an encrypted link). The link is up when the listener's hello frame
    /// says it took that step.
    fn finish_dial(&mut self, host: HostId, body: &[u8]) -> Result<(), Close> {
        let ours = self.hello_repr();
        let Some(p) = &mut self.peers else {
            return Ok(());
        };
        let hello_count = p.hello_count();
        let Some(sec) = &p.security else {
            return Err(Close::Refused(
                "a handshake, but this host has no key (links here are not authenticated)".into(),
            ));
        };
        let Some(Some(l)) = p.links.get_mut(host.0 as usize) else {
            return Ok(());
        };
        let (Some(hs), Some(ours)) = (l.handshake.take(), ours) else {
            return Err(Close::Broken("a handshake step out of place".into()));
        };
        let expected = sec
            .key_of(l.addr)
            .ok_or_else(|| Close::Refused(format!("no key configured for {}", l.addr)))?;
        let mut last = Vec::new();
        let done = hs
            .finish_dial(body, expected, ours, &mut last)
            .map_err(|e| Close::Refused(format!("handshake: {}", e.0)))?;
        if usize::from(done.hello.index) != host.0 as usize
            || usize::from(done.hello.hosts) != hello_count
        {
            return Err(Close::Refused(format!(
                "the listener's hello (host {} of {}) is not this link's host",
                done.hello.index, done.hello.hosts
            )));
        }
        l.proved = Some(done.key);
        l.cipher = done.cipher;
        match l.cipher.as_mut() {
            Some(c) => c.wire_out.extend(&last),
            None => l.out.extend(&last),
        }
        Ok(())
    }

    /// Whether link `i` is encrypted.
    fn link_encrypted(&self, i: usize) -> bool {
        self.peers
            .as_ref()
            .and_then(|p| p.links.get(i))
            .is_some_and(|l| l.as_ref().is_some_and(|l| l.cipher.is_some()))
    }

    /// Sends a keepalive on a quiet link; closes one silent past [`DEAD_AFTER`], and one whose
    /// queue has not moved for [`STALL_AFTER`].
    fn keepalive(&mut self, now: Instant, i: usize) {
        let Some(p) = &mut self.peers else { return };
        let Some(Some(l)) = p.links.get_mut(i) else {
            return;
        };
        if l.stream.is_none() {
            return;
        }
        if now.duration_since(l.last_rx) > DEAD_AFTER {
            self.close_link(now, i, Close::Gone("silent".into()));
            return;
        }
        if l.out_empty() {
            l.progress = now;
        } else if now.duration_since(l.progress) > STALL_AFTER {
            let why = format!(
                "the peer does not read ({} bytes queued, none written for {STALL_AFTER:?})",
                l.out_held()
            );
            self.close_link(now, i, Close::Gone(why));
            return;
        }
        if l.state == State::Up && now.duration_since(l.last_ping) > KEEPALIVE {
            let t = now.duration_since(p.epoch).as_nanos() as u64;
            let mut f = Vec::new();
            control(
                &mut f,
                ControlKind::Keepalive,
                &KeepaliveRepr::Ping(t).emit(),
            );
            l.out.extend(&f);
            l.last_ping = now;
        }
    }

    /// Closes link `i`: dialed again later (if we dial it). A broken peer also fails the
    /// QPs routed over it.
    fn close_link(&mut self, now: Instant, i: usize, why: Close) {
        let Some(p) = &mut self.peers else { return };
        let Some(Some(l)) = p.links.get_mut(i) else {
            return;
        };
        if let Some(mut s) = l.stream.take() {
            let _ = self.poll.registry().deregister(&mut s);
        }
        // A peer that failed its handshake is not tried again at once.
        let wait = if matches!(why, Close::Refused(_)) {
            REFUSED_REDIAL
        } else {
            REDIAL
        };
        l.state = State::Down { redial: now + wait };
        l.reset_input();
        l.out.clear();
        l.drops += 1;
        let host = l.host;
        match why {
            Close::Gone(why) => info!(peer = %l.addr, "peer link down: {why}"),
            Close::Refused(why) => warn!(peer = %l.addr, "peer link refused: {why}"),
            Close::Broken(why) => {
                warn!(peer = %l.addr, "peer link closed: {why}; its QPs fail");
                for cell in &self.shards {
                    cell.lock().engine.fail_host(now, host);
                    cell.wake();
                }
                self.cm.fail_host(host);
                if !p.is_cluster() {
                    self.directory_forget(host);
                }
            }
        }
    }

    /// Frames the engine produced, onto their links (dropped when a link is down: the
    /// requester sends them again when it is back), then writes what each link can take.
    /// Returns whether anything was sent.
    pub(super) fn flush_peers(&mut self, now: Instant) -> bool {
        let Some(p) = &mut self.peers else {
            self.cm.take_outgoing();
            return false;
        };
        for (host, m) in self.cm.take_outgoing() {
            let Some(Some(l)) = p.links.get_mut(host.0 as usize) else {
                continue;
            };
            let mut body = Vec::new();
            m.emit(&mut body);
            let mut f = Vec::new();
            control(&mut f, ControlKind::Cm, &body);
            if l.state == State::Up {
                l.out.extend(&f);
            } else {
                if l.cm_backlog.len() >= CM_BACKLOG {
                    l.cm_backlog.pop_front();
                }
                l.cm_backlog.push_back(f);
            }
        }
        // The frames the shards' passes queued for the channel (an engine thread's, a control
        // call's), as they queued them, then what each link can take (the loop's own passes
        // of the one shard wrote theirs onto the links already).
        for (host, mut frames) in self.threads.from_shards.try_iter() {
            if let Some(Some(l)) = p.links.get_mut(host.0 as usize)
                && l.state == State::Up
            {
                l.out.append(&mut frames);
            }
        }
        let sent = p.write_links(now);
        for (i, why) in std::mem::take(&mut p.failed) {
            self.close_link(now, i, Close::Gone(why));
        }
        sent
    }

    /// Whether a link has bytes it could not write yet (the loop keeps spinning for them).
    pub(super) fn peers_backlogged(&self) -> bool {
        self.peers
            .as_ref()
            .is_some_and(|p| p.links.iter().flatten().any(|l| !l.out_empty()))
    }
}

/// The peer links as where an engine pass puts its frames: each onto its link (dropped when
/// the link is down: the requester sends it again when the link is back), then what each link
/// can take written. A link that fails is remembered in [`Peers::failed`] and closed by the
/// loop's next [`Server::flush_peers`].
pub(super) struct LinkFrames<'a> {
    peers: &'a mut Peers,
    now: Instant,
}

impl Peers {
    /// The links, as the sink of an engine pass's frames.
    pub(super) fn frames(&mut self, now: Instant) -> LinkFrames<'_> {
        LinkFrames { peers: self, now }
    }
}

impl Frames for LinkFrames<'_> {
    fn send(&mut self, engine: &mut vrnic_proto::Engine, mem: &mut Mem<'_>) -> bool {
        let p = &mut *self.peers;
        while let Some(t) = engine.poll_transmit() {
            if let Some(Some(l)) = p.links.get_mut(t.host.0 as usize)
                && l.state == State::Up
                && !enqueue(&t, mem, &mut l.out)
            {
                warn!("an inconsistent frame was not sent");
            }
        }
        p.write_links(self.now)
    }
}

impl Peers {
    /// Writes what each link can take of its queue. A link that fails is remembered in
    /// [`Peers::failed`]. Returns whether anything was written.
    fn write_links(&mut self, now: Instant) -> bool {
        let p = self;
        let mut sent = false;
        for (i, l) in p.links.iter_mut().enumerate() {
            let Some(l) = l else { continue };
            let Some(s) = l.stream.as_mut() else {
                continue;
            };
            if p.failed.iter().any(|&(f, _)| f == i) {
                continue;
            }
            if let Some(c) = l.cipher.as_mut() {
                // Sealed into records, then written.
                loop {
                    if c.wire_out.data().is_empty() {
                        if l.out.is_empty() {
                            break;
                        }
                        if let Err(e) = c.seal(&mut l.out) {
                            p.failed.push((i, format!("seal a record: {e}")));
                            break;
                        }
                    }
                    match std::io::Write::write(s, c.wire_out.data()) {
                        Ok(0) => break,
                        Ok(n) => {
                            c.wire_out.consume(n);
                            l.bytes_out += n as u64;
                            l.last_tx = now;
                            l.progress = now;
                            sent = true;
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) => {
                            p.failed.push((i, e.to_string()));
                            break;
                        }
                    }
                }
                continue;
            }
            let fd = s.as_raw_fd();
            while !l.out.is_empty() {
                match l.out.write_to(fd, &mut p.iov) {
                    Ok(0) => break,
                    Ok(n) => {
                        l.bytes_out += n as u64;
                        l.last_tx = now;
                        l.progress = now;
                        sent = true;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => {
                        p.failed.push((i, e.to_string()));
                        break;
                    }
                }
            }
        }
        sent
    }
}

/// Queues `t`'s frame on `out`: a large payload in registered memory as ranges of its region
/// (the kernel reads them when the link writes), anything else written in place. The loop
/// does it for its own engine's frames; an engine thread for its shard's, into a queue the
/// loop then appends to the link's (`threads.rs`).
pub(super) fn enqueue(t: &vrnic_proto::Transmit, mem: &mut Mem, out: &mut OutQueue) -> bool {
    let len = t.frame_len();
    let range = t.payload_range();
    // Only a reliable segment's payload may be read at `writev` time: its work request
    // completes when the peer acknowledges it, after the bytes left. A UC (or UD) send
    // completes when its frame is made, and the app may then reuse its buffer at once.
    let reliable = matches!(
        t.segment.opcode.transport(),
        vrnic_wire::frame::Transport::Rc | vrnic_wire::frame::Transport::Xrc
    );
    if let Some(runs) = t.runs()
        && reliable
        && range.len() as u64 >= ZERO_COPY_MIN
    {
        if !t.encode_headers(out.spare(len)) {
            return false;
        }
        out.commit(range.start);
        let mut placed = 0usize;
        for &(loc, n) in runs {
            let n = usize::try_from(n)
                .unwrap_or(usize::MAX)
                .min(range.len() - placed);
            match mem.source(loc.vnic) {
                Some(r) => out.push_region(r.clone(), loc.off, n),
                None => out.push_zeros(n),
            }
            placed += n;
        }
        out.push_zeros(range.len() - placed);
        // The pad (zeros, as the headers' emit wrote them).
        out.extend(&[0u8; 3][..len - range.end]);
        return true;
    }
    if !t.encode_into(mem, out.spare(len)) {
        return false;
    }
    out.commit(len);
    true
}
