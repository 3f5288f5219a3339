//! Building a table entry by entry, checking each entry as it is added: tensors are found by name
//! through a hash map, so adding `n` tensors costs `O(n)`, not `O(n^2)`.

use super::table::{Need, Offer, Table, TensorSpec};
use crate::error::{Error, Result};
use std::collections::HashMap;

/// A [`Table`] being filled, with an index of its tensors by name.
#[derive(Clone, Debug, Default)]
pub struct TableBuilder {
    table: Table,
    /// Index in `table.tensors` of the first description of each name.
    by_name: HashMap<String, u32>,
    /// The key of each (process, scale) in `table.shared_amax`.
    amax_keys: HashMap<(u32, u64), u64>,
}

impl TableBuilder {
    pub fn new() -> TableBuilder {
        TableBuilder::default()
    }

    /// The table built so far.
    pub fn table(&self) -> &Table {
        &self.table
    }

    pub fn into_table(self) -> Table {
        self.table
    }

    /// Adds a tensor description and returns its index. Adding a name again returns the index it
    /// already has when the descriptions agree, and fails with TENSOR_MISMATCH when they do not.
    pub fn add_tensor(&mut self, spec: TensorSpec) -> Result<u32> {
        spec.validate()?;
        if let Some(&i) = self.by_name.get(&spec.name) {
            self.table.tensors[i as usize].check_same(&spec)?;
            return Ok(i);
        }
        let index = u32::try_from(self.table.tensors.len())
            .map_err(|_| Error::invalid_argument("a table holds at most 2^32 tensors"))?;
        self.table.tensors.try_reserve(1).map_err(|_| out_of_memory("tensor"))?;
        self.by_name.try_reserve(1).map_err(|_| out_of_memory("tensor"))?;
        self.by_name.insert(spec.name.clone(), index);
        self.table.tensors.push(spec);
        Ok(index)
    }

    /// Adds an offer after checking it against its tensor (index, box, strides, address range).
    pub fn add_offer(&mut self, offer: Offer) -> Result<()> {
        offer.resolve(self.tensor(offer.tensor)?)?;
        self.table.offers.try_reserve(1).map_err(|_| out_of_memory("offer"))?;
        self.table.offers.push(offer);
        Ok(())
    }

    /// Adds a need after checking it against its tensor (index, box, permutation, strides, address
    /// range).
    pub fn add_need(&mut self, need: Need) -> Result<()> {
        need.resolve(self.tensor(need.tensor)?)?;
        self.table.needs.try_reserve(1).map_err(|_| out_of_memory("need"))?;
        self.table.needs.push(need);
        Ok(())
    }

    /// Adds a quantized need after checking it against its tensor (index, box, strides, element
    /// size, quantization, the ranges of its codes, scales and staging).
    pub fn add_quant_need(&mut self, need: super::quantized::QuantNeed) -> Result<()> {
        need.check(self.tensor(need.tensor)?)?;
        self.table.quant_needs.try_reserve(1).map_err(|_| out_of_memory("quantized need"))?;
        self.table.quant_needs.push(need);
        Ok(())
    }

    /// Adds a per-tensor scale to the set that shares one amax under its key (key 0 is refused:
    /// INVALID_ARGUMENT). Naming a scale twice is accepted when the key is the same.
    pub fn share_amax(&mut self, shared: super::quantized::SharedAmax) -> Result<()> {
        if shared.key == 0 {
            return Err(Error::invalid_argument(format!(
                "scale at {:#x} of process {}: amax key 0 means none; give a nonzero key",
                shared.scale, shared.process
            )));
        }
        if shared.scale == 0 {
            return Err(Error::invalid_argument(format!(
                "a scale at address 0 of process {} (amax key {})",
                shared.process, shared.key
            )));
        }
        match self.amax_keys.get(&(shared.process, shared.scale)) {
            Some(&key) if key == shared.key => return Ok(()),
            Some(&key) => {
                return Err(Error::invalid_argument(format!(
                    "scale at {:#x} of process {} already shares its amax under key {key}, not {}",
                    shared.scale, shared.process, shared.key
                )))
            }
            None => {}
        }
        self.table.shared_amax.try_reserve(1).map_err(|_| out_of_memory("shared amax"))?;
        self.amax_keys.try_reserve(1).map_err(|_| out_of_memory("shared amax"))?;
        self.amax_keys.insert((shared.process, shared.scale), shared.key);
        self.table.shared_amax.push(shared);
        Ok(())
    }

    fn tensor(&self, index: u32) -> Result<&TensorSpec> {
        self.table.tensors.get(index as usize).ok_or_else(|| {
            Error::invalid_argument(format!(
                "tensor index {index} but the table has {} tensors",
                self.table.tensors.len()
            ))
        })
    }
}

impl From<Table> for TableBuilder {
    /// Continues a table (one decoded from bytes, say): later names are found among its tensors.
    fn from(table: Table) -> TableBuilder {
        let mut by_name = HashMap::with_capacity(table.tensors.len());
        for (i, spec) in table.tensors.iter().enumerate() {
            by_name.entry(spec.name.clone()).or_insert(i as u32);
        }
        let amax_keys = table.shared_amax.iter().map(|s| ((s.process, s.scale), s.key)).collect();
        TableBuilder { table, by_name, amax_keys }
    }
}

fn out_of_memory(what: &str) -> Error {
    Error::new(crate::Status::OutOfMemory, format!("no memory to add one more {what} to the table"))
}
