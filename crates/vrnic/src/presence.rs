//! The vRNIC where RDMA stacks look for a device before they use verbs: a device node
//! `/dev/infiniband/<ibv_device.dev_name>` and a sysfs view `/sys/class/infiniband/<name>/...`.
//!
//! UCX opens an IB device only if `/dev/infiniband/<dev_name>` is a node it may read and write,
//! and reads `device/numa_node`, `device/local_cpus` and `ports/N/gid_attrs/types/M` under
//! `/sys/class/infiniband/<name>`; Open MPI's `btl openib` and `ibstat` give up without that
//! class directory. No kernel module makes these for a vRNIC, and making them on the host
//! would show every process a device it cannot use. So `vrnic run` makes them in a private
//! mount namespace, for the command and its children only:
//!
//! - `/dev` becomes an overlay whose lower layer is the host's `/dev` (everything there stays
//!   visible; `/dev/pts`, `/dev/shm` and the other mounts under it are moved over) and whose
//!   upper layer is a tmpfs of this namespace: what is added goes to the tmpfs, never to the
//!   host's `devtmpfs`, and disappears with the namespace. `/sys/class` becomes a tmpfs with a
//!   bind of each host class directory (live: sysfs changes under them all the time, which an
//!   overlay's lower layer must not) and `infiniband/` beside them.
//! - The namespace's mounts are slaves of the host's: the host's later mounts (a vRNIC made
//!   later, with its own tmpfs) reach the command, and nothing mounted here reaches the host.
//! - The device node is the host's `/dev/null` bound on `/dev/infiniband/<dev_name>`: a real
//!   character device (1:3) anyone may open for reading and writing, which is all a stack
//!   checks; the verbs themselves go through the driver library, never through the node. A
//!   bind needs no `CAP_MKNOD` and works where the tmpfs would be `nodev`.
//! - The sysfs files are plain files with the values the driver library reports through
//!   `ibv_query_device`/`ibv_query_port`.
//!
//! Mount namespaces and mounts need root (`CAP_SYS_ADMIN`): without it `vrnic run` skips this
//! unless asked for it (`--device-files on`), and then fails saying so. `run --container`
//! puts the same node and files into the container's own `/dev` and a `/sys` of its own.
//!
//! A container engine cannot bind anything at `/sys/class/infiniband`: the container's `/sys`
//! is a read-only sysfs without that directory, and the engine fails to make the mount point.
//! So `vrnic docker-args` writes the view into a directory of the state dir
//! ([`container_view`]) and has the engine bind that directory over `/sys/class` (which
//! exists), read-only, and make the node with `--device`: the container's `/sys/class` then
//! holds only `infiniband`, as under `run --container`; the rest of its `/sys` is its own.
//!
//! Runs in the CLI before it `exec`s the command (single-threaded); its unsafe code is the
//! `unshare` and `mount` calls, one per block.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What the sysfs view and the node name say about a vRNIC.
#[derive(Debug, Clone)]
pub struct DeviceView {
    /// The device name (`ibv_get_device_name`).
    pub name: String,
    /// Port 1's LID.
    pub lid: u16,
    /// GID index 0 (subnet prefix, then the node GUID).
    pub gid: [u8; 16],
}

impl DeviceView {
    /// `ibv_device.dev_name`, the node's name under `/dev/infiniband`.
    pub fn dev_name(&self) -> String {
        format!("uverbs-{}", self.name)
    }

    fn guid(&self) -> String {
        self.gid[8..]
            .chunks(2)
            .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
            .collect::<Vec<_>>()
            .join(":")
    }
}

/// Whether this process may make mount namespaces (root, or `CAP_SYS_ADMIN`).
pub fn permitted() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Enters a private mount namespace in which `/dev/infiniband/<dev_name>` and
/// `/sys/class/infiniband/<name>` exist (see the module docs). The host's view is unchanged.
pub fn enter(v: &DeviceView) -> io::Result<()> {
    // SAFETY: unshare has no memory preconditions; the CLI is single-threaded here.
    let r = unsafe { libc::unshare(libc::CLONE_NEWNS) };
    check(r, "unshare a mount namespace (needs root)")?;
    // Nothing mounted from here on propagates back to the host; the host's mounts still
    // propagate here (a vRNIC made later, with its own tmpfs, is visible to the command).
    mount(
        "none",
        Path::new("/"),
        "",
        libc::MS_REC | libc::MS_SLAVE,
        "",
    )?;
    // Staging: a tmpfs over /tmp of this namespace only, for the overlays' upper layers; it
    // is detached again at the end (the overlays keep what they use), so the command sees the
    // host's /tmp.
    let stage = Path::new("/tmp");
    mount(
        "vrnic",
        stage,
        "tmpfs",
        libc::MS_NOSUID | libc::MS_NODEV,
        "mode=0700,size=1m",
    )?;
    let built = overlay_dev(stage).and_then(|()| sys_class(stage));
    detach(stage)?;
    built?;
    add_node(Path::new("/dev"), v)?;
    write_sysfs(Path::new("/sys/class"), v)
}

/// `/dev` as an overlay over the host's, with the mounts under it moved over.
fn overlay_dev(stage: &Path) -> io::Result<()> {
    let lower = stage.join("dev-lower");
    overlay(stage, "dev", Path::new("/dev"))?;
    // The host's /dev with its submounts, bound under the stage by `overlay`: move each
    // submount (pts, shm, mqueue, hugepages, ...) onto the same place in the overlay.
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let prefix = format!("{}/", lower.display());
    let mut subs: Vec<String> = mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .filter_map(|p| p.strip_prefix(&prefix).map(str::to_string))
        .collect();
    // Outer mounts first (a mount under a submount moves with it).
    subs.sort_by_key(|s| s.matches('/').count());
    subs.dedup();
    for s in subs {
        let from = lower.join(&s);
        let to = Path::new("/dev").join(&s);
        if to.is_dir() || to.is_file() {
            // Already moved with its parent if this fails: nothing to do then.
            let _ = mount(&from.to_string_lossy(), &to, "", libc::MS_MOVE, "");
        }
    }
    Ok(())
}

/// `/sys/class` as a tmpfs holding a bind of each of the host's class directories (sysfs
/// changes all the time, and an overlay's lower layer must not: binds stay live, so a network
/// interface made later still shows under `/sys/class/net`).
fn sys_class(stage: &Path) -> io::Result<()> {
    let class = Path::new("/sys/class");
    let lower = stage.join("sysclass");
    std::fs::create_dir(&lower)?;
    mount(&class.to_string_lossy(), &lower, "", libc::MS_BIND, "")?;
    let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount("vrnic-sysclass", class, "tmpfs", flags, "mode=0755,size=1m")?;
    for e in std::fs::read_dir(&lower)? {
        let e = e?;
        let (from, to) = (e.path(), class.join(e.file_name()));
        let kind = e.file_type()?;
        if kind.is_symlink() {
            std::os::unix::fs::symlink(std::fs::read_link(&from)?, &to)?;
        } else if kind.is_dir() {
            std::fs::create_dir(&to)?;
            mount(
                &from.to_string_lossy(),
                &to,
                "",
                libc::MS_BIND | libc::MS_REC,
                "",
            )?;
        }
    }
    Ok(())
}

/// Mounts an overlay on `target` whose lower layer is what `target` shows now (bound at
/// `stage/NAME-lower`) and whose upper layer is on the stage's tmpfs.
fn overlay(stage: &Path, name: &str, target: &Path) -> io::Result<()> {
    let (lower, upper, work) = (
        stage.join(format!("{name}-lower")),
        stage.join(format!("{name}-upper")),
        stage.join(format!("{name}-work")),
    );
    for d in [&lower, &upper, &work] {
        std::fs::create_dir(d)?;
    }
    mount(
        &target.to_string_lossy(),
        &lower,
        "",
        libc::MS_BIND | libc::MS_REC,
        "",
    )?;
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    mount("overlay", target, "overlay", libc::MS_NOSUID, &opts)
}

/// `dev/infiniband/<dev_name>`: the host's `/dev/null` bound on an empty file.
pub fn add_node(dev: &Path, v: &DeviceView) -> io::Result<()> {
    let dir = dev.join("infiniband");
    std::fs::create_dir_all(&dir)?;
    let node = dir.join(v.dev_name());
    std::fs::File::create(&node)?;
    mount("/dev/null", &node, "", libc::MS_BIND, "")
}

/// Writes `class/infiniband/<name>/...` under `class` (a `/sys/class` to add to): the files
/// rdma-core's sysfs layout has that stacks and tools read, with the vRNIC's values.
pub fn write_sysfs(class: &Path, v: &DeviceView) -> io::Result<()> {
    let dev = class.join("infiniband").join(&v.name);
    let port = dev.join("ports/1");
    let guid = v.guid();
    let gid = vrnic_api::gid_string(&v.gid);
    let files: [(&str, String); 24] = [
        ("node_guid", guid.clone()),
        ("sys_image_guid", guid),
        ("node_type", "1: CA".into()),
        ("node_desc", format!("vrnic {}", v.name)),
        ("fw_ver", env!("CARGO_PKG_VERSION").into()),
        ("hca_type", "vrnic".into()),
        ("hw_rev", "0x1".into()),
        ("board_id", "VRNIC".into()),
        // A software device: no NUMA node of its own, every CPU is as close as any.
        ("device/numa_node", "-1".into()),
        ("device/local_cpus", local_cpus()),
        ("device/vendor", "0x5652".into()),
        ("device/device", "0x0001".into()),
        ("ports/1/state", "4: ACTIVE".into()),
        ("ports/1/phys_state", "5: LinkUp".into()),
        ("ports/1/rate", "100 Gb/sec (4X EDR)".into()),
        ("ports/1/lid", format!("0x{:x}", v.lid)),
        ("ports/1/sm_lid", format!("0x{:x}", v.lid)),
        ("ports/1/lid_mask_count", "0".into()),
        ("ports/1/sm_sl", "0".into()),
        ("ports/1/cap_mask", "0x00010800".into()),
        ("ports/1/link_layer", "InfiniBand".into()),
        ("ports/1/gids/0", gid),
        ("ports/1/pkeys/0", "0xffff".into()),
        ("ports/1/gid_attrs/types/0", "IB/RoCE v1".into()),
    ];
    for (path, value) in files {
        let p = dev.join(path);
        std::fs::create_dir_all(p.parent().unwrap_or(&dev))?;
        std::fs::write(&p, format!("{value}\n"))?;
    }
    std::fs::create_dir_all(port.join("counters"))?;
    Ok(())
}

/// The directory of the state dir that holds the views [`container_view`] writes: its name has
/// a dot, which no vRNIC name has, and the daemon leaves alone a directory that holds no
/// region or socket.
pub fn views_dir(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join(".views")
}

/// Writes the sysfs view of `v` for a container engine to bind at `/sys/class`:
/// `VIEWS/<name>/infiniband/<name>/...` (made afresh; readable by everyone, as sysfs is), and
/// removes the views of vRNICs not in `live`. Returns the directory to bind.
pub fn container_view(
    views: &Path,
    v: &DeviceView,
    live: &[String],
) -> io::Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(views)?;
    std::fs::set_permissions(views, std::fs::Permissions::from_mode(0o755))?;
    for e in std::fs::read_dir(views)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == v.name || !live.contains(&name) {
            std::fs::remove_dir_all(e.path())?;
        }
    }
    let class = views.join(&v.name);
    std::fs::create_dir(&class)?;
    write_sysfs(&class, v)?;
    open_to_all(&class)?;
    Ok(class)
}

/// Directories 0755 and files 0644 under `dir` (whatever the umask): processes of any user in
/// the container read the view.
fn open_to_all(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))?;
    for e in std::fs::read_dir(dir)?.flatten() {
        if e.file_type()?.is_dir() {
            open_to_all(&e.path())?;
        } else {
            std::fs::set_permissions(e.path(), std::fs::Permissions::from_mode(0o644))?;
        }
    }
    Ok(())
}

/// The CPUs as sysfs masks them (`local_cpus`): comma-separated 32-bit hex words, highest
/// first, every online CPU set.
fn local_cpus() -> String {
    if let Ok(m) = std::fs::read_to_string("/sys/devices/system/node/node0/cpumap") {
        return m.trim().to_string();
    }
    let n = std::thread::available_parallelism().map_or(1, |n| n.get());
    let words = n.div_ceil(32);
    (0..words)
        .rev()
        .map(|w| {
            let bits = (n - w * 32).min(32);
            let word: u64 = (1u64 << bits) - 1;
            format!("{word:08x}")
        })
        .collect::<Vec<_>>()
        .join(",")
}

fn check(r: libc::c_int, what: &str) -> io::Result<()> {
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn cstr(s: &[u8]) -> io::Result<CString> {
    CString::new(s).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn mount(src: &str, dst: &Path, fstype: &str, flags: libc::c_ulong, data: &str) -> io::Result<()> {
    let (s, d, t, o) = (
        cstr(src.as_bytes())?,
        cstr(dst.as_os_str().as_bytes())?,
        cstr(fstype.as_bytes())?,
        cstr(data.as_bytes())?,
    );
    // SAFETY: all four are valid NUL-terminated strings that outlive the call.
    let r = unsafe { libc::mount(s.as_ptr(), d.as_ptr(), t.as_ptr(), flags, o.as_ptr().cast()) };
    check(r, &format!("mount {src} on {}", dst.display()))
}

fn detach(p: &Path) -> io::Result<()> {
    let c = cstr(p.as_os_str().as_bytes())?;
    // SAFETY: umount2 with a valid NUL-terminated path.
    let r = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    check(r, &format!("detach {}", p.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sysfs_view_holds_what_stacks_read() {
        let dir = std::env::temp_dir().join(format!("vrnic-presence-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut gid = [0u8; 16];
        gid[0] = 0xfe;
        gid[1] = 0x80;
        gid[8..].copy_from_slice(&[0x02, 0x56, 0x52, 0, 0, 0, 0, 7]);
        let v = DeviceView {
            name: "vrnic0".into(),
            lid: 0x1f,
            gid,
        };
        write_sysfs(&dir, &v).expect("write");
        let read = |p: &str| {
            std::fs::read_to_string(dir.join("infiniband/vrnic0").join(p))
                .expect(p)
                .trim()
                .to_string()
        };
        assert_eq!(read("node_guid"), "0256:5200:0000:0007");
        assert_eq!(read("ports/1/lid"), "0x1f");
        assert_eq!(read("ports/1/state"), "4: ACTIVE");
        assert_eq!(
            read("ports/1/gids/0"),
            "fe80:0000:0000:0000:0256:5200:0000:0007"
        );
        assert_eq!(read("ports/1/gid_attrs/types/0"), "IB/RoCE v1");
        assert_eq!(read("device/numa_node"), "-1");
        assert!(
            read("device/local_cpus")
                .chars()
                .all(|c| c.is_ascii_hexdigit() || c == ',')
        );
        assert_eq!(v.dev_name(), "uverbs-vrnic0");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_container_view_is_fresh_readable_by_all_and_drops_views_of_gone_vrnics() {
        use std::os::unix::fs::PermissionsExt;
        let views = std::env::temp_dir().join(format!("vrnic-views-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&views);
        let view = |name: &str, lid| DeviceView {
            name: name.into(),
            lid,
            gid: [0; 16],
        };
        let live = ["a".to_string(), "b".to_string()];
        container_view(&views, &view("a", 1), &live).expect("a");
        let gone = container_view(&views, &view("gone", 2), &["gone".to_string()]).expect("gone");
        assert!(gone.join("infiniband/gone/ports/1/lid").exists());
        // Made again with a new LID: the old files go; "gone" is no longer live and goes too.
        let old = umask(0o077);
        let b = container_view(&views, &view("b", 3), &live).expect("b");
        let a = container_view(&views, &view("a", 4), &live).expect("a again");
        umask(old);
        let lid = std::fs::read_to_string(a.join("infiniband/a/ports/1/lid")).expect("lid");
        assert_eq!(lid.trim(), "0x4");
        assert!(b.join("infiniband/b").is_dir());
        assert!(!gone.exists());
        let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
        assert_eq!(mode(&a.join("infiniband/a/ports/1")), 0o755);
        assert_eq!(mode(&a.join("infiniband/a/ports/1/state")), 0o644);
        std::fs::remove_dir_all(&views).expect("clean up");
    }

    fn umask(m: libc::mode_t) -> libc::mode_t {
        // SAFETY: umask has no memory preconditions.
        unsafe { libc::umask(m) }
    }
}
