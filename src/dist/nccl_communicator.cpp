// The NCCL communicator (see nccl_communicator.hpp). Without KVQ_WITH_NCCL only the stubs that
// say so are compiled.
#include <fmt/format.h>

#include <kvq/dist/nccl_communicator.hpp>

#ifdef KVQ_WITH_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <thread>
#endif

KVQ_NAMESPACE_BEGIN

namespace dist {

#ifndef KVQ_WITH_NCCL

bool nccl_available() { return false; }

result<nccl_id> nccl_make_id() {
  return status{errc::unsupported, "nccl_make_id: kvq was built without NCCL (configure with -DKVQ_NCCL=ON)"};
}

result<std::unique_ptr<communicator>> make_nccl_communicator(int, int, const nccl_id&, int, const nccl_options&) {
  return status{errc::unsupported, "make_nccl_communicator: kvq was built without NCCL (configure with -DKVQ_NCCL=ON)"};
}

#else

static_assert(sizeof(ncclUniqueId) == sizeof(nccl_id::bytes), "nccl_id holds an ncclUniqueId");

namespace {

using clock = std::chrono::steady_clock;

// Sets the device for the scope and restores the caller's.
class device_scope {
 public:
  explicit device_scope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    ok_ = cudaSetDevice(device) == cudaSuccess;
  }
  ~device_scope() {
    if (prev_ >= 0) (void)cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = false;
};

ncclDataType_t nccl_type(element_type t) {
  switch (t) {
    case element_type::u8:
      return ncclUint8;
    case element_type::i32:
      return ncclInt32;
    case element_type::i64:
      return ncclInt64;
    case element_type::f32:
      return ncclFloat32;
    case element_type::f64:
      return ncclFloat64;
  }
  return ncclUint8;
}

ncclRedOp_t nccl_op(reduce_op op) { return op == reduce_op::sum ? ncclSum : op == reduce_op::max ? ncclMax : ncclMin; }

class nccl_communicator final : public communicator {
 public:
  nccl_communicator(int size, int rank, int device, const nccl_options& opt)
      : size_(size), rank_(rank), device_(device), opt_(opt) {}

  ~nccl_communicator() override {
    device_scope dev(device_);
    if (comm_) {
      if (broken_) {
        (void)ncclCommAbort(comm_);
      } else {
        // Flush what was enqueued, bounded by the timeout; then free.
        ncclResult_t r = ncclCommFinalize(comm_);
        if (r == ncclInProgress) r = wait_comm("destroy");
        if (r == ncclSuccess)
          (void)ncclCommDestroy(comm_);
        else
          (void)ncclCommAbort(comm_);
      }
    }
    if (ev_) (void)cudaEventDestroy(ev_);
    if (dev_buf_) (void)cudaFree(dev_buf_);
    if (host_buf_) (void)cudaFreeHost(host_buf_);
  }

  // Creation: buffers first (a failure there needs no peer), then the NCCL communicator.
  status init(const nccl_id& id) {
    device_scope dev(device_);
    if (!dev.ok()) return fail(errc::invalid_argument, fmt::format("cannot use CUDA device {}", device_));
    const size_t stage = opt_.max_host_bytes * size_t(size_ + 1);  // [send][size recv]
    if (cudaMalloc(&dev_buf_, stage) != cudaSuccess || cudaMallocHost(&host_buf_, stage) != cudaSuccess ||
        cudaEventCreateWithFlags(&ev_, cudaEventDisableTiming) != cudaSuccess)
      return fail(errc::comm_error, fmt::format("cannot allocate {} bytes of staging buffers", stage));
    ncclUniqueId uid;
    std::memcpy(&uid, id.bytes.data(), sizeof(uid));
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size_, uid, rank_, &cfg);
    if (r == ncclInProgress) r = wait_comm("creation");
    if (r != ncclSuccess) return fail(errc::comm_error, fmt::format("ncclCommInitRankConfig: {}", nccl_text(r)));
    return {};
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  bool device_capable() const override { return true; }
  std::string name() const override { return fmt::format("nccl(rank {} of {}, device {})", rank_, size_, device_); }

  status all_gather(const void* send, void* recv, size_t bytes, memory_space where, void* stream) override {
    return run(
        "all_gather", send, recv, bytes, bytes * size_t(size_), where, stream,
        [&](const void* s, void* r, cudaStream_t st) { return ncclAllGather(s, r, bytes, ncclUint8, comm_, st); });
  }

  status all_reduce(const void* send, void* recv, size_t count, element_type type, reduce_op op, memory_space where,
                    void* stream) override {
    const size_t bytes = count * element_bytes(type);
    return run("all_reduce", send, recv, bytes, bytes, where, stream, [&](const void* s, void* r, cudaStream_t st) {
      return ncclAllReduce(s, r, count, nccl_type(type), nccl_op(op), comm_, st);
    });
  }

  void abort(const std::string& reason) override {
    if (broken_) return;
    broken_ = true;
    why_ = fmt::format("rank {} aborted: {}", rank_, reason);
    device_scope dev(device_);
    if (comm_) (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  bool broken() const override { return broken_; }

 private:
  static std::string nccl_text(ncclResult_t r) { return ncclGetErrorString(r); }

  status fail(errc code, std::string what) {
    if (!broken_) {
      broken_ = true;
      why_ = fmt::format("rank {}: {}", rank_, what);
      if (comm_) (void)ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    return {code, fmt::format("{}: {}", name(), what)};
  }

  // Polls the communicator's asynchronous state until it leaves ncclInProgress or the timeout.
  ncclResult_t wait_comm(const char*) {
    const auto deadline = clock::now() + opt_.timeout;
    ncclResult_t r = ncclInProgress;
    while (r == ncclInProgress) {
      if (ncclCommGetAsyncError(comm_, &r) != ncclSuccess) return ncclInternalError;
      if (r == ncclInProgress) {
        if (clock::now() > deadline) return ncclInProgress;
        std::this_thread::yield();
      }
    }
    return r;
  }

  // Waits for the event recorded after a host-space collective, watching NCCL's error state.
  status wait_event(const char* what) {
    const auto deadline = clock::now() + opt_.timeout;
    for (;;) {
      const cudaError_t e = cudaEventQuery(ev_);
      if (e == cudaSuccess) return {};
      if (e != cudaErrorNotReady) return fail(errc::comm_error, fmt::format("{}: {}", what, cudaGetErrorString(e)));
      ncclResult_t a = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &a) != ncclSuccess || (a != ncclSuccess && a != ncclInProgress))
        return fail(errc::comm_error, fmt::format("{}: {}", what, nccl_text(a)));
      if (clock::now() > deadline)
        return fail(errc::comm_error, fmt::format("{}: timed out after {} ms", what, opt_.timeout.count()));
      std::this_thread::yield();
    }
  }

  template <class Launch>
  status run(const char* what, const void* send, void* recv, size_t send_bytes, size_t recv_bytes, memory_space where,
             void* stream, Launch&& launch) {
    if (broken_) return {errc::comm_error, fmt::format("{}: communicator group is broken: {}", name(), why_)};
    if (!send || !recv) {
      abort(fmt::format("{}: null buffer", what));
      return {errc::invalid_argument, fmt::format("{}: {}: null buffer", name(), what)};
    }
    if (send_bytes == 0) {
      abort(fmt::format("{}: empty buffer", what));
      return {errc::invalid_argument, fmt::format("{}: {}: empty buffer", name(), what)};
    }
    if (where == memory_space::host && send_bytes > opt_.max_host_bytes) {
      abort(fmt::format("{}: {} bytes exceed max_host_bytes", what, send_bytes));
      return {errc::invalid_argument, fmt::format("{}: {}: {} bytes on the host, max_host_bytes is {}", name(), what,
                                                  send_bytes, opt_.max_host_bytes)};
    }
    device_scope dev(device_);
    if (!dev.ok()) return fail(errc::comm_error, fmt::format("{}: cannot use CUDA device {}", what, device_));
    const auto st = static_cast<cudaStream_t>(stream);
    const void* s = send;
    void* r = recv;
    auto* dsend = static_cast<std::byte*>(dev_buf_);
    std::byte* drecv = dsend + opt_.max_host_bytes;
    if (where == memory_space::host) {
      // Through pinned memory: an async copy from pageable memory is staged by the driver
      // synchronously; from pinned memory it is one DMA ordered on the stream.
      std::byte* pinned_send = static_cast<std::byte*>(host_buf_) + opt_.max_host_bytes * size_t(size_);
      std::memcpy(pinned_send, send, send_bytes);
      if (cudaMemcpyAsync(dsend, pinned_send, send_bytes, cudaMemcpyHostToDevice, st) != cudaSuccess)
        return fail(errc::comm_error, fmt::format("{}: staging copy failed", what));
      s = dsend;
      r = drecv;
    }
    ncclResult_t nr = launch(s, r, st);
    if (nr == ncclInProgress) nr = wait_comm(what);
    if (nr != ncclSuccess) return fail(errc::comm_error, fmt::format("{}: {}", what, nccl_text(nr)));
    if (where == memory_space::device) return {};
    if (cudaMemcpyAsync(host_buf_, drecv, recv_bytes, cudaMemcpyDeviceToHost, st) != cudaSuccess ||
        cudaEventRecord(ev_, st) != cudaSuccess)
      return fail(errc::comm_error, fmt::format("{}: staging copy failed", what));
    if (status w = wait_event(what); !w) return w;
    std::memcpy(recv, host_buf_, recv_bytes);
    return {};
  }

  int size_, rank_, device_;
  nccl_options opt_;
  ncclComm_t comm_ = nullptr;
  void* dev_buf_ = nullptr;   // [max_host_bytes] send, then [size][max_host_bytes] recv
  void* host_buf_ = nullptr;  // pinned [size][max_host_bytes] receive, then [max_host_bytes] send
  cudaEvent_t ev_ = nullptr;
  bool broken_ = false;
  std::string why_;
};

}  // namespace

bool nccl_available() { return true; }

result<nccl_id> nccl_make_id() {
  ncclUniqueId uid;
  if (ncclResult_t r = ncclGetUniqueId(&uid); r != ncclSuccess)
    return status{errc::comm_error, fmt::format("ncclGetUniqueId: {}", ncclGetErrorString(r))};
  nccl_id id;
  std::memcpy(id.bytes.data(), &uid, sizeof(uid));
  return id;
}

result<std::unique_ptr<communicator>> make_nccl_communicator(int size, int rank, const nccl_id& id, int device,
                                                             const nccl_options& opt) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
  if (size < 1 || rank < 0 || rank >= size)
    return status{errc::invalid_argument, fmt::format("nccl communicator: rank {} of {} ranks", rank, size)};
  if (device < 0 || device >= devices)
    return status{errc::invalid_argument,
                  fmt::format("nccl communicator: device {}, this process sees {} CUDA devices", device, devices)};
  if (opt.timeout.count() <= 0 || opt.max_host_bytes == 0)
    return status{errc::invalid_argument, "nccl communicator: timeout and max_host_bytes must be > 0"};
  auto c = std::make_unique<nccl_communicator>(size, rank, device, opt);
  if (status s = c->init(id); !s) return s;
  return std::unique_ptr<communicator>(std::move(c));
}

#endif

}  // namespace dist

KVQ_NAMESPACE_END
