//! The table wire format: random tables survive a round trip exactly; truncated, corrupted and
//! hostile bytes give a status (never a panic, never a huge allocation).

use refit::plan::wire::{
    decode, encode, VERSION, VERSION_QUANTIZED, VERSION_QUANTIZED_DIVIDE_ONLY, VERSION_SHARED_AMAX,
};
use refit::plan::{Endpoint, Need, Offer, Region, Table, TensorSpec};
use refit::Status;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// Values of every size, so that varints of every length appear.
    fn wide(&mut self) -> u64 {
        self.next() >> self.below(64)
    }
}

fn random_table(rng: &mut Rng) -> Table {
    let ntensors = rng.below(5);
    let tensors: Vec<TensorSpec> = (0..ntensors)
        .map(|i| {
            let ndim = rng.below(9) as usize;
            TensorSpec {
                name: format!("t{i}.ü.{}", rng.next()),
                dtype: rng.wide() as u32,
                elem_size: rng.wide() as u32,
                shape: (0..ndim).map(|_| rng.wide()).collect(),
            }
        })
        .collect();
    let mut table = Table { tensors, ..Table::default() };
    if ntensors == 0 {
        return table;
    }
    let dims = |rng: &mut Rng, n: usize| (0..n).map(|_| rng.wide()).collect::<Vec<u64>>();
    let endpoint = |rng: &mut Rng| Endpoint { process: rng.wide() as u32, device: rng.wide() as u32 };
    for _ in 0..rng.below(6) {
        let tensor = rng.below(ntensors) as u32;
        let n = table.tensors[tensor as usize].shape.len();
        let region = Region { offset: dims(rng, n), extent: dims(rng, n) };
        let strides = (rng.below(2) == 0).then(|| dims(rng, n));
        let digest = (rng.below(2) == 0).then(|| rng.next());
        table.offers.push(Offer { tensor, owner: endpoint(rng), addr: rng.wide(), region, strides, digest });
    }
    for _ in 0..rng.below(6) {
        let tensor = rng.below(ntensors) as u32;
        let n = table.tensors[tensor as usize].shape.len();
        let region = Region { offset: dims(rng, n), extent: dims(rng, n) };
        let perm = (rng.below(2) == 0).then(|| (0..n as u32).rev().collect());
        table.needs.push(Need {
            tensor,
            receiver: endpoint(rng),
            addr: rng.wide(),
            region,
            perm,
            strides: dims(rng, n),
        });
    }
    table
}

#[test]
fn random_tables_round_trip_exactly() {
    // REFIT_WRITE_FUZZ_SEEDS=<dir> also keeps the first encodings there (the decode fuzzer's seeds).
    let seeds = std::env::var_os("REFIT_WRITE_FUZZ_SEEDS");
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for i in 0..500 {
        let table = random_table(&mut rng);
        let bytes = encode(&table);
        if let (Some(dir), true) = (&seeds, i < 16) {
            std::fs::write(std::path::Path::new(dir).join(format!("seed-{i:02}")), &bytes).unwrap();
        }
        assert_eq!(&bytes[..4], b"RFTB");
        assert_eq!(bytes[4], VERSION);
        assert_eq!(decode(&bytes).unwrap(), table);
    }
}

#[test]
fn every_truncation_and_every_bit_flip_is_rejected() {
    let mut rng = Rng(99);
    for _ in 0..20 {
        let table = random_table(&mut rng);
        let bytes = encode(&table);
        for len in 0..bytes.len() {
            let err = decode(&bytes[..len]).unwrap_err();
            assert!(matches!(err.status, Status::DecodeError | Status::VersionMismatch), "{err}");
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                let err = decode(&bad).unwrap_err();
                // A flipped version byte names another format, or (a version read here) fails the
                // checksum.
                let known = [VERSION, VERSION_QUANTIZED_DIVIDE_ONLY, VERSION_QUANTIZED, VERSION_SHARED_AMAX]
                    .contains(&bad[4]);
                let expected = if i == 4 && !known { Status::VersionMismatch } else { Status::DecodeError };
                assert_eq!(err.status, expected, "byte {i} bit {bit}: {err}");
            }
        }
    }
}

/// Wraps a payload in the header and a valid checksum, as a hostile peer could.
fn framed(payload: &[u8]) -> Vec<u8> {
    let mut out = b"RFTB".to_vec();
    out.push(VERSION);
    out.extend_from_slice(payload);
    let sum =
        out.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

fn rejects(payload: &[u8], words: &str) {
    let err = decode(&framed(payload)).unwrap_err();
    assert_eq!(err.status, Status::DecodeError, "{err}");
    assert!(err.message.contains(words), "{:?} lacks {words:?}", err.message);
}

#[test]
fn hostile_payloads_with_valid_checksums_are_rejected() {
    // The empty table is valid.
    assert_eq!(decode(&framed(&[0, 0, 0])).unwrap(), Table::default());
    // Counts far beyond the bytes present: rejected before allocating.
    rejects(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f], "cannot fit");
    rejects(&[0, 0xff, 0xff, 0xff, 0x0f], "offers cannot fit");
    // A varint running past 64 bits, and one longer than 10 bytes.
    rejects(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x02], "overflows 64 bits");
    rejects(&[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x00], "longer than 10 bytes");
    // A name that is not UTF-8; a tensor with 9 dimensions; a 32-bit field over 32 bits.
    rejects(&[1, 1, 0xff, 0, 4, 0, 0, 0], "not UTF-8");
    rejects(&[1, 1, b'a', 0, 4, 9, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0], "9 dimensions");
    rejects(&[1, 1, b'a', 0x80, 0x80, 0x80, 0x80, 0x10, 4, 0, 0, 0], "does not fit in 32 bits");
    // An offer naming a tensor the table does not have; unknown flag bits; trailing bytes.
    rejects(&[1, 1, b'a', 0, 4, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0], "tensor index 1");
    rejects(&[1, 1, b'a', 0, 4, 0, 1, 0, 0, 0, 0, 0, 0, 4, 0], "unknown bits");
    rejects(&[1, 1, b'a', 0, 4, 0, 0, 1, 0, 0, 0, 0, 0, 0, 7, 0], "unknown bits");
    rejects(&[0, 0, 0, 0], "1 bytes follow");
    // Truncated inside an entry.
    rejects(&[1, 1, b'a', 0, 4], "truncated");
}

#[test]
fn other_versions_and_foreign_bytes_are_named() {
    let mut bytes = encode(&Table::default());
    // Versions 1, 2, 3 (tables with quantized needs) and 4 (with amax keys) are read; the next is
    // another format.
    bytes[4] = VERSION_SHARED_AMAX + 1;
    let err = decode(&bytes).unwrap_err();
    assert_eq!(err.status, Status::VersionMismatch);
    assert!(err.message.contains(&format!("version {}", VERSION_SHARED_AMAX + 1)));
    let err = decode(b"GIF89a.........").unwrap_err();
    assert_eq!(err.status, Status::DecodeError);
    assert!(err.message.contains("not a refit table"));
    assert_eq!(decode(&[]).unwrap_err().status, Status::DecodeError);
}

#[test]
fn amax_keys_survive_the_wire_and_hostile_counts_are_refused() {
    use refit::plan::SharedAmax;
    let table = Table {
        shared_amax: vec![
            SharedAmax { process: 3, scale: 0x7f00_0000_1000, key: u64::MAX },
            SharedAmax { process: 0, scale: 4, key: 1 },
        ],
        ..Table::default()
    };
    let bytes = encode(&table);
    assert_eq!(bytes[4], VERSION_SHARED_AMAX);
    assert_eq!(decode(&bytes).unwrap(), table);
    for len in 0..bytes.len() {
        assert!(decode(&bytes[..len]).is_err(), "{len} bytes decoded");
    }
    // Version 4 with a count of entries far beyond the bytes that follow (checksum valid).
    let mut hostile = framed(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x0f]);
    hostile[4] = VERSION_SHARED_AMAX;
    let len = hostile.len();
    let sum = hostile[..len - 8]
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    hostile[len - 8..].copy_from_slice(&sum.to_le_bytes());
    let err = decode(&hostile).unwrap_err();
    assert_eq!(err.status, Status::DecodeError, "{err}");
    assert!(err.message.contains("shared amax entries"), "{err}");
}
