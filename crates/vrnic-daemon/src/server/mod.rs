//! The daemon's state and its one loop: sockets (admin, per-vRNIC, per-context), the control
//! mailboxes, and the engine pass that moves work requests from the rings into the engine and
//! completions back out.
//!
//! The loop thread owns the sockets, contexts and the connection manager; the data path's state
//! is in shards (`shard/`: an engine and its vRNICs behind a mutex each), each driven the
//! same way (`shard/pacer.rs`): by the loop itself, between its looks at the sockets, with one
//! engine thread (`--engine-threads 1`, the default: the mutex is then never contended), or
//! by engine threads (`threads.rs`). A control request is served between two passes of its
//! shard, holding that shard's lock. While the loop drives the shard it spins with it and
//! sleeps in `epoll` when its pacer says the shard sleeps (its regions' engine-sleeping words
//! set, the rings looked at once more: brief §9, lost wake-ups); with engine threads it waits
//! in `epoll` for sockets, the shards' outboxes and its timers.
//!
//! This file holds what the daemon owns (vRNICs, contexts, ring slots, admin connections) and
//! the loop; each job on that state has a room of its own: `registry` (vRNICs come and go,
//! the persistent ones recorded in their file and made again at start),
//! `admin_socket` (the CLI), `attach` (contexts come and go), `control` (requests from
//! a mailbox), `pages` and `pagetable` (registered memory and rings), `resize` (CQ and SRQ
//! rings moved to a new depth), `events` (async events and wake-ups back to contexts),
//! `shard` (a shard of the data path: its engine pass over the rings, what it publishes, its
//! pacing, the siblings it reaches), `engines` and `threads` (who serves a vRNIC, who drives
//! each shard), `peers`, `linkbuf`, `outqueue` and `inbound` (links to other
//! hosts' daemons: frames out and in, payloads from and into registered memory), `directory`
//! (who is where), `cluster` (cluster mode: the directory and the host set from etcd, whose
//! client runs on a thread of its own and wakes this loop through a mio `Waker`).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::cm::Cm;
use anyhow::{Context as _, Result, bail};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use rustc_hash::FxHashMap;
use tracing::{debug, info, warn};
use vrnic_api::{AdminReply, AdminRequest, PageRun, Reply, Request, VnicSummary};
use vrnic_proto::{
    AhId, CqId, CtxId, Engine, GroupId, Loc, Memory, MrId, PdId, QpId, SrqId, VnicId,
};
use vrnic_shm::layout::{self, hdr};
use vrnic_shm::{Mailbox, MailboxState, Region, Ring};
use vrnic_wire::{CQ_SLOT, CQE_SEQ, Cqe, RQ_HEADER, RQ_SLOT, RecvWqe, SQ_HEADER, SQ_SLOT, SendWqe};

use crate::config::{self, ADMIN_SOCKET, REGION_FILE, VNIC_SOCKET};
use crate::heap::Heap;
use crate::sys;

mod admin_socket;
mod announce;
mod attach;
mod cluster;
mod control;
mod directory;
mod engines;
mod events;
mod inbound;
mod linkbuf;
mod outqueue;
mod pages;
mod pagetable;
mod peers;
mod registry;
mod resize;
mod shard;
mod threads;

pub use cluster::{ClusterOptions, DEFAULT_TTL_S};
pub use peers::PeerOptions;
pub use threads::default_engine_threads;

use control::err;
use pages::{alloc_ring, free_pages, free_ring};
use registry::cleanup_stale;
pub(crate) use shard::Grow;
use shard::{Bell, CqCell, CqSlot, QpSlot, ShardCell, Slices, SrqSlot, Wait};

const SIGNAL: Token = Token(0);
const ADMIN: Token = Token(1);
/// How long after the last control call the loop looks at the sockets every pass instead of
/// every 32nd (a driver's next call comes within a few microseconds of its last answer).
pub(super) const CONTROL_HOT: Duration = Duration::from_millis(1);
/// Most engine threads.
const MAX_ENGINE_THREADS: usize = 64;
/// Longest sleep, so timers, guest claims and the daemon's heartbeat are looked at regularly.
const MAX_SLEEP: Duration = Duration::from_millis(200);
/// Longest sleep while a region-only context (a VM guest) is attached: it cannot ring a
/// doorbell, so the engine looks at its rings at least this often.
const GUEST_SLEEP: Duration = Duration::from_millis(1);
/// How often the loop looks for guests claiming or leaving mailboxes and checks their
/// heartbeats (and advances its own).
const GUEST_SCAN: Duration = Duration::from_millis(20);

/// Options of `vrnic serve`.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The state dir.
    pub state_dir: PathBuf,
    /// Size of each region file (sparse): also the most memory one vRNIC can register, since
    /// registered buffers and rings live in it.
    pub region_size: u64,
    /// Object limits per vRNIC.
    pub limits: Limits,
    /// Most vRNICs at once.
    pub max_vrnics: u32,
    /// Engine threads (`None`: [`default_engine_threads`]); see `threads`.
    pub engine_threads: Option<usize>,
    /// Spread each vRNIC's QPs over the engine threads (`vrnic serve --spread-qps`), so that
    /// one process's QPs use several cores (its memory windows one table that every slice
    /// shares). See `engines`.
    pub spread_qps: bool,
    /// Peer links to other hosts' daemons.
    pub peer: PeerOptions,
    /// Cluster mode: etcd instead of a static peer list (needs `peer.listen`, no `peer.peers`).
    pub cluster: Option<ClusterOptions>,
    /// Where to serve Prometheus metrics (`vrnic serve --metrics`), if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// The file of persistent vRNICs (`vrnic serve --persist-file`; `None`: the state dir's
    /// default, [`crate::persist::default_file`]).
    pub persist_file: Option<PathBuf>,
    /// Record no vRNIC (`vrnic serve --no-persist`): those `vrnic create` makes last until
    /// `vrnic rm` or the daemon's end.
    pub no_persist: bool,
    /// The Unix group whose members may use root's daemon as tenants (`vrnic serve
    /// --access-group`; `None`: root only). Its admin socket is then the group's (mode 660),
    /// and each vRNIC a member's `vrnic run` makes belongs to that member alone. A group that
    /// does not exist admits nobody; a daemon not run as root admits only its own user.
    pub access_group: Option<String>,
}

/// How many objects one vRNIC may hold (all its contexts together). Creating one more fails
/// with `ENOMEM`, as on a device at its limits; `ibv_query_device` reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Queue pairs.
    pub max_qp: u32,
    /// Completion queues.
    pub max_cq: u32,
    /// Memory regions.
    pub max_mr: u32,
    /// Protection domains.
    pub max_pd: u32,
    /// Shared receive queues.
    pub max_srq: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_qp: 4096,
            max_cq: 4096,
            max_mr: 65536,
            max_pd: 4096,
            max_srq: 4096,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Tok {
    VnicListener(VnicId),
    Client(CtxId),
    Admin(u64),
    PeerListener,
    Peer,
    PeerPending,
    /// The etcd session reported something.
    Cluster,
    /// An engine thread's outbox has something for contexts.
    Shards,
    /// The file of persistent vRNICs was written.
    Persist,
}

struct Vnic {
    name: String,
    dir: PathBuf,
    /// Shared with frames queued on peer links that send straight from it.
    region: std::sync::Arc<Region>,
    lid: u16,
    gid: [u8; 16],
    guid: u64,
    /// Its tenants' group and its virtual IP in it.
    group: GroupId,
    vip: std::net::Ipv4Addr,
    heap: Heap,
    /// Its directory is a tmpfs of its own, sized to its region (its memory quota).
    quota_mount: bool,
    /// The shard whose engine serves it.
    shard: usize,
    persistent: bool,
    holders: usize,
    contexts: HashSet<CtxId>,
    /// The region's claim count when the daemon last looked for guests' claims.
    claims_seen: u32,
    listener: UnixListener,
    token: Token,
    /// Its QoS limits, shared with the engines that serve it (`vrnic policy` changes them in
    /// place).
    limit: std::sync::Arc<vrnic_proto::Limit>,
    /// The tenant it was made for (its region and socket are that user's, mode 600); `None`:
    /// the operator's.
    owner: Option<u32>,
}

struct Ctx {
    vnic: VnicId,
    /// How the context reaches the daemon and how the daemon learns that it died.
    link: Link,
    mailbox: Mailbox,
    ev_prod: u32,
    /// Which region pages back its registered app pages, and those it deregistered but still
    /// maps.
    table: pagetable::PageTable,
    /// MR -> the app pages it holds.
    mrs: HashMap<MrId, (u64, u64)>,
    cqs: HashSet<CqId>,
    qps: HashSet<QpId>,
    srqs: HashSet<SrqId>,
    pds: u32,
    wake: bool,
}

/// A context's link: a host process's socket (doorbells, wake-ups, death by close), or, for a
/// VM guest, nothing but its mailbox: polled, with a heartbeat instead of a socket to close.
enum Link {
    Socket { stream: UnixStream, token: Token },
    Region { beat: u32, beat_at: Instant },
}

struct AdminConn {
    stream: UnixStream,
    token: Token,
    /// Request bytes not yet parsed.
    buf: Vec<u8>,
    /// Reply bytes the client has not taken yet: never waited for (a client that does not
    /// read stalls only itself, and is dropped past `ADMIN_OUT_MAX`).
    out: Vec<u8>,
    /// Whether `out` waits for the socket to become writable.
    writable: bool,
    /// The client closed its side: serve what it sent, then drop it.
    eof: bool,
    held: Option<VnicId>,
    /// Who connected (`pid N uid N`), for the log of what they asked.
    who: String,
    /// A tenant's uid: a user other than root and the daemon's own (a member of the access
    /// group), who may hold vRNICs of its own and see only those; `None`: the operator.
    tenant: Option<u32>,
    /// A request whose reply waits for etcd: nothing more is read until it is answered.
    waiting: bool,
}

/// The daemon's state, owned by its one thread.
pub struct Server {
    opts: ServeOptions,
    poll: Poll,
    /// The data path's shards (one engine each); a vRNIC is served by one of them.
    shards: Vec<Arc<ShardCell>>,
    /// vRNICs' QPs spread over the shards (`--spread-qps`, with more than one shard): every
    /// vRNIC has a slice in every shard, its home shard the first.
    spread: bool,
    /// The engine threads, when there is more than one shard, and the channel their frames
    /// for peer hosts come through.
    threads: threads::Threads,
    /// The one shard's pacer, when the loop drives it (no engine threads).
    pacer: Option<shard::Pacer>,
    vnics: BTreeMap<VnicId, Vnic>,
    ctxs: HashMap<CtxId, Ctx>,
    /// Contexts with `wake` set, to be written to by `flush_wakes`.
    wakes: Vec<CtxId>,
    cm: Cm,
    tokens: HashMap<Token, Tok>,
    admin: UnixListener,
    admins: HashMap<u64, AdminConn>,
    next_token: usize,
    next_vnic: u32,
    next_ctx: u32,
    next_admin: u64,
    _signals: sys::SignalFd,
    _lock: std::fs::File,
    mounted: bool,
    /// Region-only contexts (served by polling their mailboxes).
    guests: Vec<CtxId>,
    last_scan: Instant,
    /// What each shard's passes did lately (engine threads only).
    activity: engines::Activity,
    /// The `SIGBUS` guard's epoch when the loop last looked for poisoned regions.
    fault_epoch: u64,
    /// Until when the sockets are looked at every pass ([`CONTROL_HOT`]).
    control_hot_until: Instant,
    /// Links to the other hosts' daemons, if configured.
    peers: Option<peers::Peers>,
    /// Who is where: this host's identities, other hosts' announcements.
    directory: directory::Directory,
    /// Cluster mode's side of the etcd session.
    cluster: Option<cluster::Cluster>,
    /// The file of persistent vRNICs: its records and their writer (`None`: `--no-persist`).
    kept: Option<registry::Kept>,
    /// The daemon's effective uid: its admin clients of that uid (or root) are the operator.
    euid: u32,
}

/// Runs the daemon until SIGINT/SIGTERM.
pub fn serve(opts: ServeOptions) -> Result<()> {
    let mut server = Server::start(opts)?;
    // Before the loop serves the admin socket: a client that connects meanwhile waits, then
    // sees them.
    server.restore_recorded();
    let r = server.run();
    server.shutdown();
    r
}

/// Unmounts the state dir's tmpfs when a start that mounted it fails (dropped on the error's
/// way out); a start that succeeds clears it, and the daemon's shutdown unmounts instead.
struct UnmountOnDrop(Option<PathBuf>);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_file(dir.join(ADMIN_SOCKET));
            sys::unmount(&dir);
            info!(dir = %dir.display(), "unmounted the state dir's tmpfs (the start failed)");
        }
    }
}

/// Listens on a Unix socket at `path` that appears there only once it listens and `prepare`
/// (its owner and mode) has run: bound and prepared under a hidden name beside it, then renamed
/// into place. Whoever sees the file can connect: a socket bound under its own name exists for
/// a moment before `listen`, and a client that connects then is refused (`ECONNREFUSED`), which
/// a loaded machine stretches to milliseconds. An old file at `path` is replaced.
pub(super) fn listen_in_place(
    path: &std::path::Path,
    prepare: impl FnOnce(&std::path::Path) -> Result<()>,
) -> Result<UnixListener> {
    let name = path.file_name().context("a socket path names a file")?;
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(".new");
    let at = path.with_file_name(hidden);
    let _ = std::fs::remove_file(&at);
    let listener = UnixListener::bind(&at).with_context(|| format!("bind {}", at.display()))?;
    let placed = prepare(&at).and_then(|()| {
        std::fs::rename(&at, path)
            .with_context(|| format!("move {} to {}", at.display(), path.display()))
    });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&at);
        return Err(e);
    }
    Ok(listener)
}

/// Opens root's admin socket to the members of `group` (owner root, the group's, mode 660),
/// or leaves it to root alone (mode 600) when there is no such group. A daemon not run as root
/// leaves it to its own user (its state dir is closed to others anyway).
fn open_admin_socket(path: &std::path::Path, group: Option<&str>) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let gid = match group {
        Some(g) if config::current_euid() == 0 => match config::group_id(g) {
            Some(gid) => Some((g, gid)),
            None => {
                info!(
                    group = g,
                    "no such group: the daemon admits root only (groupadd {g} and restart it to \
                     admit its members)"
                );
                None
            }
        },
        _ => None,
    };
    if let Some((g, gid)) = gid {
        std::os::unix::fs::chown(path, Some(0), Some(gid))
            .with_context(|| format!("give {} to group {g}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
            .with_context(|| format!("open {} to group {g}", path.display()))?;
        info!(
            group = g,
            gid, "members of the group may use this daemon as tenants"
        );
    } else {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
            .with_context(|| format!("close {} to others", path.display()))?;
    }
    Ok(())
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
}

impl Server {
    fn start(mut opts: ServeOptions) -> Result<Server> {
        // Each region is mapped only as far as its vRNIC uses it (`pages::cover`): the address
        // space bounds what the vRNICs register together, and a registration past it fails
        // with ENOMEM. The guard's table bounds how many regions are mapped at once.
        if opts.max_vrnics as usize > vrnic_shm::fault::MAX_GUARDED {
            bail!(
                "--max-vrnics {} is more than the {} regions the daemon can map at once",
                opts.max_vrnics,
                vrnic_shm::fault::MAX_GUARDED
            );
        }
        opts.state_dir = config::prepare_state_dir(&opts.state_dir)?;
        let dir = &opts.state_dir.clone();
        // Read before anything is mounted or locked: a file that cannot be used stops the
        // start with nothing to undo.
        let persist_file = (!opts.no_persist).then(|| {
            opts.persist_file
                .clone()
                .unwrap_or_else(|| crate::persist::default_file(dir))
        });
        let records = match &persist_file {
            Some(f) => crate::persist::load(f)?,
            None => Vec::new(),
        };
        // Before anything is mounted or locked: an address in use stops the start with nothing
        // to undo.
        if let Some(addr) = opts.metrics {
            crate::metrics::start(addr, dir.clone())?;
        }
        // What the daemon makes from here on is its own until it opens it on purpose (the
        // admin socket to the access group, a vRNIC's files to its tenant).
        sys::set_umask(0o077);
        // Mount first, then lock inside the mount: a lock taken under the mount point would be
        // hidden by it, and a second daemon would not see it.
        let mounted = sys::ensure_tmpfs(dir);
        let lock = match sys::lock_exclusive(&dir.join(config::LOCK_FILE)) {
            Ok(l) => l,
            Err(e) => {
                // The mount (ours or adopted) belongs to the daemon holding the lock: leave it.
                let _ = mounted;
                return Err(e).with_context(|| {
                    format!(
                        "another vrnic daemon already serves {} (its lock is held)",
                        dir.display()
                    )
                });
            }
        };
        // From here on the state dir is ours: a start that fails unmounts what it mounted.
        let mut unmount_on_failure = UnmountOnDrop(mounted.then(|| dir.clone()));
        // Mounts that nobody outside this mount namespace sees (`ip netns exec`, a container,
        // a private-mounts unit): it still serves, but say so, once, with the ways out.
        if (mounted || config::current_euid() == 0)
            && let Some(why) = crate::mntns::unseen_mounts(dir)
        {
            warn!("{why}");
        }
        let stale = cleanup_stale(dir);
        if stale > 0 {
            info!("removed {stale} vRNICs left by a daemon that did not shut down cleanly");
        }
        let poll = Poll::new()?;
        let nofile = sys::raise_nofile_limit();
        debug!(nofile, "open-file limit");
        let signals = sys::SignalFd::new().context("block SIGINT/SIGTERM")?;
        // A tenant that shrinks its region must not kill us with SIGBUS.
        vrnic_shm::fault::install().context("install the SIGBUS guard")?;
        poll.registry()
            .register(&mut SourceFd(&signals.fd()), SIGNAL, Interest::READABLE)?;
        let mut tokens = HashMap::new();
        let mut next_token = 2;
        let mut token = |t| {
            let tok = Token(next_token);
            next_token += 1;
            tokens.insert(tok, t);
            tok
        };
        let (peers, cluster) = match &opts.cluster {
            None => (peers::Peers::new(&opts.peer, &poll, &mut token)?, None),
            Some(c) => {
                if !opts.peer.peers.is_empty() {
                    bail!("--etcd and --peer exclude each other: a cluster's hosts come from etcd");
                }
                let listen = opts
                    .peer
                    .listen
                    .context("--etcd needs --listen (this host's address for peer links)")?;
                let p = peers::Peers::cluster(&opts.peer, listen, &poll, &mut token)?;
                let waker = mio::Waker::new(poll.registry(), token(Tok::Cluster))?;
                (
                    Some(p),
                    Some(cluster::Cluster::start(c, listen, waker, seed())?),
                )
            }
        };
        let directory = match &peers {
            // A cluster's LIDs are claimed in etcd, not taken from a share.
            Some(p) if p.is_cluster() => directory::Directory::new(0, 0..0),
            Some(p) => directory::Directory::new(p.index(), p.lid_range()),
            None => directory::Directory::new(0, 1..0xc000),
        };
        let engine_threads = match opts.engine_threads {
            Some(0) => bail!("--engine-threads must be at least 1"),
            Some(n) => n.min(MAX_ENGINE_THREADS),
            None => default_engine_threads().min(MAX_ENGINE_THREADS),
        };
        let spread = opts.spread_qps && engine_threads > 1;
        let shards: Vec<Arc<ShardCell>> = (0..engine_threads)
            .map(|i| {
                let seed = seed() ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                ShardCell::new(i, engine_threads, seed, spread)
            })
            .collect();
        let waker = Arc::new(mio::Waker::new(poll.registry(), token(Tok::Shards))?);
        let threads = threads::Threads::start(&shards, waker)?;
        let pacer = (!threads.running()).then(shard::Pacer::new);
        let kept = match persist_file {
            Some(file) => {
                let waker = mio::Waker::new(poll.registry(), token(Tok::Persist))?;
                info!(file = %file.display(), recorded = records.len(), "persistent vRNICs");
                let writer = crate::persist::Writer::start(file, waker)
                    .context("start the thread that writes the file of persistent vRNICs")?;
                Some(registry::Kept::new(writer, records))
            }
            None => None,
        };
        // The admin socket last: its existence is what the CLI, `vrnic run` and the tests
        // take for "the daemon is up", so everything else (the peer port, the engine threads)
        // must already listen when it appears.
        let admin_path = dir.join(ADMIN_SOCKET);
        let mut admin = listen_in_place(&admin_path, |at| {
            open_admin_socket(at, opts.access_group.as_deref())
        })?;
        poll.registry()
            .register(&mut admin, ADMIN, Interest::READABLE)?;
        info!(state_dir = %dir.display(), engine_threads, "vrnic daemon serving");
        unmount_on_failure.0 = None;
        Ok(Server {
            directory,
            opts,
            poll,
            spread,
            shards,
            threads,
            pacer,
            vnics: BTreeMap::new(),
            ctxs: HashMap::new(),
            wakes: Vec::new(),
            cm: Cm::new(),
            tokens,
            admin,
            admins: HashMap::new(),
            next_token,
            next_vnic: 1,
            next_ctx: 1,
            next_admin: 1,
            _signals: signals,
            _lock: lock,
            mounted,
            guests: Vec::new(),
            last_scan: Instant::now(),
            activity: engines::Activity::default(),
            fault_epoch: vrnic_shm::fault::epoch(),
            control_hot_until: Instant::now(),
            peers,
            cluster,
            kept,
            euid: config::current_euid(),
        })
    }

    fn token(&mut self, t: Tok) -> Token {
        let token = Token(self.next_token);
        self.next_token += 1;
        self.tokens.insert(token, t);
        token
    }

    fn run(&mut self) -> Result<()> {
        let mut events = Events::with_capacity(256);
        let mut pass: u64 = 0;
        // What the one shard's pacer said after the loop's last pass of it (`None`: engine
        // threads drive the shards).
        let mut wait = self.pacer.as_ref().map(|_| Wait::Now);
        // The peer links moved frames in the last pass, in or out (a read may have stopped at
        // its budget with more in the socket, which an edge-triggered poll would not report
        // again): the next poll does not wait.
        let mut links_busy = false;
        loop {
            let now = Instant::now();
            // While the loop drives the shard and it has traffic, the sockets are looked at
            // every 32nd pass, and every pass while a context is making control calls (a
            // connection being set up: create, then modify, modify, modify), so that its next
            // call waits for one pass, not for the next of every 32.
            let poll_now = match wait {
                Some(Wait::Now | Wait::Spin) => {
                    pass.is_multiple_of(32) || now < self.control_hot_until
                }
                None | Some(Wait::Sleep(_)) => true,
            };
            if poll_now {
                let cap = if self.guests.is_empty() {
                    MAX_SLEEP
                } else {
                    GUEST_SLEEP
                };
                let until = |t: Option<Instant>| {
                    t.map_or(MAX_SLEEP, |t| t.saturating_duration_since(Instant::now()))
                        .min(cap)
                };
                let due = [self.cm.next_deadline(), self.next_redial()];
                let timeout = match wait {
                    Some(Wait::Now | Wait::Spin) => Duration::ZERO,
                    _ if links_busy => Duration::ZERO,
                    // The one shard sleeps (its regions say so): a doorbell comes on a
                    // socket; its engine's next timer is due in `t` at most.
                    Some(Wait::Sleep(t)) => until(due.into_iter().flatten().chain([now + t]).min()),
                    // The engine threads drive the shards: the loop waits for sockets, the
                    // shards' outboxes, timers and guests.
                    None => until(due.into_iter().flatten().min()),
                };
                match self.poll.poll(&mut events, Some(timeout)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e).context("epoll"),
                }
                let mut stop = false;
                let mut worked = false;
                for ev in events.iter() {
                    match ev.token() {
                        SIGNAL => stop = true,
                        ADMIN => self.accept_admin(),
                        t => worked |= self.handle_token(t),
                    }
                }
                if stop {
                    info!("signal received, shutting down");
                    return Ok(());
                }
                if let Some(why) = self.cluster_fatal() {
                    bail!("{why}");
                }
                if worked {
                    self.worked(Instant::now());
                }
            }
            // Read again only after a poll (which may have waited).
            let now = if poll_now { Instant::now() } else { now };
            self.sample_activity(now);
            if now.duration_since(self.last_scan) >= GUEST_SCAN {
                self.last_scan = now;
                self.scan_guests(now);
            }
            if self.kept.as_ref().is_some_and(|k| k.retry_due(now)) {
                self.retry_recorded();
            }
            if !self.guests.is_empty() && self.serve_guests() {
                self.worked(now);
            }
            links_busy = self.peer_pass(now);
            if links_busy {
                self.worked(now);
            }
            if self.cm.has_notes() {
                self.flush_cm_notes();
                self.flush_wakes();
            }
            if self.cm.next_deadline().is_some_and(|t| now >= t) {
                self.cm.expire(now);
                self.flush_cm_notes();
                self.flush_wakes();
            }
            if self.cm.has_refusals() {
                self.log_cm_refusals();
            }
            let drove = self.drive(now);
            links_busy |= self.flush_peers(now);
            // Frames written, or (the loop drives the shard) still to be written: not idle.
            let busy = links_busy || (drove.is_some() && self.peers_backlogged());
            if let (Some(mut w), Some(d)) = (drove, self.pacer.as_mut()) {
                if busy {
                    d.worked(now);
                    w = Wait::Now;
                }
                d.settle(w, now);
                wait = Some(w);
            }
            let epoch = vrnic_shm::fault::epoch();
            if epoch != self.fault_epoch {
                self.fault_epoch = epoch;
                self.remove_poisoned();
            }
            pass = pass.wrapping_add(1);
        }
    }

    /// Work the loop did besides the passes: the shard it drives does not go to sleep yet.
    fn worked(&mut self, at: Instant) {
        if let Some(d) = self.pacer.as_mut() {
            d.worked(at);
        }
    }

    fn handle_token(&mut self, t: Token) -> bool {
        match self.tokens.get(&t).copied() {
            Some(Tok::VnicListener(v)) => {
                self.accept_client(v);
                false
            }
            Some(Tok::Client(c)) => self.client_ready(c),
            Some(Tok::Admin(a)) => {
                self.admin_ready(a);
                false
            }
            Some(Tok::PeerListener) => {
                self.accept_peers();
                true
            }
            Some(Tok::Peer | Tok::PeerPending) => true,
            Some(Tok::Cluster) => self.cluster_events(),
            Some(Tok::Shards) => {
                self.drain_outboxes();
                false
            }
            Some(Tok::Persist) => {
                self.persist_written();
                false
            }
            None => false,
        }
    }

    fn shutdown(&mut self) {
        self.threads.stop(&self.shards);
        let ids: Vec<VnicId> = self.vnics.keys().copied().collect();
        for id in ids {
            self.remove_vnic(id);
        }
        if let Some(c) = &mut self.cluster {
            c.stop();
        }
        // What is queued is written before the daemon ends.
        if let Some(k) = &mut self.kept {
            k.stop();
        }
        let dir = self.opts.state_dir.clone();
        let _ = std::fs::remove_file(dir.join(ADMIN_SOCKET));
        if self.mounted {
            sys::unmount(&dir);
        }
        let _ = std::fs::remove_file(dir.join(config::LOCK_FILE));
        if let Some(p) = &mut self.peers {
            p.flush_refusals();
        }
        info!("vrnic daemon stopped");
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;

    /// The socket's name appears only once it listens: `prepare` runs on a socket that already
    /// takes connections under a hidden name while its own name is still free, and a failed
    /// `prepare` leaves neither name behind.
    #[test]
    fn a_socket_appears_under_its_name_only_once_it_listens() {
        let dir = std::env::temp_dir().join(format!("vrnic-listen-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vrnic.sock");
        std::fs::write(&path, b"stale").unwrap();
        let l = super::listen_in_place(&path, |at| {
            assert_ne!(at, path.as_path());
            UnixStream::connect(at).expect("listens before it is named");
            assert!(std::fs::read(&path).is_ok_and(|b| b == b"stale"));
            Ok(())
        })
        .unwrap();
        UnixStream::connect(&path).expect("connects at its name");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["vrnic.sock"]);
        drop(l);

        let other = dir.join("sock");
        let r = super::listen_in_place(&other, |_| anyhow::bail!("no group"));
        assert_eq!(r.unwrap_err().to_string(), "no group");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
