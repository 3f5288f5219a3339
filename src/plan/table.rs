//! What planners are given: each process's shard table (tensors it knows, offers it publishes, needs
//! it receives), and the checks of each entry against its tensor. Plain data with addresses as
//! integers; nothing here knows where memory lives.

pub use super::boxes::MAX_DIMS;
use super::boxes::{byte_span, Dims};
use crate::bail;
use crate::error::{Error, Result, Status};

/// Where a shard lives or lands: a process (an index the caller assigns to each OS process taking
/// part in a refit) and a device ordinal within that process. Two endpoints with the same process
/// share memory through NVLink peers; with the same process and device, they are on one GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub process: u32,
    pub device: u32,
}

impl Endpoint {
    /// How far bytes travel from `self` to `other`: 0 the same device, 1 another device of the
    /// same process, 2 another process.
    pub fn distance(self, other: Endpoint) -> u8 {
        if self.process != other.process {
            2
        } else if self.device != other.device {
            1
        } else {
            0
        }
    }
}

/// A named tensor's global description. Every table that names a tensor must agree on all of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorSpec {
    pub name: String,
    /// Caller-defined dtype code, compared for consistency only.
    pub dtype: u32,
    /// Bytes per element.
    pub elem_size: u32,
    /// Global shape, at most [`MAX_DIMS`] dimensions.
    pub shape: Vec<u64>,
}

/// A box of a tensor in global coordinates: per-dimension offset and extent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Region {
    pub offset: Vec<u64>,
    pub extent: Vec<u64>,
}

/// What a publisher holds: one box of a tensor at `addr`, laid out with `strides` (in elements, one
/// per tensor dimension; `None` means row-major contiguous over `region.extent`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Offer {
    /// Index into the owning table's `tensors`.
    pub tensor: u32,
    pub owner: Endpoint,
    pub addr: u64,
    pub region: Region,
    pub strides: Option<Vec<u64>>,
    /// Optional digest of the box's bytes; replicas with differing digests are an error.
    pub digest: Option<u64>,
}

/// What a receiver wants: `region` of a tensor (global coordinates), written at `addr` with
/// destination element `strides`, one per destination dimension. Destination dimension `d` is tensor
/// dimension `perm[d]` (`None` is the identity), so a transposed destination is a permutation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Need {
    /// Index into the owning table's `tensors`.
    pub tensor: u32,
    pub receiver: Endpoint,
    pub addr: u64,
    pub region: Region,
    pub perm: Option<Vec<u32>>,
    pub strides: Vec<u64>,
}

/// One process's contribution to a plan. Tables from every process are merged by tensor name.
/// Build one entry by entry with `TableBuilder`, which checks each entry as it comes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub tensors: Vec<TensorSpec>,
    pub offers: Vec<Offer>,
    pub needs: Vec<Need>,
    /// Needs that receive FP8 codes and scales (`super::quantized`).
    pub quant_needs: Vec<super::quantized::QuantNeed>,
    /// Per-tensor scales that share one amax with every scale of the same key, in any table
    /// (`super::quantized::SharedAmax`).
    pub shared_amax: Vec<super::quantized::SharedAmax>,
}

/// A box and its element strides, resolved against the tensor: one value per tensor dimension
/// (destination strides of a need are reindexed by tensor dimension).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Resolved {
    pub lo: Dims,
    pub ext: Dims,
    pub strides: Dims,
}

impl TensorSpec {
    /// Checks the description on its own: a name, a positive element size, at most MAX_DIMS
    /// dimensions, and a byte size that fits in 64 bits.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.name.is_empty() {
            return Err(Error::invalid_argument("a tensor has an empty name"));
        }
        if self.elem_size == 0 {
            return Err(Error::invalid_argument(format!("tensor '{}' has element size 0", self.name)));
        }
        if self.shape.len() > MAX_DIMS {
            return Err(Error::invalid_argument(format!(
                "tensor '{}' has {} dimensions; at most {MAX_DIMS} are supported",
                self.name,
                self.shape.len()
            )));
        }
        let elems = self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        if elems.and_then(|e| e.checked_mul(self.elem_size.into())).is_none() {
            return Err(Error::invalid_argument(format!("tensor '{}' has more than 2^64 bytes", self.name)));
        }
        Ok(())
    }

    /// Fails with TENSOR_MISMATCH, naming both values, unless `other` describes the same tensor.
    pub(crate) fn check_same(&self, other: &TensorSpec) -> Result<()> {
        let name = &self.name;
        if self.elem_size != other.elem_size {
            bail!(
                Status::TensorMismatch,
                "tensor '{name}' has element size {} in one table and {} in another",
                self.elem_size,
                other.elem_size
            );
        }
        if self.shape != other.shape {
            bail!(
                Status::TensorMismatch,
                "tensor '{name}' has shape {:?} in one table and {:?} in another",
                self.shape,
                other.shape
            );
        }
        if self.dtype != other.dtype {
            bail!(
                Status::TensorMismatch,
                "tensor '{name}' has dtype {} in one table and {} in another",
                self.dtype,
                other.dtype
            );
        }
        Ok(())
    }

    /// Checks a box against the shape and returns its (offset, extent).
    fn resolve_region(&self, region: &Region) -> Result<(Dims, Dims)> {
        let n = self.shape.len();
        if region.offset.len() != n || region.extent.len() != n {
            bail!(
                Status::TensorMismatch,
                "box of tensor '{}' has {} offsets and {} extents; the tensor has {n} dimensions",
                self.name,
                region.offset.len(),
                region.extent.len()
            );
        }
        let (mut lo, mut ext) = ([0; MAX_DIMS], [0; MAX_DIMS]);
        for d in 0..n {
            let end = region.offset[d].checked_add(region.extent[d]);
            if end.is_none_or(|end| end > self.shape[d]) {
                bail!(
                    Status::TensorMismatch,
                    "box offset {:?} extent {:?} is outside tensor '{}' of shape {:?}",
                    region.offset,
                    region.extent,
                    self.name,
                    self.shape
                );
            }
            lo[d] = region.offset[d];
            ext[d] = region.extent[d];
        }
        Ok((lo, ext))
    }

    /// Fails with INVALID_ARGUMENT when the bytes of a box at `addr` with `strides` run past 2^64.
    fn check_addresses(&self, addr: u64, ext: &Dims, strides: &Dims, what: &str) -> Result<()> {
        let n = self.shape.len();
        let span = byte_span(n, ext, strides, self.elem_size.into());
        if span.and_then(|s| addr.checked_add(s)).is_none() {
            return Err(Error::invalid_argument(format!(
                "{what} of tensor '{}' at {addr:#x} with strides {:?} runs past the end of the address space",
                self.name,
                &strides[..n]
            )));
        }
        Ok(())
    }
}

impl Offer {
    /// Checks the offer against its tensor (box, strides, address range) and resolves its strides.
    pub(crate) fn resolve(&self, spec: &TensorSpec) -> Result<Resolved> {
        let n = spec.shape.len();
        let (lo, ext) = spec.resolve_region(&self.region)?;
        let mut strides = [0; MAX_DIMS];
        match &self.strides {
            Some(given) => {
                if given.len() != n {
                    return Err(Error::invalid_argument(format!(
                        "offer of tensor '{}' has {} strides; the tensor has {n} dimensions",
                        spec.name,
                        given.len()
                    )));
                }
                for (d, &stride) in given.iter().enumerate() {
                    strides[d] = stride;
                }
            }
            None => {
                // Saturating: a stride past 2^64 is only reachable through dimensions of extent
                // 0 or 1, which never multiply it (the span check below decides).
                let mut step = 1u64;
                for d in (0..n).rev() {
                    strides[d] = step;
                    step = step.saturating_mul(ext[d]);
                }
            }
        }
        spec.check_addresses(self.addr, &ext, &strides, "offer")?;
        Ok(Resolved { lo, ext, strides })
    }
}

impl Need {
    /// Checks the need against its tensor (box, permutation, strides, address range) and resolves
    /// its destination strides by tensor dimension.
    pub(crate) fn resolve(&self, spec: &TensorSpec) -> Result<Resolved> {
        let n = spec.shape.len();
        let (lo, ext) = spec.resolve_region(&self.region)?;
        if self.strides.len() != n {
            return Err(Error::invalid_argument(format!(
                "need of tensor '{}' has {} destination strides; the tensor has {n} dimensions",
                spec.name,
                self.strides.len()
            )));
        }
        let mut strides = [0; MAX_DIMS];
        match &self.perm {
            None => {
                for (d, &stride) in self.strides.iter().enumerate() {
                    strides[d] = stride;
                }
            }
            Some(perm) => {
                let mut seen = [false; MAX_DIMS];
                let valid = perm.len() == n
                    && perm
                        .iter()
                        .all(|&p| (p as usize) < n && !std::mem::replace(&mut seen[p as usize], true));
                if !valid {
                    return Err(Error::invalid_argument(format!(
                        "need of tensor '{}' has permutation {perm:?}, which is not a permutation of 0..{n}",
                        spec.name
                    )));
                }
                for (d, &p) in perm.iter().enumerate() {
                    strides[p as usize] = self.strides[d];
                }
            }
        }
        spec.check_addresses(self.addr, &ext, &strides, "need")?;
        Ok(Resolved { lo, ext, strides })
    }
}
