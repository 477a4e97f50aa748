//! The vRNIC registry: creating a vRNIC (its directory, quota tmpfs, region, socket, LID and
//! GID), removing it (and any whose region the `SIGBUS` guard poisoned), reaping those nobody
//! holds, and cleaning up what a killed daemon left. Persistent vRNICs (`vrnic create`) are
//! recorded in the file of [`crate::persist`] as they are made, changed (`vrnic policy`) and
//! removed (`vrnic rm`), and made again from it at start ([`Kept`]).

use tracing::error;

use super::*;

/// Removes a vRNIC's directory: its files, then (lazily: apps may still map the region) its
/// tmpfs, then the mount point.
pub(super) fn remove_vnic_dir(dir: &Path, quota_mount: bool) {
    let _ = std::fs::remove_dir_all(dir);
    if quota_mount {
        if let Err(e) = sys::detach(dir) {
            warn!("unmount {}: {e}", dir.display());
        }
        let _ = std::fs::remove_dir(dir);
    }
}

/// Removes vRNIC directories a dead daemon left behind. Returns how many.
pub(super) fn cleanup_stale(dir: &Path) -> usize {
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

/// What a vRNIC's quota tmpfs holds beyond its region (directory blocks, the socket).
pub(super) const QUOTA_SLACK: u64 = 1 << 20;

/// The file of persistent vRNICs, the daemon's side: every persistent vRNIC's record (and
/// those recorded that could not be made again, kept until `vrnic rm` or a `vrnic create` of
/// the name), and the admin replies that wait for their change to be written.
pub(super) struct Kept {
    writer: crate::persist::Writer,
    records: Vec<crate::persist::Record>,
    /// The records were made again (in cluster mode once registered in etcd).
    restored: bool,
    waiting: Vec<Deferred>,
    /// Cluster mode: recorded vRNICs etcd refused at start, tried once more at `retry_at`
    /// (after a `kill -9`, the dead daemon's lease holds their addresses until it expires).
    retry: Vec<String>,
    retry_at: Option<Instant>,
    /// That second try was made: a refusal is final.
    retried: bool,
}

/// An admin reply held until snapshot `seq` is written.
struct Deferred {
    seq: u64,
    conn: u64,
    reply: AdminReply,
    /// What was done, for the reply if the write fails.
    what: String,
}

impl Kept {
    pub(super) fn new(
        writer: crate::persist::Writer,
        records: Vec<crate::persist::Record>,
    ) -> Kept {
        Kept {
            writer,
            records,
            restored: false,
            waiting: Vec::new(),
            retry: Vec::new(),
            retry_at: None,
            retried: false,
        }
    }

    /// Whether refused vRNICs are to be tried again now.
    pub(super) fn retry_due(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|t| now >= t)
    }

    /// Writes what is queued and stops the writer.
    pub(super) fn stop(&mut self) {
        self.writer.stop();
    }

    /// Queues the records to be written; the snapshot's number.
    fn write(&mut self) -> Option<u64> {
        let seq = self.writer.write(&self.records);
        if seq.is_none() {
            error!(
                file = %self.writer.file().display(),
                "the thread that writes the file of persistent vRNICs is gone: changes are not \
                 recorded"
            );
        }
        seq
    }
}

impl Server {
    /// Creates vRNIC `name` in `group` (`None`: the default group) with virtual IP `ip`
    /// (`None`: one from the group's subnet).
    pub(super) fn create_vnic(
        &mut self,
        name: &str,
        persistent: bool,
        group: Option<&str>,
        ip: Option<std::net::Ipv4Addr>,
    ) -> Result<VnicId> {
        let group_name = group.unwrap_or(crate::cm::DEFAULT_GROUP);
        self.check_new_vnic(name, group_name)?;
        let group = self
            .directory
            .group(group_name)
            .context("the daemon knows its limit of groups")?;
        self.cm.name_group(group, group_name);
        let id = VnicId(self.next_vnic);
        self.next_vnic += 1;
        let vip = self.directory.take_vip(group, ip, id)?;
        let Some(identity) = self.directory.assign(id.0) else {
            self.directory.release_vip(group, vip);
            bail!("no free LID in this host's share");
        };
        // Given back below unless the vRNIC is made.
        let made = self.make_vnic(id, name, persistent, group, vip, identity);
        if made.is_err() {
            self.directory.release_vip(group, vip);
            self.directory.release(identity.lid);
        }
        made
    }

    /// Whether vRNIC `name` may be made in group `group` now: valid names, no vRNIC of that
    /// name (nor one being created), room under the limit.
    pub(super) fn check_new_vnic(&self, name: &str, group: &str) -> Result<()> {
        if !config::valid_name(name) {
            bail!("invalid vRNIC name {name:?}: use 1-63 letters, digits, '-' or '_'");
        }
        if !config::valid_name(group) {
            bail!("invalid group name {group:?}: use 1-63 letters, digits, '-' or '_'");
        }
        let pending = self.cluster.as_ref();
        if self.vnics.values().any(|v| v.name == name)
            || pending.is_some_and(|c| c.pending_names().any(|n| n == name))
        {
            bail!("vRNIC {name} already exists");
        }
        let count = self.vnics.len() + pending.map_or(0, |c| c.pending_count());
        if count >= self.opts.max_vrnics as usize {
            bail!(
                "the daemon serves its limit of {} vRNICs (vrnic serve --max-vrnics)",
                self.opts.max_vrnics
            );
        }
        Ok(())
    }

    /// Makes vRNIC `id` with the addresses it was given (by this host's directory, or by
    /// etcd in cluster mode).
    pub(super) fn make_vnic(
        &mut self,
        id: VnicId,
        name: &str,
        persistent: bool,
        group: GroupId,
        vip: std::net::Ipv4Addr,
        identity: super::directory::Identity,
    ) -> Result<VnicId> {
        let super::directory::Identity { lid, gid, guid } = identity;
        let dir = self.opts.state_dir.join(name);
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        let quota_mount = config::current_euid() == 0;
        if quota_mount && let Err(e) = sys::mount_quota(&dir, self.opts.region_size + QUOTA_SLACK) {
            let _ = std::fs::remove_dir(&dir);
            return Err(e).context("mount the vRNIC's tmpfs (its memory quota)");
        }
        let region = std::sync::Arc::new(
            match Region::create_partial(
                &dir.join(REGION_FILE),
                self.opts.region_size,
                name,
                lid,
                gid,
                guid,
                layout::HEAP_OFF,
            ) {
                Ok(r) => r,
                Err(e) => {
                    remove_vnic_dir(&dir, quota_mount);
                    return Err(e).context("create region");
                }
            },
        );
        let heap_off = layout::HEAP_OFF;
        let heap = Heap::new(heap_off, region.size() - heap_off, layout::PAGE);
        let mut listener = match super::listen_in_place(&dir.join(VNIC_SOCKET), |_| Ok(())) {
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
        let shard = self.pick_shard();
        let limit = std::sync::Arc::new(vrnic_proto::Limit::default());
        self.add_to_shard(shard, id, &region, (lid, gid), group, &limit);
        self.cm.add_vip(group, vip, crate::cm::VipAt::Here(id));
        let group_name = self.directory.group_name(group).to_string();
        self.announce_vnic(super::announce::Entry::Added {
            lid,
            gid,
            vip,
            name,
            group: &group_name,
        });
        info!(vnic = name, lid, group = group_name, %vip, engine = shard, "vRNIC created");
        self.vnics.insert(
            id,
            Vnic {
                name: name.to_string(),
                dir,
                region,
                lid,
                gid,
                guid,
                group,
                vip,
                heap,
                quota_mount,
                shard,
                persistent,
                holders: 0,
                contexts: HashSet::new(),
                claims_seen: 0,
                listener,
                token,
                limit,
                owner: None,
            },
        );
        Ok(id)
    }

    /// [`Server::remove_vnic`] asked by the operator (`vrnic rm`): its users' drivers are told
    /// it was removed (the region's daemon-state word says so) rather than that the daemon
    /// went away.
    pub(super) fn remove_vnic_by_operator(&mut self, id: VnicId) {
        if let Some(v) = self.vnics.get(&id)
            && let Ok(w) = v.region.atomic_u32(hdr::DAEMON_STATE)
        {
            w.store(hdr::STATE_REMOVED, Ordering::Release);
        }
        self.remove_vnic(id);
    }

    /// Moves QP number `qpn` of vRNIC `id` to the error state (`vrnic qp kill`): the engine
    /// that holds it flushes it and raises `QP_FATAL`, published at once.
    pub(super) fn kill_qp(&mut self, id: VnicId, qpn: u32) -> std::result::Result<(), String> {
        let now = std::time::Instant::now();
        for cell in self.slices_of(id) {
            let r = cell.lock().engine.kill_qp(id, qpn);
            if r.is_ok() {
                self.pass_now(&cell, now);
                return Ok(());
            }
        }
        let name = self.vnics.get(&id).map_or("?", |v| v.name.as_str());
        Err(format!("vRNIC {name} has no QP number {qpn:#x}"))
    }

    pub(super) fn remove_vnic(&mut self, id: VnicId) {
        let ctxs: Vec<CtxId> = self
            .vnics
            .get(&id)
            .map(|v| v.contexts.iter().copied().collect())
            .unwrap_or_default();
        for c in ctxs {
            self.drop_context(c);
        }
        self.remove_from_shard(id);
        if let Some(mut v) = self.vnics.remove(&id) {
            let _ = self.poll.registry().deregister(&mut v.listener);
            self.tokens.remove(&v.token);
            if let Ok(w) = v.region.atomic_u32(hdr::DAEMON_STATE) {
                // Gone (removed by the operator, if that was said first).
                let _ = w.compare_exchange(1, 2, Ordering::AcqRel, Ordering::Acquire);
            }
            drop(v.region);
            remove_vnic_dir(&v.dir, v.quota_mount);
            self.directory.release(v.lid);
            self.directory.release_vip(v.group, v.vip);
            self.cluster_release(v.lid);
            self.cm.remove_vip(v.group, v.vip);
            self.cm.forget_counts(id);
            self.announce_vnic(super::announce::Entry::Removed {
                lid: v.lid,
                gid: v.gid,
            });
            info!(vnic = v.name, "vRNIC removed");
        }
    }

    /// Makes again each vRNIC the file of persistent vRNICs records, with its group, virtual
    /// IP and limits, before the loop serves (in cluster mode, once the daemon is registered
    /// in etcd: each then registered as a fresh `vrnic create` is; called again on
    /// registration). One that cannot be made is logged with the reason and stays recorded.
    pub(super) fn restore_recorded(&mut self) {
        let Some(k) = self.kept.as_mut() else { return };
        if k.restored || self.cluster.as_ref().is_some_and(|c| !c.registered()) {
            return;
        }
        k.restored = true;
        let records = k.records.clone();
        let file = k.writer.file().display().to_string();
        let mut made = 0;
        for r in &records {
            if self.cluster.is_some() {
                // Made when etcd grants its addresses (`cluster_created`).
                self.register_recorded(r, &file);
                continue;
            }
            match self.create_vnic(&r.name, true, Some(&r.group), r.ip) {
                Ok(id) => {
                    self.set_policy(id, r.policy());
                    // A record without an address gets the one given now.
                    let _ = self.record_vnic(id);
                    made += 1;
                }
                Err(e) => not_restored(&r.name, &file, &format!("{e:#}")),
            }
        }
        if self.cluster.is_none() && !records.is_empty() {
            info!(
                file,
                made,
                failed = records.len() - made,
                "persistent vRNICs made again"
            );
        }
    }

    /// A recorded vRNIC etcd refused to register at start (cluster mode): tried once more when
    /// the lease of a daemon killed before this start must have expired, else logged.
    pub(super) fn restore_refused(&mut self, name: &str, why: &str) {
        let ttl_s = self.opts.cluster.as_ref().map_or(0, |c| c.ttl_s);
        let Some(k) = self.kept.as_mut() else { return };
        let file = k.writer.file().display().to_string();
        if k.retried {
            return not_restored(name, &file, why);
        }
        let wait = Duration::from_secs(ttl_s + 1);
        warn!(
            vnic = name,
            "a persistent vRNIC could not be made again yet: {why}; trying again in {} s (the \
             lease of a daemon killed before this one may still hold its address)",
            wait.as_secs()
        );
        k.retry.push(name.to_string());
        k.retry_at.get_or_insert(Instant::now() + wait);
    }

    /// Tries again the recorded vRNICs etcd refused at start (see [`Server::restore_refused`]).
    pub(super) fn retry_recorded(&mut self) {
        let Some(k) = self.kept.as_mut() else { return };
        k.retried = true;
        k.retry_at = None;
        let names = std::mem::take(&mut k.retry);
        let records: Vec<crate::persist::Record> = k
            .records
            .iter()
            .filter(|r| names.contains(&r.name))
            .cloned()
            .collect();
        let file = k.writer.file().display().to_string();
        for r in records {
            // Made or removed by the operator meanwhile.
            if self.vnics.values().any(|v| v.name == r.name) {
                continue;
            }
            self.register_recorded(&r, &file);
        }
    }

    /// Registers recorded vRNIC `r` in etcd as a fresh `vrnic create` (cluster mode); a
    /// refusal is logged, naming the record's `file`.
    fn register_recorded(&mut self, r: &crate::persist::Record, file: &str) {
        let refused = self.cluster_create(
            super::admin_socket::NO_CONN,
            &r.name,
            true,
            Some(&r.group),
            r.ip,
            r.policy(),
        );
        if let Some(AdminReply::Err(e)) = refused {
            not_restored(&r.name, file, &e);
        }
    }

    /// Records persistent vRNIC `id` as it is now (name, group, virtual IP, limits) in the
    /// file of persistent vRNICs; the snapshot to wait for, `None` if nothing changed (or
    /// nothing is recorded).
    pub(super) fn record_vnic(&mut self, id: VnicId) -> Option<u64> {
        let v = self.vnics.get(&id).filter(|v| v.persistent)?;
        let policy = v.limit.policy();
        let r = crate::persist::Record {
            name: v.name.clone(),
            group: self.directory.group_name(v.group).to_string(),
            ip: Some(v.vip),
            max_bw: policy.max_bw,
            max_rate: policy.max_rate,
        };
        let k = self.kept.as_mut()?;
        match k.records.iter_mut().find(|o| o.name == r.name) {
            Some(o) if *o == r => return None,
            Some(o) => *o = r,
            None => k.records.push(r),
        }
        k.write()
    }

    /// Forgets vRNIC `name` in the file of persistent vRNICs (`vrnic rm`); the snapshot to
    /// wait for, `None` if it was not recorded.
    pub(super) fn forget_vnic(&mut self, name: &str) -> Option<u64> {
        let k = self.kept.as_mut()?;
        let before = k.records.len();
        k.records.retain(|r| r.name != name);
        if k.records.len() == before {
            return None;
        }
        k.write()
    }

    /// `reply` to admin connection `conn` once snapshot `seq` is written (`None`: at once):
    /// `None` then, for [`Server::admin_request`] to hold the connection. `what` says what was
    /// done, for the reply if the write fails.
    pub(super) fn reply_when_written(
        &mut self,
        conn: u64,
        seq: Option<u64>,
        reply: AdminReply,
        what: String,
    ) -> Option<AdminReply> {
        match (seq, self.kept.as_mut()) {
            (Some(seq), Some(k)) => {
                k.waiting.push(Deferred {
                    seq,
                    conn,
                    reply,
                    what,
                });
                None
            }
            _ => Some(reply),
        }
    }

    /// Takes the writer's reports: the replies that waited for them go out (an error instead
    /// if the write failed).
    pub(super) fn persist_written(&mut self) {
        loop {
            let Some(k) = self.kept.as_mut() else { return };
            let Some(w) = k.writer.poll_written() else {
                return;
            };
            let file = k.writer.file().display().to_string();
            let (done, rest): (Vec<Deferred>, Vec<Deferred>) =
                k.waiting.drain(..).partition(|d| d.seq <= w.seq);
            k.waiting = rest;
            if let Err(e) = &w.result {
                error!(
                    file,
                    "the file of persistent vRNICs could not be written: {e}"
                );
            }
            for d in done {
                let reply = match &w.result {
                    Ok(()) => d.reply,
                    Err(e) => AdminReply::Err(format!(
                        "{}, but the file of persistent vRNICs {file} could not be written \
                         ({e}): the change is lost if the daemon restarts",
                        d.what
                    )),
                };
                self.admin_reply_later(d.conn, &reply);
            }
        }
    }

    /// Tears down every vRNIC whose region the `SIGBUS` guard caught losing pages under us: its
    /// tenant truncated the file or filled its quota. Only that vRNIC goes; its peers see their
    /// QPs fail as if it had died.
    pub(super) fn remove_poisoned(&mut self) {
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

    pub(super) fn maybe_reap(&mut self, id: VnicId) {
        if let Some(v) = self.vnics.get(&id)
            && !v.persistent
            && v.holders == 0
            && v.contexts.is_empty()
        {
            self.remove_vnic(id);
        }
    }

    /// vRNIC `id`'s counters: the sum of its slices' meters (one engine's without
    /// `--spread-qps`).
    pub(super) fn stats(&self, id: VnicId) -> Option<vrnic_api::VnicStats> {
        let mut m = vrnic_proto::Meter::default();
        let mut copied = 0u64;
        for cell in self.slices_of(id) {
            let sh = cell.lock();
            if let Some(s) = sh.engine.meter(id) {
                m.add(&s);
            }
            copied += sh.lanes.get(&id).map_or(0, |l| l.copied());
        }
        let mut s = self.stats_of(id, None, &m)?;
        s.copied = copied;
        Some(s)
    }

    /// The counters of QP number `qpn` of vRNIC `id` (from the engine that holds it).
    pub(super) fn qp_stats(&self, id: VnicId, qpn: u32) -> Option<vrnic_api::VnicStats> {
        let m = self
            .slices_of(id)
            .iter()
            .find_map(|cell| cell.lock().engine.qp_meter(id, qpn))?;
        self.stats_of(id, Some(qpn), &m)
    }

    /// `m` as the admin protocol's stats of vRNIC `id` (or of its QP `qpn`).
    fn stats_of(
        &self,
        id: VnicId,
        qpn: Option<u32>,
        m: &vrnic_proto::Meter,
    ) -> Option<vrnic_api::VnicStats> {
        let v = self.vnics.get(&id)?;
        let classes = |f: &[vrnic_proto::Flow; 4]| {
            let c = |i: usize| vrnic_api::FlowStats {
                wrs: f[i].wrs,
                bytes: f[i].bytes,
            };
            vrnic_api::ClassStats {
                send: c(0),
                write: c(1),
                read: c(2),
                atomic: c(3),
            }
        };
        let completions = m
            .completions
            .iter()
            .enumerate()
            .filter(|&(_, &n)| n > 0)
            .filter_map(|(i, &n)| {
                let s = vrnic_wire::WcStatus::from_u8(u8::try_from(i).ok()?)?;
                Some((snake(&format!("{s:?}")), n))
            })
            .collect();
        // The limit is the vRNIC's: a QP's counters say nothing of it.
        let waited = match qpn {
            None => v.limit.waited(),
            Some(_) => Default::default(),
        };
        Some(vrnic_api::VnicStats {
            name: v.name.clone(),
            group: self.directory.group_name(v.group).to_string(),
            qpn,
            sent: classes(&m.sent),
            received: classes(&m.received),
            completions,
            rnr_naks: m.rnr_naks,
            naks: m.naks,
            ud_dropped: m.ud_dropped,
            qos_waits: waited.0,
            qos_waited_us: u64::try_from(waited.1.as_micros()).unwrap_or(u64::MAX),
            copied: 0,
            cm: match qpn {
                None => self.cm.counts(id),
                Some(_) => Default::default(),
            },
        })
    }

    /// Changes vRNIC `id`'s QoS limits as `change` says (see [`vrnic_api::PolicyChange`]),
    /// live: its next turn on any engine follows them.
    pub(super) fn set_policy(&mut self, id: VnicId, change: vrnic_api::PolicyChange) {
        let Some(v) = self.vnics.get(&id) else { return };
        let before = v.limit.policy();
        let mut p = before;
        if let Some(b) = change.max_bw {
            p.max_bw = (b != 0).then_some(b);
        }
        if let Some(r) = change.max_rate {
            p.max_rate = (r != 0).then_some(r);
        }
        if p != before {
            v.limit.set(p);
            info!(
                vnic = v.name,
                max_bw = p.max_bw.map_or("none".into(), |b| b.to_string()),
                max_rate = p.max_rate.map_or("none".into(), |r| r.to_string()),
                "QoS policy set"
            );
        }
    }

    pub(super) fn summary(&self, id: VnicId) -> Option<VnicSummary> {
        let v = self.vnics.get(&id)?;
        let policy = v.limit.policy();
        Some(VnicSummary {
            name: v.name.clone(),
            lid: v.lid,
            gid: v.gid,
            qps: self
                .slices_of(id)
                .iter()
                .map(|cell| cell.lock().engine.qp_count(id))
                .sum(),
            users: v.holders + v.contexts.len(),
            persistent: v.persistent,
            // Every persistent vRNIC is recorded as it is made.
            recorded: v.persistent && self.kept.is_some(),
            dir: v.dir.display().to_string(),
            group: self.directory.group_name(v.group).to_string(),
            ip: v.vip.to_string(),
            engine: v.shard,
            max_bw: policy.max_bw,
            max_rate: policy.max_rate,
        })
    }
}

/// Logs a recorded vRNIC that could not be made again.
fn not_restored(name: &str, file: &str, why: &str) {
    error!(
        vnic = name,
        file, "a persistent vRNIC could not be made again: {why}; it stays recorded"
    );
}

/// `RemAccessErr` as `rem_access_err`.
fn snake(camel: &str) -> String {
    let mut s = String::with_capacity(camel.len() + 4);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                s.push('_');
            }
            s.push(c.to_ascii_lowercase());
        } else {
            s.push(c);
        }
    }
    s
}

#[cfg(test)]
mod stats_tests {
    #[test]
    fn status_names_are_snake_case() {
        assert_eq!(super::snake("RemAccessErr"), "rem_access_err");
        assert_eq!(super::snake("Success"), "success");
    }
}
