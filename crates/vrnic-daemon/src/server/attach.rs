//! Attaching contexts: a host process connects to its vRNIC's socket and is handed a mailbox;
//! a VM guest claims one in the region and keeps a heartbeat. Either way the context is torn
//! down, everything it held reclaimed, when its socket closes or its lease runs out.

use super::*;

/// A guest context whose heartbeat stalls this long is reclaimed as dead. Generous: a guest
/// under software emulation may be descheduled for a while.
pub(super) const GUEST_LEASE: Duration = Duration::from_secs(5);

impl Server {
    pub(super) fn accept_client(&mut self, vnic: VnicId) {
        loop {
            let Some(v) = self.vnics.get(&vnic) else {
                return;
            };
            let (mut stream, _) = match v.listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    warn!("accept: {e}");
                    return;
                }
            };
            let used: HashSet<u32> = self
                .ctxs
                .values()
                .filter(|c| c.vnic == vnic)
                .map(|c| c.mailbox.index())
                .collect();
            // Accepting moves the mailbox out of `Free` atomically: a guest claiming mailboxes
            // through the region at the same time never gets the same one.
            let Some(mailbox) = (0..layout::CTRL_SLOTS)
                .filter(|i| !used.contains(i))
                .filter_map(Mailbox::new)
                .find(|m| m.accept(&v.region, MailboxState::Free))
            else {
                warn!(
                    vnic = v.name,
                    "all control mailboxes in use; refusing a context"
                );
                let _ = stream.write_all(&u32::MAX.to_le_bytes());
                continue;
            };
            let id = CtxId(self.next_ctx);
            self.next_ctx += 1;
            // Four bytes into a socket just accepted: its buffer is empty, so this never blocks.
            if stream.write_all(&mailbox.index().to_le_bytes()).is_err() {
                mailbox.reset(&v.region, MailboxState::Free);
                continue;
            }
            let token = self.token(Tok::Client(id));
            if self
                .poll
                .registry()
                .register(&mut stream, token, Interest::READABLE)
                .is_err()
            {
                self.tokens.remove(&token);
                if let Some(v) = self.vnics.get(&vnic) {
                    mailbox.reset(&v.region, MailboxState::Free);
                }
                continue;
            }
            debug!(ctx = id.0, mailbox = mailbox.index(), "context attached");
            self.add_context(id, vnic, Link::Socket { stream, token }, mailbox);
        }
    }

    /// Registers an accepted context and tells it its port is up, as a device reports a port
    /// that goes active.
    pub(super) fn add_context(&mut self, id: CtxId, vnic: VnicId, link: Link, mailbox: Mailbox) {
        if let Link::Region { .. } = &link {
            for cell in self.slices_of(vnic) {
                cell.guests.fetch_add(1, Ordering::AcqRel);
                cell.wake();
            }
        }
        self.ctxs.insert(
            id,
            Ctx {
                vnic,
                link,
                mailbox,
                ev_prod: 0,
                table: Default::default(),
                mrs: HashMap::new(),
                cqs: HashSet::new(),
                qps: HashSet::new(),
                srqs: HashSet::new(),
                pds: 0,
                wake: false,
            },
        );
        if let Some(v) = self.vnics.get_mut(&vnic) {
            v.contexts.insert(id);
        }
        self.push_event(id, vrnic_api::event::PORT_ACTIVE, 1);
    }

    /// Region-only contexts: accepts guests that claimed a mailbox, reclaims those that left
    /// or whose heartbeat stalled for [`GUEST_LEASE`], and advances the daemon's own heartbeat
    /// in every region.
    pub(super) fn scan_guests(&mut self, now: Instant) {
        let mut joined = Vec::new();
        let mut gone = Vec::new();
        for (&vid, v) in self.vnics.iter_mut() {
            if let Ok(w) = v.region.atomic_u32(hdr::DAEMON_BEAT) {
                w.fetch_add(1, Ordering::Release);
            }
            // Look through the mailboxes only when a guest claimed one since the last look.
            let claims = Mailbox::claims(&v.region);
            if claims == v.claims_seen {
                continue;
            }
            v.claims_seen = claims;
            let used: HashSet<u32> = v
                .contexts
                .iter()
                .filter_map(|c| self.ctxs.get(c))
                .map(|c| c.mailbox.index())
                .collect();
            for m in (0..layout::CTRL_SLOTS)
                .filter(|i| !used.contains(i))
                .filter_map(Mailbox::new)
            {
                if m.load_state(&v.region) == Some(MailboxState::Attach)
                    && m.accept(&v.region, MailboxState::Attach)
                {
                    joined.push((vid, m, m.heartbeat(&v.region)));
                }
            }
        }
        for &id in &self.guests {
            let Some(ctx) = self.ctxs.get_mut(&id) else {
                continue;
            };
            let Some(v) = self.vnics.get(&ctx.vnic) else {
                continue;
            };
            if ctx.mailbox.load_state(&v.region) == Some(MailboxState::Detach) {
                debug!(ctx = id.0, "guest context detached");
                gone.push((id, ctx.vnic));
                continue;
            }
            let Link::Region { beat, beat_at } = &mut ctx.link else {
                continue;
            };
            let b = ctx.mailbox.heartbeat(&v.region);
            if b != *beat {
                *beat = b;
                *beat_at = now;
            } else if now.duration_since(*beat_at) > GUEST_LEASE {
                warn!(
                    vnic = v.name,
                    ctx = id.0,
                    "guest context stopped its heartbeat for {GUEST_LEASE:?}; reclaiming it"
                );
                gone.push((id, ctx.vnic));
            }
        }
        for (id, vnic) in gone {
            self.drop_context(id);
            self.maybe_reap(vnic);
        }
        for (vnic, mailbox, beat) in joined {
            let id = CtxId(self.next_ctx);
            self.next_ctx += 1;
            info!(
                ctx = id.0,
                mailbox = mailbox.index(),
                "region-only (guest) context attached"
            );
            self.add_context(id, vnic, Link::Region { beat, beat_at: now }, mailbox);
            self.guests.push(id);
        }
    }

    /// Serves the mailboxes of region-only contexts, which cannot ring a doorbell. Returns
    /// whether any request was waiting.
    pub(super) fn serve_guests(&mut self) -> bool {
        let mut any = false;
        for i in 0..self.guests.len() {
            let id = self.guests[i];
            let waiting = self.ctxs.get(&id).is_some_and(|c| {
                self.vnics
                    .get(&c.vnic)
                    .is_some_and(|v| c.mailbox.load_state(&v.region) == Some(MailboxState::Request))
            });
            if waiting {
                any = true;
                self.serve_mailbox(id);
            }
        }
        if any {
            self.flush_wakes();
        }
        any
    }

    /// A context's socket is readable: doorbells (drained), control requests, or its death.
    pub(super) fn client_ready(&mut self, id: CtxId) -> bool {
        let Some(ctx) = self.ctxs.get_mut(&id) else {
            return false;
        };
        let Link::Socket { stream, .. } = &mut ctx.link else {
            return false;
        };
        let mut buf = [0u8; 256];
        let mut dead = false;
        loop {
            match stream.read(&mut buf) {
                Ok(0) => {
                    dead = true;
                    break;
                }
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    dead = true;
                    break;
                }
            }
        }
        let vnic = ctx.vnic;
        if dead {
            self.drop_context(id);
            self.maybe_reap(vnic);
            return true;
        }
        // A doorbell for an engine thread that sleeps (the loop's own engine needs no call).
        self.wake_slices(vnic);
        self.serve_mailbox(id);
        true
    }

    pub(super) fn drop_context(&mut self, id: CtxId) {
        let Some(mut ctx) = self.ctxs.remove(&id) else {
            return;
        };
        let now = Instant::now();
        let cells = self.slices_of(ctx.vnic);
        // Each slice's objects of the context, then the slots of its queues there (a CQ's
        // slot is shared by the slices: the home's is freed).
        let mut qps: Vec<(usize, QpSlot)> = Vec::new();
        let mut cqs: Vec<CqCell> = Vec::new();
        let mut srqs: Vec<SrqSlot> = Vec::new();
        for (n, cell) in cells.iter().enumerate() {
            let mut guard = cell.lock();
            let sh = &mut *guard;
            sh.engine.destroy_context(now, id);
            let died = sh.engine.take_died_remote();
            qps.extend(
                ctx.qps
                    .iter()
                    .filter_map(|q| sh.qps.remove(q))
                    .map(|s| (cell.index, s)),
            );
            let mine: Vec<CqCell> = ctx.cqs.iter().filter_map(|q| sh.cqs.remove(q)).collect();
            if n == 0 {
                cqs = mine;
            }
            srqs.extend(ctx.srqs.iter().filter_map(|q| sh.srqs.remove(q)));
            drop(guard);
            self.tell_died(cell.index, died);
        }
        for (k, slot) in &qps {
            if let Some(cell) = self.shards.get(*k) {
                self.free_bell(ctx.vnic, cell, slot.bell);
            }
        }
        if let Some(home) = cells.first() {
            for s in &srqs {
                self.free_bell(ctx.vnic, home, s.bell);
            }
        }
        self.cm.drop_context(id);
        self.flush_cm_notes();
        match &mut ctx.link {
            Link::Socket { stream, token } => {
                let _ = self.poll.registry().deregister(stream);
                self.tokens.remove(token);
            }
            Link::Region { .. } => {
                self.guests.retain(|g| *g != id);
                for cell in &cells {
                    cell.guests.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        let Some(v) = self.vnics.get_mut(&ctx.vnic) else {
            return;
        };
        v.contexts.remove(&id);
        for (_, slot) in qps {
            free_ring(v, slot.sq.offset(), slot.sq.depth(), SQ_SLOT);
            free_ring(v, slot.rq.offset(), slot.rq.depth(), RQ_SLOT);
        }
        for mut slot in cqs {
            let (off, depth) = slot.with(|s| (s.ring.offset(), s.ring.depth()));
            free_ring(v, off, depth, CQ_SLOT);
        }
        for slot in srqs {
            free_ring(v, slot.ring.offset(), slot.ring.depth(), RQ_SLOT);
        }
        for (off, pages) in ctx.table.drain() {
            free_pages(v, off, pages);
        }
        ctx.mailbox.reset(&v.region, MailboxState::Free);
        debug!(
            vnic = v.name,
            ctx = id.0,
            "context detached, resources reclaimed"
        );
    }
}
