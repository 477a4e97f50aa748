//! The daemon's one loop: sockets (admin, per-vRNIC, per-context), the control mailboxes, and
//! the engine pass that moves work requests from the rings into the engine and completions
//! back out.
//!
//! One thread owns everything, so there are no locks: a control request is served between two
//! engine passes. The loop spins (yielding the CPU each idle pass) while there is traffic and
//! sleeps in `epoll` after a quiet period; before sleeping it sets every region's
//! engine-sleeping word and re-checks the rings, so a driver that publishes a work request
//! and then reads that word can never be missed (brief §9, lost wake-ups).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::cm::Cm;
use anyhow::{Context as _, Result, bail};
use mio::net::{UnixListener, UnixStream};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};
use tracing::{debug, info, warn};
use vrnic_api::{AdminReply, AdminRequest, PageRun, Reply, Request, VnicSummary};
use vrnic_proto::{AhId, CqId, CtxId, Engine, Loc, Memory, MrId, PdId, QpId, SrqId, VnicId};
use vrnic_shm::layout::{self, hdr};
use vrnic_shm::{Mailbox, MailboxState, Region, Ring};
use vrnic_wire::{CQ_SLOT, Cqe, RQ_SLOT, RecvWqe, SQ_SLOT, SendWqe};

use crate::config::{self, ADMIN_SOCKET, REGION_FILE, VNIC_SOCKET};
use crate::heap::Heap;
use crate::sys;

const SIGNAL: Token = Token(0);
const ADMIN: Token = Token(1);
/// How long the loop keeps spinning after the last work before it sleeps.
const SPIN_QUIET: Duration = Duration::from_millis(2);
/// Longest sleep, so timers, guest claims and the daemon's heartbeat are looked at regularly.
const MAX_SLEEP: Duration = Duration::from_millis(200);
/// Longest sleep while a region-only context (a VM guest) is attached: it cannot ring a
/// doorbell, so the engine looks at its rings at least this often.
const GUEST_SLEEP: Duration = Duration::from_millis(1);
/// How often the loop looks for guests claiming or leaving mailboxes and checks their
/// heartbeats (and advances its own).
const GUEST_SCAN: Duration = Duration::from_millis(20);
/// A guest context whose heartbeat stalls this long is reclaimed as dead. Generous: a guest
/// under software emulation may be descheduled for a while.
const GUEST_LEASE: Duration = Duration::from_secs(5);
/// Work requests taken from one ring per pass.
const RING_BATCH: u32 = 64;
/// Control requests served per wake of a context.
const CTRL_BUDGET: usize = 8;
/// Most QPs / CQs / MRs / PDs per vRNIC.
const MAX_QP_WR: u32 = 16384;
const MAX_CQE: u32 = 65536;
/// The longest admin request line.
const ADMIN_LINE_MAX: usize = 64 << 10;
/// Reply bytes an admin client may leave unread before it is dropped.
const ADMIN_OUT_MAX: usize = 16 << 20;
/// What a vRNIC's quota tmpfs holds beyond its region (directory blocks, the socket).
const QUOTA_SLACK: u64 = 1 << 20;

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
}

/// The daemon's address space set aside for region mappings: `max_vrnics` regions of
/// `region_size` must fit in it (a 47-bit user address space holds 128 TiB in all).
pub const MAP_BUDGET: u64 = 64 << 40;

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
}

struct Vnic {
    name: String,
    dir: PathBuf,
    region: Region,
    lid: u16,
    gid: [u8; 16],
    guid: u64,
    heap: Heap,
    /// Its directory is a tmpfs of its own, sized to its region (its memory quota).
    quota_mount: bool,
    persistent: bool,
    holders: usize,
    contexts: HashSet<CtxId>,
    /// The region's claim count when the daemon last looked for guests' claims.
    claims_seen: u32,
    listener: UnixListener,
    token: Token,
}

struct Ctx {
    vnic: VnicId,
    /// How the context reaches the daemon and how the daemon learns that it died.
    link: Link,
    mailbox: Mailbox,
    ev_prod: u32,
    /// App page address -> (region offset, registrations using it).
    pages: HashMap<u64, (u64, u32)>,
    /// MR -> the app pages it holds.
    mrs: HashMap<MrId, (u64, u64)>,
    /// Pages deregistered but still mapped by the app, by region offset.
    detaching: BTreeSet<u64>,
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

struct CqSlot {
    vnic: VnicId,
    ctx: CtxId,
    ring: Ring,
    prod: u32,
    broken: bool,
}

struct QpSlot {
    vnic: VnicId,
    sq: Ring,
    rq: Ring,
    sq_fetched: u32,
    rq_fetched: u32,
    sq_cons: u32,
    rq_cons: u32,
    broken: bool,
}

struct SrqSlot {
    vnic: VnicId,
    ring: Ring,
    fetched: u32,
    cons: u32,
    broken: bool,
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
}

/// The daemon's state, owned by its one thread.
pub struct Server {
    opts: ServeOptions,
    poll: Poll,
    engine: Engine,
    vnics: BTreeMap<VnicId, Vnic>,
    ctxs: HashMap<CtxId, Ctx>,
    cqs: HashMap<CqId, CqSlot>,
    qps: BTreeMap<QpId, QpSlot>,
    srqs: BTreeMap<SrqId, SrqSlot>,
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
    sleeping: bool,
    /// Region-only contexts (served by polling their mailboxes).
    guests: Vec<CtxId>,
    last_scan: Instant,
    /// The `SIGBUS` guard's epoch when the loop last looked for poisoned regions.
    fault_epoch: u64,
}

/// Runs the daemon until SIGINT/SIGTERM.
pub fn serve(opts: ServeOptions) -> Result<()> {
    let mut server = Server::start(opts)?;
    let r = server.run();
    server.shutdown();
    r
}

struct Mem<'a>(&'a BTreeMap<VnicId, Vnic>);

impl Memory for Mem<'_> {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) {
        let (Some(s), Some(d)) = (self.0.get(&src.vnic), self.0.get(&dst.vnic)) else {
            warn!(?src, ?dst, "copy between unknown vnics");
            return;
        };
        if let Err(e) = Region::copy(&s.region, src.off, &d.region, dst.off, len as u64) {
            warn!("engine copy refused: {e}");
        }
    }
    fn write(&mut self, dst: Loc, data: &[u8]) {
        if let Some(d) = self.0.get(&dst.vnic)
            && let Err(e) = d.region.write_bytes(dst.off, data)
        {
            warn!("engine write refused: {e}");
        }
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) {
        if let Some(s) = self.0.get(&src.vnic)
            && let Err(e) = s.region.read_bytes(src.off, out)
        {
            warn!("engine read refused: {e}");
        }
    }
}

fn cm_reply(r: Result<(), i32>, what: &str) -> Reply {
    match r {
        Ok(()) => Reply::Ok,
        Err(e) => err(e, what),
    }
}

fn err(errno: i32, msg: impl Into<String>) -> Reply {
    Reply::Err {
        errno,
        msg: msg.into(),
    }
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    t.as_nanos() as u64 ^ (u64::from(std::process::id()) << 32)
}

impl Server {
    fn start(mut opts: ServeOptions) -> Result<Server> {
        let mapped = u64::from(opts.max_vrnics).saturating_mul(opts.region_size);
        if mapped > MAP_BUDGET || opts.max_vrnics as usize > vrnic_shm::fault::MAX_GUARDED {
            bail!(
                "--max-vrnics {} with regions of {} GiB would map {} TiB; the daemon maps at most \
                 {} TiB and {} regions: lower --max-vrnics or --region-gib",
                opts.max_vrnics,
                opts.region_size >> 30,
                mapped >> 40,
                MAP_BUDGET >> 40,
                vrnic_shm::fault::MAX_GUARDED
            );
        }
        opts.state_dir = config::prepare_state_dir(&opts.state_dir)?;
        let dir = &opts.state_dir.clone();
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
        let stale = cleanup_stale(dir);
        if stale > 0 {
            info!("removed {stale} vRNICs left by a daemon that did not shut down cleanly");
        }
        let admin_path = dir.join(ADMIN_SOCKET);
        let _ = std::fs::remove_file(&admin_path);
        let mut admin = UnixListener::bind(&admin_path)
            .with_context(|| format!("bind {}", admin_path.display()))?;
        let poll = Poll::new()?;
        let nofile = sys::raise_nofile_limit();
        debug!(nofile, "open-file limit");
        let signals = sys::SignalFd::new().context("block SIGINT/SIGTERM")?;
        // A tenant that shrinks its region must not kill us with SIGBUS.
        vrnic_shm::fault::install().context("install the SIGBUS guard")?;
        poll.registry()
            .register(&mut SourceFd(&signals.fd()), SIGNAL, Interest::READABLE)?;
        poll.registry()
            .register(&mut admin, ADMIN, Interest::READABLE)?;
        info!(state_dir = %dir.display(), "vrnic daemon serving");
        Ok(Server {
            opts,
            poll,
            engine: Engine::new(seed()),
            vnics: BTreeMap::new(),
            ctxs: HashMap::new(),
            cqs: HashMap::new(),
            qps: BTreeMap::new(),
            srqs: BTreeMap::new(),
            cm: Cm::new(),
            tokens: HashMap::new(),
            admin,
            admins: HashMap::new(),
            next_token: 2,
            next_vnic: 1,
            next_ctx: 1,
            next_admin: 1,
            _signals: signals,
            _lock: lock,
            mounted,
            sleeping: false,
            guests: Vec::new(),
            last_scan: Instant::now(),
            fault_epoch: vrnic_shm::fault::epoch(),
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
        let mut last_work = Instant::now();
        let mut pass: u64 = 0;
        loop {
            let now = Instant::now();
            let idle = now.duration_since(last_work);
            let poll_now = pass.is_multiple_of(32) || idle >= SPIN_QUIET;
            if poll_now {
                let timeout = if idle >= SPIN_QUIET {
                    // Sleep: announce it, then look once more before really waiting.
                    self.set_sleeping(true);
                    if self.engine_pass(Instant::now()) {
                        self.set_sleeping(false);
                        last_work = Instant::now();
                        Some(Duration::ZERO)
                    } else {
                        let t = [self.engine.poll_timeout(), self.cm.next_deadline()]
                            .into_iter()
                            .flatten()
                            .min()
                            .map(|t| t.saturating_duration_since(Instant::now()))
                            .unwrap_or(MAX_SLEEP);
                        let cap = if self.guests.is_empty() {
                            MAX_SLEEP
                        } else {
                            GUEST_SLEEP
                        };
                        Some(t.min(cap))
                    }
                } else {
                    Some(Duration::ZERO)
                };
                match self.poll.poll(&mut events, timeout) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e).context("epoll"),
                }
                if self.sleeping {
                    self.set_sleeping(false);
                }
                let mut stop = false;
                for ev in events.iter() {
                    match ev.token() {
                        SIGNAL => stop = true,
                        ADMIN => self.accept_admin(),
                        t => {
                            if self.handle_token(t) {
                                last_work = Instant::now();
                            }
                        }
                    }
                }
                if stop {
                    info!("signal received, shutting down");
                    return Ok(());
                }
            }
            let now = Instant::now();
            if now.duration_since(self.last_scan) >= GUEST_SCAN {
                self.last_scan = now;
                self.scan_guests(now);
            }
            if !self.guests.is_empty() && self.serve_guests() {
                last_work = Instant::now();
            }
            self.engine.handle_timeout(now);
            if self.cm.next_deadline().is_some_and(|t| now >= t) {
                self.cm.expire(now);
                self.flush_cm_notes();
                self.flush_wakes();
            }
            if self.engine_pass(now) {
                last_work = Instant::now();
            } else {
                std::thread::yield_now();
            }
            let epoch = vrnic_shm::fault::epoch();
            if epoch != self.fault_epoch {
                self.fault_epoch = epoch;
                self.remove_poisoned();
            }
            pass = pass.wrapping_add(1);
        }
    }

    fn set_sleeping(&mut self, on: bool) {
        self.sleeping = on;
        for v in self.vnics.values() {
            if let Ok(w) = v.region.atomic_u32(hdr::ENGINE_SLEEPING) {
                w.store(u32::from(on), Ordering::SeqCst);
            }
        }
        fence(Ordering::SeqCst);
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
            None => false,
        }
    }

    // ---- vRNIC lifecycle -------------------------------------------------------------------

    fn create_vnic(&mut self, name: &str, persistent: bool) -> Result<VnicId> {
        if !config::valid_name(name) {
            bail!("invalid vRNIC name {name:?}: use 1-63 letters, digits, '-' or '_'");
        }
        if self.vnics.values().any(|v| v.name == name) {
            bail!("vRNIC {name} already exists");
        }
        if self.vnics.len() >= self.opts.max_vrnics as usize {
            bail!(
                "the daemon serves its limit of {} vRNICs (vrnic serve --max-vrnics)",
                self.opts.max_vrnics
            );
        }
        let id = VnicId(self.next_vnic);
        self.next_vnic += 1;
        let lid = self.free_lid().context("no free LID")?;
        let guid_host: u64 = 0x0256_5200_0000_0000 | u64::from(id.0);
        let guid = guid_host.to_be();
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[8..].copy_from_slice(&guid_host.to_be_bytes());
        let dir = self.opts.state_dir.join(name);
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        let quota_mount = config::current_euid() == 0;
        if quota_mount && let Err(e) = sys::mount_quota(&dir, self.opts.region_size + QUOTA_SLACK) {
            let _ = std::fs::remove_dir(&dir);
            return Err(e).context("mount the vRNIC's tmpfs (its memory quota)");
        }
        let region = match Region::create(
            &dir.join(REGION_FILE),
            self.opts.region_size,
            name,
            lid,
            gid,
            guid,
        ) {
            Ok(r) => r,
            Err(e) => {
                remove_vnic_dir(&dir, quota_mount);
                return Err(e).context("create region");
            }
        };
        let heap_off = layout::HEAP_OFF;
        let heap = Heap::new(heap_off, region.size() - heap_off, layout::PAGE);
        let mut listener = match UnixListener::bind(dir.join(VNIC_SOCKET)) {
            Ok(l) => l,
            Err(e) => {
                drop(region);
                remove_vnic_dir(&dir, quota_mount);
                return Err(e).context("bind vRNIC socket");
            }
        };
        let token = self.token(Tok::VnicListener(id));
        self.poll
            .registry()
            .register(&mut listener, token, Interest::READABLE)?;
        self.engine.add_vnic(id, lid, gid);
        info!(vnic = name, lid, "vRNIC created");
        self.vnics.insert(
            id,
            Vnic {
                name: name.to_string(),
                dir,
                region,
                lid,
                gid,
                guid,
                heap,
                quota_mount,
                persistent,
                holders: 0,
                contexts: HashSet::new(),
                claims_seen: 0,
                listener,
                token,
            },
        );
        Ok(id)
    }

    fn free_lid(&self) -> Option<u16> {
        (1..0xbfff).find(|l| !self.vnics.values().any(|v| v.lid == *l))
    }

    fn remove_vnic(&mut self, id: VnicId) {
        let ctxs: Vec<CtxId> = self
            .vnics
            .get(&id)
            .map(|v| v.contexts.iter().copied().collect())
            .unwrap_or_default();
        for c in ctxs {
            self.drop_context(c);
        }
        self.engine.remove_vnic(Instant::now(), id);
        if let Some(mut v) = self.vnics.remove(&id) {
            let _ = self.poll.registry().deregister(&mut v.listener);
            self.tokens.remove(&v.token);
            if let Ok(w) = v.region.atomic_u32(hdr::DAEMON_STATE) {
                w.store(2, Ordering::Release);
            }
            drop(v.region);
            remove_vnic_dir(&v.dir, v.quota_mount);
            info!(vnic = v.name, "vRNIC removed");
        }
    }

    /// Tears down every vRNIC whose region the `SIGBUS` guard caught losing pages under us: its
    /// tenant truncated the file or filled its quota. Only that vRNIC goes; its peers see their
    /// QPs fail as if it had died.
    fn remove_poisoned(&mut self) {
        let hit: Vec<VnicId> = self
            .vnics
            .iter()
            .filter(|(_, v)| v.region.poisoned())
            .map(|(&id, _)| id)
            .collect();
        for id in hit {
            if let Some(v) = self.vnics.get(&id) {
                warn!(
                    vnic = v.name,
                    "the vRNIC's region lost pages under the daemon (file truncated, or its \
                     quota full); removing the vRNIC"
                );
            }
            self.remove_vnic(id);
        }
    }

    fn maybe_reap(&mut self, id: VnicId) {
        if let Some(v) = self.vnics.get(&id)
            && !v.persistent
            && v.holders == 0
            && v.contexts.is_empty()
        {
            self.remove_vnic(id);
        }
    }

    fn summary(&self, id: VnicId) -> Option<VnicSummary> {
        let v = self.vnics.get(&id)?;
        Some(VnicSummary {
            name: v.name.clone(),
            lid: v.lid,
            gid: v.gid,
            qps: self.engine.qp_count(id),
            users: v.holders + v.contexts.len(),
            persistent: v.persistent,
            dir: v.dir.display().to_string(),
        })
    }

    // ---- admin socket ----------------------------------------------------------------------

    fn accept_admin(&mut self) {
        loop {
            match self.admin.accept() {
                Ok((mut stream, _)) => {
                    let id = self.next_admin;
                    self.next_admin += 1;
                    let token = self.token(Tok::Admin(id));
                    if self
                        .poll
                        .registry()
                        .register(&mut stream, token, Interest::READABLE)
                        .is_ok()
                    {
                        self.admins.insert(
                            id,
                            AdminConn {
                                stream,
                                token,
                                buf: Vec::new(),
                                out: Vec::new(),
                                writable: false,
                                eof: false,
                                held: None,
                            },
                        );
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("admin accept: {e}");
                    return;
                }
            }
        }
    }

    /// Serves an admin connection without ever blocking: replies go out as far as the socket
    /// takes them, the rest waits for it to become writable, and no new request is read while
    /// replies are pending (so a client that never reads holds only its own connection).
    fn admin_ready(&mut self, id: u64) {
        loop {
            let Some(conn) = self.admins.get_mut(&id) else {
                return;
            };
            if flush(&mut conn.stream, &mut conn.out).is_err() || conn.out.len() > ADMIN_OUT_MAX {
                self.close_admin(id);
                return;
            }
            if !conn.out.is_empty() {
                break;
            }
            if let Some(pos) = conn.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = conn.buf.drain(..=pos).collect();
                let reply = match serde_json::from_slice::<AdminRequest>(&line) {
                    Ok(req) => self.admin_request(id, req),
                    Err(e) => AdminReply::Err(format!("bad admin request: {e}")),
                };
                if let Some(c) = self.admins.get_mut(&id) {
                    // Invariant: our reply types always serialise.
                    let mut out = serde_json::to_vec(&reply).unwrap_or_default();
                    out.push(b'\n');
                    c.out.extend_from_slice(&out);
                }
                continue;
            }
            if conn.eof {
                self.close_admin(id);
                return;
            }
            let mut chunk = [0u8; 4096];
            match conn.stream.read(&mut chunk) {
                Ok(0) => conn.eof = true,
                Ok(n) if conn.buf.len() + n <= ADMIN_LINE_MAX => {
                    conn.buf.extend_from_slice(&chunk[..n])
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                _ => {
                    self.close_admin(id);
                    return;
                }
            }
        }
        if let Some(c) = self.admins.get_mut(&id) {
            let want = !c.out.is_empty();
            if want != c.writable {
                c.writable = want;
                let interest = if want {
                    Interest::READABLE | Interest::WRITABLE
                } else {
                    Interest::READABLE
                };
                let _ = self
                    .poll
                    .registry()
                    .reregister(&mut c.stream, c.token, interest);
            }
        }
    }

    fn admin_request(&mut self, conn: u64, req: AdminRequest) -> AdminReply {
        match req {
            AdminRequest::List => {
                AdminReply::List(self.vnics.keys().filter_map(|&v| self.summary(v)).collect())
            }
            AdminRequest::Create { name } => match self.create_vnic(&name, true) {
                Ok(v) => self
                    .summary(v)
                    .map(AdminReply::Vnic)
                    .unwrap_or(AdminReply::Ok),
                Err(e) => AdminReply::Err(format!("{e:#}")),
            },
            AdminRequest::Remove { name } => {
                match self.vnics.iter().find(|(_, v)| v.name == name) {
                    Some((&id, _)) => {
                        self.remove_vnic(id);
                        AdminReply::Ok
                    }
                    None => AdminReply::Err(format!("no vRNIC named {name}")),
                }
            }
            AdminRequest::Hold { name } => {
                if self.admins.get(&conn).is_some_and(|c| c.held.is_some()) {
                    return AdminReply::Err("this connection already holds a vRNIC".into());
                }
                let existing = name.as_ref().and_then(|n| {
                    self.vnics
                        .iter()
                        .find(|(_, v)| &v.name == n)
                        .map(|(&id, _)| id)
                });
                let id = match existing {
                    Some(id) => id,
                    None => {
                        let name = name.unwrap_or_else(|| {
                            (0..)
                                .map(|i| format!("vrnic{i}"))
                                .find(|n| !self.vnics.values().any(|v| &v.name == n))
                                .unwrap_or_default()
                        });
                        match self.create_vnic(&name, false) {
                            Ok(id) => id,
                            Err(e) => return AdminReply::Err(format!("{e:#}")),
                        }
                    }
                };
                if let Some(v) = self.vnics.get_mut(&id) {
                    v.holders += 1;
                }
                if let Some(c) = self.admins.get_mut(&conn) {
                    c.held = Some(id);
                }
                self.summary(id)
                    .map(AdminReply::Vnic)
                    .unwrap_or(AdminReply::Ok)
            }
            _ => AdminReply::Err("unsupported admin request".into()),
        }
    }

    fn close_admin(&mut self, id: u64) {
        if let Some(mut c) = self.admins.remove(&id) {
            let _ = self.poll.registry().deregister(&mut c.stream);
            self.tokens
                .retain(|_, t| !matches!(t, Tok::Admin(a) if *a == id));
            if let Some(v) = c.held {
                if let Some(vn) = self.vnics.get_mut(&v) {
                    vn.holders = vn.holders.saturating_sub(1);
                }
                self.maybe_reap(v);
            }
        }
    }

    // ---- contexts (attached driver libraries) ----------------------------------------------

    fn accept_client(&mut self, vnic: VnicId) {
        loop {
            let Some(v) = self.vnics.get(&vnic) else {
                return;
            };
            let (mut stream, _) = match v.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("accept: {e}");
                    return;
                }
            };
            let used: HashSet<u32> = self
                .ctxs
                .values()
                .filter(|c| c.vnic == vnic)
                .map(|c| c.mailbox.index())
                .collect();
            // Accepting moves the mailbox out of `Free` atomically: a guest claiming mailboxes
            // through the region at the same time never gets the same one.
            let Some(mailbox) = (0..layout::CTRL_SLOTS)
                .filter(|i| !used.contains(i))
                .filter_map(Mailbox::new)
                .find(|m| m.accept(&v.region, MailboxState::Free))
            else {
                warn!(
                    vnic = v.name,
                    "all control mailboxes in use; refusing a context"
                );
                let _ = stream.write_all(&u32::MAX.to_le_bytes());
                continue;
            };
            let id = CtxId(self.next_ctx);
            self.next_ctx += 1;
            // Four bytes into a socket just accepted: its buffer is empty, so this never blocks.
            if stream.write_all(&mailbox.index().to_le_bytes()).is_err() {
                mailbox.reset(&v.region, MailboxState::Free);
                continue;
            }
            let token = self.token(Tok::Client(id));
            if self
                .poll
                .registry()
                .register(&mut stream, token, Interest::READABLE)
                .is_err()
            {
                self.tokens.remove(&token);
                if let Some(v) = self.vnics.get(&vnic) {
                    mailbox.reset(&v.region, MailboxState::Free);
                }
                continue;
            }
            debug!(ctx = id.0, mailbox = mailbox.index(), "context attached");
            self.add_context(id, vnic, Link::Socket { stream, token }, mailbox);
        }
    }

    /// Registers an accepted context and tells it its port is up, as a device reports a port
    /// that goes active.
    fn add_context(&mut self, id: CtxId, vnic: VnicId, link: Link, mailbox: Mailbox) {
        self.ctxs.insert(
            id,
            Ctx {
                vnic,
                link,
                mailbox,
                ev_prod: 0,
                pages: HashMap::new(),
                mrs: HashMap::new(),
                detaching: BTreeSet::new(),
                cqs: HashSet::new(),
                qps: HashSet::new(),
                srqs: HashSet::new(),
                pds: 0,
                wake: false,
            },
        );
        if let Some(v) = self.vnics.get_mut(&vnic) {
            v.contexts.insert(id);
        }
        self.push_event(id, vrnic_api::event::PORT_ACTIVE, 1);
    }

    /// Region-only contexts: accepts guests that claimed a mailbox, reclaims those that left
    /// or whose heartbeat stalled for [`GUEST_LEASE`], and advances the daemon's own heartbeat
    /// in every region.
    fn scan_guests(&mut self, now: Instant) {
        let mut joined = Vec::new();
        let mut gone = Vec::new();
        for (&vid, v) in self.vnics.iter_mut() {
            if let Ok(w) = v.region.atomic_u32(hdr::DAEMON_BEAT) {
                w.fetch_add(1, Ordering::Release);
            }
            // Look through the mailboxes only when a guest claimed one since the last look.
            let claims = Mailbox::claims(&v.region);
            if claims == v.claims_seen {
                continue;
            }
            v.claims_seen = claims;
            let used: HashSet<u32> = v
                .contexts
                .iter()
                .filter_map(|c| self.ctxs.get(c))
                .map(|c| c.mailbox.index())
                .collect();
            for m in (0..layout::CTRL_SLOTS)
                .filter(|i| !used.contains(i))
                .filter_map(Mailbox::new)
            {
                if m.load_state(&v.region) == Some(MailboxState::Attach)
                    && m.accept(&v.region, MailboxState::Attach)
                {
                    joined.push((vid, m, m.heartbeat(&v.region)));
                }
            }
        }
        for &id in &self.guests {
            let Some(ctx) = self.ctxs.get_mut(&id) else {
                continue;
            };
            let Some(v) = self.vnics.get(&ctx.vnic) else {
                continue;
            };
            if ctx.mailbox.load_state(&v.region) == Some(MailboxState::Detach) {
                debug!(ctx = id.0, "guest context detached");
                gone.push((id, ctx.vnic));
                continue;
            }
            let Link::Region { beat, beat_at } = &mut ctx.link else {
                continue;
            };
            let b = ctx.mailbox.heartbeat(&v.region);
            if b != *beat {
                *beat = b;
                *beat_at = now;
            } else if now.duration_since(*beat_at) > GUEST_LEASE {
                warn!(
                    vnic = v.name,
                    ctx = id.0,
                    "guest context stopped its heartbeat for {GUEST_LEASE:?}; reclaiming it"
                );
                gone.push((id, ctx.vnic));
            }
        }
        for (id, vnic) in gone {
            self.drop_context(id);
            self.maybe_reap(vnic);
        }
        for (vnic, mailbox, beat) in joined {
            let id = CtxId(self.next_ctx);
            self.next_ctx += 1;
            info!(
                ctx = id.0,
                mailbox = mailbox.index(),
                "region-only (guest) context attached"
            );
            self.add_context(id, vnic, Link::Region { beat, beat_at: now }, mailbox);
            self.guests.push(id);
        }
    }

    /// Serves the mailboxes of region-only contexts, which cannot ring a doorbell. Returns
    /// whether any request was waiting.
    fn serve_guests(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.guests.len() {
            let id = self.guests[i];
            let waiting = self.ctxs.get(&id).is_some_and(|c| {
                self.vnics
                    .get(&c.vnic)
                    .is_some_and(|v| c.mailbox.load_state(&v.region) == Some(MailboxState::Request))
            });
            if waiting {
                any = true;
                self.serve_mailbox(id);
            }
        }
        if any {
            self.flush_wakes();
        }
        any
    }

    /// A context's socket is readable: doorbells (drained), control requests, or its death.
    fn client_ready(&mut self, id: CtxId) -> bool {
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return false;
        };
        let Link::Socket { stream, .. } = &mut ctx.link else {
            return false;
        };
        let mut buf = [0u8; 256];
        let mut dead = false;
        loop {
            match stream.read(&mut buf) {
                Ok(0) => {
                    dead = true;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    dead = true;
                    break;
                }
            }
        }
        if dead {
            let vnic = ctx.vnic;
            self.drop_context(id);
            self.maybe_reap(vnic);
            return true;
        }
        self.serve_mailbox(id);
        true
    }

    fn serve_mailbox(&mut self, id: CtxId) {
        for _ in 0..CTRL_BUDGET {
            let Some(ctx) = self.ctxs.get(&id) else {
                return;
            };
            let Some(v) = self.vnics.get(&ctx.vnic) else {
                return;
            };
            let mailbox = ctx.mailbox;
            let Some((seq, req)) = mailbox.take(&v.region) else {
                return;
            };
            let reply = match req {
                Ok(bytes) => match serde_json::from_slice::<Request>(&bytes) {
                    Ok(req) => {
                        let r = self.control(id, req);
                        self.flush_cm_notes();
                        r
                    }
                    Err(e) => err(libc::EINVAL, format!("malformed control request: {e}")),
                },
                Err(len) => err(
                    libc::EINVAL,
                    format!("control request length {len} out of range"),
                ),
            };
            if let Reply::Err { errno, msg } = &reply {
                debug!(ctx = id.0, errno, "control request failed: {msg}");
            }
            let out = serde_json::to_vec(&reply).unwrap_or_default();
            let Some(ctx) = self.ctxs.get(&id) else {
                return;
            };
            if let Some(v) = self.vnics.get(&ctx.vnic)
                && let Err(e) = mailbox.respond(&v.region, seq, &out)
            {
                warn!("respond: {e}");
            }
        }
    }

    fn drop_context(&mut self, id: CtxId) {
        let Some(mut ctx) = self.ctxs.remove(&id) else {
            return;
        };
        let now = Instant::now();
        self.engine.destroy_context(now, id);
        self.cm.drop_context(id);
        self.flush_cm_notes();
        match &mut ctx.link {
            Link::Socket { stream, token } => {
                let _ = self.poll.registry().deregister(stream);
                self.tokens.remove(token);
            }
            Link::Region { .. } => self.guests.retain(|g| *g != id),
        }
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return;
        };
        v.contexts.remove(&id);
        for qp in &ctx.qps {
            if let Some(slot) = self.qps.remove(qp) {
                free_ring(v, slot.sq.offset(), slot.sq.depth(), SQ_SLOT);
                free_ring(v, slot.rq.offset(), slot.rq.depth(), RQ_SLOT);
            }
        }
        for cq in &ctx.cqs {
            if let Some(slot) = self.cqs.remove(cq) {
                free_ring(v, slot.ring.offset(), slot.ring.depth(), CQ_SLOT);
            }
        }
        for srq in &ctx.srqs {
            if let Some(slot) = self.srqs.remove(srq) {
                free_ring(v, slot.ring.offset(), slot.ring.depth(), RQ_SLOT);
            }
        }
        let offs: Vec<u64> = ctx
            .pages
            .values()
            .map(|(off, _)| *off)
            .chain(ctx.detaching.iter().copied())
            .collect();
        for off in offs {
            free_pages(v, off, 1);
        }
        ctx.mailbox.reset(&v.region, MailboxState::Free);
        debug!(
            vnic = v.name,
            ctx = id.0,
            "context detached, resources reclaimed"
        );
    }

    fn query_srq(&self, id: CtxId, srq: SrqId) -> Reply {
        match self.engine.query_srq(id, srq) {
            Ok((max_wr, max_sge, limit)) => Reply::SrqAttr {
                max_wr,
                max_sge,
                limit,
            },
            Err(e) => err(e, "query_srq"),
        }
    }

    /// Takes new receive WQEs from an SRQ's ring into the engine. Returns whether any came.
    /// Called by every engine pass, and before the SRQ's limit is armed or queried, so that
    /// what the app posted counts, as on a device.
    fn fetch_srq(&mut self, srq: SrqId) -> bool {
        let Some(slot) = self.srqs.get_mut(&srq) else {
            return false;
        };
        if slot.broken {
            return false;
        }
        let Some(v) = self.vnics.get(&slot.vnic) else {
            return false;
        };
        let mut raw = [0u8; RQ_SLOT];
        let room = self.engine.srq_room(srq);
        match pending(
            &slot.ring,
            &v.region,
            slot.fetched,
            self.engine.srq_retired(srq),
            room,
        ) {
            Ok(n) => {
                for _ in 0..n {
                    slot.ring.read_slot(&v.region, slot.fetched, &mut raw);
                    slot.fetched = slot.fetched.wrapping_add(1);
                    self.engine.handle_srq_wqe(srq, RecvWqe::parse(&raw));
                }
                n > 0
            }
            Err(e) => {
                warn!(srq = srq.0, "SRQ ring: {e}; SRQ in error");
                slot.broken = true;
                self.engine.handle_srq_wqe(srq, Err(e));
                true
            }
        }
    }

    /// The sum of `f` over the contexts of `vnic` (object counts for the per-vRNIC limits).
    fn per_vnic(&self, vnic: VnicId, f: impl Fn(&Ctx) -> usize) -> usize {
        self.ctxs.values().filter(|c| c.vnic == vnic).map(f).sum()
    }

    /// Announces queued connection-manager events to their contexts.
    fn flush_cm_notes(&mut self) {
        for (ctx, cm_id) in self.cm.take_notes() {
            self.push_event(ctx, vrnic_api::event::CM, cm_id);
        }
    }

    fn notify_ctx(&mut self, id: CtxId) {
        if let Some(c) = self.ctxs.get_mut(&id) {
            c.wake = true;
        }
    }

    fn flush_wakes(&mut self) {
        for c in self.ctxs.values_mut() {
            if c.wake {
                c.wake = false;
                // A full socket buffer already holds a wake-up: WouldBlock is fine. A guest
                // polls its notification words instead.
                if let Link::Socket { stream, .. } = &mut c.link {
                    let _ = stream.write(&[1u8]);
                }
            }
        }
    }

    // ---- control requests ------------------------------------------------------------------

    fn control(&mut self, id: CtxId, req: Request) -> Reply {
        let now = Instant::now();
        let Some(ctx) = self.ctxs.get(&id) else {
            return err(libc::ENODEV, "no such context");
        };
        let vnic = ctx.vnic;
        match req {
            Request::QueryDevice => {
                let Some(v) = self.vnics.get(&vnic) else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                Reply::Device(vrnic_api::DeviceInfo {
                    name: v.name.clone(),
                    guid: v.guid,
                    lid: v.lid,
                    gid: v.gid,
                    max_qp: self.opts.limits.max_qp,
                    max_qp_wr: MAX_QP_WR,
                    max_cq: self.opts.limits.max_cq,
                    max_cqe: MAX_CQE,
                    max_mr: self.opts.limits.max_mr,
                    max_pd: self.opts.limits.max_pd,
                    max_mr_size: v.region.size() - layout::HEAP_OFF,
                })
            }
            Request::AllocPd => {
                if self.per_vnic(vnic, |c| c.pds as usize) >= self.opts.limits.max_pd as usize {
                    return err(libc::ENOMEM, "PD limit reached");
                }
                match self.engine.alloc_pd(vnic, id) {
                    Ok(pd) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.pds += 1;
                        }
                        Reply::Handle(pd.0)
                    }
                    Err(e) => err(e, "alloc_pd"),
                }
            }
            Request::DeallocPd { pd } => match self.engine.dealloc_pd(id, PdId(pd)) {
                Ok(()) => {
                    if let Some(c) = self.ctxs.get_mut(&id) {
                        c.pds = c.pds.saturating_sub(1);
                    }
                    Reply::Ok
                }
                Err(e) => err(e, "dealloc_pd"),
            },
            Request::RegMr {
                pd,
                addr,
                len,
                iova,
                access,
            } => self.reg_mr(id, PdId(pd), addr, len, iova, access),
            Request::DeregMr { mr } => self.dereg_mr(id, MrId(mr)),
            Request::ReleasePages { runs } => self.release_pages(id, &runs),
            Request::CreateCq { cqe } => self.create_cq(id, cqe),
            Request::DestroyCq { cq } => {
                if !ctx.cqs.contains(&CqId(cq)) {
                    return err(libc::EINVAL, "no such CQ");
                }
                match self.engine.destroy_cq(id, CqId(cq)) {
                    Ok(()) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.cqs.remove(&CqId(cq));
                        }
                        if let (Some(slot), Some(v)) =
                            (self.cqs.remove(&CqId(cq)), self.vnics.get_mut(&vnic))
                        {
                            free_ring(v, slot.ring.offset(), slot.ring.depth(), CQ_SLOT);
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "destroy_cq"),
                }
            }
            Request::CreateQp {
                pd,
                send_cq,
                recv_cq,
                qp_type,
                cap,
                sq_sig_all,
                srq,
            } => self.create_qp(
                id,
                PdId(pd),
                CqId(send_cq),
                CqId(recv_cq),
                srq.map(SrqId),
                qp_type,
                cap,
                sq_sig_all,
            ),
            Request::ModifyQp { qp, mask, attr } => {
                match self.engine.modify_qp(now, id, QpId(qp), mask, &attr) {
                    Ok(()) => Reply::Ok,
                    Err(e) => err(e, "modify_qp"),
                }
            }
            Request::QueryQp { qp } => match self.engine.query_qp(id, QpId(qp)) {
                Ok(a) => Reply::QpAttr(Box::new(a)),
                Err(e) => err(e, "query_qp"),
            },
            Request::DestroyQp { qp } => {
                if !ctx.qps.contains(&QpId(qp)) {
                    return err(libc::EINVAL, "no such QP");
                }
                match self.engine.destroy_qp(now, id, QpId(qp)) {
                    Ok(()) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.qps.remove(&QpId(qp));
                        }
                        if let (Some(slot), Some(v)) =
                            (self.qps.remove(&QpId(qp)), self.vnics.get_mut(&vnic))
                        {
                            free_ring(v, slot.sq.offset(), slot.sq.depth(), SQ_SLOT);
                            free_ring(v, slot.rq.offset(), slot.rq.depth(), RQ_SLOT);
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "destroy_qp"),
                }
            }
            Request::CreateSrq {
                pd,
                max_wr,
                max_sge,
                limit,
            } => self.create_srq(id, PdId(pd), max_wr, max_sge, limit),
            Request::ModifySrq { srq, resize, limit } => {
                self.fetch_srq(SrqId(srq));
                match self.engine.modify_srq(id, SrqId(srq), resize, limit) {
                    Ok(()) => Reply::Ok,
                    Err(e) => err(e, "modify_srq"),
                }
            }
            Request::QuerySrq { srq } => {
                self.fetch_srq(SrqId(srq));
                self.query_srq(id, SrqId(srq))
            }
            Request::DestroySrq { srq } => {
                if !ctx.srqs.contains(&SrqId(srq)) {
                    return err(libc::EINVAL, "no such SRQ");
                }
                match self.engine.destroy_srq(id, SrqId(srq)) {
                    Ok(()) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.srqs.remove(&SrqId(srq));
                        }
                        if let (Some(slot), Some(v)) =
                            (self.srqs.remove(&SrqId(srq)), self.vnics.get_mut(&vnic))
                        {
                            free_ring(v, slot.ring.offset(), slot.ring.depth(), RQ_SLOT);
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "destroy_srq"),
                }
            }
            Request::CreateAh { pd, attr } => match self.engine.create_ah(id, PdId(pd), attr) {
                Ok(ah) => Reply::Handle(ah.0),
                Err(e) => err(e, "create_ah"),
            },
            Request::DestroyAh { ah } => match self.engine.destroy_ah(id, AhId(ah)) {
                Ok(()) => Reply::Ok,
                Err(e) => err(e, "destroy_ah"),
            },
            Request::CmCreateId { ps } => {
                let Some(v) = self.vnics.get(&vnic) else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                match self.cm.create(id, ps, v.lid, v.gid) {
                    Ok(h) => Reply::Handle(h),
                    Err(e) => err(e, "rdma_create_id"),
                }
            }
            Request::CmDestroyId { id: h } => cm_reply(self.cm.destroy(id, h), "rdma_destroy_id"),
            Request::CmBind { id: h, addr } => match addr.parse() {
                Ok(a) => match self.cm.bind(id, h, a) {
                    Ok(b) => Reply::CmAddr(b.to_string()),
                    Err(e) => err(e, "rdma_bind_addr"),
                },
                Err(_) => err(libc::EINVAL, "malformed address"),
            },
            Request::CmListen { id: h } => cm_reply(self.cm.listen(id, h), "rdma_listen"),
            Request::CmResolveAddr { id: h, src, dst } => {
                let src = match src.map(|s| s.parse()).transpose() {
                    Ok(s) => s,
                    Err(_) => return err(libc::EINVAL, "malformed address"),
                };
                let Ok(dst) = dst.parse() else {
                    return err(libc::EINVAL, "malformed address");
                };
                match self.cm.resolve_addr(id, h, src, dst) {
                    Ok(a) => Reply::CmAddr(a.to_string()),
                    Err(e) => err(e, "rdma_resolve_addr"),
                }
            }
            Request::CmResolveRoute { id: h } => {
                cm_reply(self.cm.resolve_route(id, h), "rdma_resolve_route")
            }
            Request::CmConnect { id: h, param } => {
                cm_reply(self.cm.connect(id, h, param, now), "rdma_connect")
            }
            Request::CmAccept { id: h, param } => {
                cm_reply(self.cm.accept(id, h, param), "rdma_accept")
            }
            Request::CmReject {
                id: h,
                private_data,
            } => cm_reply(self.cm.reject(id, h, private_data), "rdma_reject"),
            Request::CmEstablish { id: h } => cm_reply(self.cm.establish(id, h), "rdma_establish"),
            Request::CmDisconnect { id: h } => {
                cm_reply(self.cm.disconnect(id, h), "rdma_disconnect")
            }
            Request::CmTakeEvent { id: h } => match self.cm.take_event(id, h) {
                Ok(Some(ev)) => Reply::CmEvent(Box::new(ev)),
                Ok(None) => err(libc::EAGAIN, "no CM event queued"),
                Err(e) => err(e, "CM event"),
            },
            Request::ReregMr { mr, pd, access } => {
                match self.engine.rereg_mr(id, MrId(mr), pd.map(PdId), access) {
                    Ok(()) => Reply::Ok,
                    Err(e) => err(e, "rereg_mr"),
                }
            }
            _ => err(libc::EOPNOTSUPP, "request not supported by this daemon"),
        }
    }

    fn create_srq(&mut self, id: CtxId, pd: PdId, max_wr: u32, max_sge: u32, limit: u32) -> Reply {
        let Some(ctx) = self.ctxs.get(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let vnic = ctx.vnic;
        if max_wr == 0 || max_wr > MAX_QP_WR || max_sge as usize > vrnic_wire::MAX_SGE {
            return err(libc::EINVAL, "SRQ capabilities exceed the device limits");
        }
        if self.per_vnic(vnic, |c| c.srqs.len()) >= self.opts.limits.max_srq as usize {
            return err(libc::ENOMEM, "SRQ limit of the vRNIC reached");
        }
        let depth = max_wr.next_power_of_two();
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let Some(ring) = alloc_ring(v, depth, RQ_SLOT) else {
            return err(libc::ENOMEM, "no memory for the SRQ ring");
        };
        match self.engine.create_srq(id, pd, max_wr, max_sge, limit) {
            Ok((srq, _)) => {
                self.srqs.insert(
                    srq,
                    SrqSlot {
                        vnic,
                        ring,
                        fetched: 0,
                        cons: 0,
                        broken: false,
                    },
                );
                if let Some(c) = self.ctxs.get_mut(&id) {
                    c.srqs.insert(srq);
                }
                Reply::Srq {
                    srq: srq.0,
                    ring: ring.offset(),
                    depth,
                }
            }
            Err(e) => {
                free_ring(v, ring.offset(), depth, RQ_SLOT);
                err(e, "create_srq")
            }
        }
    }

    fn reg_mr(
        &mut self,
        id: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Reply {
        let page = layout::PAGE;
        let Some(vnic) = self.ctxs.get(&id).map(|c| c.vnic) else {
            return err(libc::ENODEV, "no context");
        };
        if self.per_vnic(vnic, |c| c.mrs.len()) >= self.opts.limits.max_mr as usize {
            return err(libc::ENOMEM, "MR limit of the vRNIC reached");
        }
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Everything that needs no pages is checked before any work: a bad PD or an absurd
        // range costs nothing.
        if let Err(e) = self.engine.check_reg_mr(id, pd, addr, len, iova, access) {
            return err(e, "reg_mr");
        }
        let first = addr / page * page;
        let Some(end) = (addr + len).checked_next_multiple_of(page) else {
            return err(libc::EINVAL, "wrapping range");
        };
        let npages = (end - first) / page;
        // The quota, before any page is looked at: at most the pages this context already
        // holds plus the heap's free ones can back it.
        if npages > v.heap.free_bytes() / page + ctx.pages.len() as u64 {
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        }
        let missing: Vec<u64> = (0..npages)
            .map(|i| first + i * page)
            .filter(|va| !ctx.pages.contains_key(va))
            .collect();
        let Some(allocated) = v.heap.alloc_runs(missing.len() as u64) else {
            return err(
                libc::ENOMEM,
                format!("registering {len} bytes exceeds the vRNIC's free memory"),
            );
        };
        // Hand out the fresh pages in address order.
        let mut fresh_offs = allocated
            .iter()
            .flat_map(|&(off, n)| (0..n).map(move |i| off + i * page));
        let mut runs: Vec<PageRun> = Vec::new();
        let mut page_list = Vec::with_capacity(npages as usize);
        for i in 0..npages {
            let va = first + i * page;
            let (off, fresh) = match ctx.pages.get_mut(&va) {
                Some(e) => {
                    e.1 += 1;
                    (e.0, false)
                }
                None => {
                    // Invariant: we allocated exactly one page per missing va.
                    let off = fresh_offs.next().expect("one fresh page per missing va");
                    ctx.pages.insert(va, (off, 1));
                    (off, true)
                }
            };
            page_list.push(off);
            match runs.last_mut() {
                Some(r)
                    if r.fresh == fresh
                        && r.va + u64::from(r.pages) * page == va
                        && r.off + u64::from(r.pages) * page == off =>
                {
                    r.pages += 1
                }
                _ => runs.push(PageRun {
                    va,
                    off,
                    pages: 1,
                    fresh,
                }),
            }
        }
        match self
            .engine
            .reg_mr(id, pd, addr, len, iova, access, page_list)
        {
            Ok(keys) => {
                ctx.mrs.insert(keys.mr, (first, npages));
                Reply::Mr {
                    mr: keys.mr.0,
                    lkey: keys.lkey,
                    rkey: keys.rkey,
                    runs,
                }
            }
            Err(e) => {
                // Undo the page references taken above.
                for i in 0..npages {
                    let va = first + i * page;
                    if let Some(entry) = ctx.pages.get_mut(&va) {
                        entry.1 -= 1;
                        if entry.1 == 0 {
                            let off = entry.0;
                            ctx.pages.remove(&va);
                            free_pages(v, off, 1);
                        }
                    }
                }
                err(e, "reg_mr")
            }
        }
    }

    fn dereg_mr(&mut self, id: CtxId, mr: MrId) -> Reply {
        let page = layout::PAGE;
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(&(first, npages)) = ctx.mrs.get(&mr) else {
            return err(libc::EINVAL, "no such MR");
        };
        if let Err(e) = self.engine.dereg_mr(id, mr) {
            return err(e, "dereg_mr");
        }
        ctx.mrs.remove(&mr);
        let mut runs: Vec<PageRun> = Vec::new();
        for i in 0..npages {
            let va = first + i * page;
            let Some(entry) = ctx.pages.get_mut(&va) else {
                continue;
            };
            entry.1 -= 1;
            if entry.1 > 0 {
                continue;
            }
            let off = entry.0;
            ctx.pages.remove(&va);
            ctx.detaching.insert(off);
            match runs.last_mut() {
                Some(r)
                    if r.va + u64::from(r.pages) * page == va
                        && r.off + u64::from(r.pages) * page == off =>
                {
                    r.pages += 1
                }
                _ => runs.push(PageRun {
                    va,
                    off,
                    pages: 1,
                    fresh: false,
                }),
            }
        }
        Reply::Detach { runs }
    }

    fn release_pages(&mut self, id: CtxId, runs: &[PageRun]) -> Reply {
        let page = layout::PAGE;
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        // Work in proportion to the runs and to the pages really detaching, whatever the runs
        // claim (a run of 2^20 pages that names none costs one lookup).
        for r in runs {
            let end = r.off.saturating_add(u64::from(r.pages) * page);
            let offs: Vec<u64> = ctx.detaching.range(r.off..end).copied().collect();
            for off in offs {
                ctx.detaching.remove(&off);
                free_pages(v, off, 1);
            }
        }
        Reply::Ok
    }

    fn create_cq(&mut self, id: CtxId, cqe: u32) -> Reply {
        let Some(ctx) = self.ctxs.get(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let vnic = ctx.vnic;
        if cqe == 0 || cqe > MAX_CQE {
            return err(libc::EINVAL, format!("cqe {cqe} outside 1..={MAX_CQE}"));
        }
        if self.per_vnic(vnic, |c| c.cqs.len()) >= self.opts.limits.max_cq as usize {
            return err(libc::ENOMEM, "CQ limit of the vRNIC reached");
        }
        let depth = cqe.next_power_of_two();
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let Some(ring) = alloc_ring(v, depth, CQ_SLOT) else {
            return err(libc::ENOMEM, "no memory for the CQ ring");
        };
        match self.engine.create_cq(vnic, id, depth) {
            Ok(cq) => {
                self.cqs.insert(
                    cq,
                    CqSlot {
                        vnic,
                        ctx: id,
                        ring,
                        prod: 0,
                        broken: false,
                    },
                );
                if let Some(c) = self.ctxs.get_mut(&id) {
                    c.cqs.insert(cq);
                }
                Reply::Cq {
                    cq: cq.0,
                    ring: ring.offset(),
                    depth,
                }
            }
            Err(e) => {
                free_ring(v, ring.offset(), depth, CQ_SLOT);
                err(e, "create_cq")
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn create_qp(
        &mut self,
        id: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
        qp_type: vrnic_wire::QpType,
        mut cap: vrnic_wire::QpCap,
        sq_sig_all: bool,
    ) -> Reply {
        let Some(ctx) = self.ctxs.get(&id) else {
            return err(libc::ENODEV, "no context");
        };
        let vnic = ctx.vnic;
        if self.per_vnic(vnic, |c| c.qps.len()) >= self.opts.limits.max_qp as usize {
            return err(libc::ENOMEM, "QP limit of the vRNIC reached");
        }
        if cap.max_send_wr > MAX_QP_WR
            || cap.max_recv_wr > MAX_QP_WR
            || cap.max_send_sge as usize > vrnic_wire::MAX_SGE
            || cap.max_recv_sge as usize > vrnic_wire::MAX_SGE
            || cap.max_inline_data as usize > vrnic_wire::MAX_INLINE
        {
            return err(libc::EINVAL, "QP capabilities exceed the device limits");
        }
        if srq.is_some() {
            // Receives come from the SRQ: the QP's own receive ring stays minimal and unused.
            cap.max_recv_wr = 0;
            cap.max_recv_sge = 0;
        }
        let sq_depth = cap.max_send_wr.max(1).next_power_of_two();
        let rq_depth = cap.max_recv_wr.max(1).next_power_of_two();
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        let Some(sq) = alloc_ring(v, sq_depth, SQ_SLOT) else {
            return err(libc::ENOMEM, "no memory for the send ring");
        };
        let Some(rq) = alloc_ring(v, rq_depth, RQ_SLOT) else {
            free_ring(v, sq.offset(), sq_depth, SQ_SLOT);
            return err(libc::ENOMEM, "no memory for the receive ring");
        };
        cap.max_send_wr = cap.max_send_wr.max(1);
        cap.max_send_sge = cap.max_send_sge.max(1);
        if srq.is_none() {
            cap.max_recv_wr = cap.max_recv_wr.max(1);
            cap.max_recv_sge = cap.max_recv_sge.max(1);
        }
        cap.max_inline_data = vrnic_wire::MAX_INLINE as u32;
        match self
            .engine
            .create_qp_srq(id, pd, send_cq, recv_cq, srq, qp_type, cap, sq_sig_all)
        {
            Ok((qp, qpn)) => {
                self.qps.insert(
                    qp,
                    QpSlot {
                        vnic,
                        sq,
                        rq,
                        sq_fetched: 0,
                        rq_fetched: 0,
                        sq_cons: 0,
                        rq_cons: 0,
                        broken: false,
                    },
                );
                if let Some(c) = self.ctxs.get_mut(&id) {
                    c.qps.insert(qp);
                }
                Reply::Qp {
                    qp: qp.0,
                    qpn,
                    sq: sq.offset(),
                    sq_depth,
                    rq: rq.offset(),
                    rq_depth,
                    cap,
                }
            }
            Err(e) => {
                free_ring(v, sq.offset(), sq_depth, SQ_SLOT);
                free_ring(v, rq.offset(), rq_depth, RQ_SLOT);
                err(e, "create_qp")
            }
        }
    }

    // ---- the data path ---------------------------------------------------------------------

    /// One pass over every ring: new work requests into the engine, engine work, completions
    /// and retired indices out. Returns whether anything happened.
    fn engine_pass(&mut self, now: Instant) -> bool {
        let mut work = false;
        let mut sq_slot = [0u8; SQ_SLOT];
        let mut rq_slot = [0u8; RQ_SLOT];
        for (&qp, slot) in self.qps.iter_mut() {
            if slot.broken {
                continue;
            }
            let Some(v) = self.vnics.get(&slot.vnic) else {
                continue;
            };
            let region = &v.region;
            // Send ring, then receive ring: copy new slots out once, parse, hand to the engine.
            let room = self.engine.sq_room(qp);
            match pending(
                &slot.sq,
                region,
                slot.sq_fetched,
                self.engine.sq_retired(qp),
                room,
            ) {
                Ok(n) => {
                    for _ in 0..n {
                        slot.sq.read_slot(region, slot.sq_fetched, &mut sq_slot);
                        slot.sq_fetched = slot.sq_fetched.wrapping_add(1);
                        self.engine
                            .handle_send_wqe(now, qp, SendWqe::parse(&sq_slot));
                        work = true;
                    }
                }
                Err(e) => {
                    warn!(qp = qp.0, "send ring: {e}; failing the QP");
                    slot.broken = true;
                    self.engine.handle_send_wqe(now, qp, Err(e));
                    work = true;
                    continue;
                }
            }
            let room = self.engine.rq_room(qp);
            match pending(
                &slot.rq,
                region,
                slot.rq_fetched,
                self.engine.rq_retired(qp),
                room,
            ) {
                Ok(n) => {
                    for _ in 0..n {
                        slot.rq.read_slot(region, slot.rq_fetched, &mut rq_slot);
                        slot.rq_fetched = slot.rq_fetched.wrapping_add(1);
                        self.engine
                            .handle_recv_wqe(now, qp, RecvWqe::parse(&rq_slot));
                        work = true;
                    }
                }
                Err(e) => {
                    warn!(qp = qp.0, "receive ring: {e}; failing the QP");
                    slot.broken = true;
                    self.engine.handle_recv_wqe(now, qp, Err(e));
                    work = true;
                }
            }
        }
        // SRQ rings, walked by key so no list is built on the data path.
        let mut next = self.srqs.keys().next().copied();
        while let Some(srq) = next {
            work |= self.fetch_srq(srq);
            next = self
                .srqs
                .range((std::ops::Bound::Excluded(srq), std::ops::Bound::Unbounded))
                .next()
                .map(|(&k, _)| k);
        }
        if self.engine.process(now, &mut Mem(&self.vnics)) {
            work = true;
        }
        // Retired indices first, completions second: an app that sees a completion must also
        // see the ring slot it frees (perftest posts again as soon as it polls one).
        for (&qp, slot) in self.qps.iter_mut() {
            let Some(v) = self.vnics.get(&slot.vnic) else {
                continue;
            };
            let sq = self.engine.sq_retired(qp);
            if sq != slot.sq_cons {
                slot.sq_cons = sq;
                slot.sq.cons(&v.region).store(sq, Ordering::Release);
            }
            let rq = self.engine.rq_retired(qp);
            if rq != slot.rq_cons {
                slot.rq_cons = rq;
                slot.rq.cons(&v.region).store(rq, Ordering::Release);
            }
        }
        for (&srq, slot) in self.srqs.iter_mut() {
            let Some(v) = self.vnics.get(&slot.vnic) else {
                continue;
            };
            let r = self.engine.srq_retired(srq);
            if r != slot.cons {
                slot.cons = r;
                slot.ring.cons(&v.region).store(r, Ordering::Release);
            }
        }
        while let Some((cq, cqe, solicited)) = self.engine.poll_completion() {
            work = true;
            self.post_cqe(cq, &cqe, solicited);
        }
        while let Some((ctx, ev)) = self.engine.poll_event() {
            work = true;
            let (kind, handle) = match ev {
                vrnic_proto::Event::QpFatal { qp } => (vrnic_api::event::QP_FATAL, qp.0),
                vrnic_proto::Event::CqError { cq } => (vrnic_api::event::CQ_ERR, cq.0),
                vrnic_proto::Event::SrqLimit { srq } => {
                    (vrnic_api::event::SRQ_LIMIT_REACHED, srq.0)
                }
                vrnic_proto::Event::SrqError { srq } => (vrnic_api::event::SRQ_ERR, srq.0),
                vrnic_proto::Event::LastWqeReached { qp } => {
                    (vrnic_api::event::QP_LAST_WQE_REACHED, qp.0)
                }
            };
            self.push_event(ctx, kind, handle);
        }
        self.flush_wakes();
        work
    }

    fn push_event(&mut self, ctx: CtxId, kind: u32, handle: u32) {
        let Some(c) = self.ctxs.get_mut(&ctx) else {
            return;
        };
        let Some(v) = self.vnics.get(&c.vnic) else {
            return;
        };
        if !c
            .mailbox
            .push_event(&v.region, &mut c.ev_prod, kind, handle)
        {
            warn!(ctx = ctx.0, kind, "async event ring full; event dropped");
        }
        c.wake = true;
    }

    fn post_cqe(&mut self, cq: CqId, cqe: &Cqe, solicited: bool) {
        let Some(slot) = self.cqs.get_mut(&cq) else {
            return;
        };
        let Some(v) = self.vnics.get(&slot.vnic) else {
            return;
        };
        if slot.broken {
            return;
        }
        let region = &v.region;
        let cons = slot.ring.cons(region).load(Ordering::Acquire);
        if slot.prod.wrapping_sub(cons) >= slot.ring.depth() {
            // Overflow (or a garbage consumer index): the CQ is in error, as on a device.
            warn!(cq = cq.0, "completion queue overrun; CQ in error");
            slot.broken = true;
            let ctx = slot.ctx;
            self.push_event(ctx, vrnic_api::event::CQ_ERR, cq.0);
            return;
        }
        let mut raw = [0u8; CQ_SLOT];
        let stamped = Cqe {
            timestamp_ns: sys::monotonic_ns(),
            ..*cqe
        };
        stamped.encode(&mut raw);
        slot.ring.write_slot(region, slot.prod, &raw);
        slot.prod = slot.prod.wrapping_add(1);
        slot.ring.prod(region).store(slot.prod, Ordering::Release);
        // Store-then-load against the driver's arm-then-poll: without a full fence both sides
        // could miss each other (the CQE unseen by the poll, the arm unseen here).
        fence(Ordering::SeqCst);
        // Arm word: 1 = next completion, 2 = next solicited completion.
        let arm = slot.ring.arm(region);
        let a = arm.load(Ordering::Acquire);
        if (a == 1 || (a == 2 && solicited))
            && arm
                .compare_exchange(a, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            let n = slot.ring.notify(region).fetch_add(1, Ordering::AcqRel);
            tracing::trace!(cq = cq.0, notify = n + 1, "CQ event");
            let ctx = slot.ctx;
            self.notify_ctx(ctx);
        }
    }

    fn shutdown(&mut self) {
        let ids: Vec<VnicId> = self.vnics.keys().copied().collect();
        for id in ids {
            self.remove_vnic(id);
        }
        let dir = self.opts.state_dir.clone();
        let _ = std::fs::remove_file(dir.join(ADMIN_SOCKET));
        if self.mounted {
            sys::unmount(&dir);
        }
        let _ = std::fs::remove_file(dir.join(config::LOCK_FILE));
        info!("vrnic daemon stopped");
    }
}

/// Writes as much of `out` as the non-blocking `stream` takes now and drops what was written.
fn flush(stream: &mut UnixStream, out: &mut Vec<u8>) -> std::io::Result<()> {
    let mut done = 0;
    while done < out.len() {
        match stream.write(&out[done..]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    out.drain(..done);
    Ok(())
}

/// How many new work requests to take from a send or receive ring now. The producer index
/// comes from the region (hostile): more outstanding entries than the ring holds is an error.
fn pending(
    ring: &Ring,
    region: &Region,
    fetched: u32,
    retired: u32,
    room: u32,
) -> Result<u32, vrnic_wire::ParseError> {
    let prod = ring.prod(region).load(Ordering::Acquire);
    if prod.wrapping_sub(retired) > ring.depth() || prod.wrapping_sub(fetched) > ring.depth() {
        return Err(vrnic_wire::ParseError::ProducerIndex(prod));
    }
    Ok(prod.wrapping_sub(fetched).min(room).min(RING_BATCH))
}

fn alloc_ring(v: &mut Vnic, depth: u32, slot: usize) -> Option<Ring> {
    let bytes = layout::ring_bytes(depth, slot);
    let off = v.heap.alloc_contiguous(bytes / layout::PAGE)?;
    let ring = Ring::new(&v.region, off, depth, slot).ok()?;
    ring.reset(&v.region);
    Some(ring)
}

fn free_ring(v: &mut Vnic, off: u64, depth: u32, slot: usize) {
    free_pages(v, off, layout::ring_bytes(depth, slot) / layout::PAGE);
}

/// Gives pages back to the heap, zeroed: punched out of the file (their memory returns to the
/// host), or, where the file system cannot punch, overwritten with zeros. A page handed out
/// again reads as zeros; drivers rely on it (they do not copy untouched pages on
/// registration), and no context sees another's old bytes.
fn free_pages(v: &mut Vnic, off: u64, pages: u64) {
    let len = pages * layout::PAGE;
    if v.region.punch(off, len).is_err() {
        let zeros = [0u8; layout::PAGE as usize];
        for p in 0..pages {
            let _ = v.region.write_bytes(off + p * layout::PAGE, &zeros);
        }
    }
    v.heap.free(off, pages);
}

/// Removes a vRNIC's directory: its files, then (lazily: apps may still map the region) its
/// tmpfs, then the mount point.
fn remove_vnic_dir(dir: &Path, quota_mount: bool) {
    let _ = std::fs::remove_dir_all(dir);
    if quota_mount {
        if let Err(e) = sys::detach(dir) {
            warn!("unmount {}: {e}", dir.display());
        }
        let _ = std::fs::remove_dir(dir);
    }
}

/// Removes vRNIC directories a dead daemon left behind. Returns how many.
fn cleanup_stale(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for e in entries.flatten() {
        let p = e.path();
        // A vRNIC's directory, or an empty one: a killed daemon may have been removing it and
        // got as far as its files. Its quota tmpfs, if any, goes too (a detach of a plain dir
        // fails harmlessly).
        let empty = || std::fs::read_dir(&p).is_ok_and(|mut d| d.next().is_none());
        if e.file_type().is_ok_and(|t| t.is_dir())
            && (p.join(REGION_FILE).exists() || p.join(VNIC_SOCKET).exists() || empty())
        {
            let _ = std::fs::remove_dir_all(&p);
            let _ = sys::detach(&p);
            if std::fs::remove_dir_all(&p).is_ok() {
                n += 1;
            }
        }
    }
    n
}
