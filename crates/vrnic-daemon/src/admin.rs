//! The CLI's side of the admin socket: one JSON line per request and per reply.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use anyhow::{Context as _, Result, bail};
use vrnic_api::{AdminReply, AdminRequest};

use crate::config::{ADMIN_SOCKET, Owner, check_state_dir};

/// A connection to a running daemon.
#[derive(Debug)]
pub struct AdminClient {
    stream: BufReader<UnixStream>,
}

impl AdminClient {
    /// Connects to the daemon serving `state_dir`, or explains that none does.
    pub fn connect(state_dir: &Path) -> Result<AdminClient> {
        let path = state_dir.join(ADMIN_SOCKET);
        if state_dir.exists() {
            // Never talk to a daemon behind a dir that someone else could have planted.
            check_state_dir(state_dir, Owner::Client)?;
        }
        match UnixStream::connect(&path) {
            Ok(s) => Ok(AdminClient {
                stream: BufReader::new(s),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                bail!("{}", permission_denied(state_dir))
            }
            Err(e) => {
                // A daemon in a mount namespace of its own serves a state dir that is empty
                // here: name it, and the ways out, rather than "no daemon".
                if let Some(d) = crate::mntns::unseen_daemons(state_dir).first() {
                    bail!("{}", crate::mntns::no_daemon_here(state_dir, d));
                }
                bail!(
                    "no daemon running at {} ({e}); start one with `vrnic serve` (or pass \
                     --state-dir)",
                    state_dir.display()
                )
            }
        }
    }

    /// Sends one request and reads its reply. `AdminReply::Err` becomes an error.
    pub fn call(&mut self, req: &AdminRequest) -> Result<AdminReply> {
        let mut line = serde_json::to_vec(req)?;
        line.push(b'\n');
        self.stream
            .get_mut()
            .write_all(&line)
            .context("send to the daemon")?;
        let mut reply = String::new();
        self.stream
            .read_line(&mut reply)
            .context("read from the daemon")?;
        if reply.is_empty() {
            bail!("the daemon closed the connection");
        }
        match serde_json::from_str(&reply).context("parse the daemon's reply")? {
            AdminReply::Err(e) => bail!("{e}"),
            r => Ok(r),
        }
    }

    /// Every vRNIC's counters and listing entry (`vrnic stats`, `vrnic ls`): what `vrnic top`
    /// and the metrics endpoint show.
    pub fn stats_and_list(
        &mut self,
    ) -> Result<(Vec<vrnic_api::VnicStats>, Vec<vrnic_api::VnicSummary>)> {
        let AdminReply::Stats(stats) = self.call(&AdminRequest::Stats {
            name: None,
            qp: None,
        })?
        else {
            bail!("unexpected reply to Stats");
        };
        let AdminReply::List(list) = self.call(&AdminRequest::List)? else {
            bail!("unexpected reply to List");
        };
        Ok((stats, list))
    }

    /// The daemon's process id, from the connection's peer credentials (`SO_PEERCRED`).
    pub fn daemon_pid(&self) -> Option<u32> {
        use std::os::fd::AsRawFd as _;
        crate::sys::peer_pid(self.stream.get_ref().as_raw_fd())
    }

    /// Lets the connection outlive an `exec` (for `vrnic run`, whose command then holds the
    /// vRNIC for as long as it lives). Returns the fd number.
    pub fn inherit_across_exec(&self) -> Result<i32> {
        crate::sys::clear_cloexec(self.stream.get_ref())
            .context("keep the admin connection across exec")
    }
}

/// What a user is told when the daemon at `state_dir` is there but refuses them (`EACCES` on
/// its admin socket): whose daemon it is, whom it admits, and the two ways out.
fn permission_denied(state_dir: &Path) -> String {
    use std::os::unix::fs::MetadataExt as _;
    let dir = state_dir.display();
    let own = "or run your own daemon with `vrnic serve` as yourself";
    let meta = std::fs::metadata(state_dir.join(ADMIN_SOCKET)).ok();
    match meta {
        Some(m) if m.uid() == 0 && m.gid() != 0 && m.mode() & 0o060 == 0o060 => {
            let group = crate::config::group_name(m.gid()).unwrap_or_else(|| m.gid().to_string());
            format!(
                "permission denied: root's daemon at {dir} admits members of group {group}; add \
                 yourself (usermod -aG {group} $USER, then log in again) {own}"
            )
        }
        Some(m) if m.uid() == 0 => format!(
            "permission denied: root's daemon at {dir} admits root only (the group it admits, \
             {group} by default, did not exist when it started: groupadd {group}, add yourself \
             with usermod -aG {group} $USER and restart it), {own}",
            group = crate::config::DEFAULT_ACCESS_GROUP
        ),
        Some(m) => format!(
            "permission denied: the daemon at {dir} is uid {}'s and admits only its own user; \
             {own}",
            m.uid()
        ),
        None => format!(
            "permission denied: the daemon's state dir {dir} is closed to you (root's daemon \
             admits members of its group, {group} by default: usermod -aG {group} $USER), {own}",
            group = crate::config::DEFAULT_ACCESS_GROUP
        ),
    }
}
