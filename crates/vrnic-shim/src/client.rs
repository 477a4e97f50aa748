//! The safe core of the driver library: finding the vRNIC, attaching to it (a context), the
//! control calls over the region's mailbox, the data-path rings, and the notifier thread that
//! turns the daemon's notifications into readable file descriptors.
//!
//! A context reaches the daemon in one of two ways. A host process (or a container, which has
//! the vRNIC's directory bind-mounted) connects the vRNIC's socket: the daemon hands it a
//! mailbox, wakes it with a byte, and learns of its death when the kernel closes the socket. A
//! VM guest has only the region, as the PCI BAR of an `ivshmem-plain` device: it claims a
//! mailbox in the region itself, polls where the host would wake it, and keeps a heartbeat so
//! the daemon can reclaim a dead guest's objects (`Link::Region`).
//!
//! Nothing here knows C types; `ffi` converts between the verbs structs and these calls.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vrnic_api::{DeviceInfo, Reply, Request, event};
use vrnic_shm::layout::hdr;
use vrnic_shm::{Mailbox, Region, Ring, Spin};
use vrnic_wire::{CQ_SLOT, CQE_SEQ, Cqe, RQ_HEADER, RQ_SLOT, RecvWqe, SQ_HEADER, SQ_SLOT, SendWqe};

use crate::cq_events::CqEvents;
use crate::sys::{self, EventFd};

/// Environment variable naming the vRNIC directory (set by `vrnic run`).
pub const DEVICE_ENV: &str = "VRNIC_DEVICE";
/// Where a container finds its vRNIC when the variable is unset (the bind-mount target).
pub const CONTAINER_DEVICE_DIR: &str = "/run/vrnic-device";
/// Setting this to 1 makes a host process attach the way a VM guest does: through the region
/// alone, without the socket (tests the guest's path without a VM).
pub const REGION_ONLY_ENV: &str = "VRNIC_REGION_ONLY";
/// Where a VM guest finds vRNICs: `ivshmem-plain` PCI devices, whose BAR2 is the region.
const PCI_DEVICES: &str = "/sys/bus/pci/devices";
/// PCI vendor and device id of QEMU's ivshmem (`1af4:1110`).
const IVSHMEM_ID: (&str, &str) = ("0x1af4", "0x1110");
/// How long a region-only context waits for the daemon to accept its claim.
const ATTACH_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a region-only context advances its heartbeat (the daemon's lease is 5 s).
const BEAT_EVERY: Duration = Duration::from_millis(100);
/// A region-only context takes the daemon for dead when its heartbeat stalls this long.
const DAEMON_LEASE: Duration = Duration::from_secs(10);
/// How often a region-only context's notifier looks at the notification words.
const GUEST_POLL: Duration = Duration::from_millis(1);

/// How long a control call may wait for the daemon.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether `VRNIC_LOG` asks the library to explain failures on stderr.
pub fn log_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("VRNIC_LOG").is_some_and(|v| !v.is_empty() && v != "0"))
}

/// Prints a diagnostic when `VRNIC_LOG` is set; silent otherwise.
macro_rules! vlog {
    ($($arg:tt)*) => {
        if $crate::client::log_enabled() {
            eprintln!("vrnic: {}", format_args!($($arg)*));
        }
    };
}
pub(crate) use vlog;

/// Why attaching failed, on stderr: always where the environment names a vRNIC
/// (`$VRNIC_DEVICE`, as `vrnic run` sets it, or a container's device mount, as `vrnic
/// docker-args` makes it: the app was meant to have one, and "No IB devices found" alone would
/// hide why), else only with `VRNIC_LOG`. Each
/// distinct line once per process (apps list devices more than once).
pub fn attach_failed(msg: std::fmt::Arguments<'_>) {
    let named = std::env::var_os(DEVICE_ENV).is_some_and(|d| !d.is_empty())
        || Path::new(CONTAINER_DEVICE_DIR).join("region").exists();
    if !(named || log_enabled()) {
        return;
    }
    static SAID: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let line = msg.to_string();
    if let Ok(mut said) = SAID.lock() {
        if said.contains(&line) {
            return;
        }
        said.push(line.clone());
    }
    eprintln!("vrnic: {line}");
}

/// The error and its causes, `: `-joined.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(&format!(": {c}"));
        cur = c.source();
    }
    s
}

/// A vRNIC this process can attach to.
#[derive(Debug, Clone)]
pub struct Device {
    /// Its directory (a vRNIC directory, or a guest's PCI device directory): its identity.
    pub dir: PathBuf,
    /// The region: the file in the vRNIC's directory, or a guest's `resource2`.
    pub region: PathBuf,
    /// The vRNIC's socket, or `None` to attach through the region alone (a VM guest).
    pub socket: Option<PathBuf>,
    /// Its name.
    pub name: String,
    /// Node GUID, network byte order.
    pub guid: u64,
}

/// Finds the vRNICs: `$VRNIC_DEVICE` (a vRNIC directory, or a region file to attach to through
/// the region alone), else the container mount point, else (in a VM guest) every ivshmem PCI
/// device whose BAR2 holds a region.
pub fn discover() -> Vec<Device> {
    let region_only = std::env::var_os(REGION_ONLY_ENV).is_some_and(|v| !v.is_empty() && v != "0");
    let from_dir = |dir: PathBuf| {
        let region = dir.join("region");
        let socket = (!region_only).then(|| dir.join("sock"));
        read_header(&dir, &region, socket)
    };
    if let Some(d) = std::env::var_os(DEVICE_ENV).filter(|d| !d.is_empty()) {
        let path = PathBuf::from(d);
        let dev = if path.is_dir() {
            from_dir(path.clone())
        } else {
            read_header(&path, &path, None)
        };
        return match dev {
            Ok(d) => vec![d],
            Err(why) => {
                attach_failed(format_args!(
                    "no vRNIC at {} (from ${DEVICE_ENV}): {why}",
                    path.display()
                ));
                Vec::new()
            }
        };
    }
    let container = PathBuf::from(CONTAINER_DEVICE_DIR);
    if container.join("region").exists() {
        let at = container.display().to_string();
        return match from_dir(container) {
            Ok(d) => vec![d],
            Err(why) => {
                attach_failed(format_args!("no vRNIC at {at}: {why}"));
                Vec::new()
            }
        };
    }
    let guest = pci_devices();
    if guest.is_empty() {
        vlog!(
            "no vRNIC: ${DEVICE_ENV} unset, nothing at {CONTAINER_DEVICE_DIR}, no ivshmem device \
             (run the program under `vrnic run`)"
        );
    }
    guest
}

/// The vRNICs of a VM guest: ivshmem devices (`1af4:1110`) whose BAR2 holds a region.
fn pci_devices() -> Vec<Device> {
    let Ok(entries) = std::fs::read_dir(PCI_DEVICES) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    dirs.sort();
    dirs.into_iter()
        .filter(|d| {
            let id = |f: &str| std::fs::read_to_string(d.join(f)).unwrap_or_default();
            id("vendor").trim() == IVSHMEM_ID.0 && id("device").trim() == IVSHMEM_ID.1
        })
        .filter_map(|d| {
            let bar = d.join("resource2");
            read_header(&d, &bar, None).ok()
        })
        .collect()
}

/// Reads a region's header (by mapping it: a PCI BAR cannot be `read`); why not, in words.
fn read_header(dir: &Path, region: &Path, socket: Option<PathBuf>) -> Result<Device, String> {
    let missing = |p: &Path| {
        std::fs::symlink_metadata(p).is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    };
    if missing(region) {
        let what = if missing(dir) {
            "no such file or directory".to_string()
        } else {
            format!("{} is missing", region.display())
        };
        return Err(format!(
            "{what} (is the vRNIC's directory visible to this process? a daemon in a mount \
             namespace of its own, as under `ip netns exec`, makes its vRNICs invisible outside \
             it: see docs/operations.md, \"Where the daemon runs\")"
        ));
    }
    let r = Region::open(region).map_err(|e| match &e {
        vrnic_shm::RegionError::Io { source, .. }
            if source.kind() == std::io::ErrorKind::PermissionDenied =>
        {
            format!(
                "{}: permission denied (a vRNIC is its daemon's user's, or, on root's daemon, \
                 the user's whose `vrnic run` made it: run as that user, or as root)",
                region.display()
            )
        }
        vrnic_shm::RegionError::Format(_) => format!(
            "{} is not a vRNIC region, or one of another vrnic version than this driver \
             library's",
            region.display()
        ),
        _ => chain(&e),
    })?;
    let mut name_raw = [0u8; hdr::NAME_LEN];
    r.read_bytes(hdr::NAME, &mut name_raw)
        .map_err(|e| chain(&e))?;
    let end = name_raw
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(name_raw.len());
    let name = String::from_utf8_lossy(&name_raw[..end]).into_owned();
    let guid = r.read_u64(hdr::GUID).map_err(|e| chain(&e))?;
    Ok(Device {
        dir: dir.to_path_buf(),
        region: region.to_path_buf(),
        socket,
        name,
        guid,
    })
}

/// A completion channel: an fd the app polls, and the CQs whose events are pending on it.
#[derive(Debug)]
pub struct Channel {
    /// The fd.
    pub efd: EventFd,
    /// CQs (as `*mut ibv_cq` addresses) with an event not yet taken by `ibv_get_cq_event`.
    pub queue: Mutex<VecDeque<usize>>,
}

/// A CQ whose notifications the notifier thread forwards to a channel.
#[derive(Debug)]
struct Watch {
    ring: Ring,
    seen: u32,
    channel: Arc<Channel>,
    events: Arc<CqEvents>,
}

/// Async events waiting for `ibv_get_async_event`.
#[derive(Debug)]
pub struct AsyncQueue {
    /// The fd (`context->async_fd`).
    pub efd: EventFd,
    /// `(ibv_event_type, object handle)`.
    pub queue: Mutex<VecDeque<(u32, u32)>>,
    /// Held while events move from the mailbox's ring into `queue`, so that
    /// [`Conn::withdraw_events`] sees every event the daemon sent before it.
    forwarding: Mutex<()>,
}

/// An attached context: one `ibv_open_device`.
#[derive(Debug)]
pub struct Conn {
    /// The vRNIC's region, mapped whole.
    pub region: Region,
    /// The vRNIC's socket; `None` for a region-only context (a VM guest).
    stream: Option<UnixStream>,
    mailbox: Mailbox,
    seq: Mutex<u32>,
    /// Identity and limits.
    pub info: DeviceInfo,
    dead: AtomicBool,
    stop: AtomicBool,
    /// Set by the notifier thread once it runs.
    started: AtomicBool,
    /// The armed CQs' watches: `[0]` the opener's, `[1]` a forked child's (a map of its own,
    /// since the parent's notifier may hold `[0]`'s lock at the instant of the fork, and the
    /// child's copy of a held lock would never be released).
    watches: [Mutex<HashMap<usize, Watch>>; 2],
    /// Async events.
    pub async_q: AsyncQueue,
    notifier: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The process that opened the context (its notifier thread is the one in `notifier`).
    opener: u32,
    /// The process whose notifier thread serves this copy of the context: after a `fork`, the
    /// child's copy still names the parent until [`Conn::ensure_notifier`] starts one of its own.
    notifier_pid: std::sync::atomic::AtomicU32,
}

impl Conn {
    /// Attaches to `dev`: connects its socket (the daemon assigns a mailbox and from then on
    /// knows when this process dies), or, for a region-only device, claims a mailbox in the
    /// region; then maps its region and asks for its attributes.
    pub fn open(dev: &Device) -> Result<Arc<Conn>, i32> {
        let (stream, region, mailbox) = match &dev.socket {
            Some(sock) => {
                let (stream, mailbox) = connect(sock)?;
                (Some(stream), open_region(&dev.region)?, mailbox)
            }
            None => {
                let region = open_region(&dev.region)?;
                let mailbox = claim(&region)?;
                (None, region, mailbox)
            }
        };
        let leave = |e: i32, region: &Region| {
            if dev.socket.is_none() {
                mailbox.leave(region);
            }
            e
        };
        let efd = EventFd::new().map_err(|_| leave(libc::EMFILE, &region))?;
        let mut conn = Conn {
            region,
            stream,
            mailbox,
            seq: Mutex::new(0),
            info: DeviceInfo {
                name: dev.name.clone(),
                guid: dev.guid,
                lid: 0,
                gid: [0; 16],
                max_qp: 0,
                max_qp_wr: 0,
                max_cq: 0,
                max_cqe: 0,
                max_mr: 0,
                max_pd: 0,
                max_mr_size: 0,
                max_srq: 0,
                max_mw: 0,
            },
            dead: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            started: AtomicBool::new(false),
            watches: [Mutex::new(HashMap::new()), Mutex::new(HashMap::new())],
            async_q: AsyncQueue {
                efd,
                queue: Mutex::new(VecDeque::new()),
                forwarding: Mutex::new(()),
            },
            notifier: Mutex::new(None),
            opener: std::process::id(),
            notifier_pid: std::sync::atomic::AtomicU32::new(std::process::id()),
        };
        match conn.call(&Request::QueryDevice) {
            Ok(Reply::Device(info)) => conn.info = info,
            Ok(_) => return Err(leave(libc::EPROTO, &conn.region)),
            Err(e) => return Err(leave(e, &conn.region)),
        }
        let conn = Arc::new(conn);
        let weak = Arc::downgrade(&conn);
        let opener = std::thread::current();
        let handle = std::thread::Builder::new()
            .name("vrnic-notify".into())
            .spawn(move || {
                if let Some(c) = weak.upgrade() {
                    c.started.store(true, Ordering::Release);
                }
                opener.unpark();
                notifier(weak)
            })
            .map_err(|_| leave(libc::EAGAIN, &conn.region))?;
        // The new thread frees what its start allocated (in this thread's heap pages) before it
        // reaches us: not later, while the app registers memory ([`moving`]).
        while !conn.started.load(Ordering::Acquire) {
            std::thread::park_timeout(Duration::from_millis(10));
        }
        if let Ok(mut n) = conn.notifier.lock() {
            *n = Some(handle);
        }
        Ok(conn)
    }

    /// The watches of this process (see `watches`).
    fn watch_map(&self) -> &Mutex<HashMap<usize, Watch>> {
        &self.watches[usize::from(self.inherited())]
    }

    /// Whether this is a forked child's copy of a context its parent opened. Such a child may
    /// use the context (as a child may use a device context inherited through `fork`); it
    /// shares the parent's control mailbox and socket, so the two must not make control calls
    /// at the same time, and closing it leaves the parent's context alone.
    pub fn inherited(&self) -> bool {
        self.opener != std::process::id()
    }

    /// Makes sure a notifier thread runs in this process. `fork` leaves the opener's notifier
    /// behind: in a child the completion channels of CQs it creates would never become
    /// readable (a lost wake-up: an event-mode wait hangs). The child gets a notifier of its
    /// own, which polls the notification words (every `GUEST_POLL`, as a VM guest's does:
    /// the daemon's wake-up bytes go to the socket the parent's notifier reads). It serves the
    /// CQs the child creates (in a watch map of its own); those created before the fork stay the
    /// parent's.
    pub fn ensure_notifier(self: &Arc<Self>) {
        let me = std::process::id();
        let cur = self.notifier_pid.load(Ordering::Acquire);
        if cur == me
            || self
                .notifier_pid
                .compare_exchange(cur, me, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
        let weak = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("vrnic-notify".into())
            .spawn(move || forked_notifier(weak));
        if spawned.is_err() {
            vlog!("cannot start a notifier thread in the forked child; events will not come");
        }
    }

    /// The fd exposed as `context->cmd_fd`: the socket, or (region-only) the async-event fd.
    pub fn fd(&self) -> i32 {
        match &self.stream {
            Some(s) => s.as_raw_fd(),
            None => self.async_q.efd.fd(),
        }
    }

    /// Sends a control request and waits for its reply; `Reply::Err` becomes its errno.
    pub fn call(&self, req: &Request) -> Result<Reply, i32> {
        if self.dead.load(Ordering::Acquire) {
            return Err(libc::ENODEV);
        }
        let bytes = serde_json::to_vec(req).map_err(|_| libc::EINVAL)?;
        let mut seq = self.seq.lock().map_err(|_| libc::EIO)?;
        *seq = seq.wrapping_add(1);
        let stream = &self.stream;
        let dead = &self.dead;
        let r = self.mailbox.call(
            &self.region,
            *seq,
            &bytes,
            &mut || {
                if let Some(s) = stream {
                    let _ = (&*s).write(&[0u8]);
                }
            },
            &mut || !dead.load(Ordering::Acquire) && self.daemon_alive(),
            CALL_TIMEOUT,
        );
        let out = match r {
            Ok(out) => out,
            Err(e) => {
                vlog!("control call failed: {e}");
                return Err(match e {
                    vrnic_shm::WaitError::TooLarge(_) => libc::EINVAL,
                    vrnic_shm::WaitError::Timeout(_) => libc::ETIMEDOUT,
                    _ => libc::ENODEV,
                });
            }
        };
        match serde_json::from_slice::<Reply>(&out) {
            Ok(Reply::Err { errno, msg }) => {
                vlog!("{req:?} failed: {msg} (errno {errno})");
                Err(errno)
            }
            Ok(r) => Ok(r),
            Err(_) => Err(libc::EPROTO),
        }
    }

    fn daemon_alive(&self) -> bool {
        self.region
            .atomic_u32(hdr::DAEMON_STATE)
            .map(|w| w.load(Ordering::Acquire) == 1)
            .unwrap_or(false)
    }

    /// After publishing work: wakes the engine if it announced that it sleeps. The SeqCst
    /// fence orders our producer-index store before the read of the sleeping word, pairing
    /// with the engine's store-then-recheck (no lost wake-up).
    pub fn doorbell(&self) {
        // A region-only context cannot wake the daemon: it polls a guest's rings.
        let Some(stream) = &self.stream else { return };
        fence(Ordering::SeqCst);
        if let Ok(w) = self.region.atomic_u32(hdr::ENGINE_SLEEPING)
            && w.load(Ordering::SeqCst) != 0
            && w.swap(0, Ordering::SeqCst) != 0
        {
            let _ = (&*stream).write(&[0u8]);
        }
    }

    /// Starts forwarding `ring`'s notifications (CQ `cq`, an `ibv_cq` address) to `channel`.
    pub fn watch(&self, cq: usize, ring: Ring, channel: Arc<Channel>, events: Arc<CqEvents>) {
        let seen = ring.notify(&self.region).load(Ordering::Acquire);
        if let Ok(mut w) = self.watch_map().lock() {
            w.insert(
                cq,
                Watch {
                    ring,
                    seen,
                    channel,
                    events,
                },
            );
        }
    }

    /// Runs `f` with the CQ watches held (no CQ event is forwarded meanwhile), then points
    /// the watch of `cq`, if it has one, at the ring `f` returned, keeping the notification
    /// count it had seen: a CQ's ring moves (`ibv_resize_cq`) without the notifier reading
    /// the old ring after the daemon freed it. The daemon carries the count over to the new
    /// ring.
    pub fn move_watch<T>(&self, cq: usize, f: impl FnOnce() -> (T, Option<Ring>)) -> T {
        let Ok(mut w) = self.watch_map().lock() else {
            return f().0;
        };
        let (out, ring) = f();
        if let (Some(ring), Some(watch)) = (ring, w.get_mut(&cq)) {
            watch.ring = ring;
        }
        out
    }

    /// Stops forwarding for `cq`.
    pub fn unwatch(&self, cq: usize) {
        if let Ok(mut w) = self.watch_map().lock() {
            w.remove(&cq);
        }
    }

    /// Detaches: the daemon sees the socket close (or, region-only, the mailbox move to
    /// `Detach`) and reclaims everything of this context.
    pub fn close(&self) {
        self.stop.store(true, Ordering::Release);
        if self.inherited() {
            // A forked child's copy: the context stays the parent's (no shutdown of the shared
            // socket, no leaving the shared mailbox), and the parent's notifier thread does not
            // exist here to be joined; the child's own notifier sees `stop` and ends.
            if let Ok(mut n) = self.notifier.lock()
                && let Some(h) = n.take()
            {
                std::mem::forget(h);
            }
            return;
        }
        if let Some(s) = &self.stream {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        let handle = self.notifier.lock().ok().and_then(|mut n| n.take());
        if let Some(h) = handle
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
        }
        if self.stream.is_none() {
            self.mailbox.leave(&self.region);
        }
    }

    /// Forwards pending notifications: async events, connection-manager events and
    /// armed-CQ events; not while pages move ([`moving`]).
    fn forward(&self) {
        let _m = moving();
        self.forward_events();
        self.forward_cqs();
    }

    /// Withdraws the async events not yet read that name `handle` with one of `kinds`: called
    /// once the daemon has destroyed that object, so that no event names it afterwards (the
    /// kernel's guarantee; UCX dereferences `element.qp`). The daemon sends no event for an
    /// object after its destroy reply, and the ones it sent before are forwarded here first.
    pub fn withdraw_events(&self, kinds: &[u32], handle: u32) {
        let _ring = self.forwarding();
        self.forward_ring();
        let Ok(mut q) = self.async_q.queue.lock() else {
            return;
        };
        let before = q.len();
        q.retain(|&(k, h)| !(h == handle && kinds.contains(&k)));
        let gone = before - q.len();
        drop(q);
        self.async_q.efd.take_nowait(gone);
    }

    /// Forwards the async and connection-manager events of the mailbox's event ring.
    fn forward_events(&self) {
        let _ring = self.forwarding();
        self.forward_ring();
    }

    /// `async_q.forwarding`, held; not in a forked child's copy of the context, whose copy of
    /// the lock may have been taken by the parent's notifier at the instant of the fork and
    /// would never be released (the child then forwards without it, as it always did).
    fn forwarding(&self) -> Option<std::sync::MutexGuard<'_, ()>> {
        if self.inherited() {
            return None;
        }
        self.async_q.forwarding.lock().ok()
    }

    /// [`Conn::forward_events`], with `forwarding` held.
    fn forward_ring(&self) {
        while let Some((kind, handle)) = self.mailbox.pop_event(&self.region) {
            if kind == event::CM {
                if let Some(sink) = CM_SINK.get() {
                    sink(handle);
                }
                continue;
            }
            if let Ok(mut q) = self.async_q.queue.lock() {
                q.push_back((kind, handle));
            }
            self.async_q.efd.signal();
        }
    }

    /// Forwards the events of armed CQs to their completion channels (those with a
    /// completion behind them: [`CqEvents::forward`]).
    fn forward_cqs(&self) {
        let Ok(mut watches) = self.watch_map().lock() else {
            return;
        };
        for (&cq, w) in watches.iter_mut() {
            let now = w.ring.notify(&self.region).load(Ordering::Acquire);
            let n = now.wrapping_sub(w.seen).min(1024);
            w.seen = now;
            w.events.forward(cq, n, &w.ring, &self.region, &w.channel);
        }
    }

    fn daemon_died(&self) {
        if !self.dead.swap(true, Ordering::AcqRel) {
            let removed = self
                .region
                .atomic_u32(hdr::DAEMON_STATE)
                .is_ok_and(|w| w.load(Ordering::Acquire) == hdr::STATE_REMOVED);
            if removed {
                vlog!(
                    "vRNIC {} was removed by the operator (vrnic rm --force); the device is unusable",
                    self.info.name
                );
            } else {
                vlog!("the vrnic daemon went away; the device is unusable");
            }
            if let Ok(mut q) = self.async_q.queue.lock() {
                q.push_back((event::DEVICE_FATAL, 0));
            }
            self.async_q.efd.signal();
        }
    }
}

/// The process that holds [`moving`], or 0.
static MOVING: AtomicU32 = AtomicU32::new(0);

/// Held while the driver moves an app's pages between private memory and the region (a
/// registration, an eviction), and by the notifier threads while they work: those allocate
/// and free, and the heap's bookkeeping may lie in a page being moved, where a write made
/// between the copy and the remap would be lost (the kernel's write protection, where
/// available, makes them wait anyway: `vrnic_shm::freeze`). A lock by process id rather than a
/// mutex: a forked child inherits the word set by a thread of its parent that the child does
/// not have, and takes it over.
pub fn moving() -> Moving {
    let me = std::process::id();
    loop {
        let cur = MOVING.load(Ordering::Acquire);
        if cur != me
            && MOVING
                .compare_exchange(cur, me, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            return Moving;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// [`moving`], held until dropped.
#[derive(Debug)]
pub struct Moving;

impl Drop for Moving {
    fn drop(&mut self) {
        MOVING.store(0, Ordering::Release);
    }
}

/// Where connection-manager announcements go (the `cm` module registers itself when it
/// opens its context).
static CM_SINK: std::sync::OnceLock<fn(u32)> = std::sync::OnceLock::new();

/// Registers the receiver of connection-manager announcements (`event::CM` entries).
pub fn set_cm_sink(f: fn(u32)) {
    let _ = CM_SINK.set(f);
}

/// The notifier thread: sleeps on the context's socket (the daemon writes a byte when it has
/// something to say) and on a timer; a region-only context polls instead (see
/// [`guest_notifier`]).
fn notifier(conn: std::sync::Weak<Conn>) {
    loop {
        let Some(c) = conn.upgrade() else { return };
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        let Some(stream) = &c.stream else {
            drop(c);
            return guest_notifier(conn);
        };
        let fd = stream.as_raw_fd();
        drop(c);
        let (readable, hup) = sys::poll_in(fd, 100);
        let Some(c) = conn.upgrade() else { return };
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        if readable && let Some(stream) = &c.stream {
            let mut buf = [0u8; 256];
            // 0 bytes means the daemon closed the socket.
            match (&*stream).read(&mut buf) {
                Ok(0) => {
                    c.forward();
                    c.daemon_died();
                    return;
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => {}
            }
        }
        if hup || !c.daemon_alive() {
            c.forward();
            c.daemon_died();
            return;
        }
        c.forward();
    }
}

/// The notifier of a region-only context: every [`GUEST_POLL`] it forwards notifications;
/// every [`BEAT_EVERY`] it advances the context's heartbeat and checks the daemon's, taking
/// the daemon for dead once its beat stalls for [`DAEMON_LEASE`].
fn guest_notifier(conn: std::sync::Weak<Conn>) {
    let mut last_beat = std::time::Instant::now();
    let mut daemon_beat = (0u32, std::time::Instant::now());
    loop {
        std::thread::sleep(GUEST_POLL);
        let Some(c) = conn.upgrade() else { return };
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        let now = std::time::Instant::now();
        if now.duration_since(last_beat) >= BEAT_EVERY {
            last_beat = now;
            c.mailbox.beat(&c.region);
            let b = c
                .region
                .atomic_u32(hdr::DAEMON_BEAT)
                .map(|w| w.load(Ordering::Acquire))
                .unwrap_or(0);
            if b != daemon_beat.0 {
                daemon_beat = (b, now);
            } else if now.duration_since(daemon_beat.1) > DAEMON_LEASE {
                vlog!("the vrnic daemon stopped its heartbeat");
                c.forward();
                c.daemon_died();
                return;
            }
        }
        if !c.daemon_alive() {
            c.forward();
            c.daemon_died();
            return;
        }
        c.forward();
    }
}

/// The notifier of a forked child using a context its parent opened: every [`GUEST_POLL`] it
/// forwards what the notification words say (the parent's notifier reads the socket's wake-up
/// bytes, so the child does not rely on them).
fn forked_notifier(conn: std::sync::Weak<Conn>) {
    loop {
        std::thread::sleep(GUEST_POLL);
        let Some(c) = conn.upgrade() else { return };
        if c.stop.load(Ordering::Acquire) {
            return;
        }
        // The mailbox's event ring (async and CM events) stays the parent's to read: both
        // popping it would split its events between them.
        let _m = moving();
        if !c.daemon_alive() {
            c.forward_cqs();
            c.daemon_died();
            return;
        }
        c.forward_cqs();
    }
}

/// Connects a vRNIC's socket and reads the mailbox the daemon assigns.
fn connect(sock: &Path) -> Result<(UnixStream, Mailbox), i32> {
    let mut stream = UnixStream::connect(sock).map_err(|e| {
        attach_failed(format_args!(
            "cannot reach the vrnic daemon at {}: {e} (is `vrnic serve` running, and is its \
             socket yours to use?)",
            sock.display()
        ));
        libc::ENODEV
    })?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let mut idx = [0u8; 4];
    stream.read_exact(&mut idx).map_err(|e| {
        vlog!("the vrnic daemon did not answer: {e}");
        libc::ENODEV
    })?;
    let mailbox = Mailbox::new(u32::from_le_bytes(idx)).ok_or_else(|| {
        vlog!("the vRNIC serves too many contexts");
        libc::EMFILE
    })?;
    let _ = stream.set_read_timeout(None);
    Ok((stream, mailbox))
}

fn open_region(path: &Path) -> Result<Region, i32> {
    Region::open(path).map_err(|e| {
        attach_failed(format_args!(
            "cannot map the vRNIC region {}: {}",
            path.display(),
            chain(&e)
        ));
        libc::ENODEV
    })
}

/// Region-only attach: claims a free mailbox and waits for the daemon to accept it, beating
/// meanwhile (the daemon looks for claims at least every 200 ms).
fn claim(region: &Region) -> Result<Mailbox, i32> {
    let mailbox = Mailbox::claim(region).ok_or_else(|| {
        vlog!("the vRNIC serves too many contexts");
        libc::EMFILE
    })?;
    let start = std::time::Instant::now();
    let mut beat = start;
    while !mailbox.accepted(region) {
        let alive = region
            .atomic_u32(hdr::DAEMON_STATE)
            .is_ok_and(|w| w.load(Ordering::Acquire) == 1);
        if !alive || start.elapsed() > ATTACH_TIMEOUT {
            mailbox.leave(region);
            vlog!("no vrnic daemon accepted this context (is `vrnic serve` running?)");
            return Err(libc::ENODEV);
        }
        if beat.elapsed() >= BEAT_EVERY {
            beat = std::time::Instant::now();
            mailbox.beat(region);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(mailbox)
}

/// A send or receive queue of a QP, as the driver sees it: it owns the producer index.
#[derive(Debug)]
pub struct WorkQueue {
    /// The ring.
    pub ring: Ring,
    /// Private producer index (the region's copy is only published).
    pub prod: u32,
    /// Its doorbell index: rung after each publish, so the daemon looks at this ring.
    bell: u32,
    /// Most work requests outstanding: the `max_send_wr`/`max_recv_wr`/`max_wr` the app was
    /// told at creation (the ring itself may be deeper: its depth is a power of two).
    limit: u32,
    /// The daemon's retired index as last read from the region (see
    /// [`has_room`](Self::has_room)): never ahead of the daemon's.
    cons_seen: u32,
}

impl WorkQueue {
    /// A queue over `ring`, announced by doorbell `bell`, holding at most `limit` work
    /// requests at a time (at least 1, at most the ring's depth).
    pub fn new(ring: Ring, bell: u32, limit: u32) -> WorkQueue {
        let limit = limit.clamp(1, ring.depth());
        WorkQueue {
            ring,
            prod: 0,
            bell,
            limit,
            cons_seen: 0,
        }
    }

    /// Moves the queue to `ring` (same indices, another depth) holding at most `limit` work
    /// requests: an SRQ resized by the daemon.
    pub fn resize(&mut self, ring: Ring, limit: u32) {
        self.ring = ring;
        self.limit = limit.clamp(1, ring.depth());
    }

    /// Whether `n` more work requests may be posted: the limit less those outstanding
    /// (posted and not yet retired by the daemon, whose retired index is the consumer).
    /// Posting past it is `ENOMEM`, as on a device whose queue is full. The retired index is
    /// read from the region only when the last one read leaves too little room, so a post
    /// does not take the cache line the daemon writes as it retires work.
    pub fn has_room(&mut self, region: &Region, n: u32) -> bool {
        let room = |cons: u32| self.limit.saturating_sub(self.prod.wrapping_sub(cons));
        if room(self.cons_seen) >= n {
            return true;
        }
        self.cons_seen = self.ring.cons(region).load(Ordering::Acquire);
        room(self.cons_seen) >= n
    }

    /// Starts the ring afresh from the daemon's retired index (a QP moved to RESET: the
    /// daemon dropped what the ring held and published that index before it answered).
    pub fn restart(&mut self, region: &Region) {
        self.cons_seen = self.ring.cons(region).load(Ordering::Acquire);
        self.prod = self.cons_seen;
        self.publish(region);
    }

    /// Writes a send WQE into the next slot (not yet published): only the bytes it uses, all
    /// the daemon reads.
    pub fn push_send(&mut self, region: &Region, wqe: &SendWqe) {
        let mut slot = [0u8; SQ_SLOT];
        wqe.encode(&mut slot);
        let used = SendWqe::used(slot[..SQ_HEADER].try_into().expect("a header"));
        self.ring.write_slot_head(region, self.prod, &slot[..used]);
        self.prod = self.prod.wrapping_add(1);
    }

    /// Writes a receive WQE into the next slot (not yet published): only the bytes it uses.
    pub fn push_recv(&mut self, region: &Region, wqe: &RecvWqe) {
        let mut slot = [0u8; RQ_SLOT];
        wqe.encode(&mut slot);
        let used = RecvWqe::used(slot[..RQ_HEADER].try_into().expect("a header"));
        self.ring.write_slot_head(region, self.prod, &slot[..used]);
        self.prod = self.prod.wrapping_add(1);
    }

    /// Publishes what was pushed and rings its doorbell bit (the daemon then looks at it),
    /// unless the daemon says it looks at this ring every pass anyway: then the doorbell's
    /// three words, which the daemon takes back after each pass, stay untouched. The fence
    /// orders the index store before the read of that word (`layout::ring::POLLED`).
    pub fn publish(&self, region: &Region) {
        self.ring.prod(region).store(self.prod, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.ring.polled(region).load(Ordering::SeqCst) == 0 {
            vrnic_shm::bell::ring(region, self.bell);
        }
    }
}

/// A poll of the calling thread found work: its empty polls count from zero again.
fn worked() {
    SPIN.with(|s| s.borrow_mut().worked());
}

thread_local! {
    /// When this thread's empty CQ polls give its CPU away (`vrnic_shm::Spin`): a yield every
    /// 8 empty polls while that runs another thread, at most every 1,024 while it does not.
    /// It is the thread's, not a CQ's: whether to give the CPU away is a question about the
    /// thread that polls, whichever CQs it polls. A thread that polls several CQs in turn
    /// (UCX's progress polls its RC receive and send CQs and its UD ones, four per round)
    /// counts them together, and work on any of them is work: with a count per CQ, four
    /// counts that reached their yield in one round gave the CPU away four times in a row,
    /// and a CQ that stayed empty beside one that did not made a busy thread yield.
    static SPIN: RefCell<Spin> = const { RefCell::new(Spin::new(8, 1024)) };
}

/// A CQ as the driver sees it: it owns the consumer index.
#[derive(Debug)]
pub struct CompQueue {
    /// The ring.
    pub ring: Ring,
    /// Private consumer index.
    pub cons: u32,
}

impl CompQueue {
    /// A CQ over `ring` with nothing polled yet.
    pub fn new(ring: Ring) -> CompQueue {
        CompQueue { ring, cons: 0 }
    }

    /// Whether the slot at the consumer index holds a completion: its sequence word says it
    /// was written at this index (`CQE_SEQ`). The slot is all a poll reads: not the
    /// producer index, a second cache line the daemon writes per completion.
    fn ready(&self, region: &Region) -> bool {
        self.ring
            .slot_word(region, self.cons, CQE_SEQ)
            .load(Ordering::Acquire)
            == vrnic_wire::cqe_seq(self.cons)
    }

    /// Takes up to `max` completions, calling `out` for each.
    pub fn poll(&mut self, region: &Region, max: usize, mut out: impl FnMut(usize, &Cqe)) -> usize {
        let mut n = 0;
        let mut raw = [0u8; CQ_SLOT];
        while n < max && self.ready(region) {
            self.ring.read_slot(region, self.cons, &mut raw);
            self.cons = self.cons.wrapping_add(1);
            // The daemon is trusted by the driver; a slot that does not parse is skipped.
            if let Ok(cqe) = Cqe::parse(&raw) {
                out(n, &cqe);
                n += 1;
            }
        }
        if n > 0 {
            self.publish(region);
            worked();
        } else {
            self.idle();
        }
        n
    }

    /// The completion at the consumer index, left in the ring: `start_poll`/`next_poll` read
    /// it, [`consume`](Self::consume) retires it. Slots that do not parse are skipped.
    pub fn peek(&mut self, region: &Region) -> Option<Cqe> {
        let mut raw = [0u8; CQ_SLOT];
        while self.ready(region) {
            self.ring.read_slot(region, self.cons, &mut raw);
            if let Ok(cqe) = Cqe::parse(&raw) {
                worked();
                return Some(cqe);
            }
            self.cons = self.cons.wrapping_add(1);
        }
        self.idle();
        None
    }

    /// Removes the completions of QP number `qpn` from the ring, keeping the others in their
    /// order, and returns how many went: a QP moved to RESET or destroyed leaves nothing behind
    /// (mlx5's provider does the same in `__mlx5_cq_clean`).
    ///
    /// Only the slots between the consumer index and a snapshot of the producer index are
    /// touched: the daemon writes no slot there until the consumer index passes it. The walk
    /// goes from the newest completion back to the oldest, moving each kept one up over the
    /// removed ones, then advances the consumer index past the gap; completions the daemon
    /// adds meanwhile land after the snapshot and are not moved.
    pub fn clean(&mut self, region: &Region, qpn: u32) -> u32 {
        let prod = self.ring.prod(region).load(Ordering::Acquire);
        let pending = prod.wrapping_sub(self.cons);
        if pending == 0 || pending > self.ring.depth() {
            return 0;
        }
        let mut raw = [0u8; CQ_SLOT];
        let mut removed = 0u32;
        let mut i = prod;
        while i != self.cons {
            i = i.wrapping_sub(1);
            self.ring.read_slot(region, i, &mut raw);
            if Cqe::parse(&raw).is_ok_and(|c| c.qp_num == qpn) {
                removed += 1;
            } else if removed > 0 {
                // Moved up, with the sequence word of its new index.
                let to = i.wrapping_add(removed);
                self.ring.write_slot(region, to, &raw);
                self.ring
                    .slot_word(region, to, CQE_SEQ)
                    .store(vrnic_wire::cqe_seq(to), Ordering::Release);
            }
        }
        if removed > 0 {
            self.cons = self.cons.wrapping_add(removed);
            self.publish(region);
        }
        removed
    }

    /// Retires the completion [`peek`](Self::peek) returned; the daemon may reuse its slot
    /// after the next [`publish`](Self::publish).
    pub fn consume(&mut self) {
        self.cons = self.cons.wrapping_add(1);
    }

    /// Publishes the consumer index (the slots retired so far are free for the daemon).
    pub fn publish(&self, region: &Region) {
        self.ring.cons(region).store(self.cons, Ordering::Release);
    }

    /// Whether no completion waits to be polled.
    pub fn is_empty(&self, region: &Region) -> bool {
        !self.ready(region)
    }

    /// Counts an empty poll, the calling thread's (see `SPIN`). On a machine with few cores,
    /// an app spinning on an empty CQ can starve the engine that would fill it: the CPU is
    /// given away every few empty polls while that lets another thread run, and rarely while
    /// it does not (a core of its own). Returns whether it gave the CPU away.
    fn idle(&self) -> bool {
        SPIN.with(|s| s.borrow_mut().idle())
    }

    /// Arms the CQ: the next completion (or next solicited one) raises a channel event.
    pub fn arm(&self, region: &Region, solicited_only: bool) {
        self.ring
            .arm(region)
            .store(if solicited_only { 2 } else { 1 }, Ordering::SeqCst);
        // Pairs with the daemon's fence between publishing a CQE and reading the arm word: a
        // CQE the daemon wrote without seeing the arm is visible to the app's next poll.
        fence(Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vrnic_shm::layout;
    use vrnic_wire::{WcOpcode, WcStatus};

    fn cqe(wr_id: u64, qp_num: u32) -> [u8; CQ_SLOT] {
        let mut raw = [0u8; CQ_SLOT];
        Cqe {
            wr_id,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            wc_flags: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            slid: 0,
            sl: 0,
            vendor_err: 0,
            timestamp_ns: 0,
        }
        .encode(&mut raw);
        raw
    }

    /// A fresh test region in a file named for `tag`, and its path (to remove).
    fn region(tag: &str) -> (std::path::PathBuf, Region) {
        let p = std::env::temp_dir().join(format!("vrnic-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        let r = Region::create(&p, 0, "r", 1, [0; 16], 1).unwrap();
        (p, r)
    }

    /// `clean` removes one QP's completions and keeps the others in order, across the end of
    /// the ring, and frees exactly the removed slots for the daemon.
    #[test]
    fn clean_removes_one_qps_completions_and_keeps_the_rest_in_order() {
        let (p, r) = region("clean");
        let ring = Ring::new(&r, layout::HEAP_OFF, 8, CQ_SLOT).unwrap();
        ring.reset(&r);
        // Six completions from index 5 on (they wrap past slot 7), QP 1's among QP 2's and 3's.
        let start = 5u32;
        let qps = [1, 2, 1, 3, 1, 2];
        for (k, &qp) in qps.iter().enumerate() {
            let i = start + k as u32;
            ring.write_slot(&r, i, &cqe(u64::from(i), qp));
            ring.slot_word(&r, i, CQE_SEQ)
                .store(vrnic_wire::cqe_seq(i), Ordering::Release);
        }
        ring.prod(&r)
            .store(start + qps.len() as u32, Ordering::Release);
        ring.cons(&r).store(start, Ordering::Release);
        let mut q = CompQueue { ring, cons: start };
        assert_eq!(q.clean(&r, 1), 3);
        assert_eq!(q.cons, start + 3);
        assert_eq!(ring.cons(&r).load(Ordering::Acquire), start + 3);
        let mut got = Vec::new();
        q.poll(&r, 16, |_, c| got.push((c.wr_id, c.qp_num)));
        assert_eq!(got, vec![(6, 2), (8, 3), (10, 2)]);
        assert_eq!(q.clean(&r, 2), 0, "an empty ring has nothing to clean");
        std::fs::remove_file(p).unwrap();
    }

    /// Empty polls are counted per thread, whichever CQ they were of: a thread polling two
    /// CQs in turn gives its CPU away every 8 empty polls in all (not 8 of each, all due in
    /// the same round), and work found on either counts from zero again.
    #[test]
    fn empty_polls_of_several_cqs_count_together_for_their_thread() {
        let (p, r) = region("spin");
        let ra = Ring::new(&r, layout::HEAP_OFF, 4, CQ_SLOT).unwrap();
        let rb = Ring::new(&r, layout::HEAP_OFF + 4096, 4, CQ_SLOT).unwrap();
        ra.reset(&r);
        rb.reset(&r);
        // A thread of its own: its count starts at zero.
        std::thread::scope(|t| {
            t.spawn(|| {
                let mut a = CompQueue::new(ra);
                let mut b = CompQueue::new(rb);
                for _ in 0..7 {
                    assert_eq!(a.poll(&r, 4, |_, _| ()), 0);
                }
                assert!(
                    b.idle(),
                    "the thread's 8th empty poll, b's first, gives the CPU away"
                );
                for _ in 0..3 {
                    assert!(!a.idle());
                    assert!(!b.idle());
                }
                // Work on b: a's empty polls count from zero again.
                rb.write_slot(&r, 0, &cqe(1, 1));
                rb.slot_word(&r, 0, CQE_SEQ)
                    .store(vrnic_wire::cqe_seq(0), Ordering::Release);
                assert_eq!(b.poll(&r, 4, |_, _| ()), 1);
                for _ in 0..7 {
                    assert!(!a.idle());
                }
                assert!(a.idle(), "8 empty polls after the work");
            });
        });
        drop(r);
        let _ = std::fs::remove_file(&p);
    }

    /// A poll takes the slot at the consumer index only when its sequence word names that
    /// index: not a zeroed ring, not a slot still holding the last lap's completion, not one
    /// whose word is not yet stored, not a zeroed slot at index `u32::MAX` (whose index plus
    /// one wraps to 0 in 32 bits); and it goes on across the end of the `u32` index space.
    /// The producer index is not what it reads (left at 0 here throughout).
    #[test]
    fn a_poll_takes_only_slots_whose_sequence_word_names_their_index() {
        let (p, r) = region("seq");
        let ring = Ring::new(&r, layout::HEAP_OFF, 4, CQ_SLOT).unwrap();
        ring.reset(&r);
        let mut q = CompQueue::new(ring);
        let mut got = Vec::new();
        assert_eq!(q.poll(&r, 16, |_, c| got.push(c.wr_id)), 0, "a zeroed ring");
        assert!(q.is_empty(&r));
        // Written, its sequence word not yet stored: not taken.
        ring.write_slot(&r, 0, &cqe(7, 1));
        assert_eq!(q.poll(&r, 16, |_, c| got.push(c.wr_id)), 0);
        ring.slot_word(&r, 0, CQE_SEQ)
            .store(vrnic_wire::cqe_seq(0), Ordering::Release);
        assert!(!q.is_empty(&r));
        assert_eq!(q.peek(&r).map(|c| c.wr_id), Some(7));
        assert_eq!(q.poll(&r, 16, |_, c| got.push(c.wr_id)), 1);
        assert_eq!(got, vec![7]);
        // Slot 0 again at index 4: its last lap's word does not count.
        q.cons = 4;
        assert_eq!(
            q.poll(&r, 16, |_, c| got.push(c.wr_id)),
            0,
            "last lap's slot"
        );
        // A zeroed slot at index u32::MAX.
        r.write_bytes(
            layout::HEAP_OFF + layout::ring::SLOTS + 3 * CQ_SLOT as u64,
            &[0; CQ_SLOT],
        )
        .unwrap();
        q.cons = u32::MAX;
        assert_eq!(
            q.poll(&r, 16, |_, c| got.push(c.wr_id)),
            0,
            "a zeroed slot at u32::MAX"
        );
        // Across the end of the index space: indices u32::MAX - 1, u32::MAX, 0, 1.
        let start = u32::MAX - 1;
        q.cons = start;
        got.clear();
        for k in 0..4u32 {
            let i = start.wrapping_add(k);
            ring.write_slot(&r, i, &cqe(u64::from(k), 1));
            ring.slot_word(&r, i, CQE_SEQ)
                .store(vrnic_wire::cqe_seq(i), Ordering::Release);
        }
        assert_eq!(q.poll(&r, 16, |_, c| got.push(c.wr_id)), 4);
        assert_eq!(got, vec![0, 1, 2, 3]);
        assert_eq!(q.cons, 2);
        assert_eq!(
            ring.cons(&r).load(Ordering::Acquire),
            2,
            "the consumer index published"
        );
        assert_eq!(ring.prod(&r).load(Ordering::Acquire), 0);
        std::fs::remove_file(p).unwrap();
    }
}
