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
        // The library's warnings (an IPC fallback and its reasons) go to stderr, which the parent
        // prints when this process did not end as expected.
        refit::logging::init();
        body(rank.parse().unwrap(), size.parse().unwrap(), &id);
        println!("rank {rank} done");
        return;
    }
    let id = Communicator::unique_id(kind).unwrap();
    // Output goes to files, not pipes: a child writing more than a pipe holds would block while
    // the parent waits for an earlier child to exit.
    let logs = |rank: usize| {
        let base = std::env::temp_dir().join(format!("refit-{test}-{}-{rank}", std::process::id()));
        (base.with_extension("out"), base.with_extension("err"))
    };
    let children: Vec<_> = (0..ends.len())
        .map(|rank| {
            let (out, err) = logs(rank);
            Command::new(std::env::current_exe().unwrap())
                .args([test, "--exact", "--include-ignored", "--nocapture", "--test-threads=1"])
                .env(RANK, rank.to_string())
                .env(SIZE, ends.len().to_string())
                .env(ID, encode_hex(&id.0))
                .stdout(Stdio::from(std::fs::File::create(out).unwrap()))
                .stderr(Stdio::from(std::fs::File::create(err).unwrap()))
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
        let status = child.wait().unwrap();
        let (out, err) = logs(rank);
        let read = |path: &std::path::Path| {
            let text = String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned();
            let _ = std::fs::remove_file(path);
            text
        };
        let (stdout, stderr) = (read(&out), read(&err));
        let text = format!("rank {rank} of {test}: {status}\n--- stdout\n{stdout}\n--- stderr\n{stderr}");
        let ended_as_expected = match ends[rank] {
            End::Done => status.success() && stdout.contains(&format!("rank {rank} done")),
            End::Killed => signal(status) == Some(libc::SIGKILL),
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
