//! What the engine's integration tests share: registered memory as one vector per vRNIC.

use std::collections::HashMap;

use vrnic_proto::{Loc, Memory, MemoryRefused, MwId, VnicId};
use vrnic_wire::{SendFlags, SendOpcode, SendPayload, SendWqe};

/// Each vRNIC's region, as a vector.
pub struct VecMem(pub HashMap<VnicId, Vec<u8>>);

/// A vRNIC without a vector refuses every access (as a region the daemon cannot reach); a
/// range past a vector's end is a bug of the engine and panics.
impl Memory for VecMem {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) -> Result<(), MemoryRefused> {
        let r = self.0.get(&src.vnic).ok_or(MemoryRefused)?;
        let data = r[src.off as usize..src.off as usize + len].to_vec();
        self.write(dst, &data)
    }
    fn write(&mut self, dst: Loc, data: &[u8]) -> Result<(), MemoryRefused> {
        let r = self.0.get_mut(&dst.vnic).ok_or(MemoryRefused)?;
        r[dst.off as usize..dst.off as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) -> Result<(), MemoryRefused> {
        let r = self.0.get(&src.vnic).ok_or(MemoryRefused)?;
        out.copy_from_slice(&r[src.off as usize..src.off as usize + out.len()]);
        Ok(())
    }
    /// A misaligned store is a bug of the engine (it checks alignment first) and panics.
    fn store_u64(&mut self, dst: Loc, value: [u8; 8]) -> Result<(), MemoryRefused> {
        assert!(
            dst.off.is_multiple_of(8),
            "misaligned atomic store at {dst:?}"
        );
        self.write(dst, &value)
    }
}

/// Region runs `(offset, pages)` for `Engine::reg_mr` from one region offset per page.
pub fn per_page(pages: &[u64]) -> Vec<(u64, u64)> {
    pages.iter().map(|&p| (p, 1)).collect()
}

/// A signaled bind work request (`IBV_WR_BIND_MW`, as the driver posts it): window `mw` to
/// `rkey`, over `[addr, addr + len)` of the MR whose L_Key is `lkey`, granting `acc`.
#[allow(dead_code)] // not every test binary binds windows
pub fn bind(wr_id: u64, mw: MwId, rkey: u32, lkey: u32, addr: u64, len: u64, acc: u32) -> SendWqe {
    SendWqe {
        wr_id,
        opcode: SendOpcode::BindMw,
        flags: SendFlags::SIGNALED,
        imm_data: acc,
        remote_addr: addr,
        rkey,
        compare_add: len,
        swap: u64::from(mw.0) << 32 | u64::from(lkey),
        ud: Default::default(),
        xrc_srqn: 0,
        payload: SendPayload::Sges(Default::default()),
    }
}

/// The next key of a window: same index, next consumer byte (`ibv_inc_rkey`).
#[allow(dead_code)] // not every test binary binds windows
pub fn inc(rkey: u32) -> u32 {
    (rkey & !0xff) | ((rkey + 1) & 0xff)
}
