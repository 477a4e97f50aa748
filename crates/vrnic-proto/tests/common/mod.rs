//! What the engine's integration tests share: registered memory as one vector per vRNIC.

use std::collections::HashMap;

use vrnic_proto::{Loc, Memory, VnicId};

/// Each vRNIC's region, as a vector.
pub struct VecMem(pub HashMap<VnicId, Vec<u8>>);

impl Memory for VecMem {
    fn copy(&mut self, src: Loc, dst: Loc, len: usize) {
        let data = self.0[&src.vnic][src.off as usize..src.off as usize + len].to_vec();
        self.write(dst, &data);
    }
    fn write(&mut self, dst: Loc, data: &[u8]) {
        let r = self.0.get_mut(&dst.vnic).expect("vnic");
        r[dst.off as usize..dst.off as usize + data.len()].copy_from_slice(data);
    }
    fn read(&mut self, src: Loc, out: &mut [u8]) {
        out.copy_from_slice(&self.0[&src.vnic][src.off as usize..src.off as usize + out.len()]);
    }
}

/// Region runs `(offset, pages)` for `Engine::reg_mr` from one region offset per page.
pub fn per_page(pages: &[u64]) -> Vec<(u64, u64)> {
    pages.iter().map(|&p| (p, 1)).collect()
}
