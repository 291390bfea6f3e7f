// GPU backends: see gpu_backend.h.
#include "gpu_backend.h"

#include <algorithm>

namespace pyddp {

#ifdef PYDDP_HAVE_DEVICE_KERNEL
extern const char* const kReduceKernelPtx;  // generated from reduce_kernels.cu
#endif

using namespace cuda;

GpuBackend::GpuBackend(std::vector<int> devices, double timeout_s, bool comm_per_replica)
    : devices_(std::move(devices)), timeout_s_(timeout_s) {
  PYDDP_ENFORCE(!devices_.empty(), "no devices");
  PYDDP_ENFORCE(timeout_s_ > 0, "timeout must be > 0 seconds, got ", timeout_s_);
  const DriverApi& d = driver();
  ContextRestore restore;
  const int count = device_count();
  for (int dev : devices_) {
    PYDDP_ENFORCE(dev >= 0 && dev < count, "cuda:", dev, " does not exist (", count,
                  " CUDA devices)");
  }
  const size_t n = devices_.size();
  compute_.assign(n, nullptr);  // the legacy default stream until told otherwise
  comm_.assign(n, nullptr);
  ready_.assign(n, nullptr);
  for (size_t r = 0; r < n; ++r) {
    set_device(devices_[r]);
    PYDDP_CU(d.cuEventCreate(&ready_[r], kEventDisableTiming));
    if (r == 0 || comm_per_replica) {
      // Non-blocking: no implicit ordering with the legacy default stream;
      // every dependency is an explicit event.
      PYDDP_CU(d.cuStreamCreate(&comm_[r], kStreamNonBlocking));
      comm_owner_.push_back(static_cast<int>(r));
      comm_index_.push_back(static_cast<int>(comm_owner_.size()) - 1);
      fence_.push_back(nullptr);
      PYDDP_CU(d.cuEventCreate(&fence_.back(), kEventDisableTiming));
    } else {
      comm_[r] = comm_[0];
      comm_index_.push_back(0);
    }
  }
  free_events_.resize(comm_owner_.size());
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void GpuBackend::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

GpuBackend::~GpuBackend() {
  stop_watchdog();
  // Streams and events are left to the context: destroying them here could
  // race work still queued by a failed run, and the process owns the context.
}

void GpuBackend::set_compute_stream(int replica, uintptr_t stream) {
  PYDDP_ENFORCE(replica >= 0 && static_cast<size_t>(replica) < compute_.size(), "replica ",
                replica, " out of range");
  compute_[replica] = reinterpret_cast<CUstream>(stream);
}

void GpuBackend::wait_for_compute() {
  throw_if_failed();
  const DriverApi& d = driver();
  ContextRestore restore;
  for (size_t r = 0; r < devices_.size(); ++r) {
    set_device(devices_[r]);
    // Event, not a host sync: the CPU goes on queuing backward while the
    // communication stream waits on the GPU for this replica's gradients.
    PYDDP_CU(d.cuEventRecord(ready_[r], compute_[r]));
    PYDDP_CU(d.cuStreamWaitEvent(comm_[r], ready_[r], 0));
  }
}

CUevent GpuBackend::take_event_locked(int stream_index) {
  auto& pool = free_events_[stream_index];
  if (!pool.empty()) {
    CUevent e = pool.back();
    pool.pop_back();
    return e;
  }
  CUevent e = nullptr;
  set_device(devices_[comm_owner_[stream_index]]);
  PYDDP_CU(driver().cuEventCreate(&e, kEventDisableTiming));
  return e;
}

void GpuBackend::watch(const std::string& what) {
  InFlight f;
  f.what = what;
  f.deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(timeout_s_));
  ContextRestore restore;
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t s = 0; s < comm_owner_.size(); ++s) {
    CUevent e = take_event_locked(static_cast<int>(s));
    const int r = comm_owner_[s];
    set_device(devices_[r]);
    PYDDP_CU(driver().cuEventRecord(e, comm_[r]));
    f.done.push_back(e);
  }
  in_flight_.push_back(std::move(f));
  cv_.notify_all();
}

void GpuBackend::fence() {
  // Also after a failure: reductions already queued must still finish before
  // compute reuses their buffers (an aborted NCCL kernel exits; ours always ends).
  const DriverApi& d = driver();
  ContextRestore restore;
  for (size_t s = 0; s < comm_owner_.size(); ++s) {
    const int owner = comm_owner_[s];
    set_device(devices_[owner]);
    PYDDP_CU(d.cuEventRecord(fence_[s], comm_[owner]));
  }
  for (size_t r = 0; r < devices_.size(); ++r) {
    set_device(devices_[r]);
    // The compute stream waits on the GPU; the host returns at once. Nothing
    // queued after this (optimizer step, zero_grad, next backward) can touch
    // a bucket before its reduction finished.
    PYDDP_CU(d.cuStreamWaitEvent(compute_[r], fence_[comm_index_[r]], 0));
  }
}

void GpuBackend::fail_locked(const std::string& message) {
  if (error_.empty()) error_ = message;
}

void GpuBackend::fail(const std::string& message) {
  std::lock_guard<std::mutex> lk(mu_);
  fail_locked(message);
}

void GpuBackend::throw_if_failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_.empty()) throw ReduceError(error_);
}

void GpuBackend::check() {
  bool timed_out = false;
  {
    ContextRestore restore;
    std::lock_guard<std::mutex> lk(mu_);
    timed_out = poll_locked();
  }
  if (timed_out) abort_after_timeout();
  throw_if_failed();
}

void GpuBackend::abort_after_timeout() {
  // Outside mu_: aborting may wait for a launch in progress (NcclBackend).
  const std::string done = abort_communication();
  std::lock_guard<std::mutex> lk(mu_);
  error_ += "; " + done;
}

bool GpuBackend::poll_locked() {
  const DriverApi& d = driver();
  const auto now = std::chrono::steady_clock::now();
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    bool done = true;
    for (size_t s = 0; s < f.done.size(); ++s) {
      set_device(devices_[comm_owner_[s]]);
      const CUresult r = d.cuEventQuery(f.done[s]);
      if (r == kCudaNotReady) {
        done = false;
      } else if (r != kCudaSuccess) {
        fail_locked(detail::concat("pyddp: ", f.what, " failed on cuda:",
                                   devices_[comm_owner_[s]], " with CUDA error ", r));
        return false;
      }
    }
    if (!done) {
      if (now > f.deadline && error_.empty()) {
        std::string devs;
        for (int dev : devices_) devs += (devs.empty() ? "cuda:" : ", cuda:") + std::to_string(dev);
        fail_locked(detail::concat("pyddp: ", f.what, " on ", devs, " did not complete within ",
                                   timeout_s_, " s"));
        return true;
      }
      return false;  // later launches complete after this one
    }
    for (size_t s = 0; s < f.done.size(); ++s) free_events_[s].push_back(f.done[s]);
    in_flight_.pop_front();
  }
  return false;
}

void GpuBackend::watchdog_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (in_flight_.empty()) {
      cv_.wait(lk, [&] { return stop_ || !in_flight_.empty(); });
      continue;
    }
    bool timed_out = false;
    try {
      ContextRestore restore;
      timed_out = poll_locked();
    } catch (const std::exception& e) {
      fail_locked(e.what());
    }
    if (timed_out) {
      lk.unlock();
      abort_after_timeout();
      lk.lock();
    }
    // Poll often enough for a timeout to fire near its deadline, rarely
    // enough to cost nothing next to a training step.
    cv_.wait_for(lk, std::chrono::milliseconds(5));
  }
}

// ------------------------------------------------------------------- NCCL

NcclBackend::NcclBackend(std::vector<int> devices, const std::string& nccl_path, double timeout_s)
    : GpuBackend(std::move(devices), timeout_s, /*comm_per_replica=*/true) {
  const NcclApi& n = nccl(nccl_path);
  ContextRestore restore;
  std::vector<int> sorted = devices_;
  std::sort(sorted.begin(), sorted.end());
  PYDDP_ENFORCE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                "NCCL needs one replica per GPU; replicas sharing a GPU use the device backend");
  comms_.assign(devices_.size(), nullptr);
  // One communicator per local device, created together: single process,
  // several GPUs, no unique id exchange needed.
  PYDDP_NCCL(n.ncclCommInitAll(comms_.data(), static_cast<int>(devices_.size()), devices_.data()));
}

NcclBackend::~NcclBackend() {
  stop_watchdog();
  std::lock_guard<std::timed_mutex> lk(nccl_mu_);
  if (aborted_) return;
  const NcclApi& n = nccl(nccl_path());
  for (ncclComm_t c : comms_) {
    if (c != nullptr) n.ncclCommDestroy(c);  // best effort: a destructor must not throw
  }
}

void NcclBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) {
  PYDDP_ENFORCE(bufs.size() == devices_.size(), "got ", bufs.size(), " buffers for ",
                devices_.size(), " replicas");
  int dtype = kNcclFloat32;
  switch (bufs[0].dtype) {
    case DType::kFloat32: dtype = kNcclFloat32; break;
    case DType::kFloat64: dtype = kNcclFloat64; break;
    case DType::kFloat16: dtype = kNcclFloat16; break;
    case DType::kBFloat16: dtype = kNcclBfloat16; break;
  }
  for (size_t r = 0; r < bufs.size(); ++r) {
    PYDDP_ENFORCE(bufs[r].device == devices_[r], "replica ", r, " buffer is on device ",
                  bufs[r].device, ", expected cuda:", devices_[r]);
  }
  wait_for_compute();
  const NcclApi& n = nccl(nccl_path());
  {
    ContextRestore restore;
    std::lock_guard<std::timed_mutex> lk(nccl_mu_);
    if (aborted_) throw ReduceError("pyddp: the NCCL communicators were aborted earlier");
    // Several devices driven from one thread: the calls must form one group or
    // the first would wait for peers that are never launched.
    PYDDP_NCCL(n.ncclGroupStart());
    ncclResult_t launched = kNcclSuccess;
    for (size_t r = 0; r < bufs.size() && launched == kNcclSuccess; ++r) {
      launched = n.ncclAllReduce(bufs[r].data, bufs[r].data, static_cast<size_t>(bufs[r].count),
                                 dtype, op == ReduceOp::kSum ? kNcclSum : kNcclAvg, comms_[r],
                                 comm_stream(static_cast<int>(r)));
    }
    const ncclResult_t ended = n.ncclGroupEnd();
    PYDDP_NCCL(launched);
    PYDDP_NCCL(ended);
  }
  watch(detail::concat("NCCL all-reduce of ", bufs[0].count, " ", dtype_name(bufs[0].dtype),
                       " elements"));
}

void NcclBackend::check() {
  std::string failure;
  {
    std::lock_guard<std::timed_mutex> lk(nccl_mu_);
    if (!aborted_) {
      const NcclApi& n = nccl(nccl_path());
      for (size_t r = 0; r < comms_.size() && failure.empty(); ++r) {
        ncclResult_t async = kNcclSuccess;
        PYDDP_NCCL(n.ncclCommGetAsyncError(comms_[r], &async));
        if (async != kNcclSuccess && async != kNcclInProgress) {
          failure = detail::concat("pyddp: NCCL communicator of cuda:", devices_[r],
                                   " failed asynchronously: ", n.ncclGetErrorString(async));
        }
      }
    }
  }
  if (!failure.empty()) {
    fail(failure);  // first, so no launch uses the communicators being freed
    abort_communication();
  }
  GpuBackend::check();
}

std::string NcclBackend::abort_communication() {
  // A launch stuck inside NCCL holds nccl_mu_ for good: after a bounded wait
  // the abort goes ahead anyway, the only way to free a hung collective.
  std::unique_lock<std::timed_mutex> lk(nccl_mu_, std::defer_lock);
  const bool locked = lk.try_lock_for(std::chrono::seconds(2));
  if (aborted_) return "NCCL communicators aborted";
  aborted_ = true;
  const NcclApi& n = nccl(nccl_path());
  // Aborting frees every rank stuck in a collective (their kernels exit), so
  // no stream and no host thread waits forever.
  for (ncclComm_t c : comms_) {
    if (c != nullptr) n.ncclCommAbort(c);
  }
  return locked ? "NCCL communicators aborted"
                : "NCCL communicators aborted while a launch was still inside NCCL";
}

// ------------------------------------------------- replicas on one device

bool device_kernel_available() {
#ifdef PYDDP_HAVE_DEVICE_KERNEL
  return true;
#else
  return false;
#endif
}

DeviceBackend::DeviceBackend(int device, int replicas, double timeout_s)
    : GpuBackend(std::vector<int>(replicas, device), timeout_s, /*comm_per_replica=*/false) {
  PYDDP_ENFORCE(replicas >= 1 && replicas <= kMaxReplicas, "the device backend handles 1 to ",
                kMaxReplicas, " replicas per GPU, got ", replicas);
#ifdef PYDDP_HAVE_DEVICE_KERNEL
  const DriverApi& d = driver();
  ContextRestore restore;
  set_device(device);
  CUmodule module = nullptr;
  // PTX, JIT-compiled by the driver for whatever GPU this is.
  PYDDP_CU(d.cuModuleLoadData(&module, kReduceKernelPtx));
  const char* names[4] = {"pyddp_reduce_f32", "pyddp_reduce_f64", "pyddp_reduce_f16",
                          "pyddp_reduce_bf16"};
  for (int i = 0; i < 4; ++i) PYDDP_CU(d.cuModuleGetFunction(&kernels_[i], module, names[i]));
#else
  throw UsageError(
      "replicas sharing one GPU need pyddp's reduction kernel, and this build has none (no "
      "CUDA compiler was found when it was built): reinstall pyddp where nvcc is on PATH");
#endif
}

namespace {
// Must match `Ptrs` in reduce_kernels.cu: passed by value as a kernel argument.
struct KernelPtrs {
  void* p[DeviceBackend::kMaxReplicas];
};
static_assert(sizeof(KernelPtrs) == 64, "must match Ptrs in reduce_kernels.cu");
}  // namespace

void DeviceBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) {
  PYDDP_ENFORCE(bufs.size() == devices_.size(), "got ", bufs.size(), " buffers for ",
                devices_.size(), " replicas");
  KernelPtrs ptrs{};
  for (size_t r = 0; r < bufs.size(); ++r) {
    PYDDP_ENFORCE(bufs[r].device == devices_[0], "replica ", r, " buffer is on device ",
                  bufs[r].device, ", expected cuda:", devices_[0]);
    ptrs.p[r] = bufs[r].data;
  }
  wait_for_compute();
  int n = static_cast<int>(bufs.size());
  long long count = bufs[0].count;
  int avg = op == ReduceOp::kAvg ? 1 : 0;
  if (count > 0) {
    void* args[] = {&ptrs, &n, &count, &avg};
    const unsigned threads = 256;
    // Grid-stride loop: a few waves of blocks cover any size.
    const long long blocks = std::min<long long>((count + threads - 1) / threads, 4096);
    ContextRestore restore;
    set_device(devices_[0]);
    PYDDP_CU(driver().cuLaunchKernel(kernels_[static_cast<int>(bufs[0].dtype)],
                                     static_cast<unsigned>(blocks), 1, 1, threads, 1, 1, 0,
                                     comm_stream(0), args, nullptr));
  }
  watch(detail::concat("on-device all-reduce of ", count, " ", dtype_name(bufs[0].dtype),
                       " elements across ", n, " replicas"));
}

}  // namespace pyddp
