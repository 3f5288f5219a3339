//! What the element-level layout tests share: a framework's memory-to-tensor formula ([`Locate`])
//! and the check that every placed box holds exactly the tensor elements that formula names.

use refit_workloads::{Placed, Workload};
use std::collections::HashMap;

/// Which tensor element a framework keeps at element `i` of parameter `name`, or None for padding.
pub type Locate = dyn Fn(&str, u64) -> Option<(String, u64)>;

/// Splits `decoder.layers.3.mlp.router.weight` into (Some(3), "mlp.router.weight").
pub fn layer_of(name: &str, prefix: &str) -> (Option<u64>, String) {
    match name.strip_prefix(prefix) {
        Some(rest) => {
            let (l, tail) = rest.split_once('.').unwrap();
            (Some(l.parse().unwrap()), tail.to_string())
        }
        None => (None, name.to_string()),
    }
}

/// Calls `f(byte offset in the buffer, global flat index in the tensor)` for every element of a box,
/// in the box's row-major order.
pub fn for_each_element<S>(w: &Workload<S>, p: &Placed, mut f: impl FnMut(usize, u64)) {
    let spec = &w.catalog.tensors[p.tensor as usize];
    let es = u64::from(spec.elem_size);
    let extent = &p.region.extent;
    for k in 0..extent.iter().product::<u64>() {
        let (mut rest, mut global) = (k, 0);
        for d in 0..extent.len() {
            let inner: u64 = extent[d + 1..].iter().product();
            global = global * spec.shape[d] + p.region.offset[d] + rest / inner;
            rest %= inner;
        }
        f((p.offset + k * es) as usize, global);
    }
}

/// Bytes per element of buffer `b` (every piece of a separately allocated parameter has one type).
fn buffer_elem_size<S>(w: &Workload<S>, list: &[Placed], b: u32) -> u64 {
    let p = list.iter().find(|p| p.buffer == b).unwrap();
    u64::from(w.catalog.tensors[p.tensor as usize].elem_size)
}

/// Every element of every placed box is where the framework formula says that tensor element is, and
/// every non-padding element of every buffer is in exactly one box.
pub fn check_elements<S>(w: &Workload<S>, locate: &dyn Fn(&Placed) -> Box<Locate>, list: &[Placed]) {
    let mut covered: HashMap<u32, Vec<u8>> = HashMap::new();
    for p in list {
        let buffer = &w.buffers[p.buffer as usize];
        let spec = &w.catalog.tensors[p.tensor as usize];
        let es = u64::from(spec.elem_size);
        assert_eq!(es, buffer_elem_size(w, list, p.buffer), "{}: one element type", buffer.name);
        let f = locate(p);
        let cover = covered.entry(p.buffer).or_insert_with(|| vec![0; (buffer.bytes / es) as usize]);
        for_each_element(w, p, |at, global| {
            let elem = at as u64 / es;
            assert_eq!(
                f(&buffer.name, elem),
                Some((spec.name.clone(), global)),
                "{} element {elem}",
                buffer.name
            );
            cover[elem as usize] += 1;
        });
    }
    for (b, cover) in covered {
        let buffer = &w.buffers[b as usize];
        let f = locate(list.iter().find(|p| p.buffer == b).unwrap());
        for (elem, &c) in cover.iter().enumerate() {
            let padding = f(&buffer.name, elem as u64).is_none();
            assert_eq!(c, u8::from(!padding), "{} element {elem}", buffer.name);
        }
    }
}
