//! The table decoder on arbitrary bytes: never a panic; whatever decodes re-encodes to bytes that
//! decode to the same table, and plans without panicking. Inputs whose first byte is odd get a
//! valid header (version 1, 2 or 3 by the first byte: without and with quantized needs) and
//! checksum written first, so that the parser behind the checksum is explored too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use refit::plan::wire::{decode, encode};
use refit::plan::{build_with_limits, Limits, PlanOptions};

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if bytes.first().is_some_and(|b| b & 1 == 1) && bytes.len() >= 13 {
        let version = [1u8, 2, 3][usize::from(bytes[0] >> 1) % 3];
        bytes[..4].copy_from_slice(b"RFTB");
        bytes[4] = version;
        let end = bytes.len() - 8;
        let sum = fnv(&bytes[..end]);
        bytes[end..].copy_from_slice(&sum.to_le_bytes());
    }
    let Ok(table) = decode(&bytes) else {
        return;
    };
    let again = encode(&table);
    assert_eq!(decode(&again).expect("re-encoded table decodes"), table);
    let limits = Limits {
        max_segments: 1 << 16,
        max_pieces: 1 << 12,
        max_overlap_runs: 1 << 16,
        max_box_tests: 1 << 20,
    };
    let _ = build_with_limits(&[table], &PlanOptions::default(), &limits);
});
