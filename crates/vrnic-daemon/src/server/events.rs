//! What goes back to a context besides its CQs: async events and CM notes on its event ring,
//! and one-byte wake-ups on its socket.

use super::*;

impl Server {
    pub(super) fn push_event(&mut self, ctx: CtxId, kind: u32, handle: u32) {
        let Some(c) = self.ctxs.get_mut(&ctx) else {
            return;
        };
        let Some(v) = self.vnics.get(&c.vnic) else {
            return;
        };
        if !c
            .mailbox
            .push_event(&v.region, &mut c.ev_prod, kind, handle)
        {
            warn!(ctx = ctx.0, kind, "async event ring full; event dropped");
        }
        if !c.wake {
            c.wake = true;
            self.wakes.push(ctx);
        }
    }

    /// Announces queued connection-manager events to their contexts.
    pub(super) fn flush_cm_notes(&mut self) {
        for (ctx, cm_id) in self.cm.take_notes() {
            self.push_event(ctx, vrnic_api::event::CM, cm_id);
        }
    }

    pub(super) fn notify_ctx(&mut self, id: CtxId) {
        if let Some(c) = self.ctxs.get_mut(&id)
            && !c.wake
        {
            c.wake = true;
            self.wakes.push(id);
        }
    }

    /// Writes one byte to each context that has something new (costs those contexts only).
    pub(super) fn flush_wakes(&mut self) {
        for id in self.wakes.drain(..) {
            let Some(c) = self.ctxs.get_mut(&id) else {
                continue;
            };
            c.wake = false;
            // A full socket buffer already holds a wake-up: WouldBlock is fine. A guest
            // polls its notification words instead.
            if let Link::Socket { stream, .. } = &mut c.link {
                let _ = stream.write(&[1u8]);
            }
        }
    }
}
