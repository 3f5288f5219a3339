// A CUDA launch run on the CPU, for building refit's kernel sources as host C++ in CI (no GPU).
//
// Every thread of a block is a coroutine (ucontext) on the calling OS thread; the block's threads run
// one at a time and switch only where a kernel waits for others: __syncthreads, the warp shuffles and
// __syncwarp. So a kernel that communicates within a warp or a block computes here what it computes on
// the GPU, and a kernel whose threads wait for something that never comes (a shuffle with a lane
// missing, a barrier not every thread reaches) is reported as a deadlock instead of hanging. Blocks run
// one after another. Atomics are plain read-modify-writes: only one coroutine runs at a time.
#pragma once

#include <ucontext.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <utility>
#include <vector>

struct refit_dim3 {
    unsigned x, y, z;
};
// thread_local: cargo runs tests on several OS threads at once.
static thread_local refit_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__ __restrict
// Block-shared arrays: one per OS thread, shared by the block's coroutines (blocks run one at a time).
#define __shared__ static thread_local

namespace emu {

struct Thread {
    ucontext_t context;
    refit_dim3 index;
    bool done = false;
    uint64_t barriers = 0;                                  // __syncthreads calls made
    std::map<uint32_t, uint64_t> syncs;                     // warp mask -> warp syncs made with it
    std::map<std::pair<uint32_t, uint64_t>, uint64_t> posted;  // (mask, sync) -> value offered
};

struct Block {
    std::vector<Thread> threads;
    ucontext_t scheduler;
    size_t current = 0;
    uint64_t events = 0;  // grows whenever a thread arrives somewhere or finishes: progress
    std::function<void()> body;
};

static thread_local Block* block = nullptr;

inline Thread& me() { return block->threads[block->current]; }

inline void yield() { swapcontext(&me().context, &block->scheduler); }

inline void trampoline() {
    block->body();
    me().done = true;
    block->events++;
}

// Kept out of line: getcontext returns twice, which the caller's locals must not see.
__attribute__((noinline)) inline void start(Thread& th, std::vector<char>& stack, ucontext_t* link) {
    getcontext(&th.context);
    th.context.uc_stack.ss_sp = stack.data();
    th.context.uc_stack.ss_size = stack.size();
    th.context.uc_link = link;
    makecontext(&th.context, trampoline, 0);
}

// Runs `body` as `blocks` blocks of `threads` threads (1-D).
inline void launch(unsigned blocks, unsigned threads, std::function<void()> body) {
    Block b;
    b.body = std::move(body);
    b.threads.resize(threads);
    // Coroutine stacks, kept per OS thread from one launch to the next (allocating them is most of a
    // small launch's time).
    static thread_local std::vector<std::vector<char>> stacks;
    while (stacks.size() < threads) stacks.emplace_back(64 * 1024);
    Block* outer = block;
    block = &b;
    gridDim = {blocks, 1, 1};
    blockDim = {threads, 1, 1};
    for (unsigned bx = 0; bx < blocks; ++bx) {
        blockIdx = {bx, 0, 0};
        for (unsigned t = 0; t < threads; ++t) {
            Thread& th = b.threads[t];
            th = Thread();
            th.index = {t, 0, 0};
            start(th, stacks[t], &b.scheduler);
        }
        for (;;) {
            bool any = false;
            const uint64_t before = b.events;
            for (unsigned t = 0; t < threads; ++t) {
                if (b.threads[t].done) continue;
                any = true;
                b.current = t;
                threadIdx = b.threads[t].index;
                swapcontext(&b.scheduler, &b.threads[t].context);
            }
            if (!any) break;
            if (b.events == before) {
                fprintf(stderr, "emulated launch: block %u deadlocked (threads wait for each other forever)\n", bx);
                abort();
            }
        }
    }
    block = outer;
}

inline Thread& thread_at(unsigned index) { return block->threads[index]; }

// Waits until every lane of `mask` in this warp has made its `n`-th sync with `mask`.
inline void wait_for_lanes(uint32_t mask, uint64_t n) {
    const unsigned warp_base = threadIdx.x & ~31u;
    for (;;) {
        bool all = true;
        for (unsigned lane = 0; lane < 32; ++lane) {
            if (!((mask >> lane) & 1)) continue;
            Thread& other = thread_at(warp_base + lane);
            auto it = other.syncs.find(mask);
            if (it != other.syncs.end() && it->second >= n) continue;
            if (other.done) {
                fprintf(stderr, "emulated launch: lane %u exited before a warp sync with mask %#x\n", lane, mask);
                abort();
            }
            all = false;
        }
        if (all) return;
        yield();
    }
}

// Offers `value` at this lane's next sync with `mask`, waits for the other lanes, returns the number
// of that sync.
inline uint64_t arrive(uint32_t mask, uint64_t value) {
    const unsigned lane = threadIdx.x & 31u;
    if (!((mask >> lane) & 1)) {
        fprintf(stderr, "emulated launch: lane %u syncs with mask %#x that excludes it\n", lane, mask);
        abort();
    }
    const uint64_t n = ++me().syncs[mask];
    me().posted[{mask, n}] = value;
    block->events++;
    wait_for_lanes(mask, n);
    return n;
}

inline uint64_t shfl_xor(uint32_t mask, uint64_t value, unsigned lane_mask, unsigned width) {
    const uint64_t n = arrive(mask, value);
    const unsigned lane = threadIdx.x & 31u;
    const unsigned source = (lane & ~(width - 1)) | ((lane ^ lane_mask) & (width - 1));
    Thread& other = thread_at((threadIdx.x & ~31u) + source);
    return other.posted.at({mask, n});
}

}  // namespace emu

inline void __syncthreads() {
    const uint64_t n = ++emu::me().barriers;
    emu::block->events++;
    for (;;) {
        bool all = true;
        for (auto& t : emu::block->threads) {
            if (!t.done && t.barriers < n) all = false;
        }
        if (all) return;
        emu::yield();
    }
}

inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::arrive(mask, 0); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffles move at most 64 bits");
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof(T));
    bits = emu::shfl_xor(mask, bits, (unsigned)lane_mask, (unsigned)width);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}

template <typename T>
inline T __ldg(const T* p) {
    return *p;
}

template <typename T>
inline T atomicXor(T* p, T v) {
    T old = *p;
    *p = old ^ v;
    return old;
}

template <typename T>
inline T atomicMin(T* p, T v) {
    T old = *p;
    if (v < old) *p = v;
    return old;
}

template <typename T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
