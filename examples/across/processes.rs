//! The demo's `--processes N`: the same refit with publishers and receivers in separate OS processes,
//! through the C ABI's calls between processes (communicator, plan across, executor across).
//!
//! The demo runs again as N processes (this example binary, a rank in its environment): the first
//! half are Megatron publishers (EP over them), the others vLLM receivers (TP over them), one device
//! each. Each process adds only its own table and allocates only its own buffers; the tables are
//! exchanged and every process plans its share (`refit_plan_build_across`), then runs an executor
//! across the processes (`refit_executor_create_across`): direct steps, then one staged, verified
//! step committed after the run. Receivers check every element they need; every process prints the
//! route choice (CUDA IPC or staging over the communicator) and the wire bytes.
//!
//! Devices: with a GPU per process, each process gets its own and the communicator is NCCL; with
//! fewer GPUs the processes share GPU 0 (CUDA IPC between processes, coordinated by a host-backend
//! communicator, since NCCL puts no two ranks on one GPU); without a GPU, the host backend (Unix
//! sockets and host memory: a simulation of the same calls).

use super::{gib, ms, ok, Args};
use refit::exec::RunStats;
use refit::ffi::comm::*;
use refit::ffi::exec::*;
use refit::ffi::group::*;
use refit::ffi::plan::*;
use refit::plan::{wire, Endpoint, PlanStats};
use refit::transport::cuda::cuda_backend;
use refit::transport::host::HostBackend;
use refit::transport::Backend;
use refit_workloads::{Megatron, Model, Packing, Role, Spec, Vllm, Workload};
use std::sync::Arc;
use std::time::Instant;

const RANK: &str = "REFIT_DEMO_RANK";
const ID: &str = "REFIT_DEMO_COMM_ID";

/// Runs the demo across `n` processes: the parent spawns them and prints their reports in order.
pub fn run(args: &Args, n: usize) -> Result<(), String> {
    if n < 2 {
        return Err("--processes needs at least 2 (publishers and receivers)".into());
    }
    if let (Ok(rank), Ok(id)) = (std::env::var(RANK), std::env::var(ID)) {
        let rank: usize = rank.parse().map_err(|e| format!("{RANK}: {e}"))?;
        return process(args, n, rank, &id);
    }
    let gpus = cuda_backend().map(|b| b.device_count()).unwrap_or(0);
    let backend = match gpus {
        0 => REFIT_BACKEND_HOST,
        g if g >= n => REFIT_BACKEND_CUDA,
        // Processes share GPU 0: a host-backend communicator coordinates CUDA IPC between them.
        _ => REFIT_BACKEND_HOST,
    };
    let mut id = refit_comm_id { internal: [0; 136] };
    ok(refit_comm_get_unique_id(backend, &mut id), "refit_comm_get_unique_id")?;
    let hex: String = id.internal.iter().map(|b| format!("{b:02x}")).collect();
    println!(
        "refit demo across {n} processes ({} publisher(s), {} receiver(s)), {}",
        n / 2,
        n - n / 2,
        match gpus {
            0 => "host backend: Unix sockets and host memory between the processes".to_string(),
            g if g >= n => format!("one GPU each, NCCL communicator ({g} GPUs)"),
            _ => "sharing GPU 0 (CUDA IPC between processes)".to_string(),
        }
    );
    let started = Instant::now();
    let children: Vec<_> = (0..n)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().expect("the demo's path"))
                .args(std::env::args().skip(1))
                .env(RANK, rank.to_string())
                .env(ID, &hex)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("starting process {rank}: {e}"))
        })
        .collect::<Result<_, _>>()?;
    let mut failed = Vec::new();
    for (rank, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().map_err(|e| format!("process {rank}: {e}"))?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        if !out.status.success() {
            eprint!("{}", String::from_utf8_lossy(&out.stderr));
            failed.push(rank);
        }
    }
    if !failed.is_empty() {
        return Err(format!("processes {failed:?} failed"));
    }
    println!("done in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// One process's part.
fn process(args: &Args, n: usize, rank: usize, id_hex: &str) -> Result<(), String> {
    let say = |line: String| println!("[process {rank}] {line}");
    let mut id = refit_comm_id { internal: [0; 136] };
    for (i, byte) in id.internal.iter_mut().enumerate() {
        *byte = u8::from_str_radix(id_hex.get(2 * i..2 * i + 2).ok_or("a short id")?, 16)
            .map_err(|e| e.to_string())?;
    }
    let cuda = cuda_backend().ok().filter(|b| b.device_count() > 0);
    let gpus = cuda.as_ref().map_or(0, |b| b.device_count());
    let device = if gpus >= n { rank as i32 } else { 0 };
    let backend: Arc<dyn Backend> = match cuda {
        Some(cuda) => cuda,
        None => Arc::new(HostBackend::new(1).map_err(|e| e.to_string())?),
    };
    let on_gpu = gpus > 0;
    let layers = args.layers.unwrap_or(if on_gpu { 8 } else { 1 });

    let mut comm = std::ptr::null_mut();
    ok(
        refit_comm_create(&id, n as u32, rank as u32, device, std::ptr::null(), &mut comm),
        "refit_comm_create",
    )?;
    let mut group_options = unsafe { std::mem::zeroed::<refit_group_options>() };
    ok(refit_group_options_init(&mut group_options), "refit_group_options_init")?;
    group_options.backend = if on_gpu { REFIT_BACKEND_CUDA } else { REFIT_BACKEND_HOST };
    group_options.host_devices = 1;
    let mut group = std::ptr::null_mut();
    ok(refit_group_create(&device, 1, &group_options, &mut group), "refit_group_create")?;

    let publishers = n / 2;
    let at = |ranks: std::ops::Range<usize>| -> Vec<Endpoint> {
        ranks.map(|p| Endpoint { process: p as u32, device: device as u32 }).collect()
    };
    // Every process's endpoints on its own device (the same ordinal on a shared GPU).
    let endpoint_device = |p: usize| if gpus >= n { p as u32 } else { 0 };
    let with_devices = |mut e: Vec<Endpoint>| {
        for x in &mut e {
            x.device = endpoint_device(x.process as usize);
        }
        e
    };
    let spec = Spec {
        model: Model::qwen3_30b_a3b().with_layers(layers),
        publishers: Megatron {
            endpoints: with_devices(at(0..publishers)),
            tp: 1,
            ep: publishers as u64,
            grouped_experts: true,
        },
        publisher_layout: args.layout,
        receivers: Vllm { endpoints: with_devices(at(publishers..n)) },
        receiver_layout: Packing::Separate,
        digests: true,
    };
    let workload = Workload::generate(&spec).map_err(|e| e.to_string())?;
    let mine = |process: u32| process as usize == rank;
    // This process's view: only its own offers and needs (the others' buffers stay unallocated).
    let mut own = workload.clone();
    own.offers.retain(|o| mine(o.endpoint.process));
    own.needs.retain(|x| mine(x.endpoint.process));
    let mut bases = vec![0u64; workload.buffers.len()];
    let mut images: Vec<Vec<u8>> = vec![Vec::new(); workload.buffers.len()];
    for (b, buffer) in workload.buffers.iter().enumerate().filter(|(_, x)| mine(x.endpoint.process)) {
        bases[b] = backend.alloc(device, buffer.bytes as usize).map_err(|e| e.to_string())?;
        images[b] = vec![0xa5; buffer.bytes as usize];
    }
    {
        let mut views: Vec<&mut [u8]> = images.iter_mut().map(|v| v.as_mut_slice()).collect();
        own.fill_offers(&mut views);
    }
    let upload = |which: Role| -> Result<(), String> {
        for (b, buffer) in workload.buffers.iter().enumerate() {
            if mine(buffer.endpoint.process) && buffer.role == which {
                let bytes = if which == Role::Receiver {
                    vec![0xa5; buffer.bytes as usize]
                } else {
                    images[b].clone()
                };
                // SAFETY: allocated above with this many bytes.
                unsafe { backend.write(device, bases[b], &bytes) }.map_err(|e| e.to_string())?;
            }
        }
        Ok(())
    };
    let download = || -> Result<Vec<Vec<u8>>, String> {
        let mut out = vec![Vec::new(); workload.buffers.len()];
        for (b, buffer) in workload.buffers.iter().enumerate() {
            if mine(buffer.endpoint.process) && buffer.role == Role::Receiver {
                out[b] = vec![0u8; buffer.bytes as usize];
                // SAFETY: allocated above with this many bytes.
                unsafe { backend.read(device, bases[b], &mut out[b]) }.map_err(|e| e.to_string())?;
            }
        }
        Ok(out)
    };
    let check = || -> Result<u64, String> {
        let memory = download()?;
        let views: Vec<&[u8]> = memory.iter().map(|v| v.as_slice()).collect();
        own.check_needs(&views)
    };
    upload(Role::Publisher)?;
    upload(Role::Receiver)?;

    // Only this process's table crosses the C ABI (as its encoded bytes); the plan is built across.
    let tables = workload.tables(&bases).map_err(|e| e.to_string())?;
    let position = tables
        .iter()
        .position(|t| {
            t.offers
                .iter()
                .map(|o| o.owner)
                .chain(t.needs.iter().map(|x| x.receiver))
                .any(|e| mine(e.process))
        })
        .ok_or("this process has no table")?;
    let bytes = wire::encode(&tables[position]);
    let mut table = std::ptr::null_mut();
    // SAFETY: `bytes` is readable for its length.
    ok(unsafe { refit_table_decode(bytes.as_ptr(), bytes.len(), &mut table) }, "refit_table_decode")?;
    let t = Instant::now();
    let mut plan = std::ptr::null_mut();
    ok(refit_plan_build_across(comm, table, std::ptr::null(), &mut plan), "refit_plan_build_across")?;
    let mut s = unsafe { std::mem::zeroed::<PlanStats>() };
    s.size = std::mem::size_of::<PlanStats>();
    // SAFETY: a live plan; `s` has its size set.
    ok(unsafe { refit_plan_get_stats(plan, &mut s) }, "refit_plan_get_stats")?;
    say(format!(
        "{}: built its share of the plan in {:.1} ms ({:.1} ms with the tables' exchange and the agreement, \
         waiting for the other processes); receives {:.3} GiB from other processes",
        if rank < publishers { "publisher" } else { "receiver" },
        s.build_ns as f64 / 1e6,
        t.elapsed().as_secs_f64() * 1e3,
        gib(s.bytes_remote)
    ));

    let make = |commit: u32, verify: bool| -> Result<*mut refit_executor, String> {
        let mut options = unsafe { std::mem::zeroed::<refit_executor_options>() };
        ok(refit_executor_options_init(&mut options), "refit_executor_options_init")?;
        options.arm = args.arm;
        options.commit = commit;
        options.verify = verify;
        let mut executor = std::ptr::null_mut();
        ok(
            refit_executor_create_across(plan, group, comm, &options, &mut executor),
            "refit_executor_create_across",
        )?;
        Ok(executor)
    };
    let report = |name: &str, r: &RunStats| {
        say(format!(
            "{name}: {:.2} ms; sent {:.3} GiB ({:.3} GiB written straight into {} peer(s) through IPC, {:.3} GiB \
             on the wire to {} peer(s) through staging), received {:.3} GiB",
            ms(r.wall_ns),
            gib(r.bytes[2]),
            gib(r.remote_ipc_bytes),
            r.remote_ipc_peers,
            gib(r.remote_wire_bytes),
            r.remote_staged_peers,
            gib(r.remote_received_bytes)
        ))
    };
    let direct = make(REFIT_COMMIT_DIRECT, false)?;
    for step in 1..=args.steps {
        let mut stats = RunStats::default();
        ok(refit_executor_run(direct, group, &mut stats), "refit_executor_run")?;
        report(&format!("direct step {step}"), &stats);
    }
    refit_executor_destroy(direct);
    // A meeting of every process (an allgather of one byte each over the communicator): before the
    // buffers are freed, so that no peer still holds them open.
    let mut comm_backend = 0u32;
    ok(refit_comm_backend(comm, &mut comm_backend), "refit_comm_backend")?;
    let barrier = || -> Result<(), String> {
        let counts = vec![1usize; n];
        let (mut host_send, mut host_recv) = (vec![1u8], vec![0u8; n]);
        let (send, recv) = if comm_backend == REFIT_BACKEND_CUDA {
            (
                backend.alloc(device, 1).map_err(|e| e.to_string())?,
                backend.alloc(device, n).map_err(|e| e.to_string())?,
            )
        } else {
            (host_send.as_mut_ptr() as u64, host_recv.as_mut_ptr() as u64)
        };
        let met = ok(
            refit_comm_allgather(comm, send, recv, counts.as_ptr(), std::ptr::null_mut()),
            "refit_comm_allgather",
        )
        .and_then(|()| ok(refit_comm_synchronize(comm, std::ptr::null_mut()), "refit_comm_synchronize"));
        if comm_backend == REFIT_BACKEND_CUDA {
            // SAFETY: allocated above; the allgather has completed (or failed and was aborted).
            unsafe {
                let _ = backend.free(device, send);
                let _ = backend.free(device, recv);
            }
        }
        met
    };
    barrier()?;
    if rank >= publishers {
        say(format!("all {} received elements correct after the direct steps", check()?));
    }
    upload(Role::Receiver)?;
    let staged = make(REFIT_COMMIT_STAGED, true)?;
    let mut ran = RunStats::default();
    ok(refit_executor_run(staged, group, &mut ran), "refit_executor_run")?;
    report("staged, verified run", &ran);
    barrier()?;
    if rank >= publishers {
        let memory = download()?;
        let untouched = memory.iter().flatten().all(|&b| b == 0xa5);
        say(format!(
            "before the commit every live byte is {}",
            if untouched { "unchanged" } else { "CHANGED" }
        ));
        if !untouched {
            return Err("a staged run changed live bytes before its commit".into());
        }
    }
    let mut committed = RunStats::default();
    ok(refit_executor_commit(staged, group, &mut committed), "refit_executor_commit")?;
    say(format!(
        "commit: {:.2} ms, {:.3} GiB installed",
        ms(committed.wall_ns),
        gib(committed.installed_bytes)
    ));
    refit_executor_destroy(staged);
    barrier()?;
    if rank >= publishers {
        say(format!("all {} received elements correct after the commit", check()?));
    }
    refit_plan_destroy(plan);
    refit_table_destroy(table);
    barrier()?;
    refit_group_destroy(group);
    refit_comm_destroy(comm);
    for (b, &base) in bases.iter().enumerate().filter(|(_, &x)| x != 0) {
        // SAFETY: allocated above; every process is done with it.
        unsafe { backend.free(device, base) }.map_err(|e| format!("freeing buffer {b}: {e}"))?;
    }
    Ok(())
}
