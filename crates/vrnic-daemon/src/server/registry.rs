//! The vRNIC registry: creating a vRNIC (its directory, quota tmpfs, region, socket, LID and
//! GID), removing it (and any whose region the `SIGBUS` guard poisoned), reaping those nobody
//! holds, and cleaning up what a killed daemon left.

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
        Err(format!("vRNIC has no QP number {qpn:#x}"))
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
            self.announce_vnic(super::announce::Entry::Removed {
                lid: v.lid,
                gid: v.gid,
            });
            info!(vnic = v.name, "vRNIC removed");
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
            dir: v.dir.display().to_string(),
            group: self.directory.group_name(v.group).to_string(),
            ip: v.vip.to_string(),
            engine: v.shard,
            max_bw: policy.max_bw,
            max_rate: policy.max_rate,
        })
    }
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
