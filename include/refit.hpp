/*
 * refit.hpp: a header-only C++17 wrapper over the C API in refit.h.
 *
 * - Every handle (refit::Group, Table, Plan, PreparedCopy, HostStream, Comm, Executor) owns what it
 *   wraps: it is move-only, releases the handle in its destructor, and a moved-from object holds
 *   nothing (get() == nullptr; any call on it throws refit::Error with REFIT_STATUS_INVALID_STATE;
 *   passing it as an argument to another object's call throws REFIT_STATUS_NULL_ARGUMENT).
 * - Options structs are the C ones, filled with the library's defaults by refit::executor_options(),
 *   comm_options() and plan_options() (the *_options_init calls), so fields appended later keep their
 *   defaults; change fields, then pass the struct.
 * - A failing call throws refit::Error, carrying the refit_status and the library's message
 *   (refit_last_error_message() of the calling thread). Arguments the C API cannot check (the lengths
 *   of the vectors passed in) are checked here and throw REFIT_STATUS_INVALID_ARGUMENT.
 * - Thread-safety and stream ordering are those of the C functions each method names (refit.h).
 *
 * Link with librefit (pkg-config refit, or CMake's refit::refit) and compile as C++17 or later.
 */
#ifndef REFIT_HPP
#define REFIT_HPP

#if !defined(__cplusplus) || __cplusplus < 201703L
#error "refit.hpp needs C++17 or later; from C, include refit.h"
#endif

#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "refit.h"

namespace refit {

/// A refit call failed: status() is the refit_status it returned, message() the library's reason.
class Error : public std::runtime_error {
 public:
  Error(refit_status status, std::string message)
      : std::runtime_error(std::string(refit_status_string(status)) + ": " + message),
        status_(status),
        message_(std::move(message)) {}

  refit_status status() const noexcept { return status_; }
  const std::string &message() const noexcept { return message_; }

 private:
  refit_status status_;
  std::string message_;
};

/// Throws refit::Error (with this thread's last error message) unless `status` is SUCCESS.
inline void check(refit_status status) {
  if (status != REFIT_STATUS_SUCCESS) {
    const char *message = refit_last_error_message();
    throw Error(status, message ? message : "");
  }
}

/// refit_version(): the library's "MAJOR.MINOR.PATCH".
inline std::string version() { return refit_version(); }

/// refit_abi_version() of the loaded library; REFIT_ABI_VERSION is the header's.
inline uint32_t abi_version() noexcept { return refit_abi_version(); }

namespace detail {

/// Unique ownership of a C handle released by `Destroy` (which accepts NULL).
template <typename T, void (*Destroy)(T *)>
class Owned {
 public:
  Owned() noexcept = default;
  explicit Owned(T *raw) noexcept : raw_(raw) {}
  Owned(const Owned &) = delete;
  Owned &operator=(const Owned &) = delete;
  Owned(Owned &&other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
  Owned &operator=(Owned &&other) noexcept {
    if (this != &other) {
      Destroy(raw_);
      raw_ = std::exchange(other.raw_, nullptr);
    }
    return *this;
  }
  ~Owned() { Destroy(raw_); }

  /// The raw handle, still owned by this object (nullptr once moved from).
  T *get() const noexcept { return raw_; }
  /// Gives up ownership: the caller destroys the returned handle.
  T *release() noexcept { return std::exchange(raw_, nullptr); }
  explicit operator bool() const noexcept { return raw_ != nullptr; }

  /// The handle, or INVALID_STATE when this object was moved from.
  T *live(const char *what) const {
    if (!raw_) throw Error(REFIT_STATUS_INVALID_STATE, std::string("this ") + what + " was moved from");
    return raw_;
  }

 private:
  T *raw_ = nullptr;
};

inline void destroy_host_stream(void *stream) {
  // Only a live host stream is ever stored, so this cannot fail; a destructor could not report it.
  if (stream) (void)refit_host_stream_destroy(stream);
}

/// Throws INVALID_ARGUMENT unless the vector `what` has `expected` entries, one per `unit` of `whole`
/// (the C API reads exactly that many, so a shorter vector would be read past its end).
inline void same_length(std::size_t expected, std::size_t got, const char *what, const char *whole, const char *unit) {
  if (expected != got) {
    throw Error(REFIT_STATUS_INVALID_ARGUMENT, std::string(what) + " has " + std::to_string(got) + " entries; " +
                                                   whole + " has " + std::to_string(expected) + " " + unit);
  }
}

inline void box_length(std::size_t ndim, std::size_t got, const char *what) {
  same_length(ndim, got, what, "the box", "dimensions");
}

}  // namespace detail

/// refit_executor_options_init: the defaults (REFIT_ARM_AUTO, no SM cap, no verify, REFIT_COMMIT_DIRECT).
inline refit_executor_options executor_options() {
  refit_executor_options options;
  check(refit_executor_options_init(&options));
  return options;
}

/// refit_comm_options_init: the defaults (ten minutes' timeout, 256 MiB of staging, CUDA IPC on,
/// allgather counts compared on CUDA).
inline refit_comm_options comm_options() {
  refit_comm_options options;
  check(refit_comm_options_init(&options));
  return options;
}

/// refit_plan_options_init, then `policy` (a REFIT_POLICY_*) and `coalesce`.
inline refit_plan_options plan_options(uint32_t policy = REFIT_POLICY_LOCAL, bool coalesce = true) {
  refit_plan_options options;
  check(refit_plan_options_init(&options));
  options.policy = policy;
  options.coalesce = coalesce;
  return options;
}

/// A caller-side stream of the host backend (refit_host_stream_create). Destroying it waits for the
/// work queued on it.
class HostStream {
 public:
  HostStream() {
    void *raw = nullptr;
    check(refit_host_stream_create(&raw));
    handle_ = Handle(raw);
  }
  /// The stream, to pass where a CUstream is taken.
  void *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<void, detail::destroy_host_stream>;
  Handle handle_;
};

/// A batch of segments prepared once for one rank's device (refit_copy_batch_prepare).
class PreparedCopy {
 public:
  explicit PreparedCopy(refit_prepared_copy *raw) noexcept : handle_(raw) {}
  /// refit_copy_batch_launch: queues the batch on `stream` (nullptr: the device's legacy default).
  void launch(void *stream = nullptr) const { check(refit_copy_batch_launch(handle_.live("prepared copy"), stream)); }
  refit_prepared_copy *get() const noexcept { return handle_.get(); }

 private:
  detail::Owned<refit_prepared_copy, refit_copy_batch_destroy> handle_;
};

/// One rank per device, each with its own stream and thread (refit_group). Use from one thread at a
/// time, except as refit.h says for calls from run() callbacks.
/// A refit_quantization: `target` REFIT_FP8_*, `granularity` REFIT_QUANT_*; the block shape is used
/// for REFIT_QUANT_BLOCK only (128 x 128 by default) and left 0 x 0 for the others, as the C call wants.
inline refit_quantization quantization(uint32_t target, uint32_t granularity, uint32_t block_rows = 128,
                                       uint32_t block_cols = 128) {
  const bool block = granularity == REFIT_QUANT_BLOCK;
  return refit_quantization{target, granularity, block ? block_rows : 0u, block ? block_cols : 0u};
}

class Group {
 public:
  /// refit_group_create: rank r is `devices[r]`; `backend` is a REFIT_BACKEND_*; `host_devices` is
  /// how many devices the host backend simulates (0: the largest listed + 1).
  explicit Group(const std::vector<int32_t> &devices, uint32_t backend = REFIT_BACKEND_AUTO,
                 uint32_t host_devices = 0) {
    refit_group_options options;
    check(refit_group_options_init(&options));
    options.backend = backend;
    options.host_devices = host_devices;
    refit_group *raw = nullptr;
    check(refit_group_create(devices.data(), devices.size(), &options, &raw));
    handle_ = Handle(raw);
  }

  std::size_t size() const {
    std::size_t n = 0;
    check(refit_group_size(live(), &n));
    return n;
  }
  int32_t device(uint32_t rank) const {
    int32_t d = 0;
    check(refit_group_device(live(), rank, &d));
    return d;
  }
  /// refit_group_rank_of: the rank whose device is `device` (throws INVALID_ARGUMENT when the group
  /// has no such device).
  uint32_t rank_of(int32_t device) const {
    uint32_t r = 0;
    check(refit_group_rank_of(live(), device, &r));
    return r;
  }
  /// The group's own stream of `rank` (owned by the group).
  void *stream(uint32_t rank) const {
    void *s = nullptr;
    check(refit_group_stream(live(), rank, &s));
    return s;
  }
  bool peer_access(uint32_t rank, uint32_t peer) const {
    bool direct = false;
    check(refit_group_peer_access(live(), rank, peer, &direct));
    return direct;
  }
  /// REFIT_BACKEND_CUDA or REFIT_BACKEND_HOST.
  uint32_t backend() const {
    uint32_t b = 0;
    check(refit_group_backend(live(), &b));
    return b;
  }

  /// refit_group_enter: each rank's stream waits for `caller_streams[rank]` (empty: every device's
  /// legacy default stream).
  void enter(const std::vector<void *> &caller_streams = {}) {
    if (caller_streams.empty()) {
      check(refit_group_enter(live(), nullptr));
      return;
    }
    detail::same_length(size(), caller_streams.size(), "caller_streams", "the group", "ranks");
    check(refit_group_enter(live(), caller_streams.data()));
  }
  /// refit_group_exit with REFIT_EXIT_SYNC or REFIT_EXIT_ASYNC.
  void exit(uint32_t mode = REFIT_EXIT_SYNC) { check(refit_group_exit(live(), mode)); }

  /// A scope that exit()s when it ends (errors there are dropped: call close() to see them).
  class Scope {
   public:
    Scope(Group &group, const std::vector<void *> &caller_streams, uint32_t mode) : group_(&group), mode_(mode) {
      group.enter(caller_streams);
    }
    Scope(const Scope &) = delete;
    Scope &operator=(const Scope &) = delete;
    Scope(Scope &&other) noexcept : group_(std::exchange(other.group_, nullptr)), mode_(other.mode_) {}
    Scope &operator=(Scope &&) = delete;
    ~Scope() {
      if (group_) (void)refit_group_exit(group_->get(), mode_);
    }
    /// Exits now, throwing what refit_group_exit returned (INVALID_STATE when already closed).
    void close() {
      if (!group_) throw Error(REFIT_STATUS_INVALID_STATE, "this scope is already closed");
      std::exchange(group_, nullptr)->exit(mode_);
    }

   private:
    Group *group_;
    uint32_t mode_;
  };
  Scope scope(const std::vector<void *> &caller_streams = {}, uint32_t mode = REFIT_EXIT_SYNC) {
    return Scope(*this, caller_streams, mode);
  }

  /// refit_group_run: calls `fn(rank, stream)` once per rank on the rank threads and returns when all
  /// have. An exception thrown by `fn` fails its rank (ranks waiting in allgather_rank are released);
  /// the first one thrown is rethrown here, else a failed run throws refit::Error.
  template <typename Fn>
  void run(Fn &&fn) {
    struct Context {
      std::remove_reference_t<Fn> *fn;
      std::mutex lock;
      std::exception_ptr first;
    } context{&fn, {}, nullptr};
    auto trampoline = [](uint32_t rank, void *stream, void *user_data) -> int32_t {
      auto *c = static_cast<Context *>(user_data);
      try {
        (*c->fn)(rank, stream);
        return REFIT_STATUS_SUCCESS;
      } catch (...) {  // nothing may unwind into the library
        std::lock_guard<std::mutex> guard(c->lock);
        if (!c->first) c->first = std::current_exception();
        return REFIT_STATUS_CALLBACK_FAILED;
      }
    };
    refit_status status = refit_group_run(live(), trampoline, &context);
    if (context.first) std::rethrow_exception(context.first);
    check(status);
  }

  /// refit_allgather: rank r sends counts[r] bytes from send[r]; recv[r] receives every block.
  /// Returns the REFIT_ALLGATHER_* that ran.
  uint32_t allgather(const std::vector<uint64_t> &send, const std::vector<uint64_t> &recv,
                     const std::vector<std::size_t> &counts, uint32_t algorithm = REFIT_ALLGATHER_AUTO) {
    std::size_t n = size();
    detail::same_length(n, send.size(), "send", "the group", "ranks");
    detail::same_length(n, recv.size(), "recv", "the group", "ranks");
    detail::same_length(n, counts.size(), "counts", "the group", "ranks");
    uint32_t picked = 0;
    check(refit_allgather(live(), send.data(), recv.data(), counts.data(), algorithm, &picked));
    return picked;
  }

  /// refit_group_allgather_rank, from a run() callback only.
  uint32_t allgather_rank(uint32_t rank, uint64_t send, uint64_t recv, const std::vector<std::size_t> &counts,
                          uint32_t algorithm = REFIT_ALLGATHER_AUTO) {
    detail::same_length(size(), counts.size(), "counts", "the group", "ranks");
    uint32_t picked = 0;
    check(refit_group_allgather_rank(live(), rank, send, recv, counts.data(), algorithm, &picked));
    return picked;
  }

  /// refit_copy_batch: `segments` in one launch on `stream` of `rank`'s device.
  void copy_batch(uint32_t rank, const std::vector<refit_segment> &segments, void *stream = nullptr,
                  uint32_t flags = 0) const {
    check(refit_copy_batch(live(), rank, stream, segments.data(), segments.size(), flags));
  }

  /// refit_digest: the digest of the `len` bytes at `addr` on `rank`'s device, computed on `stream`
  /// (nullptr: the device's legacy default); waits for it, so the bytes may change once it returns.
  uint64_t digest(uint32_t rank, uint64_t addr, uint64_t len, void *stream = nullptr) const {
    uint64_t value = 0;
    check(refit_digest(live(), rank, addr, len, stream, &value));
    return value;
  }

  /// refit_digest_many: the digest of each range (`lens[i]` bytes at `addrs[i]`) on `rank`'s device, in
  /// one pass on `stream` (nullptr: the device's legacy default); each equals digest() of that range.
  /// Waits for the stream. No ranges: an empty vector, nothing queued. The lists must be equally long
  /// (else refit::Error INVALID_ARGUMENT, before any call).
  std::vector<uint64_t> digest_many(uint32_t rank, const std::vector<uint64_t> &addrs,
                                    const std::vector<uint64_t> &lens, void *stream = nullptr) const {
    detail::same_length(addrs.size(), lens.size(), "lens", "addrs", "entries");
    std::vector<uint64_t> values(addrs.size());
    check(refit_digest_many(live(), rank, addrs.data(), lens.data(), addrs.size(), stream, values.data()));
    return values;
  }

  /// refit_quantize_batch: every job quantized to FP8 with its scales on `stream` of `rank`'s device
  /// (nullptr: the device's legacy default); see refit::quantization for the description.
  void quantize_batch(uint32_t rank, const std::vector<refit_quantize_job> &jobs, void *stream = nullptr) const {
    check(refit_quantize_batch(live(), rank, stream, jobs.data(), jobs.size(), 0));
  }

  /// refit_copy_batch_prepare.
  PreparedCopy prepare_copy(uint32_t rank, const std::vector<refit_segment> &segments, uint32_t flags = 0) const {
    refit_prepared_copy *raw = nullptr;
    check(refit_copy_batch_prepare(live(), rank, segments.data(), segments.size(), flags, &raw));
    return PreparedCopy(raw);
  }

  refit_group *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<refit_group, refit_group_destroy>;
  refit_group *live() const { return handle_.live("group"); }
  Handle handle_;
};

/// One rank's shard table (refit_table). Not for concurrent use from several threads.
class Table {
 public:
  Table() {
    refit_table *raw = nullptr;
    check(refit_table_create(&raw));
    handle_ = Handle(raw);
  }
  /// Takes ownership of `raw` (from refit_table_create or refit_table_decode).
  explicit Table(refit_table *raw) noexcept : handle_(raw) {}

  /// refit_table_decode: a table from bytes encode() wrote, in any process.
  static Table decode(const uint8_t *bytes, std::size_t len) {
    refit_table *raw = nullptr;
    check(refit_table_decode(bytes, len, &raw));
    return Table(raw);
  }
  static Table decode(const std::vector<uint8_t> &bytes) { return decode(bytes.data(), bytes.size()); }

  /// refit_table_add_tensor: returns the tensor's index in this table.
  uint32_t add_tensor(const std::string &name, const std::vector<uint64_t> &shape, uint32_t elem_size,
                      uint32_t dtype = 0) {
    uint32_t index = 0;
    check(refit_table_add_tensor(live(), name.c_str(), dtype, elem_size, shape.data(), shape.size(), &index));
    return index;
  }

  /// refit_table_add_offer: the box `offset`/`extent` of tensor `tensor` held by (`rank`, `device`) at
  /// `addr` with element `strides` (empty: row-major over `extent`).
  void add_offer(uint32_t tensor, uint32_t rank, uint32_t device, uint64_t addr, const std::vector<uint64_t> &offset,
                 const std::vector<uint64_t> &extent, const std::vector<uint64_t> &strides = {},
                 std::optional<uint64_t> digest = std::nullopt) {
    detail::box_length(offset.size(), extent.size(), "extent");
    if (!strides.empty()) detail::box_length(offset.size(), strides.size(), "strides");
    check(refit_table_add_offer(live(), tensor, rank, device, addr, offset.data(), extent.data(),
                                strides.empty() ? nullptr : strides.data(), offset.size(),
                                digest ? &*digest : nullptr));
  }

  /// refit_table_add_need: the box `offset`/`extent` written at `addr` with destination element
  /// `strides`; destination dimension d is tensor dimension perm[d] (empty: the identity).
  void add_need(uint32_t tensor, uint32_t rank, uint32_t device, uint64_t addr, const std::vector<uint64_t> &offset,
                const std::vector<uint64_t> &extent, const std::vector<uint64_t> &strides,
                const std::vector<uint32_t> &perm = {}) {
    detail::box_length(offset.size(), extent.size(), "extent");
    detail::box_length(offset.size(), strides.size(), "strides");
    if (!perm.empty()) detail::box_length(offset.size(), perm.size(), "perm");
    check(refit_table_add_need(live(), tensor, rank, device, addr, offset.data(), extent.data(),
                               perm.empty() ? nullptr : perm.data(), strides.data(), offset.size()));
  }

  /// refit_table_add_quantized_need: the box `offset`/`extent` as FP8 codes at `addr` (byte `strides`,
  /// the last 1) and scales, quantized as `quantization` says (see refit_need_quantization).
  void add_quantized_need(uint32_t tensor, uint32_t rank, uint32_t device, uint64_t addr,
                          const std::vector<uint64_t> &offset, const std::vector<uint64_t> &extent,
                          const std::vector<uint64_t> &strides, const refit_need_quantization &quantization) {
    detail::box_length(offset.size(), extent.size(), "extent");
    detail::box_length(offset.size(), strides.size(), "strides");
    check(refit_table_add_quantized_need(live(), tensor, rank, device, addr, offset.data(), extent.data(),
                                         strides.data(), offset.size(), &quantization));
  }

  /// refit_table_share_amax: the scales starting at `scale` of process `rank` share their amax with
  /// every scale any table gives `key` (nonzero): per tensor, the amax of all the needs writing any
  /// of them; per row, each row's amax over all of them.
  void share_amax(uint32_t rank, uint64_t scale, uint64_t key) {
    check(refit_table_share_amax(live(), rank, scale, key));
  }

  /// refit_table_encode: the table's versioned wire encoding.
  std::vector<uint8_t> encode() const {
    std::size_t size = 0;
    check(refit_table_encoded_size(live(), &size));
    std::vector<uint8_t> bytes(size);
    std::size_t written = 0;
    check(refit_table_encode(live(), bytes.data(), bytes.size(), &written));
    bytes.resize(written);
    return bytes;
  }

  refit_table *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<refit_table, refit_table_destroy>;
  refit_table *live() const { return handle_.live("table"); }
  Handle handle_;
};

/// One rank of a communicator between processes (refit_comm). Calls are made by one thread at a time,
/// in the same order on every rank; abort() from any thread at any time.
class Comm {
 public:
  /// Takes ownership of `raw` (from refit_comm_create or refit_comm_adopt).
  explicit Comm(refit_comm *raw) noexcept : handle_(raw) {}

  /// refit_comm_create: joins communicator `id` as `rank` of `nranks` on `device`; blocks until every
  /// rank has joined (at most options.timeout_ms). Throws INVALID_ARGUMENT at once for an id with any
  /// byte changed, a rank another process holds, and on the host backend an id with another secret or
  /// a spent one (an id forms one communicator; see refit.h).
  Comm(const refit_comm_id &id, uint32_t nranks, uint32_t rank, int32_t device,
       const refit_comm_options &options = comm_options()) {
    refit_comm *raw = nullptr;
    check(refit_comm_create(&id, nranks, rank, device, &options, &raw));
    handle_ = Handle(raw);
  }

  /// refit_comm_get_unique_id: the id one process makes and hands to every rank by its own means; good
  /// for one communicator, and this process must live until every rank has joined.
  static refit_comm_id unique_id(uint32_t backend = REFIT_BACKEND_AUTO) {
    refit_comm_id id;
    check(refit_comm_get_unique_id(backend, &id));
    return id;
  }

  /// refit_comm_adopt: wraps an ncclComm_t the caller keeps owning (it must outlive this object).
  static Comm adopt(void *nccl_comm, const refit_comm_options &options = comm_options()) {
    refit_comm *raw = nullptr;
    check(refit_comm_adopt(nccl_comm, &options, &raw));
    return Comm(raw);
  }

  uint32_t rank() const {
    uint32_t r = 0;
    check(refit_comm_rank(live(), &r));
    return r;
  }
  uint32_t size() const {
    uint32_t n = 0;
    check(refit_comm_size(live(), &n));
    return n;
  }
  int32_t device() const {
    int32_t d = 0;
    check(refit_comm_device(live(), &d));
    return d;
  }
  /// REFIT_BACKEND_CUDA or REFIT_BACKEND_HOST.
  uint32_t backend() const {
    uint32_t b = 0;
    check(refit_comm_backend(live(), &b));
    return b;
  }

  /// refit_comm_allgather: this rank's counts[rank()] bytes at `send`; `recv` receives every rank's
  /// block in rank order. Queued on `stream` (nullptr: see refit.h); synchronize() reports failures,
  /// and on the host backend a refusal of counts that differ between ranks (once; the communicator
  /// stays usable).
  void allgather(uint64_t send, uint64_t recv, const std::vector<std::size_t> &counts, void *stream = nullptr) {
    detail::same_length(size(), counts.size(), "counts", "the communicator", "ranks");
    check(refit_comm_allgather(live(), send, recv, counts.data(), stream));
  }

  /// refit_comm_synchronize: waits for `stream`, then throws the communicator's failure, if any.
  void synchronize(void *stream = nullptr) { check(refit_comm_synchronize(live(), stream)); }

  /// refit_comm_abort: any thread, any time; later calls throw REFIT_STATUS_ABORTED.
  void abort() { check(refit_comm_abort(live())); }

  refit_comm *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<refit_comm, refit_comm_destroy>;
  refit_comm *live() const { return handle_.live("communicator"); }
  Handle handle_;
};

/// Every segment from one source endpoint to one destination endpoint of a plan, copied out of it.
struct Route {
  uint32_t src_rank = 0, src_device = 0, dst_rank = 0, dst_device = 0;
  uint32_t kind = REFIT_ROUTE_LOCAL;  // REFIT_ROUTE_*
  std::vector<refit_segment> segments;
};

/// The quantization one device runs for one quantized need, copied out of a plan
/// (refit_quant_route_info; `path` REFIT_PATH_*).
struct QuantRoute {
  std::string tensor;
  uint32_t receiver_rank = 0, receiver_device = 0, runner_rank = 0, runner_device = 0;
  uint32_t path = REFIT_PATH_IN_PLACE;
  uint64_t need = 0, jobs = 0, elements = 0, source_bytes = 0;
};

/// A built reshard plan (refit_plan): immutable, so any thread may read it.
class Plan {
 public:
  explicit Plan(refit_plan *raw) noexcept : handle_(raw) {}

  /// refit_plan_build over every rank's table, in any order.
  static Plan build(const std::vector<const Table *> &tables, uint32_t policy = REFIT_POLICY_LOCAL,
                    bool coalesce = true) {
    std::vector<const refit_table *> raw = raw_tables(tables);
    refit_plan_options options = plan_options(policy, coalesce);
    refit_plan *plan = nullptr;
    check(refit_plan_build(raw.data(), raw.size(), &options, &plan));
    return Plan(plan);
  }

  /// refit_plan_build_share: the routes process `process` takes part in, from every process's table.
  static Plan build_share(const std::vector<const Table *> &tables, uint32_t process,
                          uint32_t policy = REFIT_POLICY_LOCAL, bool coalesce = true) {
    std::vector<const refit_table *> raw = raw_tables(tables);
    refit_plan_options options = plan_options(policy, coalesce);
    refit_plan *plan = nullptr;
    check(refit_plan_build_share(raw.data(), raw.size(), process, &options, &plan));
    return Plan(plan);
  }

  /// refit_plan_build_across: this rank's share of one plan over `comm`, from this process's own
  /// `table` (a collective call: every rank makes it, with the same policy and coalescing).
  static Plan build_across(Comm &comm, const Table &table, uint32_t policy = REFIT_POLICY_LOCAL,
                           bool coalesce = true) {
    refit_plan_options options = plan_options(policy, coalesce);
    refit_plan *plan = nullptr;
    check(refit_plan_build_across(comm.get(), table.get(), &options, &plan));
    return Plan(plan);
  }

  /// refit_plan_get_stats.
  refit_plan_stats stats() const {
    refit_plan_stats s{};
    s.size = sizeof(s);
    check(refit_plan_get_stats(live(), &s));
    return s;
  }
  /// refit_plan_get_receiver_stats.
  refit_plan_stats receiver_stats(uint32_t rank, uint32_t device) const {
    refit_plan_stats s{};
    s.size = sizeof(s);
    check(refit_plan_get_receiver_stats(live(), rank, device, &s));
    return s;
  }
  uint64_t fingerprint() const {
    uint64_t f = 0;
    check(refit_plan_fingerprint(live(), &f));
    return f;
  }
  /// refit_plan_inputs_fingerprint: equal in every process's share built from the same inputs.
  uint64_t inputs_fingerprint() const {
    uint64_t f = 0;
    check(refit_plan_inputs_fingerprint(live(), &f));
    return f;
  }
  std::size_t route_count() const {
    std::size_t n = 0;
    check(refit_plan_route_count(live(), &n));
    return n;
  }
  /// refit_plan_route, with its segments copied so they outlive the plan.
  Route route(std::size_t index) const {
    refit_route_info info{};
    info.size = sizeof(info);
    check(refit_plan_route(live(), index, &info));
    Route r;
    r.src_rank = info.src_rank;
    r.src_device = info.src_device;
    r.dst_rank = info.dst_rank;
    r.dst_device = info.dst_device;
    r.kind = info.kind;
    r.segments.assign(info.segments, info.segments + info.segment_count);
    return r;
  }
  std::vector<Route> routes() const {
    std::vector<Route> all;
    std::size_t n = route_count();
    all.reserve(n);
    for (std::size_t i = 0; i < n; i++) all.push_back(route(i));
    return all;
  }

  /// refit_plan_quant_route_count and refit_plan_quant_route: which path each quantized need took,
  /// per quantizing device.
  std::vector<QuantRoute> quant_routes() const {
    std::size_t n = 0;
    check(refit_plan_quant_route_count(live(), &n));
    std::vector<QuantRoute> all;
    all.reserve(n);
    for (std::size_t i = 0; i < n; i++) {
      refit_quant_route_info info{};
      info.size = sizeof(info);
      check(refit_plan_quant_route(live(), i, &info));
      all.push_back(QuantRoute{info.tensor, info.receiver_rank, info.receiver_device, info.runner_rank,
                               info.runner_device, info.path, info.need, info.jobs, info.elements,
                               info.source_bytes});
    }
    return all;
  }

  refit_plan *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<refit_plan, refit_plan_destroy>;
  refit_plan *live() const { return handle_.live("plan"); }
  static std::vector<const refit_table *> raw_tables(const std::vector<const Table *> &tables) {
    std::vector<const refit_table *> raw;
    raw.reserve(tables.size());
    for (const Table *table : tables) {
      if (!table || !table->get()) throw Error(REFIT_STATUS_NULL_ARGUMENT, "a table is null or was moved from");
      raw.push_back(table->get());
    }
    return raw;
  }
  Handle handle_;
};

/// One process's share of a plan prepared for a group (refit_executor), run step after step. Used by
/// the thread driving its group; every call is passed the group it was created with.
class Executor {
 public:
  /// Takes ownership of `raw` (from refit_executor_create or refit_executor_create_across).
  explicit Executor(refit_executor *raw) noexcept : handle_(raw) {}

  /// refit_executor_create: process `process`'s share of `plan` on `group` (blocking: builds and
  /// uploads descriptors, allocates staging).
  Executor(const Plan &plan, const Group &group, uint32_t process = 0,
           const refit_executor_options &options = executor_options()) {
    refit_executor *raw = nullptr;
    check(refit_executor_create(plan.get(), group.get(), process, &options, &raw));
    handle_ = Handle(raw);
  }

  /// refit_executor_create_across: with the routes to and from the other processes of `comm` (a
  /// collective call: every process of the communicator makes it).
  static Executor across(const Plan &plan, const Group &group, const Comm &comm,
                         const refit_executor_options &options = executor_options()) {
    refit_executor *raw = nullptr;
    check(refit_executor_create_across(plan.get(), group.get(), comm.get(), &options, &raw));
    return Executor(raw);
  }

  /// refit_executor_run: one step on `group`; returns what it did (device times only when it waited).
  refit_run_stats run(Group &group) {
    refit_run_stats s = empty_stats();
    check(refit_executor_run(live(), group.get(), &s));
    return s;
  }
  /// refit_executor_commit: installs a staged step (REFIT_COMMIT_STAGED).
  refit_run_stats commit(Group &group) {
    refit_run_stats s = empty_stats();
    check(refit_executor_commit(live(), group.get(), &s));
    return s;
  }
  /// refit_executor_stats: the last run's or commit's stats with device times (blocks until it ran).
  refit_run_stats stats() {
    refit_run_stats s = empty_stats();
    check(refit_executor_stats(live(), &s));
    return s;
  }
  /// refit_executor_get_info: what the executor was prepared to do (slices per run, staging, the
  /// time its creation spent checking addresses); known from its creation, does not wait.
  refit_executor_info info() const {
    refit_executor_info i{};
    i.size = sizeof(i);
    check(refit_executor_get_info(live(), &i));
    return i;
  }
  /// refit_executor_rebind: the caller's [old_base, old_base + length) on `device` now lives at new_base.
  void rebind(uint32_t device, uint64_t old_base, uint64_t new_base, uint64_t length) {
    check(refit_executor_rebind(live(), device, old_base, new_base, length));
  }

  refit_executor *get() const noexcept { return handle_.get(); }

 private:
  using Handle = detail::Owned<refit_executor, refit_executor_destroy>;
  refit_executor *live() const { return handle_.live("executor"); }
  static refit_run_stats empty_stats() noexcept {
    refit_run_stats s{};
    s.size = sizeof(s);
    return s;
  }
  Handle handle_;
};

}  // namespace refit

#endif /* REFIT_HPP */
