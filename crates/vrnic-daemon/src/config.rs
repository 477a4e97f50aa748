//! Where the daemon keeps its state, and the names of the files in it. Shared with the CLI so
//! both agree without a config file (the embedded default).

use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

/// The admin socket, relative to the state dir.
pub const ADMIN_SOCKET: &str = "vrnic.sock";
/// The lock that keeps a second daemon off a state dir.
pub const LOCK_FILE: &str = "daemon.lock";
/// A vRNIC's region file, inside its directory.
pub const REGION_FILE: &str = "region";
/// A vRNIC's socket, inside its directory.
pub const VNIC_SOCKET: &str = "sock";
/// The environment variable naming the state dir.
pub const STATE_DIR_ENV: &str = "VRNIC_STATE_DIR";
/// The environment variable that points the driver library at a vRNIC directory.
pub const DEVICE_ENV: &str = "VRNIC_DEVICE";

/// Root's daemon's state dir, the system one: where a user's CLI looks when it finds no daemon
/// of its own.
pub const SYSTEM_STATE_DIR: &str = "/run/vrnic";
/// The Unix group whose members may use root's daemon (`vrnic serve --access-group`).
pub const DEFAULT_ACCESS_GROUP: &str = "vrnic";

/// The state dir when none is given: `$VRNIC_STATE_DIR`, else `/run/vrnic` as root, else
/// `$XDG_RUNTIME_DIR/vrnic`, else `/tmp/vrnic-<uid>` (which [`prepare_state_dir`] refuses if
/// another user made it first).
pub fn default_state_dir() -> PathBuf {
    match std::env::var_os(STATE_DIR_ENV).filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d),
        None => builtin_state_dir(),
    }
}

/// The state dir when neither `--state-dir` nor `$VRNIC_STATE_DIR` names one (see
/// [`default_state_dir`]).
pub fn builtin_state_dir() -> PathBuf {
    let uid = current_euid();
    if uid == 0 {
        return PathBuf::from(SYSTEM_STATE_DIR);
    }
    if let Some(x) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return Path::new(&x).join("vrnic");
    }
    PathBuf::from(format!("/tmp/vrnic-{uid}"))
}

/// The state dir a client (the CLI) talks to when neither `--state-dir` nor
/// `$VRNIC_STATE_DIR` names one: the user's own daemon's ([`builtin_state_dir`]) if it has
/// one there, else root's system daemon's ([`SYSTEM_STATE_DIR`]) if one serves it (or its
/// socket cannot even be looked at: the connection then says that permission is missing),
/// else the user's own (whose error says no daemon runs there).
pub fn client_state_dir() -> PathBuf {
    let own = builtin_state_dir();
    if current_euid() == 0 || std::fs::symlink_metadata(own.join(ADMIN_SOCKET)).is_ok() {
        return own;
    }
    let system = Path::new(SYSTEM_STATE_DIR);
    match std::fs::symlink_metadata(system.join(ADMIN_SOCKET)) {
        Ok(m) if m.file_type().is_socket() && m.uid() == 0 => system.to_path_buf(),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => system.to_path_buf(),
        _ => own,
    }
}

/// A group's id by its name; `None` if there is no such group.
pub fn group_id(name: &str) -> Option<u32> {
    crate::sys::group_id(name)
}

/// A group's name by its id; `None` if it has none.
pub fn group_name(gid: u32) -> Option<String> {
    crate::sys::group_name(gid)
}

/// Why a state dir is not trusted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateDirError {
    /// A system call failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A path component that someone else could replace or fill.
    #[error(
        "refusing state dir: {path} is owned by uid {owner} with mode {mode:04o}; it must be \
         owned by uid {want} (or root) and not writable by group or others (sticky excepted \
         for parents)"
    )]
    Unsafe {
        /// The offending component.
        path: PathBuf,
        /// Its owner.
        owner: u32,
        /// Its permission bits.
        mode: u32,
        /// Who may own it.
        want: u32,
    },
    /// The state dir (or its admin socket) is not what it should be.
    #[error("refusing state dir: {0}")]
    Kind(String),
}

/// Who must own the state dir.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owner {
    /// The daemon itself: the dir is ours alone.
    Daemon,
    /// A client (the CLI): a dir of ours, or of root (a root daemon serving this user).
    Client,
}

/// Makes sure the state dir exists and that nobody but us (and root) can change it, then
/// returns its canonical path. A missing dir and missing parents are created (0700 for a
/// non-root daemon, 0711 for root, so unprivileged users can reach the vRNICs it hands out by
/// name but not list them). An existing state dir loses its read bits for group and others
/// (its search bits stay): nobody else lists the vRNICs' names.
///
/// Every component of the canonical path is checked without following links: each parent must
/// be owned by root or us and not writable by group or others unless it is sticky (like
/// `/tmp`: others cannot rename or remove our entry in it); the dir itself must be owned by
/// us and not writable by group or others. So a directory another local user made in advance
/// (say `/tmp/vrnic-<uid>`, mode 0777) is refused with a clear error instead of trusted.
pub fn prepare_state_dir(dir: &Path) -> Result<PathBuf, StateDirError> {
    let uid = current_euid();
    if std::fs::symlink_metadata(dir).is_err() {
        let mode = if uid == 0 { 0o711 } else { 0o700 };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(mode)
            .create(dir)
            .map_err(|source| StateDirError::Io {
                op: "create",
                path: dir.to_path_buf(),
                source,
            })?;
    }
    let canon = check_state_dir(dir, Owner::Daemon)?;
    // Ours (checked just above): only its listing is taken from others.
    if let Ok(m) = std::fs::metadata(&canon)
        && m.permissions().mode() & 0o044 != 0
    {
        let mode = m.permissions().mode() & 0o7777 & !0o044;
        std::fs::set_permissions(&canon, std::fs::Permissions::from_mode(mode)).map_err(
            |source| StateDirError::Io {
                op: "restrict",
                path: canon.clone(),
                source,
            },
        )?;
    }
    Ok(canon)
}

/// Checks an existing state dir (see [`prepare_state_dir`]) for `who`, and returns its
/// canonical path. A client also checks the admin socket: a socket owned by root or us.
pub fn check_state_dir(dir: &Path, who: Owner) -> Result<PathBuf, StateDirError> {
    let uid = current_euid();
    let canon = dir.canonicalize().map_err(|source| StateDirError::Io {
        op: "resolve",
        path: dir.to_path_buf(),
        source,
    })?;
    let mut at = PathBuf::new();
    let comps: Vec<Component<'_>> = canon.components().collect();
    for (i, c) in comps.iter().enumerate() {
        at.push(c);
        let last = i + 1 == comps.len();
        let m = std::fs::symlink_metadata(&at).map_err(|source| StateDirError::Io {
            op: "stat",
            path: at.clone(),
            source,
        })?;
        if !m.file_type().is_dir() {
            return Err(StateDirError::Kind(format!(
                "{} is not a directory",
                at.display()
            )));
        }
        let mode = m.mode() & 0o7777;
        let others_write = mode & 0o022 != 0;
        let owner_ok = match (last, who) {
            (true, Owner::Daemon) => m.uid() == uid,
            _ => m.uid() == uid || m.uid() == 0,
        };
        let write_ok = !others_write || (!last && mode & 0o1000 != 0);
        if !owner_ok || !write_ok {
            return Err(StateDirError::Unsafe {
                path: at,
                owner: m.uid(),
                mode,
                want: uid,
            });
        }
    }
    if who == Owner::Client {
        let sock = canon.join(ADMIN_SOCKET);
        if let Ok(m) = std::fs::symlink_metadata(&sock)
            && (!m.file_type().is_socket() || (m.uid() != uid && m.uid() != 0))
        {
            return Err(StateDirError::Kind(format!(
                "{} is not a socket of root or uid {uid}",
                sock.display()
            )));
        }
    }
    Ok(canon)
}

/// The effective uid of this process.
pub fn current_euid() -> u32 {
    // Read from /proc to keep this module free of unsafe code; falls back to "not root".
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).and_then(|u| u.parse().ok()))
        })
        .unwrap_or(u32::MAX)
}

/// Checks a vRNIC name: what a device name may be (`ibv_get_device_name`) and a safe directory
/// name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        && !name.starts_with('-')
}
