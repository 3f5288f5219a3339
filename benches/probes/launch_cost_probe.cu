// Host cost of one kernel launch, and of what could replace one, on the GPU machine.
//
// Question: the peer allgather's host time at 256 B is two launches of refit's synced copy kernel
// (3.2-4.2 us each, depending on the host: benches/gpu_allgather.rs, "host cost of one driver call").
// Is that the price of any launch on this driver, or of something about our kernel (nine
// parameters, 80 registers with a spill, a non-blocking stream)? And what do the cheaper stream
// operations cost (a stream memory operation pair, which could order a rank that launches nothing)?
// Prediction: an empty kernel costs within 10% of ours; parameters and spills do not matter.
// Result: docs/measurements.md (this probe's section); what it decided: docs/decisions.md.
// Second question: do two launches on two GPUs cost one launch when two threads issue them at once
// (the driver could serialize them on a lock of its own)? Prediction: 3.5-4 us against about 6.
//
// Build and run on the GPU machine: `gpu/run.sh probes launch_cost` (nvcc -O2 -std=c++17 -arch=native
// benches/probes/launch_cost_probe.cu -lcuda -lpthread, then the program with OUT.json). Prints a
// table and writes the medians as JSON.
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

typedef unsigned long long u64;
typedef unsigned int u32;

#define CK(call)                                                                    \
    do {                                                                            \
        CUresult rc_ = (call);                                                      \
        if (rc_ != CUDA_SUCCESS) {                                                  \
            const char* name_ = nullptr;                                            \
            cuGetErrorName(rc_, &name_);                                            \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, name_); \
            std::exit(1);                                                           \
        }                                                                           \
    } while (0)

__global__ void empty_kernel() {}

__global__ void nine_params(u64 a, u64 b, u64 c, u32 d, u32 e, u64 f, u32 g, u32 h, u64 i) {
    if (a == ~0ull) *(u64*)f = b + c + d + e + g + h + i;  // never true: keeps the parameters live
}

// Forces local memory (an indexed array the compiler cannot keep in registers).
__global__ void spilling(u64 index, u64 out) {
    volatile u64 local[64];
    for (int k = 0; k < 64; ++k) local[k] = k * index;
    if (index == ~0ull) *(u64*)out = local[index & 63];
}

static const int CALLS = 20000;

// Median and p90 host time in us of `issue`, after 200 untimed calls; `drain` runs every 100 calls
// outside the timed region so that no queue fills.
static std::pair<double, double> time_calls(const std::function<void()>& issue, const std::function<void()>& drain) {
    std::vector<double> samples;
    samples.reserve(CALLS);
    for (int call = 0; call < CALLS + 200; ++call) {
        auto start = std::chrono::steady_clock::now();
        issue();
        double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
        if (call >= 200) samples.push_back(us);
        if (call % 100 == 99) drain();
    }
    std::sort(samples.begin(), samples.end());
    return {samples[samples.size() / 2], samples[samples.size() * 9 / 10]};
}

static CUfunction function_of(const void* symbol) {
    cudaFunction_t f;
    if (cudaGetFuncBySymbol(&f, symbol) != cudaSuccess) {
        std::fprintf(stderr, "cudaGetFuncBySymbol failed\n");
        std::exit(1);
    }
    return (CUfunction)f;
}

int main(int argc, char** argv) {
    const char* json_path = argc > 1 ? argv[1] : nullptr;
    int devices = 0;
    cudaGetDeviceCount(&devices);
    cudaSetDevice(0);
    cudaFree(nullptr);  // the runtime's primary context, current from here on
    CUcontext ctx0;
    CK(cuCtxGetCurrent(&ctx0));
    CUstream nonblocking;
    CK(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING));
    CUdeviceptr flag;
    CK(cuMemAlloc(&flag, 64));
    CK(cuMemsetD8(flag, 0, 64));
    CUdeviceptr sink;
    CK(cuMemAlloc(&sink, 64));
    auto drain = [&] { CK(cuStreamSynchronize(nonblocking)); CK(cuStreamSynchronize(nullptr)); };

    CUfunction empty = function_of((const void*)empty_kernel);
    CUfunction nine = function_of((const void*)nine_params);
    CUfunction spill = function_of((const void*)spilling);
    u64 a = 1, b = 2, c = 3, f = sink, i = 9;
    u32 d = 4, e = 5, g = 7, h = 8;
    void* nine_args[] = {&a, &b, &c, &d, &e, &f, &g, &h, &i};
    u64 index = 5, out = sink;
    void* spill_args[] = {&index, &out};
    u64 value = 0;

    std::vector<std::pair<std::string, std::pair<double, double>>> rows;
    auto launch = [&](CUfunction fn, u32 blocks, CUstream stream, void** args) {
        CK(cuLaunchKernel(fn, blocks, 1, 1, 256, 1, 1, 0, stream, args, nullptr));
    };
    rows.push_back({"empty kernel, 1 block, non-blocking stream",
                    time_calls([&] { launch(empty, 1, nonblocking, nullptr); }, drain)});
    rows.push_back({"empty kernel, 132 blocks, non-blocking stream",
                    time_calls([&] { launch(empty, 132, nonblocking, nullptr); }, drain)});
    rows.push_back({"empty kernel, 1 block, legacy null stream",
                    time_calls([&] { launch(empty, 1, nullptr, nullptr); }, drain)});
    rows.push_back({"nine parameters, 1 block, non-blocking stream",
                    time_calls([&] { launch(nine, 1, nonblocking, nine_args); }, drain)});
    rows.push_back({"local-memory kernel, 1 block, non-blocking stream",
                    time_calls([&] { launch(spill, 1, nonblocking, spill_args); }, drain)});
    rows.push_back({"cuStreamWriteValue64",
                    time_calls([&] { CK(cuStreamWriteValue64(nonblocking, flag, ++value, 0)); }, drain)});
    auto write_and_wait = [&] {
        ++value;
        CUstreamBatchMemOpParams ops[2] = {};
        ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        ops[0].writeValue.address = flag;
        ops[0].writeValue.value64 = value;
        ops[1].waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        ops[1].waitValue.address = flag;
        ops[1].waitValue.value64 = value;
        ops[1].waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
        CK(cuStreamBatchMemOp(nonblocking, 2, ops, 0));
    };
    rows.push_back({"cuStreamBatchMemOp (write + wait)", time_calls(write_and_wait, drain)});
    if (devices > 1) {
        // Launching on device 1 from a thread whose current context alternates, as a whole-group
        // call does: switch, launch, switch back.
        cudaSetDevice(1);
        cudaFree(nullptr);
        CUcontext ctx1;
        CK(cuCtxGetCurrent(&ctx1));
        CUstream stream1;
        CK(cuStreamCreate(&stream1, CU_STREAM_NON_BLOCKING));
        CUfunction empty1 = function_of((const void*)empty_kernel);  // functions belong to a context
        CK(cuCtxSetCurrent(ctx0));
        auto drain2 = [&] {
            drain();
            CK(cuCtxSetCurrent(ctx1));
            CK(cuStreamSynchronize(stream1));
            CK(cuCtxSetCurrent(ctx0));
        };
        auto both_devices = [&] {
            launch(empty, 1, nonblocking, nullptr);
            CK(cuCtxSetCurrent(ctx1));
            launch(empty1, 1, stream1, nullptr);
            CK(cuCtxSetCurrent(ctx0));
        };
        rows.push_back({"empty kernel on GPU 0 then GPU 1 (two launches, two switches)", time_calls(both_devices, drain2)});

        // The same two launches issued at once: GPU 1's by a helper thread with its context bound,
        // which spins on a counter for the next call (the hand-over a group's rank threads do).
        std::atomic<u64> posted{0}, launched{0};
        std::atomic<bool> stop{false};
        std::thread helper([&] {
            CK(cuCtxSetCurrent(ctx1));
            u64 seen = 0;
            while (!stop.load(std::memory_order_acquire)) {
                if (posted.load(std::memory_order_acquire) == seen) continue;
                ++seen;
                launch(empty1, 1, stream1, nullptr);
                launched.store(seen, std::memory_order_release);
            }
        });
        u64 calls = 0;
        auto both_at_once = [&] {
            posted.store(++calls, std::memory_order_release);
            launch(empty, 1, nonblocking, nullptr);
            while (launched.load(std::memory_order_acquire) != calls) {
            }
        };
        rows.push_back({"empty kernel on GPU 0 and, at once, on GPU 1 from a spinning thread", time_calls(both_at_once, drain2)});
        stop.store(true, std::memory_order_release);
        helper.join();
    }

    std::printf("| call | median us | p90 us |\n|---|---|---|\n");
    for (auto& row : rows) std::printf("| %s | %.3f | %.3f |\n", row.first.c_str(), row.second.first, row.second.second);
    if (json_path) {
        FILE* json = std::fopen(json_path, "w");
        std::fprintf(json, "{\n  \"host_us\": [\n");
        for (size_t k = 0; k < rows.size(); ++k)
            std::fprintf(json, "    {\"call\": \"%s\", \"median\": %.4f, \"p90\": %.4f}%s\n", rows[k].first.c_str(),
                         rows[k].second.first, rows[k].second.second, k + 1 < rows.size() ? "," : "");
        std::fprintf(json, "  ]\n}\n");
        std::fclose(json);
    }
    return 0;
}
