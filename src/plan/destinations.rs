//! Where every need of a plan lands, kept with the plan so that an executor can name the tensor, box
//! and element a destination byte belongs to (a verify mismatch reports them) after the tables are
//! gone. Compact: the needs' fixed fields and one pool of their dimensions, as the catalog holds them.

use super::merge::Merged;
use super::table::Endpoint;

/// One need as kept: its tensor (an index into the names), where it lands and its dimensions'
/// offset, extent and destination element strides (`n` values each from `dims`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Landing {
    receiver: Endpoint,
    tensor: u32,
    addr: u64,
    dims: usize,
}

/// The needs of a plan, sorted by receiver.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Destinations {
    landings: Vec<Landing>,
    pool: Vec<u64>,
    /// Name, dimensions and element size of each tensor the needs name.
    tensors: Vec<(String, usize, u64)>,
}

/// The need a destination byte belongs to, and the element holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located<'a> {
    pub tensor: &'a str,
    /// The need's box, in global element coordinates.
    pub offset: &'a [u64],
    pub extent: &'a [u64],
    /// Global coordinates of the element holding the byte.
    pub element: Vec<u64>,
}

impl Destinations {
    /// The needs `needs` (indices of `merged`'s, which are sorted by receiver).
    pub(crate) fn new(merged: &Merged, needs: std::ops::Range<usize>) -> Destinations {
        let tensors = merged
            .tensors
            .iter()
            .zip(&merged.geometry)
            .map(|(spec, &(n, elem))| (spec.name.clone(), n, elem))
            .collect();
        let mut landings = Vec::with_capacity(needs.len());
        let mut pool = Vec::new();
        for i in needs {
            let need = merged.need(i);
            let n = merged.geometry[need.tensor].0;
            landings.push(Landing {
                receiver: need.receiver,
                tensor: need.tensor as u32,
                addr: need.addr,
                dims: pool.len(),
            });
            pool.extend_from_slice(&need.lo[..n]);
            pool.extend_from_slice(&need.ext[..n]);
            pool.extend_from_slice(&need.strides[..n]);
        }
        Destinations { landings, pool, tensors }
    }

    /// The needs of process `process`'s receivers only.
    pub fn of_process(&self, process: u32) -> Destinations {
        let landings: Vec<Landing> =
            self.landings.iter().filter(|l| l.receiver.process == process).copied().collect();
        let mut pool = Vec::new();
        let landings = landings
            .into_iter()
            .map(|l| {
                let n = self.tensors[l.tensor as usize].1;
                let dims = pool.len();
                pool.extend_from_slice(&self.pool[l.dims..l.dims + 3 * n]);
                Landing { dims, ..l }
            })
            .collect();
        Destinations { landings, pool, tensors: self.tensors.clone() }
    }

    /// The need of `receiver` whose elements hold the byte at `addr` (an address as the tables gave
    /// it), with that element's coordinates; None when no need of `receiver` writes that byte.
    /// Scans the receiver's needs: meant for reporting an error, not for a hot path.
    pub fn locate(&self, receiver: Endpoint, addr: u64) -> Option<Located<'_>> {
        let first = self.landings.partition_point(|l| l.receiver < receiver);
        for landing in self.landings[first..].iter().take_while(|l| l.receiver == receiver) {
            let (name, n, elem) = &self.tensors[landing.tensor as usize];
            let values = &self.pool[landing.dims..landing.dims + 3 * n];
            let (offset, extent, strides) = (&values[..*n], &values[*n..2 * n], &values[2 * n..]);
            if addr < landing.addr {
                continue;
            }
            if let Some(local) = element_at(addr - landing.addr, *elem, extent, strides) {
                let element = local.iter().zip(offset).map(|(x, o)| x + o).collect();
                return Some(Located { tensor: name, offset, extent, element });
            }
        }
        None
    }
}

/// Box-local coordinates of the element whose bytes hold byte `offset` of a box of `extent`
/// elements laid out with element `strides` (elements of `elem` bytes), or None when no element does.
/// Dimensions are peeled from the largest stride down, which is exact for every layout whose
/// elements do not overlap (the planner rejects the others).
fn element_at(offset: u64, elem: u64, extent: &[u64], strides: &[u64]) -> Option<Vec<u64>> {
    if elem == 0 || extent.contains(&0) {
        return None;
    }
    let mut rest = offset / elem;
    let mut order: Vec<usize> = (0..extent.len()).collect();
    order.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let mut element = vec![0; extent.len()];
    for d in order {
        if extent[d] > 1 && strides[d] > 0 {
            let x = (rest / strides[d]).min(extent[d] - 1);
            element[d] = x;
            rest -= x * strides[d];
        }
    }
    (rest == 0).then_some(element)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_are_found_in_row_major_transposed_and_padded_layouts() {
        // 3 x 4 row-major, 2-byte elements: byte 2 * (1 * 4 + 2) + 1 is in element (1, 2).
        assert_eq!(element_at(13, 2, &[3, 4], &[4, 1]), Some(vec![1, 2]));
        // The same box transposed in memory (dimension 0 fastest).
        assert_eq!(element_at(2 * (2 * 3 + 1), 2, &[3, 4], &[1, 3]), Some(vec![1, 2]));
        // Rows padded to 6 elements: the padding belongs to no element.
        assert_eq!(element_at(2 * 5, 2, &[3, 4], &[6, 1]), None);
        assert_eq!(element_at(2 * 6, 2, &[3, 4], &[6, 1]), Some(vec![1, 0]));
        // Past the box.
        assert_eq!(element_at(2 * 12, 2, &[3, 4], &[4, 1]), None);
        // A dimension of extent 1 with any stride.
        assert_eq!(element_at(4, 4, &[1, 5], &[0, 1]), Some(vec![0, 1]));
    }
}
