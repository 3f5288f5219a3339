// Can a small whole-group allgather cost one kernel launch instead of one per GPU?
//
// Today (refit's KernelPushes) every rank launches the group-synchronized copy kernel on its stream:
// the launches meet through flags, each pushes its block, and they meet again. Host time is one launch
// per GPU (about 3 us each: benches/probes/launch_cost_probe.cu), so 6 us at G = 2 and some 24 us at G = 8.
// The alternative measured here, "leader": only rank 0 launches a kernel; every other rank enqueues one
// stream memory-operation batch (0.9 us of host time): "arrived" written into rank 0's memory, then a
// wait until rank 0's kernel writes "done" into its own. Rank 0's kernel waits for every arrival,
// copies every block of every rank (remote reads and writes through its SMs), and signals done.
// Prediction: host time 3 + 0.9 (G - 1) us; GPU time per call higher than the rendezvous's, by the
// latency of a memory-operation wait (the memops round trip in cross_gpu_sync_probe is 12.3 us against
// 9.6 for events), and much higher from about 1 MiB per rank, where one GPU's SMs move every block.
// Result: docs/measurements.md (this probe's section). The leader saves host time but costs GPU time,
// so refit keeps one launch per GPU; the variant that counts departures per block was faster at every
// size, and refit's kernel now departs that way (docs/decisions.md).
//
// Build and run on the GPU machine (2 or more GPUs with peer access):
//   gpu/run.sh probes leader (nvcc -O2 -std=c++17 -arch=native benches/probes/leader_launch_probe.cu
//   -lcuda -lpthread, then the program with OUT.json)
// Every variant is checked byte for byte before it is timed.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

typedef unsigned long long u64;
typedef unsigned int u32;

#define CK(call)                                                                        \
    do {                                                                                \
        auto rc_ = (call);                                                              \
        if ((int)rc_ != 0) {                                                            \
            std::fprintf(stderr, "%s:%d %s failed: %d\n", __FILE__, __LINE__, #call, (int)rc_); \
            std::exit(1);                                                               \
        }                                                                               \
    } while (0)

static const int MAX_RANKS = 8;

// Flag words in each rank's memory: arrived[p] at word p, rendezvous departures at MAX_RANKS + p,
// done (leader -> rank) at 2 * MAX_RANKS, the finished-block counter at 3 * MAX_RANKS, and for the
// counted departure two counters per peer (by epoch parity) from 4 * MAX_RANKS.
enum {
    ARRIVED = 0,
    DEPARTED = MAX_RANKS,
    DONE = 2 * MAX_RANKS,
    COUNTER = 3 * MAX_RANKS,
    COUNTS = 4 * MAX_RANKS,
    FLAG_WORDS = 6 * MAX_RANKS
};

struct Ranks {
    u32 n;
    u64 bytes;                 // per rank
    u64 send[MAX_RANKS];       // device addresses
    u64 recv[MAX_RANKS];       // n * bytes each
    u64 flags[MAX_RANKS];      // FLAG_WORDS u64 each
};

__device__ __forceinline__ void store_release(u64 addr, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(v) : "memory");
}
__device__ __forceinline__ u64 load_acquire(u64 addr) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(addr) : "memory");
    return v;
}
__device__ __forceinline__ void wait_at_least(u64 addr, u64 epoch) {
    while (load_acquire(addr) < epoch) asm volatile("nanosleep.u32 64;");
}

// Copies `len` bytes (a multiple of 16) with every thread of the grid.
__device__ void grid_copy(u64 dst, u64 src, u64 len) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)dst;
    u64 n = len / 16;
    for (u64 k = blockIdx.x * (u64)blockDim.x + threadIdx.x; k < n; k += (u64)gridDim.x * blockDim.x) d[k] = s[k];
}

// The last block of the grid to get here returns true (after a system-scope fence that makes every
// block's writes visible); the counter is reset for the next launch.
__device__ bool last_block(u64 counter) {
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        u64 finished = atomicAdd((unsigned long long*)counter, 1ull);
        last = finished == gridDim.x - 1;
        if (last) {
            *(volatile u64*)counter = 0;
            asm volatile("fence.acq_rel.sys;" ::: "memory");
        }
    }
    __syncthreads();
    return last;
}

// Refit's design: every rank's launch meets the others, pushes its block, and meets them again.
// FROM: where the kernel finds its addresses. 0: its parameters. 1: the flag blocks' addresses from a
// copy of `Ranks` in device memory (as refit's kernel reads its rendezvous table). 2: every address
// from there (as refit's kernel also reads its copy descriptors).
template <int FROM>
__global__ void rendezvous_push(Ranks g, const Ranks* __restrict__ dev, u32 rank, u64 epoch) {
    auto flags = [&](u32 p) { return FROM >= 1 ? dev->flags[p] : g.flags[p]; };
    const u64 mine = flags(rank);
    if (threadIdx.x == 0) {
        for (u32 p = 0; p < g.n; ++p)
            if (p != rank) store_release(flags(p) + 8 * (ARRIVED + rank), epoch);
        for (u32 p = 0; p < g.n; ++p)
            if (p != rank) wait_at_least(mine + 8 * (ARRIVED + p), epoch);
    }
    __syncthreads();
    const Ranks& a = FROM == 2 ? *dev : g;
    for (u32 r = 0; r < g.n; ++r) grid_copy(a.recv[r] + rank * a.bytes, a.send[rank], a.bytes);
    if (!last_block(mine + 8 * COUNTER) || threadIdx.x != 0) return;
    for (u32 p = 0; p < g.n; ++p)
        if (p != rank) store_release(flags(p) + 8 * (DEPARTED + rank), epoch);
    for (u32 p = 0; p < g.n; ++p)
        if (p != rank) wait_at_least(mine + 8 * (DEPARTED + p), epoch);
}

// The same meeting with a cheaper departure: every block, once its copies are issued, adds one to a
// counter in every peer's memory with release semantics (its writes are visible before the count);
// block 0 of each rank waits until every peer's count reaches that peer's grid size. This drops the
// local counter, the second fence and the last block's extra hop of the departure above.
__global__ void rendezvous_push_counted(Ranks g, u32 rank, u64 epoch) {
    const u64 mine = g.flags[rank];
    if (threadIdx.x == 0) {
        for (u32 p = 0; p < g.n; ++p)
            if (p != rank) store_release(g.flags[p] + 8 * (ARRIVED + rank), epoch);
        for (u32 p = 0; p < g.n; ++p)
            if (p != rank) wait_at_least(mine + 8 * (ARRIVED + p), epoch);
    }
    __syncthreads();
    for (u32 r = 0; r < g.n; ++r) grid_copy(g.recv[r] + rank * g.bytes, g.send[rank], g.bytes);
    __syncthreads();
    if (threadIdx.x != 0) return;
    const u32 parity = (u32)(epoch & 1);
    for (u32 p = 0; p < g.n; ++p)
        if (p != rank)
            asm volatile("red.release.sys.global.add.u64 [%0], 1;" ::"l"(g.flags[p] + 8 * (COUNTS + 2 * rank + parity))
                         : "memory");
    if (blockIdx.x != 0) return;
    for (u32 p = 0; p < g.n; ++p) {
        if (p == rank) continue;
        // Every rank launches the same grid here. The slot is next added to at epoch + 2, after this
        // rank has arrived there, so it is free to reset now.
        const u64 count = mine + 8 * (COUNTS + 2 * p + parity);
        wait_at_least(count, gridDim.x);
        asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(count), "l"(0ull) : "memory");
    }
}

// The leader design: rank 0's launch waits for every rank's memory-operation "arrived", copies every
// block, and writes "done" into every other rank's flags, which their memory-operation waits poll.
__global__ void leader_copy(Ranks g, u64 epoch) {
    const u64 mine = g.flags[0];
    if (threadIdx.x == 0)
        for (u32 p = 1; p < g.n; ++p) wait_at_least(mine + 8 * (ARRIVED + p), epoch);
    __syncthreads();
    for (u32 p = 0; p < g.n; ++p)
        for (u32 r = 0; r < g.n; ++r) grid_copy(g.recv[r] + p * g.bytes, g.send[p], g.bytes);
    if (!last_block(mine + 8 * COUNTER) || threadIdx.x != 0) return;
    for (u32 p = 1; p < g.n; ++p) store_release(g.flags[p] + 8 * DONE, epoch);
}

__global__ void spin_gate(volatile int* open) {
    while (*open == 0) asm volatile("nanosleep.u32 256;");
}

struct Group {
    int n;
    std::vector<CUcontext> ctx;
    std::vector<cudaStream_t> streams;
    Ranks ranks;
    std::vector<Ranks*> tables;  // per rank, in its memory: a copy of `ranks`
    u64 epoch = 0;
};

static u32 blocks_for(u64 bytes) { return (u32)std::min<u64>(132, std::max<u64>(1, bytes / (16 << 10))); }

template <int FROM>
static void rendezvous_call(Group& g) {
    ++g.epoch;
    u32 blocks = blocks_for(g.ranks.bytes * g.n);
    for (int r = 0; r < g.n; ++r) {
        CK(cuCtxSetCurrent(g.ctx[r]));
        rendezvous_push<FROM><<<blocks, 256, 0, g.streams[r]>>>(g.ranks, g.tables[r], r, g.epoch);
    }
    CK(cuCtxSetCurrent(g.ctx[0]));
}

static void counted_call(Group& g) {
    ++g.epoch;
    u32 blocks = blocks_for(g.ranks.bytes * g.n);
    for (int r = 0; r < g.n; ++r) {
        CK(cuCtxSetCurrent(g.ctx[r]));
        rendezvous_push_counted<<<blocks, 256, 0, g.streams[r]>>>(g.ranks, r, g.epoch);
    }
    CK(cuCtxSetCurrent(g.ctx[0]));
}

static void leader_call(Group& g) {
    ++g.epoch;
    for (int r = 1; r < g.n; ++r) {
        CK(cuCtxSetCurrent(g.ctx[r]));
        CUstreamBatchMemOpParams ops[2] = {};
        ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        ops[0].writeValue.address = g.ranks.flags[0] + 8 * (ARRIVED + r);
        ops[0].writeValue.value64 = g.epoch;
        ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        ops[1].waitValue.address = g.ranks.flags[r] + 8 * DONE;
        ops[1].waitValue.value64 = g.epoch;
        ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
        CK(cuStreamBatchMemOp((CUstream)g.streams[r], 2, ops, 0));
    }
    CK(cuCtxSetCurrent(g.ctx[0]));
    leader_copy<<<blocks_for(g.ranks.bytes * g.n * g.n), 256, 0, g.streams[0]>>>(g.ranks, g.epoch);
}

static void sync_all(Group& g) {
    for (int r = 0; r < g.n; ++r) {
        CK(cuCtxSetCurrent(g.ctx[r]));
        CK(cudaStreamSynchronize(g.streams[r]));
    }
    CK(cuCtxSetCurrent(g.ctx[0]));
}

// Poisons every receive buffer, runs one call, and compares every byte with the sends.
static bool check(Group& g, const std::function<void(Group&)>& call) {
    u64 b = g.ranks.bytes;
    for (int r = 0; r < g.n; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaMemset((void*)g.ranks.recv[r], 0xEE, b * g.n));
        CK(cudaDeviceSynchronize());  // the group's streams do not wait for the legacy stream
    }
    CK(cuCtxSetCurrent(g.ctx[0]));
    call(g);
    sync_all(g);
    std::vector<unsigned char> want(b), got(b * g.n);
    for (int r = 0; r < g.n; ++r) {
        CK(cudaMemcpy(got.data(), (void*)g.ranks.recv[r], b * g.n, cudaMemcpyDefault));
        for (int p = 0; p < g.n; ++p) {
            CK(cudaMemcpy(want.data(), (void*)g.ranks.send[p], b, cudaMemcpyDefault));
            if (std::memcmp(want.data(), got.data() + p * b, b) != 0) return false;
        }
    }
    return true;
}

// GPU time per call (us): CALLS calls queued behind a gate on every stream, timed from the gate's
// opening to the end of every stream's work, so the host's issue time is not in it.
static double gpu_us(Group& g, const std::function<void(Group&)>& call, volatile int* gate) {
    const int CALLS = 200, ROUNDS = 5;
    std::vector<double> per_call;
    for (int round = 0; round < ROUNDS; ++round) {
        sync_all(g);
        *gate = 0;
        std::vector<cudaEvent_t> start(g.n), end(g.n);
        for (int r = 0; r < g.n; ++r) {
            CK(cuCtxSetCurrent(g.ctx[r]));
            CK(cudaEventCreate(&start[r]));
            CK(cudaEventCreate(&end[r]));
            spin_gate<<<1, 1, 0, g.streams[r]>>>(gate);
            CK(cudaEventRecord(start[r], g.streams[r]));
        }
        CK(cuCtxSetCurrent(g.ctx[0]));
        for (int k = 0; k < CALLS; ++k) call(g);
        for (int r = 0; r < g.n; ++r) {
            CK(cuCtxSetCurrent(g.ctx[r]));
            CK(cudaEventRecord(end[r], g.streams[r]));
        }
        *gate = 1;
        sync_all(g);
        float worst = 0;
        for (int r = 0; r < g.n; ++r) {
            float ms;
            CK(cudaEventElapsedTime(&ms, start[r], end[r]));
            worst = std::max(worst, ms);
            CK(cudaEventDestroy(start[r]));
            CK(cudaEventDestroy(end[r]));
        }
        per_call.push_back(worst * 1e3 / CALLS);
    }
    std::sort(per_call.begin(), per_call.end());
    return per_call[ROUNDS / 2];
}

// Host time per call (median and p90 us), draining every 100 calls outside the timed region.
static std::pair<double, double> host_us(Group& g, const std::function<void(Group&)>& call) {
    std::vector<double> samples;
    for (int k = 0; k < 10200; ++k) {
        auto t0 = std::chrono::steady_clock::now();
        call(g);
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        if (k >= 200) samples.push_back(us);
        if (k % 100 == 99) sync_all(g);
    }
    std::sort(samples.begin(), samples.end());
    return {samples[samples.size() / 2], samples[samples.size() * 9 / 10]};
}

int main(int argc, char** argv) {
    int n = 0;
    CK(cudaGetDeviceCount(&n));
    n = std::min(n, MAX_RANKS);
    if (n < 2) {
        std::fprintf(stderr, "needs 2 GPUs\n");
        return 1;
    }
    Group g;
    g.n = n;
    g.ctx.resize(n);
    g.streams.resize(n);
    const u64 MAX_BYTES = 4 << 20;
    g.ranks.n = n;
    for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaFree(nullptr));
        CK(cuCtxGetCurrent(&g.ctx[r]));
        for (int p = 0; p < n; ++p)
            if (p != r) {
                cudaError_t e = cudaDeviceEnablePeerAccess(p, 0);
                if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) CK(e);
            }
        CK(cudaStreamCreateWithFlags(&g.streams[r], cudaStreamNonBlocking));
        void *s, *rv, *f;
        CK(cudaMalloc(&s, MAX_BYTES));
        CK(cudaMalloc(&rv, MAX_BYTES * n));
        CK(cudaMalloc(&f, 8 * FLAG_WORDS));
        CK(cudaMemset(f, 0, 8 * FLAG_WORDS));
        std::vector<unsigned char> pattern(MAX_BYTES);
        for (u64 k = 0; k < MAX_BYTES; ++k) pattern[k] = (unsigned char)(k * 131 + r * 29 + 7);
        CK(cudaMemcpy(s, pattern.data(), MAX_BYTES, cudaMemcpyHostToDevice));
        g.ranks.send[r] = (u64)s;
        g.ranks.recv[r] = (u64)rv;
        g.ranks.flags[r] = (u64)f;
    }
    g.tables.resize(n);
    for (int r = 0; r < n; ++r) {
        CK(cudaSetDevice(r));
        CK(cudaMalloc((void**)&g.tables[r], sizeof(Ranks)));
    }
    CK(cudaSetDevice(0));
    CK(cuCtxSetCurrent(g.ctx[0]));
    int* gate;
    CK(cudaHostAlloc((void**)&gate, sizeof(int), cudaHostAllocMapped | cudaHostAllocPortable));

    struct Design {
        const char* name;
        std::function<void(Group&)> call;
    } designs[] = {{"rendezvous (every rank launches)", rendezvous_call<0>},
                   {"rendezvous, flag addresses from device memory", rendezvous_call<1>},
                   {"rendezvous, every address from device memory", rendezvous_call<2>},
                   {"rendezvous, departures counted in the receiver's memory", counted_call},
                   {"leader (one launch, memops)", leader_call}};
    const u64 sizes[] = {256, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
    FILE* json = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
    if (json) std::fprintf(json, "{\"gpus\": %d, \"rows\": [\n", n);
    std::printf("G = %d\n| design | per rank | byte-exact | GPU us per call | host us median | host us p90 |\n|---|---|---|---|---|---|\n", n);
    bool first = true;
    for (u64 bytes : sizes) {
        g.ranks.bytes = bytes;
        for (int r = 0; r < g.n; ++r) CK(cudaMemcpy(g.tables[r], &g.ranks, sizeof(Ranks), cudaMemcpyHostToDevice));
        for (auto& d : designs) {
            bool exact = check(g, d.call) && check(g, d.call);
            double gpu = exact ? gpu_us(g, d.call, gate) : 0;
            auto host = bytes == 256 && exact ? host_us(g, d.call) : std::make_pair(0.0, 0.0);
            std::printf("| %s | %llu B | %s | %.2f | %.2f | %.2f |\n", d.name, bytes, exact ? "yes" : "NO", gpu, host.first,
                        host.second);
            if (json)
                std::fprintf(json, "%s{\"design\": \"%s\", \"bytes\": %llu, \"exact\": %s, \"gpu_us\": %.3f, \"host_median_us\": %.3f, \"host_p90_us\": %.3f}",
                             first ? "" : ",\n", d.name, bytes, exact ? "true" : "false", gpu, host.first, host.second);
            first = false;
        }
    }
    if (json) {
        std::fprintf(json, "\n]}\n");
        std::fclose(json);
    }
    return 0;
}
