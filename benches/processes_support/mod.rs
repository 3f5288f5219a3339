//! Benches that run in two processes on one machine: this binary runs again as each rank, with the
//! rank and a host-backend communicator id in its environment, and reports `name=value` words on
//! stdout for the parent to read (benches/gpu_comm.rs, benches/gpu_quant_across.rs).

#![allow(dead_code)]

use refit::transport::comm::{CommId, Communicator};
use refit::transport::BackendKind;
use std::process::{Command, Stdio};

const RANK: &str = "REFIT_BENCH_PROCESS_RANK";
const ID: &str = "REFIT_BENCH_PROCESS_ID";

/// In a child: its rank and the communicator id it was given; in the parent: None.
pub fn child_role() -> Option<(usize, CommId)> {
    let (rank, id) = (std::env::var(RANK).ok()?, std::env::var(ID).ok()?);
    let bytes: Vec<u8> =
        (0..id.len()).step_by(2).map(|i| u8::from_str_radix(&id[i..i + 2], 16).unwrap()).collect();
    Some((rank.parse().unwrap(), CommId(bytes.try_into().unwrap())))
}

/// Runs this binary as ranks 0 and 1 at once (they meet on a host-backend communicator) and returns
/// each one's stdout; panics when one fails.
pub fn run_two() -> Vec<String> {
    let id = Communicator::unique_id(BackendKind::Host).unwrap();
    let hex: String = id.0.iter().map(|b| format!("{b:02x}")).collect();
    let running: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .env(RANK, rank.to_string())
                .env(ID, &hex)
                .stdout(Stdio::piped())
                .spawn()
                .expect("a child process starts")
        })
        .collect();
    running
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().expect("a child process ends");
            assert!(out.status.success(), "a child process failed: {}", out.status);
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect()
}

/// The value of the word `name=value` in a child's report.
pub fn field(text: &str, name: &str) -> Option<f64> {
    text.split_whitespace().find_map(|w| w.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
}
