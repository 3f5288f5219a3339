//! Tests that run one body in several OS processes: this test binary runs again, filtered to the one
//! test, with the rank, the size and a communicator id in its environment, and the parent checks how
//! each process ended (tests/comm_host.rs, tests/gpu_comm.rs).
#![allow(dead_code)]

use refit::transport::comm::{CommId, Communicator};
use refit::transport::BackendKind;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const RANK: &str = "REFIT_COMM_TEST_RANK";
const SIZE: &str = "REFIT_COMM_TEST_SIZE";
const ID: &str = "REFIT_COMM_TEST_ID";

/// How a process is expected to end.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum End {
    /// The body returned (its checks held).
    Done,
    /// Killed by SIGKILL (the body kills itself to simulate a crash).
    Killed,
}

/// Runs `body(rank, size, id)` in `ends.len()` processes, with a communicator id of `kind` made here
/// (for NCCL, this process hosts the bootstrap root and outlives the others), and checks that each
/// ends as `ends[rank]`; every process that did not is reported with its output. In a child (the
/// environment names its rank), runs the body instead.
pub fn in_processes(test: &str, kind: BackendKind, ends: &[End], body: fn(usize, usize, &CommId)) {
    if let (Ok(rank), Ok(size), Ok(id)) = (std::env::var(RANK), std::env::var(SIZE), std::env::var(ID)) {
        let id = CommId(decode_hex(&id).try_into().expect("an id's bytes"));
        body(rank.parse().unwrap(), size.parse().unwrap(), &id);
        println!("rank {rank} done");
        return;
    }
    let id = Communicator::unique_id(kind).unwrap();
    let children: Vec<_> = (0..ends.len())
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
                .env(RANK, rank.to_string())
                .env(SIZE, ends.len().to_string())
                .env(ID, encode_hex(&id.0))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(240);
    let mut failures = Vec::new();
    for (rank, mut child) in children.into_iter().enumerate() {
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let output = child.wait_with_output().unwrap();
        let text = format!(
            "rank {rank} of {test}: {}\n{}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let ended_as_expected = match ends[rank] {
            End::Done => output.status.success() && text.contains(&format!("rank {rank} done")),
            End::Killed => signal(output.status) == Some(libc::SIGKILL),
        };
        if !ended_as_expected {
            failures.push(text);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn signal(status: ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.signal()
}

fn encode_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn decode_hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}
