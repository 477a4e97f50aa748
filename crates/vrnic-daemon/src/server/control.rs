//! Control requests from a context's mailbox: each is checked against the context that sent it
//! and answered in the same mailbox (PD, CQ, QP, SRQ, XRC domain, AH, connection management).

use super::shard::{Lane, Shard};
use super::*;

pub(super) fn cm_reply(r: Result<(), i32>, what: &str) -> Reply {
    match r {
        Ok(()) => Reply::Ok,
        Err(e) => err(e, what),
    }
}

pub(super) fn err(errno: i32, msg: impl Into<String>) -> Reply {
    Reply::Err {
        errno,
        msg: msg.into(),
    }
}

/// Control requests served per wake of a context.
pub(super) const CTRL_BUDGET: usize = 8;

/// The deepest work queue and completion queue: the engine's limits, which it checks again.
pub(super) use vrnic_proto::{MAX_CQE, MAX_QP_WR};

/// The address vectors of a `ModifyQp` against the port (the engine checks the rest of the
/// attributes against the device's limits): one port, one GID, one P_Key.
fn check_paths(mask: u32, a: &vrnic_wire::QpAttr) -> Result<(), i32> {
    use vrnic_wire::qp_attr;
    let av_bad =
        |av: &vrnic_wire::AhAttr| av.port_num > 1 || (av.is_global && av.grh.sgid_index != 0);
    if (mask & qp_attr::AV != 0 && av_bad(&a.ah_attr))
        || (mask & qp_attr::ALT_PATH != 0
            && (av_bad(&a.alt_ah_attr) || a.alt_port_num > 1 || a.alt_pkey_index != 0))
    {
        return Err(libc::EINVAL);
    }
    Ok(())
}

impl Server {
    pub(super) fn serve_mailbox(&mut self, id: CtxId) {
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
            self.control_hot_until = Instant::now() + super::CONTROL_HOT;
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

    pub(super) fn control(&mut self, id: CtxId, req: Request) -> Reply {
        let now = Instant::now();
        let Some(ctx) = self.ctxs.get(&id) else {
            return err(libc::ENODEV, "no such context");
        };
        let vnic = ctx.vnic;
        let Some(cell) = self.cell_of(vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
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
                    max_srq: self.opts.limits.max_srq,
                    max_mw: vrnic_proto::MAX_MW as u32,
                })
            }
            Request::AllocPd => {
                if self.per_vnic(vnic, |c| c.pds as usize) >= self.opts.limits.max_pd as usize {
                    return err(libc::ENOMEM, "PD limit reached");
                }
                let made = cell.lock().engine.alloc_pd(vnic, id);
                let made = self.mirror_made(
                    vnic,
                    made,
                    |pd| pd.0,
                    |e| e.alloc_pd(vnic, id),
                    |e, pd| {
                        let _ = e.dealloc_pd(id, pd);
                    },
                );
                match made {
                    Ok(pd) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.pds += 1;
                        }
                        Reply::Handle(pd.0)
                    }
                    Err(e) => err(e, "alloc_pd"),
                }
            }
            Request::OpenXrcd { key, create, excl } => {
                match cell.lock().engine.open_xrcd(vnic, id, key, create, excl) {
                    Ok(x) => Reply::Handle(x.0),
                    Err(e) => err(e, "open_xrcd"),
                }
            }
            Request::CloseXrcd { xrcd } => cm_reply(
                cell.lock().engine.close_xrcd(id, vrnic_proto::XrcdId(xrcd)),
                "close_xrcd",
            ),
            Request::DeallocPd { pd } if self.busy_in_slices(vnic, |e| e.pd_busy(id, PdId(pd))) => {
                err(libc::EBUSY, "dealloc_pd: the PD is in use")
            }
            Request::DeallocPd { pd } => match cell.lock().engine.dealloc_pd(id, PdId(pd)) {
                Ok(()) => {
                    self.on_slices(vnic, |e| {
                        let _ = e.dealloc_pd(id, PdId(pd));
                    });
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
                reuse,
            } => self.reg_mr(
                id,
                super::pages::RegMr {
                    pd: PdId(pd),
                    addr,
                    len,
                    iova,
                    access,
                    reuse: &reuse,
                },
            ),
            Request::DeregMr { mr } => self.dereg_mr(id, MrId(mr)),
            Request::ReleasePages { runs } => self.release_pages(id, &runs),
            Request::AllocMw { pd, ty } => match cell.lock().engine.alloc_mw(id, PdId(pd), ty) {
                Ok((mw, rkey)) => Reply::Mw { mw: mw.0, rkey },
                Err(e) => err(e, "alloc_mw"),
            },
            Request::DeallocMw { mw } => {
                match cell.lock().engine.dealloc_mw(id, vrnic_proto::MwId(mw)) {
                    Ok(()) => Reply::Ok,
                    Err(e) => err(e, "dealloc_mw"),
                }
            }
            Request::CreateCq { cqe } => self.create_cq(id, cqe),
            Request::ResizeCq { cq, cqe } => self.resize_cq(id, CqId(cq), cqe),
            Request::DestroyCq { cq } => {
                if !ctx.cqs.contains(&CqId(cq)) {
                    return err(libc::EINVAL, "no such CQ");
                }
                if self.busy_in_slices(vnic, |e| e.cq_busy(id, CqId(cq))) {
                    return err(libc::EBUSY, "destroy_cq: the CQ is in use");
                }
                let r = {
                    let mut sh = cell.lock();
                    sh.engine
                        .destroy_cq(id, CqId(cq))
                        .map(|()| sh.cqs.remove(&CqId(cq)))
                };
                match r {
                    Ok(slot) => {
                        for c in self.slices_of(vnic).iter().skip(1) {
                            let mut sh = c.lock();
                            let _ = sh.engine.destroy_cq(id, CqId(cq));
                            sh.cqs.remove(&CqId(cq));
                        }
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.cqs.remove(&CqId(cq));
                        }
                        if let (Some(mut slot), Some(v)) = (slot, self.vnics.get_mut(&vnic)) {
                            let (off, depth) = slot.with(|s| (s.ring.offset(), s.ring.depth()));
                            free_ring(v, off, depth, CQ_SLOT);
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
                xrcd,
            } => self.create_qp(
                id,
                PdId(pd),
                CqId(send_cq),
                CqId(recv_cq),
                srq.map(SrqId),
                xrcd.map(vrnic_proto::XrcdId),
                qp_type,
                cap,
                sq_sig_all,
            ),
            Request::ModifyQp { qp, mask, attr } => {
                if let Err(e) = check_paths(mask, &attr) {
                    return err(e, "modify_qp: address vector past the port's limits");
                }
                let Some(cell) = self.cell_of_qp(vnic, QpId(qp)) else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                let r = cell.lock().engine.modify_qp(now, id, QpId(qp), mask, &attr);
                match r {
                    Ok(()) => {
                        if mask & vrnic_wire::qp_attr::STATE != 0
                            && attr.qp_state == vrnic_wire::QpState::Reset
                        {
                            self.reset_rings(&cell, now, QpId(qp));
                        }
                        if mask & vrnic_wire::qp_attr::STATE != 0
                            && matches!(
                                attr.qp_state,
                                vrnic_wire::QpState::Rtr | vrnic_wire::QpState::Rts
                            )
                        {
                            // It may be the responder a QP of another engine thread waits for.
                            for other in self.shards.iter().filter(|c| c.index != cell.index) {
                                if other.lock().engine.responder_ready_elsewhere() {
                                    other.wake();
                                }
                            }
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "modify_qp"),
                }
            }
            Request::QueryQp { qp } => match self
                .cell_of_qp(vnic, QpId(qp))
                .map_or(Err(libc::ENODEV), |c| {
                    c.lock().engine.query_qp(id, QpId(qp))
                }) {
                Ok(a) => Reply::QpAttr(Box::new(a)),
                Err(e) => err(e, "query_qp"),
            },
            Request::DestroyQp { qp } => {
                if !ctx.qps.contains(&QpId(qp)) {
                    return err(libc::EINVAL, "no such QP");
                }
                let Some(qcell) = self.cell_of_qp(vnic, QpId(qp)) else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                let r = {
                    let mut sh = qcell.lock();
                    sh.engine
                        .destroy_qp(now, id, QpId(qp))
                        .map(|()| sh.qps.remove(&QpId(qp)))
                };
                match r {
                    Ok(slot) => {
                        if let Some(slot) = &slot {
                            self.free_bell(vnic, &qcell, slot.bell);
                        }
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.qps.remove(&QpId(qp));
                        }
                        if let (Some(slot), Some(v)) = (slot, self.vnics.get_mut(&vnic)) {
                            free_ring(v, slot.sq.offset(), slot.sq.depth(), SQ_SLOT);
                            free_ring(v, slot.rq.offset(), slot.rq.depth(), RQ_SLOT);
                        }
                        // The completions the engine still holds for the QP go into its CQs
                        // now, where the driver removes them once it has the reply.
                        self.pass_now(&qcell, now);
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
                xrc,
            } => self.create_srq(id, PdId(pd), max_wr, max_sge, limit, xrc),
            Request::ModifySrq { srq, resize, limit } => {
                self.modify_srq(id, SrqId(srq), resize, limit)
            }
            Request::QuerySrq { srq } => {
                let mut sh = cell.lock();
                sh.fetch_srq(SrqId(srq));
                query_srq(&sh, id, SrqId(srq))
            }
            Request::DestroySrq { srq } => {
                if !ctx.srqs.contains(&SrqId(srq)) {
                    return err(libc::EINVAL, "no such SRQ");
                }
                let r = {
                    let mut sh = cell.lock();
                    sh.engine.destroy_srq(id, SrqId(srq)).map(|()| {
                        let slot = sh.srqs.remove(&SrqId(srq));
                        if let (Some(slot), Some(l)) = (&slot, sh.lanes.get_mut(&vnic)) {
                            l.free_bell(slot.bell);
                        }
                        slot
                    })
                };
                match r {
                    Ok(slot) => {
                        if let Some(c) = self.ctxs.get_mut(&id) {
                            c.srqs.remove(&SrqId(srq));
                        }
                        if let (Some(slot), Some(v)) = (slot, self.vnics.get_mut(&vnic)) {
                            free_ring(v, slot.ring.offset(), slot.ring.depth(), RQ_SLOT);
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "destroy_srq"),
                }
            }
            Request::CreateAh { pd, attr } => {
                let made = cell.lock().engine.create_ah(id, PdId(pd), attr);
                let made = self.mirror_made(
                    vnic,
                    made,
                    |ah| ah.0,
                    |e| e.create_ah(id, PdId(pd), attr),
                    |e, ah| {
                        let _ = e.destroy_ah(id, ah);
                    },
                );
                match made {
                    Ok(ah) => Reply::Handle(ah.0),
                    Err(e) => err(e, "create_ah"),
                }
            }
            Request::DestroyAh { ah } => match cell.lock().engine.destroy_ah(id, AhId(ah)) {
                Ok(()) => {
                    self.on_slices(vnic, |e| {
                        let _ = e.destroy_ah(id, AhId(ah));
                    });
                    Reply::Ok
                }
                Err(e) => err(e, "destroy_ah"),
            },
            Request::CmCreateId { ps } => {
                let Some(v) = self.vnics.get(&vnic) else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                let owner = crate::cm::Owner {
                    vnic,
                    group: v.group,
                    vip: v.vip,
                };
                match self.cm.create_owned(id, ps, v.lid, v.gid, owner) {
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
                let Ok(dst) = dst.parse::<std::net::SocketAddr>() else {
                    return err(libc::EINVAL, "malformed address");
                };
                if let Some(why) = self.cluster_lookup_refused(vnic, dst.ip()) {
                    return err(libc::EHOSTUNREACH, why);
                }
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
                // Every slice held at once (`--spread-qps`): a window bound to the MR in
                // another slice between the home's change and that slice's would leave that
                // slice's copy of the MR with its old access and PD. Held, every copy answers
                // as the home's does.
                let cells = self.slices_of(vnic);
                let mut guards = Slices::lock(vnic, &cells);
                let Some((home, others)) = guards.split_first_mut() else {
                    return err(libc::ENODEV, "vRNIC gone");
                };
                match home.engine.rereg_mr(id, MrId(mr), pd.map(PdId), access) {
                    Ok(()) => {
                        for g in others {
                            if let Err(e) = g.engine.rereg_mr(id, MrId(mr), pd.map(PdId), access) {
                                warn!(mr, errno = e, "a slice refused an MR change its home took");
                            }
                        }
                        Reply::Ok
                    }
                    Err(e) => err(e, "rereg_mr"),
                }
            }
            _ => err(libc::EOPNOTSUPP, "request not supported by this daemon"),
        }
    }

    /// A QP just moved to RESET. The work requests the driver published and the engine has
    /// not taken yet are handed to it now (in RESET it drops them silently, retiring their
    /// slots), so nothing of the QP's previous life is left in its rings, and a ring broken by
    /// a bad producer index starts afresh. Then one engine pass publishes the retired indices
    /// and every completion queued so far. So when the driver has the reply, its rings are
    /// empty (producer = consumer) and its CQs hold every completion the QP will ever have,
    /// which the driver then removes from them, as mlx5's provider does.
    pub(super) fn reset_rings(&mut self, cell: &Arc<ShardCell>, now: Instant, qp: QpId) {
        {
            let mut sh = cell.lock();
            let sh = &mut *sh;
            sh.reset_rings(now, qp);
        }
        self.pass_now(cell, now);
    }
}

impl Shard {
    /// [`Server::reset_rings`]'s work on the shard: the QP's published work requests handed to
    /// the engine (dropped there) and its rings' indices moved past them.
    fn reset_rings(&mut self, now: Instant, qp: QpId) {
        if let Some(slot) = self.qps.get_mut(&qp)
            && let Some(v) = self.lanes.get(&slot.vnic)
        {
            let region = &v.region;
            // Hostile producer indices: at most a ring's depth is handed over; a ring claiming
            // more stays broken.
            let sq_prod = slot.sq.prod(region).load(Ordering::Acquire);
            let rq_prod = slot.rq.prod(region).load(Ordering::Acquire);
            let sq_new = sq_prod.wrapping_sub(slot.sq_fetched);
            let rq_new = rq_prod.wrapping_sub(slot.rq_fetched);
            if sq_new <= slot.sq.depth() && rq_new <= slot.rq.depth() {
                let dropped = Err(vrnic_wire::ParseError::ProducerIndex(sq_prod));
                for _ in 0..sq_new {
                    self.engine.handle_send_wqe(now, qp, dropped.clone());
                }
                let dropped = Err(vrnic_wire::ParseError::ProducerIndex(rq_prod));
                for _ in 0..rq_new {
                    self.engine.handle_recv_wqe(now, qp, dropped.clone());
                }
                slot.sq_fetched = sq_prod;
                slot.rq_fetched = rq_prod;
                slot.broken = false;
            }
        }
    }
}

fn query_srq(sh: &Shard, id: CtxId, srq: SrqId) -> Reply {
    match sh.engine.query_srq(id, srq) {
        Ok((max_wr, max_sge, limit)) => Reply::SrqAttr {
            max_wr,
            max_sge,
            limit,
        },
        Err(e) => err(e, "query_srq"),
    }
}

impl Server {
    /// The sum of `f` over the contexts of `vnic` (object counts for the per-vRNIC limits).
    pub(super) fn per_vnic(&self, vnic: VnicId, f: impl Fn(&Ctx) -> usize) -> usize {
        self.ctxs.values().filter(|c| c.vnic == vnic).map(f).sum()
    }

    pub(super) fn create_srq(
        &mut self,
        id: CtxId,
        pd: PdId,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
        xrc: Option<(u32, u32)>,
    ) -> Reply {
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
        // Its ring may grow the region's mapping: every shard reading it is held. An SRQ is
        // its vRNIC's home shard's.
        let cells = self.slices_of(vnic);
        let mut guards = Slices::lock(vnic, &cells);
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        if guards.is_empty() {
            return err(libc::ENODEV, "vRNIC gone");
        }
        let Some(bell) = guards[0].lane(vnic).and_then(Lane::alloc_bell) else {
            return err(libc::ENOMEM, "no doorbell left for the SRQ");
        };
        let Some(ring) = alloc_ring(guards.grow(), vnic, v, depth, RQ_SLOT) else {
            if let Some(l) = guards[0].lane(vnic) {
                l.free_bell(bell);
            }
            return err(libc::ENOMEM, "no memory for the SRQ ring");
        };
        let sh = &mut *guards[0];
        let made = match xrc {
            Some((xrcd, cq)) => sh
                .engine
                .create_xrc_srq(
                    id,
                    vrnic_proto::XrcdId(xrcd),
                    pd,
                    CqId(cq),
                    max_wr,
                    max_sge,
                    limit,
                )
                .map(|(s, _, n)| (s, n)),
            None => sh
                .engine
                .create_srq(id, pd, max_wr, max_sge, limit)
                .and_then(|(s, _)| Ok((s, sh.engine.srq_num(id, s)?))),
        };
        match made {
            Ok((srq, srqn)) => {
                if let Some(l) = sh.lane(vnic) {
                    l.set_bell(bell, Bell::Srq(srq));
                }
                sh.srqs.insert(
                    srq,
                    SrqSlot {
                        vnic,
                        bell,
                        ring,
                        fetched: 0,
                        cons: 0,
                        broken: false,
                        carried: false,
                    },
                );
                if let Some(c) = self.ctxs.get_mut(&id) {
                    c.srqs.insert(srq);
                }
                Reply::Srq {
                    srq: srq.0,
                    ring: ring.offset(),
                    depth,
                    bell,
                    srqn,
                }
            }
            Err(e) => {
                free_ring(v, ring.offset(), depth, RQ_SLOT);
                if let Some(l) = sh.lane(vnic) {
                    l.free_bell(bell);
                }
                err(e, "create_srq")
            }
        }
    }

    pub(super) fn create_cq(&mut self, id: CtxId, cqe: u32) -> Reply {
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
        // Its ring may grow the region's mapping: every shard reading it is held.
        let cells = self.slices_of(vnic);
        let mut guards = Slices::lock(vnic, &cells);
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        if guards.is_empty() {
            return err(libc::ENODEV, "vRNIC gone");
        }
        let Some(ring) = alloc_ring(guards.grow(), vnic, v, depth, CQ_SLOT) else {
            return err(libc::ENOMEM, "no memory for the CQ ring");
        };
        let made = guards[0].engine.create_cq(vnic, id, depth).and_then(|cq| {
            // The same CQ in every slice (the QPs there complete into it).
            for n in 1..guards.len() {
                let r = guards[n]
                    .engine
                    .mirrored(cq.0, None, |e| e.create_cq(vnic, id, depth));
                if let Err(e) = r {
                    for g in &mut guards[..n] {
                        let _ = g.engine.destroy_cq(id, cq);
                    }
                    return Err(e);
                }
            }
            Ok(cq)
        });
        match made {
            Ok(cq) => {
                let slot = CqSlot {
                    vnic,
                    ctx: id,
                    ring,
                    prod: 0,
                    cons_seen: 0,
                    broken: false,
                };
                if guards.len() == 1 {
                    guards[0].cqs.insert(cq, CqCell::Own(slot));
                } else {
                    let shared = Arc::new(std::sync::Mutex::new(slot));
                    for g in guards.iter_mut() {
                        g.cqs.insert(cq, CqCell::Shared(shared.clone()));
                    }
                }
                drop(guards);
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
    pub(super) fn create_qp(
        &mut self,
        id: CtxId,
        pd: PdId,
        send_cq: CqId,
        recv_cq: CqId,
        srq: Option<SrqId>,
        xrcd: Option<vrnic_proto::XrcdId>,
        qp_type: vrnic_wire::QpType,
        mut cap: vrnic_wire::QpCap,
        sq_sig_all: bool,
    ) -> Reply {
        use vrnic_wire::QpType;
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
        let xrc = matches!(qp_type, QpType::XrcSend | QpType::XrcRecv);
        if srq.is_some() || xrc {
            // Receives come from an SRQ: the QP's own receive ring stays minimal and unused.
            cap.max_recv_wr = 0;
            cap.max_recv_sge = 0;
        }
        if qp_type == QpType::XrcRecv {
            // An XRC target has no send queue either.
            cap = vrnic_wire::QpCap::default();
        }
        let sq_depth = cap.max_send_wr.max(1).next_power_of_two();
        let rq_depth = cap.max_recv_wr.max(1).next_power_of_two();
        // Its rings may grow the region's mapping: every shard reading it is held.
        let cells = self.slices_of(vnic);
        let mut guards = Slices::lock(vnic, &cells);
        let Some(v) = self.vnics.get_mut(&vnic) else {
            return err(libc::ENODEV, "vRNIC gone");
        };
        if guards.is_empty() {
            return err(libc::ENODEV, "vRNIC gone");
        }
        // A plain QP goes to the slice with the fewest QPs of the vRNIC (ties: the first, its
        // home); one with an SRQ, and XRC, stay home with their SRQs and domains.
        let k = if srq.is_none() && !xrc {
            (0..guards.len())
                .min_by_key(|&i| guards[i].engine.qp_count(vnic))
                .unwrap_or(0)
        } else {
            0
        };
        // The home lane gives the doorbell index out, for every slice.
        let Some(bell) = guards[0].lane(vnic).and_then(Lane::alloc_bell) else {
            return err(libc::ENOMEM, "no doorbell left for the QP");
        };
        let free_bell = |sh: &mut Shard| {
            if let Some(l) = sh.lane(vnic) {
                l.free_bell(bell);
            }
        };
        let Some(sq) = alloc_ring(guards.grow(), vnic, v, sq_depth, SQ_SLOT) else {
            free_bell(&mut guards[0]);
            return err(libc::ENOMEM, "no memory for the send ring");
        };
        let Some(rq) = alloc_ring(guards.grow(), vnic, v, rq_depth, RQ_SLOT) else {
            free_ring(v, sq.offset(), sq_depth, SQ_SLOT);
            free_bell(&mut guards[0]);
            return err(libc::ENOMEM, "no memory for the receive ring");
        };
        if qp_type != QpType::XrcRecv {
            cap.max_send_wr = cap.max_send_wr.max(1);
            cap.max_send_sge = cap.max_send_sge.max(1);
            cap.max_inline_data = vrnic_wire::MAX_INLINE as u32;
        }
        if srq.is_none() && !xrc {
            cap.max_recv_wr = cap.max_recv_wr.max(1);
            cap.max_recv_sge = cap.max_recv_sge.max(1);
        }
        let sh = &mut *guards[k];
        let made = match (qp_type, xrcd) {
            (QpType::XrcRecv, Some(x)) => sh.engine.create_xrc_recv_qp(id, x),
            (QpType::XrcRecv, None) => Err(libc::EINVAL),
            (QpType::XrcSend, None) => sh
                .engine
                .create_xrc_send_qp(id, pd, send_cq, cap, sq_sig_all),
            (_, Some(_)) => Err(libc::EINVAL),
            _ => sh
                .engine
                .create_qp_srq(id, pd, send_cq, recv_cq, srq, qp_type, cap, sq_sig_all),
        };
        match made {
            Ok((qp, qpn)) => {
                if let Some(l) = sh.lane(vnic) {
                    l.put_bell(bell, Bell::Qp(qp));
                }
                sh.qps.insert(qp, QpSlot::new(vnic, bell, sq, rq));
                if k != 0
                    && let Some(l) = guards[0].lane(vnic)
                {
                    // The home hands this doorbell on to the QP's slice.
                    l.set_bell(bell, Bell::Elsewhere(cells[k].index));
                }
                drop(guards);
                if self.spread {
                    info!(vnic = vnic.0, qpn, engine = cells[k].index, "QP created");
                }
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
                    bell,
                }
            }
            Err(e) => {
                free_bell(&mut guards[0]);
                free_ring(v, sq.offset(), sq_depth, SQ_SLOT);
                free_ring(v, rq.offset(), rq_depth, RQ_SLOT);
                err(e, "create_qp")
            }
        }
    }

    /// Frees doorbell `bell` of `vnic`, whose queue was served by shard `cell`: forgotten
    /// there, and given back by the home lane.
    pub(super) fn free_bell(&self, vnic: VnicId, cell: &ShardCell, bell: u32) {
        let Some(home) = self.cell_of(vnic) else {
            return;
        };
        if home.index != cell.index
            && let Some(l) = cell.lock().lane(vnic)
        {
            l.clear_bell(bell);
        }
        if let Some(l) = home.lock().lane(vnic) {
            l.free_bell(bell);
        }
    }
}
