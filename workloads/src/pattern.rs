//! Known contents for a refit run on host memory: every tensor element gets a value computed from
//! (tensor, element index), publishers' boxes are filled with it, and after the refit every receiver
//! box is compared with it. Works for any element size: the value's low bytes are written.

use crate::{Placed, Role, Workload};

/// The bytes of element `global` (row-major index in the whole tensor) of tensor `tensor`, as a
/// little-endian u64 of which the low `elem_size` bytes are used. splitmix64, so neighbouring
/// elements and tensors differ.
pub fn element_value(tensor: u32, global: u64) -> u64 {
    let mut z = ((u64::from(tensor) << 40) ^ global).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Workload {
    /// Calls `f(byte offset in the box's buffer, global element index in the tensor)` for every element
    /// of a placed box, in memory order.
    pub fn for_each_element(&self, p: &Placed, mut f: impl FnMut(u64, u64)) {
        let spec = &self.catalog.tensors[p.tensor as usize];
        let es = u64::from(spec.elem_size);
        let extent = &p.region.extent;
        let n = extent.len();
        if n == 0 || extent.contains(&0) {
            return;
        }
        let inner = extent[n - 1];
        let rows: u64 = extent[..n - 1].iter().product();
        let mut coord = vec![0u64; n - 1];
        let mut at = p.offset;
        for _ in 0..rows {
            // Global index of the row's first element.
            let row_start = (0..n - 1).fold(0, |acc, d| acc * spec.shape[d] + p.region.offset[d] + coord[d]);
            let first = row_start * spec.shape[n - 1] + p.region.offset[n - 1];
            for k in 0..inner {
                f(at, first + k);
                at += es;
            }
            for d in (0..n - 1).rev() {
                coord[d] += 1;
                if coord[d] < extent[d] {
                    break;
                }
                coord[d] = 0;
            }
        }
    }

    /// Writes every offered box into the publishers' host memory (`memory[i]` is buffer `i`; receiver
    /// buffers are not touched and may be empty). Panics if a slice is shorter than its buffer.
    pub fn fill_offers(&self, memory: &mut [&mut [u8]]) {
        for o in &self.offers {
            let es = self.catalog.tensors[o.tensor as usize].elem_size as usize;
            let buffer = &mut memory[o.buffer as usize];
            self.for_each_element(o, |at, g| {
                let at = at as usize;
                buffer[at..at + es].copy_from_slice(&element_value(o.tensor, g).to_le_bytes()[..es]);
            });
        }
    }

    /// Checks every needed box in the receivers' host memory (`memory[i]` is buffer `i`; publisher
    /// buffers may be empty). Returns the elements checked, or the first wrong element named by
    /// buffer, tensor and index.
    pub fn check_needs(&self, memory: &[&[u8]]) -> Result<u64, String> {
        let mut checked = 0;
        for n in &self.needs {
            let spec = &self.catalog.tensors[n.tensor as usize];
            let es = spec.elem_size as usize;
            let buffer = &memory[n.buffer as usize];
            let mut wrong = None;
            self.for_each_element(n, |at, g| {
                let at = at as usize;
                if wrong.is_none() && buffer[at..at + es] != element_value(n.tensor, g).to_le_bytes()[..es] {
                    wrong = Some((at, g));
                }
            });
            if let Some((at, g)) = wrong {
                let b = &self.buffers[n.buffer as usize];
                debug_assert_eq!(b.role, Role::Receiver);
                return Err(format!(
                    "{} byte {at}: element {g} of {} is wrong ({:02x?})",
                    b.name,
                    spec.name,
                    &buffer[at..at + es]
                ));
            }
            checked += n.region.extent.iter().product::<u64>();
        }
        Ok(checked)
    }
}
