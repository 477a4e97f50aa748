//! The admin socket the CLI talks to (`ls`, `create`, `rm`, `run`'s hold): one JSON line per
//! request and per reply, served without ever blocking the loop. In cluster mode a request
//! that makes a vRNIC is answered once etcd has granted its addresses (`cluster`); until then
//! that connection's next requests wait, and every other connection is served as usual. So
//! does a request that changes a persistent vRNIC (`create`, `policy`, `rm`): its reply waits
//! until the file of persistent vRNICs is written (`registry::Kept`).

use super::*;

/// Writes as much of `out` as the non-blocking `stream` takes now and drops what was written.
pub(super) fn flush(stream: &mut UnixStream, out: &mut Vec<u8>) -> std::io::Result<()> {
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

/// The longest admin request line.
pub(super) const ADMIN_LINE_MAX: usize = 64 << 10;

/// Reply bytes an admin client may leave unread before it is dropped.
pub(super) const ADMIN_OUT_MAX: usize = 16 << 20;

/// The admin connection of no client (connections are numbered from 1): what the daemon does
/// of its own accord, making recorded vRNICs again.
pub(super) const NO_CONN: u64 = 0;

impl Server {
    pub(super) fn accept_admin(&mut self) {
        loop {
            match self.admin.accept() {
                Ok((mut stream, _)) => {
                    let id = self.next_admin;
                    self.next_admin += 1;
                    let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
                    let who = crate::sys::peer_cred(fd);
                    // Root and the daemon's own user are the operator; anyone else the socket
                    // let in (a member of the access group) is a tenant, and a peer the
                    // kernel does not name is treated as one that owns nothing.
                    let tenant = match crate::sys::peer_uid(fd) {
                        Some(uid) if uid == 0 || uid == self.euid => None,
                        Some(uid) => Some(uid),
                        None => Some(u32::MAX),
                    };
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
                                waiting: false,
                                who,
                                tenant,
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
    pub(super) fn admin_ready(&mut self, id: u64) {
        loop {
            let Some(conn) = self.admins.get_mut(&id) else {
                return;
            };
            if flush(&mut conn.stream, &mut conn.out).is_err() || conn.out.len() > ADMIN_OUT_MAX {
                self.close_admin(id);
                return;
            }
            if !conn.out.is_empty() || conn.waiting {
                break;
            }
            if let Some(pos) = conn.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = conn.buf.drain(..=pos).collect();
                let reply = match serde_json::from_slice::<AdminRequest>(&line) {
                    Ok(req) => self.admin_request(id, req),
                    Err(e) => Some(AdminReply::Err(format!("bad admin request: {e}"))),
                };
                let Some(reply) = reply else {
                    // Answered when etcd has (`admin_reply_later`).
                    if let Some(c) = self.admins.get_mut(&id) {
                        c.waiting = true;
                    }
                    break;
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

    /// The reply to a request deferred by [`Server::admin_request`]; the connection's next
    /// requests are served after it.
    pub(super) fn admin_reply_later(&mut self, id: u64, reply: &AdminReply) {
        let Some(c) = self.admins.get_mut(&id) else {
            return;
        };
        // Invariant: our reply types always serialise.
        let mut out = serde_json::to_vec(reply).unwrap_or_default();
        out.push(b'\n');
        c.out.extend_from_slice(&out);
        c.waiting = false;
        self.admin_ready(id);
    }

    /// The tenant at the other end of admin connection `conn`, if it is not the operator.
    fn tenant(&self, conn: u64) -> Option<u32> {
        self.admins.get(&conn).and_then(|c| c.tenant)
    }

    /// Whether admin connection `conn` may see and use vRNIC `v`: the operator any, a tenant
    /// only those made for it.
    fn may_use(&self, conn: u64, v: &Vnic) -> bool {
        match self.tenant(conn) {
            None => true,
            Some(uid) => v.owner == Some(uid),
        }
    }

    /// Serves one request; `None`: its reply waits for etcd (cluster mode). A tenant (see
    /// [`AdminConn::tenant`]) may hold vRNICs of its own (`vrnic run`) and list, count and
    /// look up only those; what changes the daemon's other vRNICs is the operator's.
    pub(super) fn admin_request(&mut self, conn: u64, req: AdminRequest) -> Option<AdminReply> {
        if let Some(uid) = self.tenant(conn) {
            let what = match &req {
                AdminRequest::Create { .. } => Some("vrnic create"),
                AdminRequest::Policy { .. } => Some("vrnic policy"),
                AdminRequest::Remove { .. } => Some("vrnic rm"),
                AdminRequest::KillQp { .. } => Some("vrnic qp kill"),
                _ => None,
            };
            if let Some(what) = what {
                return Some(AdminReply::Err(format!(
                    "permission denied: `{what}` is for root (uid {uid} may run apps on \
                     vRNICs of its own with `vrnic run`)"
                )));
            }
        }
        Some(match req {
            AdminRequest::List => AdminReply::List(
                self.vnics
                    .iter()
                    .filter(|(_, v)| self.may_use(conn, v))
                    .filter_map(|(&v, _)| self.summary(v))
                    .collect(),
            ),
            AdminRequest::Peers => AdminReply::Peers(
                self.peers
                    .as_ref()
                    .map(|p| p.status(&self.shards))
                    .unwrap_or_default(),
            ),
            AdminRequest::ListAll => AdminReply::Directory(self.directory_listing()),
            AdminRequest::Stats {
                name: Some(name),
                qp: Some(qpn),
            } => match self
                .vnics
                .iter()
                .find(|(_, v)| v.name == name && self.may_use(conn, v))
            {
                Some((&id, _)) => match self.qp_stats(id, qpn) {
                    Some(s) => AdminReply::Stats(vec![s]),
                    None => AdminReply::Err(format!("vRNIC {name} has no QP number {qpn:#x}")),
                },
                None => AdminReply::Err(format!("no vRNIC {name}")),
            },
            AdminRequest::Stats { qp: Some(_), .. } => {
                AdminReply::Err("a QP's counters need the vRNIC's name".into())
            }
            AdminRequest::Stats { name, qp: None } => {
                let ids: Vec<VnicId> = self
                    .vnics
                    .iter()
                    .filter(|(_, v)| name.as_ref().is_none_or(|n| *n == v.name))
                    .filter(|(_, v)| self.may_use(conn, v))
                    .map(|(&id, _)| id)
                    .collect();
                match (&name, ids.is_empty()) {
                    (Some(n), true) => AdminReply::Err(format!("no vRNIC {n}")),
                    _ => AdminReply::Stats(ids.into_iter().filter_map(|v| self.stats(v)).collect()),
                }
            }
            AdminRequest::Create {
                name,
                group,
                ip,
                policy,
            } if self.cluster.is_some() => {
                return self.cluster_create(conn, &name, true, group.as_deref(), ip, policy);
            }
            AdminRequest::Create {
                name,
                group,
                ip,
                policy,
            } => match self.create_vnic(&name, true, group.as_deref(), ip) {
                Ok(v) => {
                    self.set_policy(v, policy);
                    let reply = self
                        .summary(v)
                        .map(AdminReply::Vnic)
                        .unwrap_or(AdminReply::Ok);
                    let seq = self.record_vnic(v);
                    return self.reply_when_written(
                        conn,
                        seq,
                        reply,
                        format!("vRNIC {name} was made"),
                    );
                }
                Err(e) => AdminReply::Err(format!("{e:#}")),
            },
            AdminRequest::Policy { name, change } => {
                match self.vnics.iter().find(|(_, v)| v.name == name) {
                    Some((&id, _)) => {
                        self.set_policy(id, change);
                        let reply = self
                            .summary(id)
                            .map(AdminReply::Vnic)
                            .unwrap_or(AdminReply::Ok);
                        let seq = self.record_vnic(id);
                        return self.reply_when_written(
                            conn,
                            seq,
                            reply,
                            format!("vRNIC {name}'s limits were set"),
                        );
                    }
                    None => AdminReply::Err(format!("no vRNIC named {name}")),
                }
            }
            AdminRequest::Remove { name, force } => {
                let who = self.who(conn);
                match self.vnics.iter().find(|(_, v)| v.name == name) {
                    Some((&id, v)) => {
                        let users = v.holders + v.contexts.len();
                        if users > 0 && !force {
                            let n = |k: usize, one: &str, many: &str| {
                                format!("{k} {}", if k == 1 { one } else { many })
                            };
                            AdminReply::Err(format!(
                                "vRNIC {name} is in use ({}, {} holding it); `vrnic rm --force \
                                 {name}` detaches them (their apps get IBV_EVENT_DEVICE_FATAL)",
                                n(v.contexts.len(), "attached context", "attached contexts"),
                                n(v.holders, "`vrnic run`", "`vrnic run`s")
                            ))
                        } else {
                            if users > 0 {
                                warn!(
                                    vnic = name,
                                    contexts = v.contexts.len(),
                                    holders = v.holders,
                                    by = who,
                                    "vRNIC removed by force: its users lose it"
                                );
                            } else {
                                info!(vnic = name, by = who, "vRNIC removal asked");
                            }
                            self.remove_vnic_by_operator(id);
                            let seq = self.forget_vnic(&name);
                            return self.reply_when_written(
                                conn,
                                seq,
                                AdminReply::Ok,
                                format!("vRNIC {name} was removed"),
                            );
                        }
                    }
                    // Recorded, but not made again at start: forgotten.
                    None => match self.forget_vnic(&name) {
                        Some(seq) => {
                            info!(vnic = name, by = who, "recorded vRNIC forgotten");
                            return self.reply_when_written(
                                conn,
                                Some(seq),
                                AdminReply::Ok,
                                format!("vRNIC {name} was forgotten"),
                            );
                        }
                        None => AdminReply::Err(format!("no vRNIC named {name}")),
                    },
                }
            }
            AdminRequest::KillQp { name, qpn } => {
                let who = self.who(conn);
                match self.vnics.iter().find(|(_, v)| v.name == name) {
                    Some((&id, _)) => match self.kill_qp(id, qpn) {
                        Ok(()) => {
                            warn!(vnic = name, qpn, by = who, "QP moved to the error state");
                            AdminReply::Ok
                        }
                        Err(e) => AdminReply::Err(e),
                    },
                    None => AdminReply::Err(format!("no vRNIC named {name}")),
                }
            }
            AdminRequest::Hold { name, group, ip } => {
                if self.admins.get(&conn).is_some_and(|c| c.held.is_some()) {
                    return Some(AdminReply::Err(
                        "this connection already holds a vRNIC".into(),
                    ));
                }
                let existing = name.as_ref().and_then(|n| {
                    self.vnics
                        .iter()
                        .find(|(_, v)| &v.name == n)
                        .map(|(&id, _)| id)
                });
                let id = match existing {
                    Some(id) => {
                        let v = &self.vnics[&id];
                        if !self.may_use(conn, v) {
                            return Some(AdminReply::Err(format!(
                                "permission denied: vRNIC {} is not yours (pick another name, \
                                 or none for a fresh one)",
                                v.name
                            )));
                        }
                        let in_group = self.directory.group_name(v.group);
                        if let Some(g) = &group
                            && g != in_group
                        {
                            return Some(AdminReply::Err(format!(
                                "vRNIC {} is in group {in_group}, not {g}",
                                v.name
                            )));
                        }
                        if let Some(ip) = ip
                            && ip != v.vip
                        {
                            return Some(AdminReply::Err(format!(
                                "vRNIC {} has the address {}, not {ip}",
                                v.name, v.vip
                            )));
                        }
                        id
                    }
                    None => {
                        let name = name.unwrap_or_else(|| {
                            (0..)
                                .map(|i| format!("vrnic{i}"))
                                .find(|n| {
                                    !self.vnics.values().any(|v| &v.name == n)
                                        && !self
                                            .cluster
                                            .as_ref()
                                            .is_some_and(|c| c.pending_names().any(|p| p == n))
                                })
                                .unwrap_or_default()
                        });
                        if self.cluster.is_some() {
                            return self.cluster_create(
                                conn,
                                &name,
                                false,
                                group.as_deref(),
                                ip,
                                vrnic_api::PolicyChange::default(),
                            );
                        }
                        match self.create_vnic(&name, false, group.as_deref(), ip) {
                            Ok(id) => match self.give_to_tenant(conn, id) {
                                Ok(()) => id,
                                Err(e) => {
                                    self.maybe_reap(id);
                                    return Some(AdminReply::Err(format!("{e:#}")));
                                }
                            },
                            Err(e) => return Some(AdminReply::Err(format!("{e:#}"))),
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
        })
    }

    /// Gives vRNIC `id`, just made for admin connection `conn`, to its tenant if it is one:
    /// its region and socket become that user's (mode 600, as they were root's), so that user's
    /// apps attach to it and nobody else's (root aside). Its directory stays the daemon's, so
    /// the tenant cannot swap the files under it.
    pub(super) fn give_to_tenant(&mut self, conn: u64, id: VnicId) -> Result<()> {
        let Some(uid) = self.tenant(conn) else {
            return Ok(());
        };
        let Some(v) = self.vnics.get_mut(&id) else {
            return Ok(());
        };
        for f in [REGION_FILE, VNIC_SOCKET] {
            let path = v.dir.join(f);
            std::os::unix::fs::lchown(&path, Some(uid), None)
                .with_context(|| format!("give {} to uid {uid}", path.display()))?;
        }
        v.owner = Some(uid);
        info!(
            vnic = v.name,
            uid, "vRNIC made for a tenant of the access group"
        );
        Ok(())
    }

    /// Who is at the other end of admin connection `conn` (`pid N uid N`), for the log.
    fn who(&self, conn: u64) -> String {
        self.admins
            .get(&conn)
            .map_or_else(|| "?".to_string(), |c| c.who.clone())
    }

    pub(super) fn close_admin(&mut self, id: u64) {
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
}
