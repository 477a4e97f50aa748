//! The control verbs: vRNICs and contexts, PDs, MRs, CQs, QPs, SRQs and address handles,
//! each checked against its owner and the device's limits before it changes anything.

use super::*;
use vrnic_wire::frame::QPN_MASK;

impl Engine {
    // ---- vRNICs and contexts ---------------------------------------------------------------

    /// Registers a vRNIC with its address.
    pub fn add_vnic(&mut self, vnic: VnicId, lid: u16, gid: [u8; 16]) {
        self.routes.generation += 1;
        self.routes.by_lid.insert(lid, vnic);
        self.routes.by_gid.insert(gid, vnic);
        self.objs.vnics.insert(
            vnic,
            Vnic {
                lid,
                gid,
                group: GroupId(0),
                keys: FxHashMap::default(),
                windows: Windows::new(),
                ready: VecDeque::new(),
                queued: false,
                meter: Meter::default(),
                limit: None,
                throttled: false,
            },
        );
    }

    /// Destroys every object of `vnic` and forgets it.
    pub fn remove_vnic(&mut self, now: Instant, vnic: VnicId) {
        let mut ctxs: Vec<CtxId> = self
            .objs
            .pds
            .values()
            .filter(|p| p.vnic == vnic)
            .map(|p| p.ctx)
            .collect();
        ctxs.extend(
            self.objs
                .qps
                .values()
                .filter(|q| q.vnic == vnic)
                .map(|q| q.ctx),
        );
        ctxs.extend(
            self.objs
                .cqs
                .values()
                .filter(|c| c.vnic == vnic)
                .map(|c| c.ctx),
        );
        ctxs.extend(
            self.objs
                .srqs
                .values()
                .filter(|s| s.vnic == vnic)
                .map(|s| s.ctx),
        );
        ctxs.extend(
            self.objs
                .xrcds
                .values()
                .filter(|x| x.vnic == vnic)
                .map(|x| x.ctx),
        );
        ctxs.sort();
        ctxs.dedup();
        for c in ctxs {
            self.destroy_context(now, c);
        }
        if let Some(v) = self.objs.vnics.remove(&vnic) {
            self.routes.generation += 1;
            if self.routes.by_lid.get(&v.lid) == Some(&vnic) {
                self.routes.by_lid.remove(&v.lid);
            }
            if self.routes.by_gid.get(&v.gid) == Some(&vnic) {
                self.routes.by_gid.remove(&v.gid);
            }
        }
    }

    /// Destroys everything `ctx` owns: its QPs (their peers see errors), SRQs, AHs, MRs, CQs
    /// and PDs.
    pub fn destroy_context(&mut self, now: Instant, ctx: CtxId) {
        let qps: Vec<QpId> = self
            .objs
            .qps
            .iter()
            .filter(|(_, q)| q.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for qp in qps {
            self.fail_peers(qp);
            let _ = self.destroy_qp(now, ctx, qp);
        }
        self.dealloc_ctx_windows(ctx);
        let mrs: Vec<MrId> = self
            .objs
            .mrs
            .iter()
            .filter(|(_, m)| m.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for mr in mrs {
            let _ = self.dereg_mr(ctx, mr);
        }
        let srqs: Vec<SrqId> = self
            .objs
            .srqs
            .iter()
            .filter(|(_, s)| s.ctx == ctx)
            .map(|(&id, _)| id)
            .collect();
        for srq in srqs {
            let _ = self.destroy_srq(ctx, srq);
        }
        self.objs.srqs.retain(|_, s| s.ctx != ctx);
        self.objs
            .by_srqn
            .retain(|_, s| self.objs.srqs.contains_key(s));
        self.close_ctx_xrcds(ctx);
        self.objs.ahs.retain(|_, a| a.ctx != ctx);
        self.objs.cqs.retain(|_, c| c.ctx != ctx);
        self.objs.pds.retain(|_, p| p.ctx != ctx);
        self.out
            .completions
            .retain(|(cq, _, _)| self.objs.cqs.contains_key(cq));
        self.out.events.retain(|(c, _)| *c != ctx);
    }

    // ---- PDs and MRs -----------------------------------------------------------------------

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&mut self, vnic: VnicId, ctx: CtxId) -> Result<PdId, Errno> {
        if !self.objs.vnics.contains_key(&vnic) {
            return Err(ENOENT);
        }
        if self.objs.pds.values().filter(|p| p.vnic == vnic).count() >= MAX_PD {
            return Err(ENOMEM);
        }
        let pd = PdId(self.id());
        self.objs.pds.insert(
            pd,
            Pd {
                vnic,
                ctx,
                users: 0,
            },
        );
        Ok(pd)
    }

    /// `ibv_dealloc_pd`: `EBUSY` while MRs, QPs or memory windows use it.
    pub fn dealloc_pd(&mut self, ctx: CtxId, pd: PdId) -> Result<(), Errno> {
        match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => {
                if p.users > 0 || self.windows_in(p.vnic, pd) > 0 {
                    return Err(EBUSY);
                }
                self.objs.pds.remove(&pd);
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// Whether PD `pd` of `ctx` is used here (by MRs, QPs, SRQs, address handles) or by a
    /// memory window: of a vRNIC with slices on several engines, each slice counts its own
    /// users (its windows are one table, which they share).
    pub fn pd_busy(&self, ctx: CtxId, pd: PdId) -> bool {
        self.objs
            .pds
            .get(&pd)
            .is_some_and(|p| p.ctx == ctx && (p.users > 0 || self.windows_in(p.vnic, pd) > 0))
    }

    /// Whether CQ `cq` of `ctx` is used here by a QP or SRQ (see [`Engine::pd_busy`]).
    pub fn cq_busy(&self, ctx: CtxId, cq: CqId) -> bool {
        self.objs
            .cqs
            .get(&cq)
            .is_some_and(|c| c.ctx == ctx && c.users > 0)
    }

    /// The checks of [`Engine::reg_mr`] that need no pages: the PD, the access flags, the
    /// range, the MR limit. The daemon runs them before it does any work for a registration.
    /// Returns the vRNIC the MR would belong to.
    pub fn check_reg_mr(
        &self,
        ctx: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    ) -> Result<VnicId, Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if access & !access::SUPPORTED != 0 {
            return Err(EOPNOTSUPP);
        }
        // Remote write or atomic access requires local write (IB spec, every device).
        if len == 0
            || (access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
                && access & access::LOCAL_WRITE == 0)
        {
            return Err(EINVAL);
        }
        addr.checked_add(len).ok_or(EINVAL)?;
        iova.checked_add(len).ok_or(EINVAL)?;
        if self.objs.vnics.get(&vnic).ok_or(ENOENT)?.keys.len() >= MAX_MR {
            return Err(ENOMEM);
        }
        Ok(vnic)
    }

    /// `ibv_reg_mr`: `pages[i]` backs the i-th 4 KiB page from floor(`addr`).
    #[allow(clippy::too_many_arguments)]
    pub fn reg_mr(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
        runs: &[(u64, u64)],
    ) -> Result<MrKeys, Errno> {
        let vnic = self.check_reg_mr(ctx, pd, addr, len, iova, access)?;
        let npages = (addr + len).div_ceil(PAGE) - addr / PAGE;
        let spans = spans_of(runs, npages).ok_or(EINVAL)?;
        // Unique among the MR keys and outside every memory window's key range.
        let taken = |e: &Engine, key: u32| {
            key == 0
                || e.objs
                    .vnics
                    .get(&vnic)
                    .is_some_and(|v| v.keys.contains_key(&key) || v.windows.uses_index(key >> 8))
        };
        let key = match self.forced {
            // A mirror keeps the key its maker gave.
            Some((_, Some(k))) if taken(self, k) => return Err(EEXIST),
            Some((_, Some(k))) => k,
            _ => loop {
                let key = self.random() as u32;
                if !taken(self, key) {
                    break key;
                }
            },
        };
        let mr = MrId(self.id());
        self.objs
            .vnics
            .get_mut(&vnic)
            .ok_or(ENOENT)?
            .keys
            .insert(key, mr);
        self.objs.mrs.insert(
            mr,
            Mr {
                vnic,
                ctx,
                pd,
                addr,
                len,
                iova,
                access,
                key,
                spans,
            },
        );
        if let Some(p) = self.objs.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok(MrKeys {
            mr,
            lkey: key,
            rkey: key,
        })
    }

    /// `ibv_dereg_mr`: from now on no work request can reach its memory. `EINVAL` while
    /// memory windows are bound to it (IB spec 10.6.7.2.6, as rxe).
    pub fn dereg_mr(&mut self, ctx: CtxId, mr: MrId) -> Result<(), Errno> {
        match self.objs.mrs.get(&mr) {
            Some(m) if m.ctx == ctx && self.windows_on(m.vnic, mr) == 0 => {}
            _ => return Err(EINVAL),
        }
        let m = self.objs.mrs.remove(&mr).ok_or(EINVAL)?;
        self.memory_changed();
        if let Some(v) = self.objs.vnics.get_mut(&m.vnic) {
            v.keys.remove(&m.key);
        }
        if let Some(p) = self.objs.pds.get_mut(&m.pd) {
            p.users = p.users.saturating_sub(1);
        }
        Ok(())
    }

    // ---- CQs and QPs -----------------------------------------------------------------------

    /// `ibv_create_cq`.
    pub fn create_cq(&mut self, vnic: VnicId, ctx: CtxId, depth: u32) -> Result<CqId, Errno> {
        if !self.objs.vnics.contains_key(&vnic) {
            return Err(ENOENT);
        }
        if depth == 0 || depth > MAX_CQE {
            return Err(EINVAL);
        }
        if self.objs.cqs.values().filter(|c| c.vnic == vnic).count() >= MAX_CQ {
            return Err(ENOMEM);
        }
        let cq = CqId(self.id());
        self.objs.cqs.insert(
            cq,
            Cq {
                vnic,
                ctx,
                users: 0,
            },
        );
        Ok(cq)
    }

    /// `ibv_destroy_cq`: `EBUSY` while a QP uses it.
    pub fn destroy_cq(&mut self, ctx: CtxId, cq: CqId) -> Result<(), Errno> {
        match self.objs.cqs.get(&cq) {
            Some(c) if c.ctx == ctx => {
                if c.users > 0 {
                    return Err(EBUSY);
                }
                self.objs.cqs.remove(&cq);
                self.out.completions.retain(|(c, _, _)| *c != cq);
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// `ibv_create_qp` without an SRQ. Returns the QP and its number.
    #[allow(clippy::too_many_arguments)]
    pub fn create_qp(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        qp_type: QpType,
        cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        self.create_qp_srq(ctx, pd, send_cq, recv_cq, None, qp_type, cap, sq_sig_all)
    }

    /// `ibv_create_qp`, its receives taken from `srq` if given (then `max_recv_wr` and
    /// `max_recv_sge` are ignored, as on a device). Returns the QP and its number.
    #[allow(clippy::too_many_arguments)]
    pub fn create_qp_srq(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
        qp_type: QpType,
        mut cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        for cq in [send_cq, recv_cq] {
            match self.objs.cqs.get(&cq) {
                Some(c) if c.ctx == ctx && c.vnic == vnic => {}
                _ => return Err(EINVAL),
            }
        }
        if let Some(s) = srq {
            match self.objs.srqs.get(&s) {
                // An XRC SRQ serves XRC receive QPs only.
                Some(s) if s.ctx == ctx && s.vnic == vnic && s.xrc.is_none() => {}
                _ => return Err(EINVAL),
            }
            cap.max_recv_wr = 0;
            cap.max_recv_sge = 0;
        }
        if qp_type == QpType::XrcRecv || (qp_type == QpType::XrcSend && srq.is_some()) {
            // An XRC receive QP has no PD or CQ: `create_xrc_recv_qp`.
            return Err(EINVAL);
        }
        if cap.max_send_wr > MAX_QP_WR
            || cap.max_recv_wr > MAX_QP_WR
            || cap.max_send_sge as usize > MAX_SGE
            || cap.max_recv_sge as usize > MAX_SGE
            || cap.max_inline_data as usize > MAX_INLINE
        {
            return Err(EINVAL);
        }
        self.insert_qp(
            vnic, ctx, pd, send_cq, recv_cq, srq, qp_type, cap, sq_sig_all,
        )
    }

    /// Makes a QP of checked parts, counting it as a user of its PD, CQs and SRQ.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn insert_qp(
        &mut self,
        vnic: VnicId,
        ctx: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
        qp_type: QpType,
        cap: QpCap,
        sq_sig_all: bool,
    ) -> Result<(QpId, u32), Errno> {
        // Numbers of this engine's class (see `Engine::set_qpn_space`), at most 3/4 of them in
        // use, so the search below ends.
        let class = (QPN_MASK + 1) / self.qpn_stride;
        if self.qp_count(vnic) >= MAX_QP || self.objs.by_qpn.len() as u32 >= class / 4 * 3 {
            return Err(ENOMEM);
        }
        let mut qpn = self.next_qpn;
        loop {
            if qpn > QPN_MASK {
                qpn = self.qpn_offset;
            }
            if qpn >= 2 && !self.objs.by_qpn.contains_key(&qpn) {
                break;
            }
            qpn += self.qpn_stride;
        }
        self.next_qpn = qpn + self.qpn_stride;
        let id = QpId(self.id());
        self.objs.by_qpn.insert(qpn, id);
        self.objs.qps.insert(
            id,
            Qp {
                meter: Meter::default(),
                ty: qp_type,
                xrcd: None,
                xrc_srq: None,
                srq,
                vnic,
                ctx,
                pd,
                send_cq,
                recv_cq,
                qpn,
                cap,
                sq_sig_all,
                attr: QpAttr {
                    cap,
                    ..QpAttr::default()
                },
                sq: VecDeque::new(),
                rq: VecDeque::new(),
                sq_depth: cap.max_send_wr.max(1).next_power_of_two(),
                rq_depth: cap.max_recv_wr.max(1).next_power_of_two(),
                sq_retired: 0,
                rq_retired: 0,
                wait: Wait::None,
                progress: None,
                route: Route::Nowhere,
                addr: AddrRepr::default(),
                link: Link::default(),
                resp: Resp::default(),
                sched: Sched::default(),
                tr: Tr::default(),
            },
        );
        if let Some(p) = self.objs.pds.get_mut(&pd) {
            p.users += 1;
        }
        for cq in [send_cq, recv_cq] {
            if let Some(c) = self.objs.cqs.get_mut(&cq) {
                c.users += 1;
            }
        }
        if let Some(s) = srq.and_then(|s| self.objs.srqs.get_mut(&s)) {
            s.users += 1;
        }
        Ok((id, qpn))
    }

    pub(super) fn own_qp(&self, ctx: CtxId, qp: QpId) -> Result<&Qp, Errno> {
        match self.objs.qps.get(&qp) {
            Some(q) if q.ctx == ctx => Ok(q),
            _ => Err(EINVAL),
        }
    }

    /// `ibv_modify_qp`, with the attribute-mask rules of a real device.
    pub fn modify_qp(
        &mut self,
        now: Instant,
        ctx: CtxId,
        qp: QpId,
        mask: u32,
        attr: &QpAttr,
    ) -> Result<(), Errno> {
        // Access flags may change: translations checked against them are stale.
        self.memory_changed();
        let q = self.own_qp(ctx, qp)?;
        let (cur, ty) = (q.attr.qp_state, q.ty);
        let next = if mask & qp_attr::STATE != 0 {
            attr.qp_state
        } else {
            cur
        };
        if mask & qp_attr::CUR_STATE != 0 && attr.cur_qp_state != cur {
            return Err(EINVAL);
        }
        if !state::check(ty, cur, next, mask) {
            return Err(EINVAL);
        }
        if (mask & qp_attr::PORT != 0 && attr.port_num != 1)
            || (mask & qp_attr::PKEY_INDEX != 0 && attr.pkey_index != 0)
            || (mask & qp_attr::PATH_MTU != 0 && !(1..=5).contains(&attr.path_mtu))
            || (mask & qp_attr::MAX_QP_RD_ATOMIC != 0 && attr.max_rd_atomic > 16)
            || (mask & qp_attr::MAX_DEST_RD_ATOMIC != 0 && attr.max_dest_rd_atomic > 16)
            || (mask & qp_attr::MIN_RNR_TIMER != 0 && attr.min_rnr_timer > 31)
            || (mask & qp_attr::TIMEOUT != 0 && attr.timeout > 31)
            || (mask & qp_attr::RETRY_CNT != 0 && attr.retry_cnt > 7)
            || (mask & qp_attr::RNR_RETRY != 0 && attr.rnr_retry > 7)
            || (mask & qp_attr::ACCESS_FLAGS != 0
                && attr.qp_access_flags
                    & !(access::LOCAL_WRITE
                        | access::REMOTE_WRITE
                        | access::REMOTE_READ
                        | access::REMOTE_ATOMIC)
                    != 0)
            || (mask & qp_attr::DEST_QPN != 0 && attr.dest_qp_num > QPN_MASK)
            || (mask & qp_attr::AV != 0 && attr.ah_attr.port_num > 1)
        {
            return Err(EINVAL);
        }
        let dqpn = if mask & qp_attr::DEST_QPN != 0 {
            attr.dest_qp_num
        } else {
            q.attr.dest_qp_num
        };
        // Where its segments go: resolved now, from the address it will have.
        let (vnic, qpn) = (q.vnic, q.qpn);
        let ah = if mask & qp_attr::AV != 0 {
            attr.ah_attr
        } else {
            q.attr.ah_attr
        };
        let route = match (next, mask & qp_attr::AV != 0) {
            (QpState::Rtr | QpState::Rts | QpState::Sqd, true) => self.route_from(vnic, &ah, true),
            (QpState::Rtr | QpState::Rts | QpState::Sqd, false) => {
                self.route_from(vnic, &ah, false)
            }
            _ => Route::Nowhere,
        };
        let route = self.classed(route, dqpn);
        let addr = self.addr_to(vnic, qpn, route, &ah);
        let Some(q) = self.objs.qps.get_mut(&qp) else {
            return Err(EINVAL);
        };
        q.route = route;
        q.addr = addr;
        q.resp.admitted = None;
        let a = &mut q.attr;
        macro_rules! set {
            ($bit:ident => $($f:ident),+) => {
                if mask & qp_attr::$bit != 0 { $(a.$f = attr.$f;)+ }
            };
        }
        set!(ACCESS_FLAGS => qp_access_flags);
        set!(PKEY_INDEX => pkey_index);
        set!(PORT => port_num);
        set!(QKEY => qkey);
        set!(AV => ah_attr);
        set!(PATH_MTU => path_mtu);
        set!(TIMEOUT => timeout);
        set!(RETRY_CNT => retry_cnt);
        set!(RNR_RETRY => rnr_retry);
        set!(RQ_PSN => rq_psn);
        set!(MAX_QP_RD_ATOMIC => max_rd_atomic);
        set!(ALT_PATH => alt_ah_attr, alt_pkey_index, alt_port_num, alt_timeout);
        set!(MIN_RNR_TIMER => min_rnr_timer);
        set!(SQ_PSN => sq_psn);
        set!(MAX_DEST_RD_ATOMIC => max_dest_rd_atomic);
        set!(PATH_MIG_STATE => path_mig_state);
        set!(DEST_QPN => dest_qp_num);
        set!(EN_SQD_ASYNC_NOTIFY => en_sqd_async_notify);
        a.qp_state = next;
        match next {
            QpState::Reset => {
                // Forget the queues silently: their slots are free again.
                q.sq_retired = q.sq_retired.wrapping_add(q.sq.len() as u32);
                touch(&mut self.sched.touched, qp, q);
                q.rq_retired = q.rq_retired.wrapping_add(q.rq.len() as u32);
                touch(&mut self.sched.touched, qp, q);
                q.sq.clear();
                q.rq.clear();
                q.wait = Wait::None;
                q.progress = None;
                q.resp.rx = None;
                q.resp.rx_lost = false;
                q.resp.nak_sent = false;
                q.clear_flights();
                q.resp.last_atomic = None;
                q.attr = QpAttr {
                    cap: q.cap,
                    ..QpAttr::default()
                };
            }
            QpState::Err => {
                let (ctx, srq) = (q.ctx, q.srq);
                self.flush(qp);
                if srq.is_some() && cur != QpState::Err {
                    self.out
                        .events
                        .push_back((ctx, Event::LastWqeReached { qp }));
                }
            }
            QpState::Rtr | QpState::Rts => {
                // This QP may be the responder someone waits for; and it may have work.
                self.wake_retry_waiters();
                self.wake(qp);
            }
            _ => {}
        }
        let _ = now;
        Ok(())
    }

    /// `ibv_query_qp`.
    pub fn query_qp(&self, ctx: CtxId, qp: QpId) -> Result<QpAttr, Errno> {
        let q = self.own_qp(ctx, qp)?;
        let mut a = q.attr;
        a.cur_qp_state = a.qp_state;
        a.cap = q.cap;
        Ok(a)
    }

    /// `ibv_destroy_qp`. As on a real fabric, a connected peer notices only when it next sends
    /// (`RETRY_EXC_ERR` after its transport timeout).
    pub fn destroy_qp(&mut self, now: Instant, ctx: CtxId, qp: QpId) -> Result<(), Errno> {
        self.own_qp(ctx, qp)?;
        let Some(q) = self.objs.qps.remove(&qp) else {
            return Err(EINVAL);
        };
        self.objs.by_qpn.remove(&q.qpn);
        // Its counts stay the vRNIC's ([`Engine::meter`]).
        if let Some(v) = self.objs.vnics.get_mut(&q.vnic) {
            v.meter.add(&q.meter);
        }
        self.unbind_qp_windows(q.vnic, qp);
        if let Some(p) = self.objs.pds.get_mut(&q.pd) {
            p.users = p.users.saturating_sub(1);
        }
        if let Some(s) = q.srq.and_then(|s| self.objs.srqs.get_mut(&s)) {
            s.users = s.users.saturating_sub(1);
        }
        for cq in [q.send_cq, q.recv_cq] {
            if let Some(c) = self.objs.cqs.get_mut(&cq) {
                c.users = c.users.saturating_sub(1);
            }
        }
        self.release_xrc_qp(q.xrcd);
        let _ = now;
        Ok(())
    }

    /// A context died with `qp` still connected: its RC peers move to ERR at once (the head
    /// send fails with `RETRY_EXC_ERR`, everything else flushes), so a peer that only waits for
    /// receives does not hang.
    pub(super) fn fail_peers(&mut self, qp: QpId) {
        let Some(q) = self.objs.qps.get(&qp) else {
            return;
        };
        let (qpn, vnic) = (q.qpn, q.vnic);
        // Whatever its own state (a QP its ring check failed is in ERR already): the peer
        // still waits on it.
        if let Route::Remote(host) = q.route {
            self.out.died_remote.push((host, qpn));
        }
        self.fail_connected(Route::Local(vnic), qpn);
    }

    /// Moves the QPs connected to QP `qpn` along `route` to ERR, their head WQE (or next one)
    /// completing with `RETRY_EXC_ERR`.
    fn fail_connected(&mut self, route: Route, qpn: u32) {
        let peers: Vec<QpId> = self
            .objs
            .qps
            .iter()
            .filter(|(_, p)| {
                matches!(p.attr.qp_state, QpState::Rtr | QpState::Rts | QpState::Sqd)
                    && p.attr.dest_qp_num == qpn
                    && p.route == route
            })
            .map(|(&id, _)| id)
            .collect();
        for p in peers {
            self.fail_qp(p, Some(WcStatus::RetryExcErr));
        }
    }

    /// QPs that died with their context (see [`Engine::destroy_context`]) while connected over
    /// a peer link: each one's host and number. The driver takes them after each
    /// `destroy_context` or `remove_vnic` (they are kept until then) and, where it can reach
    /// the engine at the other end (another engine of the same daemon), tells it
    /// ([`Engine::peer_died`]); another host's QPs find out by their retry timers.
    pub fn take_died_remote(&mut self) -> Vec<(HostId, u32)> {
        std::mem::take(&mut self.out.died_remote)
    }

    /// QP `qpn` behind `host` died with its context: the QPs connected to it over that link
    /// move to ERR, their head WQE (or next one) completing with `RETRY_EXC_ERR`, as a local
    /// peer's do at once.
    pub fn peer_died(&mut self, host: HostId, qpn: u32) {
        self.fail_connected(Route::Remote(host), qpn);
    }

    /// The QP's current state.
    pub fn qp_state(&self, qp: QpId) -> Option<QpState> {
        self.objs.qps.get(&qp).map(|q| q.attr.qp_state)
    }

    /// QP number `qpn` when it has no receive taken in (the driver hands the engine the
    /// receives an app posts only when it looks at their ring), with the SRQ it takes its
    /// receives from, if any. A driver looks at that ring before it hands the engine a segment
    /// from another engine or host that takes a receive ([`Op::takes_receive`]), so that a
    /// receive posted before the message was sent is there for it, as on a device: otherwise
    /// UD and UC drop the message and RC answers RNR. `None` when it has a receive taken in,
    /// or no such QP (an XRC target's SRQ is named by each segment: not looked up here).
    ///
    /// [`Op::takes_receive`]: vrnic_wire::frame::Op::takes_receive
    pub fn receives_wanted(&self, qpn: u32) -> Option<(QpId, Option<SrqId>)> {
        let qp = *self.objs.by_qpn.get(&qpn)?;
        let q = self.objs.qps.get(&qp)?;
        match q.srq {
            Some(s) => self
                .objs
                .srqs
                .get(&s)?
                .rq
                .is_empty()
                .then_some((qp, Some(s))),
            None if q.xrc_srq.is_some() || q.ty == QpType::XrcRecv => None,
            None => q.rq.is_empty().then_some((qp, None)),
        }
    }

    /// All QPs (for the daemon's ring scan).
    pub fn qps(&self) -> impl Iterator<Item = QpId> + '_ {
        self.objs.qps.keys().copied()
    }

    /// Moves QP number `qpn` of vRNIC `vnic` to the error state from outside (the operator's
    /// `vrnic qp kill`), as a fatal error of the QP would: its outstanding work requests
    /// complete with `WR_FLUSH_ERR`, its context gets `IBV_EVENT_QP_FATAL` (and, on an SRQ,
    /// `LAST_WQE_REACHED`), and its peer, getting no more answers, fails within its retry
    /// budget. Nothing else of the vRNIC changes. `ENOENT` when this engine has no QP of that
    /// number in that vRNIC; a QP already in error stays as it is.
    pub fn kill_qp(&mut self, vnic: VnicId, qpn: u32) -> Result<QpId, Errno> {
        let qp = *self.objs.by_qpn.get(&qpn).ok_or(ENOENT)?;
        if self.objs.qps.get(&qp).is_none_or(|q| q.vnic != vnic) {
            return Err(ENOENT);
        }
        self.fail_qp(qp, None);
        Ok(qp)
    }

    /// Number of QPs of a vRNIC.
    pub fn qp_count(&self, vnic: VnicId) -> usize {
        self.objs.qps.values().filter(|q| q.vnic == vnic).count()
    }

    // ---- SRQs and address handles ----------------------------------------------------------

    /// `ibv_create_srq`: returns the SRQ and its ring depth (`max_wr` rounded up to a power
    /// of two). `limit` (0: disarmed) must be below `max_wr`.
    pub fn create_srq(
        &mut self,
        ctx: CtxId,
        pd: PdId,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<(SrqId, u32), Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if max_wr == 0 || max_wr > MAX_QP_WR || max_sge as usize > MAX_SGE || limit >= max_wr {
            return Err(EINVAL);
        }
        if self.objs.srqs.values().filter(|s| s.vnic == vnic).count() >= MAX_SRQ
            || self.objs.by_srqn.len() >= 0xff_0000
        {
            return Err(ENOMEM);
        }
        let id = SrqId(self.id());
        let depth = max_wr.next_power_of_two();
        let mut srqn = self.objs.next_srqn;
        while self.objs.by_srqn.contains_key(&srqn) || srqn == 0 {
            srqn = (srqn + 1) & QPN_MASK;
        }
        self.objs.next_srqn = (srqn + 1) & QPN_MASK;
        self.objs.by_srqn.insert(srqn, id);
        self.objs.srqs.insert(
            id,
            Srq {
                vnic,
                ctx,
                pd,
                rq: VecDeque::new(),
                depth,
                max_wr,
                max_sge: max_sge.max(1),
                retired: 0,
                limit,
                users: 0,
                broken: false,
                touched: false,
                srqn,
                xrc: None,
            },
        );
        if let Some(p) = self.objs.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok((id, depth))
    }

    /// `ibv_modify_srq`: `max_wr` resizes (`IBV_SRQ_MAX_WR`), `limit` arms the limit event
    /// (`IBV_SRQ_LIMIT`; 0 disarms). Returns the SRQ's ring depth afterwards (`max_wr`
    /// rounded up to a power of two).
    ///
    /// A resize may grow or shrink, keeping the receives posted: the new `max_wr` must be in
    /// `1..=MAX_QP_WR`, hold every receive outstanding and not fall below an armed limit, and
    /// the SRQ must not be in error (rxe's `rxe_srq_chk_attr` and `rxe_queue_resize`: `EINVAL`
    /// otherwise). The driver must have handed every receive it published to
    /// [`Engine::handle_srq_wqe`] first. A limit must be below the (new) `max_wr`. Nothing
    /// changes unless both parts are valid.
    pub fn modify_srq(
        &mut self,
        ctx: CtxId,
        srq: SrqId,
        max_wr: Option<u32>,
        limit: Option<u32>,
    ) -> Result<u32, Errno> {
        let s = match self.objs.srqs.get_mut(&srq) {
            Some(s) if s.ctx == ctx => s,
            _ => return Err(EINVAL),
        };
        let new_max = match max_wr {
            Some(m) => {
                let outstanding = s.rq.len() as u32;
                let armed = limit.unwrap_or(s.limit);
                if s.broken || m == 0 || m > MAX_QP_WR || m < outstanding || m < armed {
                    return Err(EINVAL);
                }
                m
            }
            None => s.max_wr,
        };
        if limit.is_some_and(|l| l >= new_max) {
            return Err(EINVAL);
        }
        if max_wr.is_some() {
            s.max_wr = new_max;
            s.depth = new_max.next_power_of_two();
        }
        if let Some(l) = limit {
            s.limit = l;
            if l > 0 && (s.rq.len() as u32) < l {
                // Already below: the event fires at once, as a device raises it on arming.
                s.limit = 0;
                self.out.events.push_back((ctx, Event::SrqLimit { srq }));
            }
        }
        Ok(s.depth)
    }

    /// `ibv_query_srq`: `(max_wr, max_sge, srq_limit)`.
    pub fn query_srq(&self, ctx: CtxId, srq: SrqId) -> Result<(u32, u32, u32), Errno> {
        match self.objs.srqs.get(&srq) {
            Some(s) if s.ctx == ctx => Ok((s.max_wr, s.max_sge, s.limit)),
            _ => Err(EINVAL),
        }
    }

    /// `ibv_destroy_srq`: `EBUSY` while a QP uses it.
    pub fn destroy_srq(&mut self, ctx: CtxId, srq: SrqId) -> Result<(), Errno> {
        match self.objs.srqs.get(&srq) {
            Some(s) if s.ctx == ctx => {
                if s.users > 0 {
                    return Err(EBUSY);
                }
                let (pd, srqn, xrc) = (s.pd, s.srqn, s.xrc);
                self.objs.srqs.remove(&srq);
                self.objs.by_srqn.remove(&srqn);
                if let Some(p) = self.objs.pds.get_mut(&pd) {
                    p.users = p.users.saturating_sub(1);
                }
                if let Some(x) = xrc {
                    self.release_xrc_srq(x);
                }
                self.out.events
                    .retain(|(_, e)| !matches!(e, Event::SrqLimit { srq: x } | Event::SrqError { srq: x } if *x == srq));
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// Receive WQEs the SRQ can take now.
    pub fn srq_room(&self, srq: SrqId) -> u32 {
        self.objs
            .srqs
            .get(&srq)
            .filter(|s| !s.broken)
            .map(|s| s.depth.saturating_sub(s.rq.len() as u32))
            .unwrap_or(0)
    }

    /// SRQ receive WQEs retired so far (free running).
    pub fn srq_retired(&self, srq: SrqId) -> u32 {
        self.objs.srqs.get(&srq).map(|s| s.retired).unwrap_or(0)
    }

    /// All SRQs (for the daemon's ring scan).
    pub fn srq_ids(&self) -> impl Iterator<Item = SrqId> + '_ {
        self.objs.srqs.keys().copied()
    }

    /// A receive WQE from an SRQ's ring. One that does not parse, has more SGEs than the SRQ
    /// allows, or exceeds the depth breaks the SRQ: it takes no more receives and its owner
    /// gets `IBV_EVENT_SRQ_ERR` (the QPs on it see RNR, as with an empty queue).
    pub fn handle_srq_wqe(&mut self, srq: SrqId, wqe: Result<RecvWqe, ParseError>) {
        let Some(s) = self.objs.srqs.get_mut(&srq) else {
            return;
        };
        if s.broken {
            return;
        }
        match wqe {
            Ok(w) if (s.rq.len() as u32) < s.depth && w.sges.len() as u32 <= s.max_sge => {
                s.rq.push_back(w);
                self.wake_rnr(RecvQueue::Srq(srq));
            }
            w => {
                tracing::debug!(
                    srq = srq.0,
                    ok = w.is_ok(),
                    "SRQ receive refused; SRQ in error"
                );
                s.broken = true;
                s.retired = s.retired.wrapping_add(1);
                touch_srq(&mut self.sched.touched_srqs, srq, s);
                let ctx = s.ctx;
                self.out.events.push_back((ctx, Event::SrqError { srq }));
            }
        }
    }

    /// `ibv_create_ah`: an address for UD sends from QPs of `pd`. Only port 1 and GID index 0
    /// exist; the address need not name a vRNIC that exists now (datagrams to nowhere are
    /// dropped).
    pub fn create_ah(&mut self, ctx: CtxId, pd: PdId, attr: AhAttr) -> Result<AhId, Errno> {
        let vnic = match self.objs.pds.get(&pd) {
            Some(p) if p.ctx == ctx => p.vnic,
            _ => return Err(EINVAL),
        };
        if attr.port_num != 1 || (attr.is_global && attr.grh.sgid_index != 0) {
            return Err(EINVAL);
        }
        let mine = self
            .objs
            .ahs
            .values()
            .filter(|a| self.objs.pds.get(&a.pd).is_some_and(|p| p.vnic == vnic))
            .count();
        if mine >= MAX_AH {
            return Err(ENOMEM);
        }
        let id = AhId(self.id());
        let route = self.route_from(vnic, &attr, true);
        self.objs.ahs.insert(
            id,
            Ah {
                ctx,
                pd,
                attr,
                route,
            },
        );
        if let Some(p) = self.objs.pds.get_mut(&pd) {
            p.users += 1;
        }
        Ok(id)
    }

    /// `ibv_destroy_ah`.
    pub fn destroy_ah(&mut self, ctx: CtxId, ah: AhId) -> Result<(), Errno> {
        match self.objs.ahs.get(&ah) {
            Some(a) if a.ctx == ctx => {
                let pd = a.pd;
                self.objs.ahs.remove(&ah);
                if let Some(p) = self.objs.pds.get_mut(&pd) {
                    p.users = p.users.saturating_sub(1);
                }
                Ok(())
            }
            _ => Err(EINVAL),
        }
    }

    /// `ibv_rereg_mr` without a new translation: moves the MR to `pd` and/or gives it new
    /// `access` flags; keys stay. (A new address range is a new registration: the driver
    /// registers it and deregisters the old one.) `EINVAL` while memory windows are bound to
    /// it.
    pub fn rereg_mr(
        &mut self,
        ctx: CtxId,
        mr: MrId,
        pd: Option<PdId>,
        acc: Option<u32>,
    ) -> Result<(), Errno> {
        let (old_pd, vnic) = match self.objs.mrs.get(&mr) {
            Some(m) if m.ctx == ctx && self.windows_on(m.vnic, mr) == 0 => (m.pd, m.vnic),
            _ => return Err(EINVAL),
        };
        if let Some(p) = pd {
            match self.objs.pds.get(&p) {
                Some(x) if x.ctx == ctx && x.vnic == vnic => {}
                _ => return Err(EINVAL),
            }
        }
        if let Some(a) = acc {
            if a & !access::SUPPORTED != 0 {
                return Err(EOPNOTSUPP);
            }
            if a & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0
                && a & access::LOCAL_WRITE == 0
            {
                return Err(EINVAL);
            }
        }
        self.memory_changed();
        let Some(m) = self.objs.mrs.get_mut(&mr) else {
            return Err(EINVAL);
        };
        if let Some(a) = acc {
            m.access = a;
        }
        if let Some(p) = pd {
            m.pd = p;
            if let Some(x) = self.objs.pds.get_mut(&old_pd) {
                x.users = x.users.saturating_sub(1);
            }
            if let Some(x) = self.objs.pds.get_mut(&p) {
                x.users += 1;
            }
        }
        Ok(())
    }
}

/// An MR's spans from the region runs `(offset, pages)` behind its `npages` pages, in order:
/// adjacent runs contiguous in the region become one span. `None` unless every offset is page
/// aligned, every run nonempty and without overflow, and the runs hold exactly `npages` pages.
pub(super) fn spans_of(runs: &[(u64, u64)], npages: u64) -> Option<Vec<Span>> {
    let mut spans: Vec<Span> = Vec::with_capacity(runs.len());
    let mut first = 0u64;
    for &(off, pages) in runs {
        if !off.is_multiple_of(PAGE) || pages == 0 {
            return None;
        }
        off.checked_add(pages.checked_mul(PAGE)?)?;
        match spans.last_mut() {
            Some(s) if s.off + s.pages * PAGE == off => s.pages += pages,
            _ => spans.push(Span { first, off, pages }),
        }
        first = first.checked_add(pages)?;
    }
    (first == npages).then_some(spans)
}
