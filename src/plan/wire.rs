//! The wire format of one process's table, so that processes can exchange tables by their own
//! means and each build the same plan.
//!
//! Layout (version 1): the magic `RFTB`, a version byte, the tensors, offers and needs, then an
//! FNV-1a 64 checksum (little-endian) of every byte before it. Integers are LEB128 varints; a digest
//! is 8 bytes little-endian.
//!
//! - tensor: name length, name (UTF-8), dtype, element size, dimension count `n`, `n` dimensions
//! - offer: tensor index, owner process, owner device, address, `n`, `n` offsets, `n` extents, flags
//!   (bit 0: strides follow, bit 1: digest follows), [`n` strides], [digest]
//! - need: tensor index, receiver process, receiver device, address, `n`, `n` offsets, `n` extents,
//!   flags (bit 0: permutation follows), [`n` permutation entries], `n` destination strides
//!
//! - version 2 only, after the needs: the quantized needs (`super::quantized`), each: tensor index,
//!   receiver process, receiver device, address, `n`, `n` offsets, `n` extents, `n` strides, target,
//!   granularity, block rows, block columns, source type, scales, scale row stride, scale matrix
//!   stride, staging. A table without quantized needs is written as version 1, byte for byte as
//!   before them.
//! - version 3: as version 2, each quantized need's arithmetic after its block columns.
//! - version 4 only, after the quantized needs: the shared amax entries (`super::quantized::SharedAmax`),
//!   each: process, scale, key. A table without them is written as version 3 (or 1).
//!
//! Each list is preceded by its length. Decoding checks every length against the bytes that are
//! left before allocating, so hostile input costs at most memory proportional to its own size.

use super::digest::fnv1a;
use super::quantized::{QuantNeed, SharedAmax};
use super::table::{Endpoint, Need, Offer, Region, Table, TensorSpec, MAX_DIMS};
use crate::bail;
use crate::error::{Error, Result, Status};
use crate::quant::{Quantization, SourceType};

const MAGIC: &[u8; 4] = b"RFTB";
/// The format version this library writes and reads.
///
/// cbindgen:ignore
pub const VERSION: u8 = 1;
/// The version of tables with quantized needs, each with its arithmetic (read as well as
/// [`VERSION`]).
///
/// cbindgen:ignore
pub const VERSION_QUANTIZED: u8 = 3;
/// The version of tables with shared amax entries (read as well as the others).
///
/// cbindgen:ignore
pub const VERSION_SHARED_AMAX: u8 = 4;
/// Tables with quantized needs written before needs had an arithmetic (read as the default one).
///
/// cbindgen:ignore
pub const VERSION_QUANTIZED_DIVIDE_ONLY: u8 = 2;
const HEADER: usize = 5;
const CHECKSUM: usize = 8;

/// Encodes one table. Never fails: every table has an encoding (validation happens when planning).
pub fn encode(table: &Table) -> Vec<u8> {
    let version = if !table.shared_amax.is_empty() {
        VERSION_SHARED_AMAX
    } else if !table.quant_needs.is_empty() {
        VERSION_QUANTIZED
    } else {
        VERSION
    };
    encode_as(table, version)
}

/// [`encode`] in format `version`: [`VERSION_QUANTIZED_DIVIDE_ONLY`] leaves the arithmetic out (the
/// tests write the tables of earlier libraries with it).
fn encode_as(table: &Table, version: u8) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + 48 * (table.offers.len() + table.needs.len()));
    out.extend_from_slice(MAGIC);
    out.push(version);
    put(&mut out, table.tensors.len() as u64);
    for t in &table.tensors {
        put(&mut out, t.name.len() as u64);
        out.extend_from_slice(t.name.as_bytes());
        put(&mut out, t.dtype.into());
        put(&mut out, t.elem_size.into());
        put_list(&mut out, &t.shape);
    }
    put(&mut out, table.offers.len() as u64);
    for o in &table.offers {
        put(&mut out, o.tensor.into());
        put_endpoint(&mut out, o.owner);
        put(&mut out, o.addr);
        put_region(&mut out, &o.region);
        out.push(u8::from(o.strides.is_some()) | (u8::from(o.digest.is_some()) << 1));
        if let Some(strides) = &o.strides {
            put_list(&mut out, strides);
        }
        if let Some(digest) = o.digest {
            out.extend_from_slice(&digest.to_le_bytes());
        }
    }
    put(&mut out, table.needs.len() as u64);
    for nd in &table.needs {
        put(&mut out, nd.tensor.into());
        put_endpoint(&mut out, nd.receiver);
        put(&mut out, nd.addr);
        put_region(&mut out, &nd.region);
        out.push(u8::from(nd.perm.is_some()));
        if let Some(perm) = &nd.perm {
            put(&mut out, perm.len() as u64);
            for &p in perm {
                put(&mut out, p.into());
            }
        }
        put_list(&mut out, &nd.strides);
    }
    if version != VERSION {
        put(&mut out, table.quant_needs.len() as u64);
        for q in &table.quant_needs {
            put(&mut out, q.tensor.into());
            put_endpoint(&mut out, q.receiver);
            put(&mut out, q.addr);
            put_region(&mut out, &q.region);
            put_list(&mut out, &q.strides);
            let codes = q.quantization.codes();
            let written = if version == VERSION_QUANTIZED_DIVIDE_ONLY { &codes[..4] } else { &codes[..] };
            for &code in written {
                put(&mut out, code.into());
            }
            put(&mut out, q.source.code().into());
            for v in [q.scales, q.scale_row_stride, q.scale_matrix_stride, q.staging] {
                put(&mut out, v);
            }
        }
    }
    if version == VERSION_SHARED_AMAX {
        put(&mut out, table.shared_amax.len() as u64);
        for s in &table.shared_amax {
            for v in [u64::from(s.process), s.scale, s.key] {
                put(&mut out, v);
            }
        }
    }
    let sum = checksum(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes one table. Truncated, corrupted or hostile bytes give DECODE_ERROR (VERSION_MISMATCH for
/// another format version); never a panic, never an allocation larger than the input warrants.
pub fn decode(bytes: &[u8]) -> Result<Table> {
    if bytes.len() < HEADER + CHECKSUM || &bytes[..4] != MAGIC {
        bail!(
            Status::DecodeError,
            "not a refit table: {} bytes without the RFTB header and checksum",
            bytes.len()
        );
    }
    if ![VERSION, VERSION_QUANTIZED_DIVIDE_ONLY, VERSION_QUANTIZED, VERSION_SHARED_AMAX].contains(&bytes[4]) {
        bail!(
            Status::VersionMismatch,
            "table format version {} (this library reads versions {VERSION}, {VERSION_QUANTIZED_DIVIDE_ONLY}, \
             {VERSION_QUANTIZED} and {VERSION_SHARED_AMAX})",
            bytes[4]
        );
    }
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM);
    let stored = u64::from_le_bytes(sum.try_into().expect("split at 8 bytes from the end"));
    if checksum(body) != stored {
        bail!(Status::DecodeError, "table checksum mismatch: the bytes are corrupted or truncated");
    }
    let mut r = Reader { bytes: body, at: HEADER };
    let count = r.count("tensors", 4)?;
    let mut tensors = Vec::with_capacity(count);
    for _ in 0..count {
        let len = r.count("name bytes", 1)?;
        let name = std::str::from_utf8(r.take(len)?)
            .map_err(|_| Error::new(Status::DecodeError, "a tensor name is not UTF-8"))?
            .to_string();
        let dtype = r.u32("dtype")?;
        let elem_size = r.u32("element size")?;
        let shape = r.list()?;
        tensors.push(TensorSpec { name, dtype, elem_size, shape });
    }
    let tensor = |r: &mut Reader| -> Result<u32> {
        let t = r.u32("tensor index")?;
        if t as usize >= tensors.len() {
            bail!(Status::DecodeError, "tensor index {t} but the table has {} tensors", tensors.len());
        }
        Ok(t)
    };
    let count = r.count("offers", 7)?;
    let mut offers = Vec::with_capacity(count);
    for _ in 0..count {
        let tensor = tensor(&mut r)?;
        let owner = r.endpoint()?;
        let addr = r.varint()?;
        let region = r.region()?;
        let flags = r.byte()?;
        if flags & !3 != 0 {
            bail!(Status::DecodeError, "offer flags {flags:#x} have unknown bits");
        }
        let strides = if flags & 1 != 0 { Some(r.list()?) } else { None };
        let digest = if flags & 2 != 0 {
            Some(u64::from_le_bytes(r.take(8)?.try_into().expect("8 bytes")))
        } else {
            None
        };
        offers.push(Offer { tensor, owner, addr, region, strides, digest });
    }
    let count = r.count("needs", 7)?;
    let mut needs = Vec::with_capacity(count);
    for _ in 0..count {
        let tensor = tensor(&mut r)?;
        let receiver = r.endpoint()?;
        let addr = r.varint()?;
        let region = r.region()?;
        let perm = match r.byte()? {
            0 => None,
            1 => {
                let n = r.count("permutation entries", 1)?;
                if n > MAX_DIMS {
                    bail!(Status::DecodeError, "a permutation has {n} entries; at most {MAX_DIMS}");
                }
                Some((0..n).map(|_| r.u32("permutation entry")).collect::<Result<Vec<u32>>>()?)
            }
            flags => bail!(Status::DecodeError, "need flags {flags:#x} have unknown bits"),
        };
        let strides = r.list()?;
        needs.push(Need { tensor, receiver, addr, region, perm, strides });
    }
    let mut quant_needs = Vec::new();
    if bytes[4] != VERSION {
        let count = r.count("quantized needs", 16)?;
        quant_needs.reserve(count);
        for _ in 0..count {
            let tensor = tensor(&mut r)?;
            let receiver = r.endpoint()?;
            let addr = r.varint()?;
            let region = r.region()?;
            let strides = r.list()?;
            let codes = [
                r.u32("target")?,
                r.u32("granularity")?,
                r.u32("block rows")?,
                r.u32("block columns")?,
                if bytes[4] == VERSION_QUANTIZED_DIVIDE_ONLY { 0 } else { r.u32("arithmetic")? },
            ];
            let quantization = Quantization::from_codes(codes).ok_or_else(|| {
                Error::new(Status::DecodeError, format!("no quantization has the numbers {codes:?}"))
            })?;
            let code = r.u32("source type")?;
            let source = SourceType::from_code(code)
                .ok_or_else(|| Error::new(Status::DecodeError, format!("source type {code} is unknown")))?;
            let [scales, scale_row_stride, scale_matrix_stride, staging] =
                [r.varint()?, r.varint()?, r.varint()?, r.varint()?];
            quant_needs.push(QuantNeed {
                tensor,
                receiver,
                addr,
                region,
                strides,
                quantization,
                source,
                scales,
                scale_row_stride,
                scale_matrix_stride,
                staging,
            });
        }
    }
    let mut shared_amax = Vec::new();
    if bytes[4] == VERSION_SHARED_AMAX {
        let count = r.count("shared amax entries", 3)?;
        shared_amax.reserve(count);
        for _ in 0..count {
            let process = r.u32("process")?;
            let (scale, key) = (r.varint()?, r.varint()?);
            shared_amax.push(SharedAmax { process, scale, key });
        }
    }
    if r.at != body.len() {
        bail!(Status::DecodeError, "{} bytes follow the table", body.len() - r.at);
    }
    Ok(Table { tensors, offers, needs, quant_needs, shared_amax })
}

fn checksum(bytes: &[u8]) -> u64 {
    fnv1a(bytes)
}

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_list(out: &mut Vec<u8>, values: &[u64]) {
    put(out, values.len() as u64);
    for &v in values {
        put(out, v);
    }
}

fn put_endpoint(out: &mut Vec<u8>, e: Endpoint) {
    put(out, e.process.into());
    put(out, e.device.into());
}

fn put_region(out: &mut Vec<u8>, region: &Region) {
    put_list(out, &region.offset);
    put_list(out, &region.extent);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn truncated(&self) -> Error {
        Error::new(Status::DecodeError, format!("table truncated at byte {}", self.at))
    }

    fn byte(&mut self) -> Result<u8> {
        let b = *self.bytes.get(self.at).ok_or_else(|| self.truncated())?;
        self.at += 1;
        Ok(b)
    }

    fn take(&mut self, len: usize) -> Result<&[u8]> {
        let end =
            self.at.checked_add(len).filter(|&e| e <= self.bytes.len()).ok_or_else(|| self.truncated())?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.byte()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                bail!(Status::DecodeError, "varint at byte {} overflows 64 bits", self.at);
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!(Status::DecodeError, "varint at byte {} is longer than 10 bytes", self.at)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        let v = self.varint()?;
        u32::try_from(v)
            .map_err(|_| Error::new(Status::DecodeError, format!("{what} {v} does not fit in 32 bits")))
    }

    /// A length of entries that take at least `min_bytes` each: bounded by the bytes left.
    fn count(&mut self, what: &str, min_bytes: usize) -> Result<usize> {
        let v = self.varint()?;
        let left = (self.bytes.len() - self.at) / min_bytes;
        match usize::try_from(v) {
            Ok(n) if n <= left => Ok(n),
            _ => bail!(
                Status::DecodeError,
                "{v} {what} cannot fit in the {} bytes left",
                self.bytes.len() - self.at
            ),
        }
    }

    fn list(&mut self) -> Result<Vec<u64>> {
        let n = self.count("dimensions", 1)?;
        if n > MAX_DIMS {
            bail!(Status::DecodeError, "{n} dimensions; at most {MAX_DIMS}");
        }
        (0..n).map(|_| self.varint()).collect()
    }

    fn endpoint(&mut self) -> Result<Endpoint> {
        Ok(Endpoint { process: self.u32("process")?, device: self.u32("device")? })
    }

    fn region(&mut self) -> Result<Region> {
        Ok(Region { offset: self.list()?, extent: self.list()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::quantized::QuantNeed;
    use crate::quant::{Arithmetic, Fp8, Granularity};

    fn table(arithmetic: Arithmetic) -> Table {
        let q = Quantization::new(Fp8::E4m3fn, Granularity::Row).with(arithmetic);
        Table {
            tensors: vec![TensorSpec { name: "w".into(), dtype: 1, elem_size: 2, shape: vec![4, 8] }],
            quant_needs: vec![QuantNeed {
                tensor: 0,
                receiver: Endpoint { process: 0, device: 0 },
                addr: 0x1000,
                region: Region { offset: vec![0, 0], extent: vec![4, 8] },
                strides: vec![8, 1],
                quantization: q,
                source: SourceType::Bf16,
                scales: 0x2000,
                scale_row_stride: 1,
                scale_matrix_stride: 4,
                staging: 0,
            }],
            ..Table::default()
        }
    }

    #[test]
    fn tables_of_libraries_before_the_arithmetic_read_as_its_default() {
        let earlier = encode_as(&table(Arithmetic::Divide), VERSION_QUANTIZED_DIVIDE_ONLY);
        assert_eq!(decode(&earlier).unwrap(), table(Arithmetic::Divide));
        // The arithmetic is one more number per need than those tables hold.
        let now = encode(&table(Arithmetic::VllmChannel));
        assert_eq!(now[4], VERSION_QUANTIZED);
        assert_eq!(now.len(), earlier.len() + 1);
        assert_eq!(decode(&now).unwrap(), table(Arithmetic::VllmChannel));
    }
}
