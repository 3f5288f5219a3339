//! What planners are given: each rank's shard table (tensors it knows, offers it publishes, needs it
//! receives). Plain data with addresses as integers; nothing here knows where memory lives.

/// Most dimensions a tensor may have (C callers: REFIT_MAX_DIMS).
///
/// cbindgen:ignore
pub const MAX_DIMS: usize = 8;

/// Where a shard lives or lands: a process rank and a device ordinal within that process.
/// Two endpoints with the same rank are in the same process; with the same rank and device, on the
/// same GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Endpoint {
    pub rank: u32,
    pub device: u32,
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

/// One rank's contribution to a plan. Tables from every rank are merged by tensor name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Table {
    pub tensors: Vec<TensorSpec>,
    pub offers: Vec<Offer>,
    pub needs: Vec<Need>,
}

impl Table {
    /// Adds a tensor description and returns its index. Adding a name again returns the index it
    /// already has when the descriptions agree, and fails with TENSOR_MISMATCH when they do not.
    pub fn add_tensor(&mut self, spec: TensorSpec) -> crate::Result<u32> {
        super::merge::validate_spec(&spec)?;
        if let Some(i) = self.tensors.iter().position(|t| t.name == spec.name) {
            super::merge::check_same(&self.tensors[i], &spec)?;
            return Ok(i as u32);
        }
        let index = u32::try_from(self.tensors.len())
            .map_err(|_| crate::Error::invalid_argument("a table holds at most 2^32 tensors"))?;
        self.tensors.push(spec);
        Ok(index)
    }

    /// Adds an offer after checking it against its tensor (index, box, strides, address range).
    pub fn add_offer(&mut self, offer: Offer) -> crate::Result<()> {
        super::merge::check_offer(self.tensor(offer.tensor)?, &offer)?;
        self.offers.push(offer);
        Ok(())
    }

    /// Adds a need after checking it against its tensor (index, box, permutation, strides, address range).
    pub fn add_need(&mut self, need: Need) -> crate::Result<()> {
        super::merge::check_need(self.tensor(need.tensor)?, &need)?;
        self.needs.push(need);
        Ok(())
    }

    fn tensor(&self, index: u32) -> crate::Result<&TensorSpec> {
        self.tensors.get(index as usize).ok_or_else(|| {
            crate::Error::invalid_argument(format!(
                "tensor index {index} but the table has {} tensors",
                self.tensors.len()
            ))
        })
    }
}
