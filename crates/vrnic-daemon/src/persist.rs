//! The file of persistent vRNICs: what `vrnic create` made (name, group, virtual IP, QoS
//! limits, as `vrnic policy` last set them), so that a daemon started again, after a graceful
//! stop or a `kill -9`, makes them again before it serves. A vRNIC made by `vrnic run` is not
//! recorded; `vrnic rm` forgets one.
//!
//! Where it lives: the state dir is a tmpfs (the daemon's own, unmounted when it stops), so the
//! file lives outside it. For the default state dir it is `/var/lib/vrnic/vnics.json` as root,
//! else `$XDG_STATE_HOME/vrnic/vnics.json` (`~/.local/state/vrnic/vnics.json`); for any other
//! state dir, a file beside it named after it (`/srv/vrnic` → `/srv/vrnic.vnics.json`), so two
//! daemons on two state dirs never share one. `vrnic serve --persist-file PATH` (or
//! `persist_file` in the config file) chooses another, `--no-persist` records nothing.
//!
//! ```json
//! {
//!   "version": 1,
//!   "vnics": [
//!     { "name": "a", "group": "red", "ip": "10.9.0.1", "max_bw": 1000000000 },
//!     { "name": "b", "group": "default", "ip": "100.64.0.2" }
//!   ]
//! }
//! ```
//!
//! It is written whole on every change, atomically (a temporary file beside it, `fsync`, then
//! `rename`, then the directory's `fsync`), mode 600, by a thread of its own ([`Writer`]): the
//! daemon's loop never waits on the disk, and the change's admin reply waits for the write.
//! It is read strictly: an unknown key, a bad value, a duplicate name, a file that is not a
//! regular file of the daemon's user or that others can write, each stops the daemon at start
//! with one line naming the file (the vRNICs are never dropped silently); fixing or removing
//! the file, or `--no-persist`, lets it start.

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};

use serde::{Deserialize, Serialize};

use crate::config;

/// The file's name in its directory, for the default state dir.
pub const PERSIST_FILE: &str = "vnics.json";
/// What is appended to another state dir's path to name its file beside it.
pub const PERSIST_SUFFIX: &str = ".vnics.json";
/// The format's version.
const VERSION: u32 = 1;
/// The longest file read: far more than the daemon's most vRNICs need.
const FILE_MAX: u64 = 16 << 20;

/// One persistent vRNIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// Its name.
    pub name: String,
    /// Its tenants' group.
    pub group: String,
    /// Its virtual IP (given or assigned); without it, one from the group's subnet.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip: Option<Ipv4Addr>,
    /// Its bandwidth limit, payload bytes per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bw: Option<u64>,
    /// Its message-rate limit, work requests per second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rate: Option<u64>,
}

impl Record {
    /// Its limits, as a change of policy that sets them.
    pub fn policy(&self) -> vrnic_api::PolicyChange {
        vrnic_api::PolicyChange {
            max_bw: self.max_bw,
            max_rate: self.max_rate,
        }
    }
}

/// The file's body.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Body {
    version: u32,
    vnics: Vec<Record>,
}

/// A file of persistent vRNICs that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PersistError {
    /// It could not be read.
    #[error("the file of persistent vRNICs {file} cannot be read")]
    Read {
        /// The file.
        file: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Someone else could have written it.
    #[error(
        "the file of persistent vRNICs {file} is {what}: it must be a regular file of uid {want} \
         that group and others cannot write"
    )]
    Unsafe {
        /// The file.
        file: PathBuf,
        /// What it is instead.
        what: String,
        /// Who must own it.
        want: u32,
    },
    /// It does not hold records.
    #[error(
        "the file of persistent vRNICs {file} is invalid: {message}; fix or remove it (its \
         vRNICs are then not made again), or serve with --no-persist"
    )]
    Invalid {
        /// The file.
        file: PathBuf,
        /// The parser's message, or the rule broken.
        message: String,
    },
}

/// The file of persistent vRNICs when none is given, for canonical state dir `state_dir`.
pub fn default_file(state_dir: &Path) -> PathBuf {
    let builtin = config::builtin_state_dir();
    let builtin = builtin.canonicalize().unwrap_or(builtin);
    if state_dir == builtin {
        if config::current_euid() == 0 {
            return Path::new("/var/lib/vrnic").join(PERSIST_FILE);
        }
        // A home that is not this user's (`sudo -u` keeping root's `HOME`) is not used: its
        // files could not be read, or would be another user's.
        let me = config::current_euid();
        let home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .filter(|h| std::fs::metadata(h).is_ok_and(|m| m.uid() == me));
        let state_home = std::env::var_os("XDG_STATE_HOME")
            .filter(|d| Path::new(d).is_absolute())
            .map(PathBuf::from)
            .or_else(|| home.map(|h| Path::new(&h).join(".local/state")));
        if let Some(d) = state_home {
            return d.join("vrnic").join(PERSIST_FILE);
        }
    }
    let mut beside = state_dir.as_os_str().to_owned();
    beside.push(PERSIST_SUFFIX);
    PathBuf::from(beside)
}

/// Reads the records in `file` (none if it does not exist).
pub fn load(file: &Path) -> Result<Vec<Record>, PersistError> {
    let read = |source| PersistError::Read {
        file: file.to_path_buf(),
        source,
    };
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(file)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(PersistError::Unsafe {
                file: file.to_path_buf(),
                what: "a symbolic link".into(),
                want: config::current_euid(),
            });
        }
        Err(e) => return Err(read(e)),
    };
    let m = f.metadata().map_err(read)?;
    let want = config::current_euid();
    let what = if !m.is_file() {
        Some("not a regular file".to_string())
    } else if m.uid() != want || m.mode() & 0o022 != 0 {
        Some(format!(
            "owned by uid {} with mode {:03o}",
            m.uid(),
            m.mode() & 0o777
        ))
    } else {
        None
    };
    if let Some(what) = what {
        return Err(PersistError::Unsafe {
            file: file.to_path_buf(),
            what,
            want,
        });
    }
    if m.len() > FILE_MAX {
        return Err(PersistError::Invalid {
            file: file.to_path_buf(),
            message: format!("{} bytes, more than {FILE_MAX}", m.len()),
        });
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(f, FILE_MAX), &mut text).map_err(
        |e| match e.kind() {
            std::io::ErrorKind::InvalidData => PersistError::Invalid {
                file: file.to_path_buf(),
                message: "not UTF-8 text".into(),
            },
            _ => read(e),
        },
    )?;
    parse(&text).map_err(|message| PersistError::Invalid {
        file: file.to_path_buf(),
        message,
    })
}

/// Parses and checks a file's text; the error says what is wrong and where.
pub fn parse(text: &str) -> Result<Vec<Record>, String> {
    let body: Body = serde_json::from_str(text).map_err(|e| e.to_string())?;
    if body.version != VERSION {
        return Err(format!(
            "version {}: this daemon reads version {VERSION}",
            body.version
        ));
    }
    let mut seen = std::collections::HashSet::new();
    for r in &body.vnics {
        if !config::valid_name(&r.name) {
            return Err(format!("{:?} is not a vRNIC name", r.name));
        }
        if !config::valid_name(&r.group) {
            return Err(format!(
                "vRNIC {}: {:?} is not a group name",
                r.name, r.group
            ));
        }
        if !seen.insert(r.name.as_str()) {
            return Err(format!("vRNIC {} is listed twice", r.name));
        }
        if r.max_bw == Some(0) || r.max_rate == Some(0) {
            return Err(format!(
                "vRNIC {}: a limit of 0 (leave it out for no limit)",
                r.name
            ));
        }
    }
    Ok(body.vnics)
}

/// The file's text for `records`.
pub fn encode(records: &[Record]) -> Vec<u8> {
    let body = Body {
        version: VERSION,
        vnics: records.to_vec(),
    };
    // Invariant: plain strings, numbers and addresses always serialise.
    let mut out = serde_json::to_vec_pretty(&body).unwrap_or_default();
    out.push(b'\n');
    out
}

/// Replaces `file` with `bytes` atomically and durably: a temporary file beside it (mode 600),
/// written and `fsync`ed, renamed over it, then the directory `fsync`ed. A missing directory
/// is made (mode 700).
pub fn write_atomic(file: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    let mut tmp = file.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // One left by a daemon killed while writing (only ours: one daemon per file).
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, file)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A write done: every snapshot up to `seq` is on disk, or the write of `seq` failed.
#[derive(Debug)]
pub struct Written {
    /// The last snapshot this write covers.
    pub seq: u64,
    /// Why it failed.
    pub result: Result<(), String>,
}

/// The thread that writes the file, so that the daemon's loop never waits on the disk. It
/// takes whole snapshots; of several queued, it writes the last (which holds every change
/// before it), and reports each write through a channel and the loop's waker.
pub struct Writer {
    file: PathBuf,
    tx: Option<Sender<(u64, Vec<u8>)>>,
    done: Receiver<Written>,
    thread: Option<std::thread::JoinHandle<()>>,
    next_seq: u64,
}

impl Writer {
    /// Starts the thread for `file`; `waker` wakes the loop when a write is done.
    pub fn start(file: PathBuf, waker: mio::Waker) -> std::io::Result<Writer> {
        let (tx, jobs) = channel::<(u64, Vec<u8>)>();
        let (done_tx, done) = channel();
        let waker = Arc::new(waker);
        let path = file.clone();
        let thread = std::thread::Builder::new()
            .name("vrnic-persist".into())
            .spawn(move || {
                while let Ok(mut job) = jobs.recv() {
                    while let Ok(later) = jobs.try_recv() {
                        job = later;
                    }
                    let result = write_atomic(&path, &job.1).map_err(|e| e.to_string());
                    if done_tx.send(Written { seq: job.0, result }).is_err() {
                        return;
                    }
                    let _ = waker.wake();
                }
            })?;
        Ok(Writer {
            file,
            tx: Some(tx),
            done,
            thread: Some(thread),
            next_seq: 1,
        })
    }

    /// The file it writes.
    pub fn file(&self) -> &Path {
        &self.file
    }

    /// Queues `records` to be written; returns the snapshot's number (its [`Written`] comes
    /// later), `None` if the thread is gone.
    pub fn write(&mut self, records: &[Record]) -> Option<u64> {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.tx.as_ref()?.send((seq, encode(records))).ok()?;
        Some(seq)
    }

    /// A write done, if any.
    pub fn poll_written(&self) -> Option<Written> {
        self.done.try_recv().ok()
    }

    /// Writes what is queued and stops the thread.
    pub fn stop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: &str) -> Record {
        Record {
            name: name.into(),
            group: "default".into(),
            ip: Some(Ipv4Addr::new(100, 64, 0, 1)),
            max_bw: None,
            max_rate: Some(2000),
        }
    }

    #[test]
    fn records_round_trip_and_limits_left_out_are_none() {
        let rs = vec![rec("a"), rec("b")];
        let text = String::from_utf8(encode(&rs)).unwrap();
        assert!(!text.contains("max_bw"), "{text}");
        assert_eq!(parse(&text).unwrap(), rs);
        let one = parse(r#"{"version":1,"vnics":[{"name":"c","group":"red"}]}"#).unwrap();
        assert_eq!(
            (one[0].ip, one[0].max_bw, one[0].max_rate),
            (None, None, None)
        );
        assert!(parse(r#"{"version":1,"vnics":[]}"#).unwrap().is_empty());
    }

    #[test]
    fn parsing_is_strict_and_says_what_is_wrong() {
        for (text, says) in [
            (
                r#"{"version":1,"vnics":[{"nmae":"a","group":"g"}]}"#,
                "nmae",
            ),
            (r#"{"version":1,"vnics":[],"extra":1}"#, "extra"),
            (r#"{"version":2,"vnics":[]}"#, "version 2"),
            (
                r#"{"version":1,"vnics":[{"name":"../x","group":"g"}]}"#,
                "vRNIC name",
            ),
            (
                r#"{"version":1,"vnics":[{"name":"a","group":"g h"}]}"#,
                "group name",
            ),
            (
                r#"{"version":1,"vnics":[{"name":"a","group":"g"},{"name":"a","group":"g"}]}"#,
                "twice",
            ),
            (
                r#"{"version":1,"vnics":[{"name":"a","group":"g","ip":"1.2.3"}]}"#,
                "IPv4",
            ),
            (
                r#"{"version":1,"vnics":[{"name":"a","group":"g","max_bw":0}]}"#,
                "limit of 0",
            ),
            (
                r#"{"version":1,"vnics":[{"name":"a","group":"g","max_bw":-1}]}"#,
                "-1",
            ),
            ("", "EOF"),
            ("{\"version\":1,\"vnics\":[", "EOF"),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
            assert!(!e.contains('\n'), "one line: {e}");
        }
    }

    #[test]
    fn written_atomically_read_back_and_refused_when_others_can_write_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("vrnic-persist-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("sub").join(PERSIST_FILE);
        assert!(load(&file).unwrap().is_empty(), "no file: no records");
        write_atomic(&file, &encode(&[rec("a")])).unwrap();
        let m = std::fs::metadata(&file).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
        assert!(!dir.join("sub").join("vnics.json.tmp").exists());
        assert_eq!(load(&file).unwrap(), vec![rec("a")]);
        // A temporary file a killed writer left is replaced.
        std::fs::write(dir.join("sub").join("vnics.json.tmp"), "junk").unwrap();
        write_atomic(&file, &encode(&[rec("b")])).unwrap();
        assert_eq!(load(&file).unwrap(), vec![rec("b")]);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
        let e = load(&file).unwrap_err().to_string();
        assert!(
            e.contains(&file.display().to_string()) && e.contains("666"),
            "{e}"
        );
        std::fs::remove_file(&file).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &file).unwrap();
        let e = load(&file).unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, "{\"version\":1}").unwrap();
        let e = load(&file).unwrap_err().to_string();
        assert!(e.contains("invalid") && e.contains("vnics"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_state_dir_other_than_the_default_has_its_file_beside_it() {
        assert_eq!(
            default_file(Path::new("/srv/vrnic-a")),
            Path::new("/srv/vrnic-a.vnics.json")
        );
    }
}
