// GPU backends: see gpu_backend.h.
#include "gpu_backend.h"

#include <algorithm>
#include <functional>
#include <map>

namespace pyddp {

using namespace cuda;

// ------------------------------------------------------------- GpuBackend

GpuBackend::GpuBackend(std::vector<int> devices, double timeout_s, std::string nccl_path,
                       NcclRendezvous rdzv)
    : devices_(std::move(devices)),
      timeout_s_(timeout_s),
      nccl_path_(std::move(nccl_path)),
      rdzv_(std::move(rdzv)) {
  PYDDP_ENFORCE(!devices_.empty(), "no devices");
  PYDDP_ENFORCE(timeout_s_ > 0, "timeout must be > 0 seconds, got ", timeout_s_);
  const int count = device_count();
  for (int dev : devices_) {
    PYDDP_ENFORCE(dev >= 0 && dev < count, "cuda:", dev, " does not exist (", count,
                  " CUDA devices)");
  }
  // The set is keyed by the sorted devices: [1, 0] and [0, 1] share it
  // (NCCL rank i = the i-th smallest device); comm_index_ maps replicas.
  std::vector<int> distinct = devices_;
  std::sort(distinct.begin(), distinct.end());
  distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
  for (int dev : devices_) {
    comm_index_.push_back(
        static_cast<int>(std::find(distinct.begin(), distinct.end(), dev) - distinct.begin()));
  }
  set_ = acquire_comm_set(distinct, nccl_path_, timeout_s_, rdzv_);
  ContextRestore restore;
  for (int dev : distinct) {
    set_device(dev);
    fence_.push_back(nullptr);
    PYDDP_CU(driver().cuEventCreate(&fence_.back(), kEventDisableTiming));
  }
  fence_capture_.assign(fence_.size(), 0);
  free_events_.resize(distinct.size());
  writers_.resize(devices_.size());
  set_keys(0);
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

GpuBackend::~GpuBackend() { stop_watchdog(); }

void GpuBackend::stop_watchdog() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
}

void GpuBackend::close() {
  stop_watchdog();
  std::shared_ptr<CommSet> set;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    closed_ = true;
    set.swap(set_);
  }
  // Events and this backend's slots are left to the context (destroying them
  // could race work still queued); the set is destroyed here if this was its
  // last user, idle-or-abort as its destructor says.
  set.reset();
}

void GpuBackend::set_keys(int n) {
  PYDDP_ENFORCE(n >= 0, "negative key count ", n);
  slots_.resize((static_cast<size_t>(n) + 1) * devices_.size());
}

void GpuBackend::add_writer_locked(int replica, uintptr_t stream) {
  auto& w = writers_[replica];
  if (std::find(w.begin(), w.end(), stream) == w.end()) w.push_back(stream);
}

void GpuBackend::record_ready(int replica, int key, const std::vector<uintptr_t>& streams) {
  PYDDP_ENFORCE(replica >= 0 && static_cast<size_t>(replica) < devices_.size(), "replica ",
                replica, " out of range");
  PYDDP_ENFORCE(key >= -1 && (key + 1) * devices_.size() < slots_.size(), "key ", key,
                " out of range");
  throw_if_dead();
  const DriverApi& d = driver();
  ContextRestore restore;
  // The replica's context: stream 0 means its device's legacy default stream,
  // and events must live in the context of the stream they are recorded on.
  set_device(devices_[replica]);
  Slot& s = slot(replica, key);
  for (uintptr_t stream : streams) {
    if (static_cast<size_t>(s.used) == s.events.size()) {
      s.events.push_back(nullptr);
      PYDDP_CU(d.cuEventCreate(&s.events.back(), kEventDisableTiming));
    }
    // Event, not a host sync: the producing thread goes straight back to
    // backward; the communication stream will wait for this point on the GPU.
    PYDDP_CU(d.cuEventRecord(s.events[s.used++], reinterpret_cast<CUstream>(stream)));
  }
  std::lock_guard<std::mutex> lk(writers_mu_);
  for (uintptr_t stream : streams) add_writer_locked(replica, stream);
}

void GpuBackend::throw_if_dead() const {
  const std::string dead = dead_context_error();
  if (!dead.empty()) throw ReduceError(dead);
}

void GpuBackend::probe_contexts(const CommSet& set) {
  ContextRestore restore;
  RelaxedCaptureMode relaxed;  // (queries, legal during another thread's capture)
  try {
    for (size_t s = 0; s < set.streams.size(); ++s) {
      set_device(set.devices[s]);
      // Not a host wait: a query. Busy is fine (an aborted kernel may still
      // be exiting); a dead context answers with its sticky error.
      const CUresult r = driver().cuStreamQuery(set.streams[s]);
      if (r != kCudaNotReady) PYDDP_CU(r);
    }
  } catch (const ReduceError&) {
    throw_if_dead();  // the first sticky failure, whichever call saw it
    throw;
  }
}

void GpuBackend::use_stream(int replica, uintptr_t stream) {
  PYDDP_ENFORCE(replica >= 0 && static_cast<size_t>(replica) < devices_.size(), "replica ",
                replica, " out of range");
  throw_if_dead();
  ContextRestore restore;
  set_device(devices_[replica]);
  // A stream about to write this replica's buckets waits (on the GPU) for the
  // reductions that still read them. An event never recorded waits for nothing.
  const auto s = reinterpret_cast<CUstream>(stream);
  std::lock_guard<std::mutex> lk(writers_mu_);
  wait_fence_locked(s, comm_index_[replica]);
  add_writer_locked(replica, stream);
}

void GpuBackend::wait_fence_locked(CUstream stream, int comm_index) {
  // A stream capturing a CUDA graph may only wait on what its own capture
  // recorded (CUDA's isolation error otherwise), and a stream outside any
  // capture on nothing a capture recorded (the wait would pull it into that
  // capture): a fence recorded elsewhere is not waited on. From a capture,
  // the fence left out is an eager step's, which made the caller's streams
  // wait already and comes before the graph's launch on them, or another
  // graph's, complete within that graph's launch.
  if (capture_id(stream) != fence_capture_[comm_index]) return;
  PYDDP_CU(driver().cuStreamWaitEvent(stream, fence_[comm_index], 0));
}

unsigned long long GpuBackend::one_capture_locked(const CommSet& set) {
  std::vector<unsigned long long> ids;
  for (size_t s = 0; s < set.streams.size(); ++s) {
    set_device(set.devices[s]);
    ids.push_back(capture_id(set.streams[s]));
  }
  if (std::adjacent_find(ids.begin(), ids.end(), std::not_equal_to<>()) == ids.end()) {
    return ids[0];
  }
  std::string which;
  for (size_t s = 0; s < ids.size(); ++s) {
    which += detail::concat(s ? ", " : "", "cuda:", set.devices[s], ids[s] ? " capturing" : " not");
  }
  // Not a ReduceError: nothing was launched, the communicators stay usable.
  throw UsageError(detail::concat(
      "pyddp: the replicas' streams are not all in one CUDA graph capture (", which,
      "): NCCL's ranks launched now and those launched only at a replay would never meet. "
      "Run every device's work on a stream that joined the capture"));
}

void GpuBackend::note_abort(const CommSet& set) {
  fail("pyddp: the NCCL communicators on " + devices_text(set.devices) +
       " were aborted after a failure (here or in another model or all_reduce on these GPUs); "
       "reductions in flight were cut short. Call zero_grad() to rebuild them");
}

GpuBackend::Launch GpuBackend::lock_for_launch() {
  throw_if_failed();
  Launch launch;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) throw UsageError("pyddp: the GPU backend was closed");
    launch.set = set_;
  }
  launch.lock = std::unique_lock<std::mutex>(launch.set->launch_mu);
  if (launch.set->aborted) {
    launch.lock.unlock();
    note_abort(*launch.set);
    throw_if_failed();
  }
  return launch;
}

void GpuBackend::wait_ready_locked(const CommSet& set, int key) {
  const DriverApi& d = driver();
  for (size_t r = 0; r < devices_.size(); ++r) {
    set_device(devices_[r]);
    Slot& s = slot(static_cast<int>(r), key);
    // cuStreamWaitEvent captures the event's latest record now, so the slot's
    // events can be recorded again for the next iteration right after.
    for (int i = 0; i < s.used; ++i) {
      PYDDP_CU(d.cuStreamWaitEvent(comm_stream(set, static_cast<int>(r)), s.events[i], 0));
    }
    s.used = 0;
  }
}

CUevent GpuBackend::take_event_locked(const CommSet& set, int stream_index) {
  auto& pool = free_events_[stream_index];
  if (!pool.empty()) {
    CUevent e = pool.back();
    pool.pop_back();
    return e;
  }
  CUevent e = nullptr;
  set_device(set.devices[stream_index]);
  PYDDP_CU(driver().cuEventCreate(&e, kEventDisableTiming));
  return e;
}

void GpuBackend::watch_locked(const CommSet& set, const std::string& what,
                              unsigned long long captured) {
  // A launch captured into a CUDA graph runs at each replay, not now: its
  // events would be captured ones, which no query may ask (CUDA fails it
  // and invalidates the capture). Not watched, as torch's ProcessGroupNCCL
  // leaves captured work to the graph's launcher.
  if (captured != 0) {
    captured_launches_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  InFlight f;
  f.what = what;
  f.deadline = std::chrono::steady_clock::now() +
               std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                   std::chrono::duration<double>(timeout_s_));
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t s = 0; s < set.streams.size(); ++s) {
    CUevent e = take_event_locked(set, static_cast<int>(s));
    set_device(set.devices[s]);
    PYDDP_CU(driver().cuEventRecord(e, set.streams[s]));
    f.done.push_back(e);
  }
  in_flight_.push_back(std::move(f));
  cv_.notify_all();
}

void GpuBackend::fence() {
  std::shared_ptr<CommSet> set;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    set = set_;
  }
  // Also after a failure: reductions already queued must finish before
  // compute reuses their buffers (an aborted NCCL kernel exits; ours ends).
  // Not on a dead context: nothing queued there runs again.
  throw_if_dead();
  const DriverApi& d = driver();
  ContextRestore restore;
  // Lock order: launch_mu, then writers_mu_ (use_stream takes writers_mu_
  // alone): each fence and the capture it was recorded in change together.
  std::lock_guard<std::mutex> launch(set->launch_mu);
  std::lock_guard<std::mutex> lk(writers_mu_);
  for (size_t s = 0; s < set->streams.size(); ++s) {
    set_device(set->devices[s]);
    const unsigned long long captured = capture_id(set->streams[s]);
    PYDDP_CU(d.cuEventRecord(fence_[s], set->streams[s]));
    fence_capture_[s] = captured;
  }
  for (size_t r = 0; r < devices_.size(); ++r) {
    set_device(devices_[r]);
    // Every stream that wrote this replica's buckets waits on the GPU; the
    // host returns at once. Nothing queued there later (optimizer step,
    // zero_grad, next backward) touches a bucket before its reduction ends.
    for (uintptr_t w : writers_[r]) {
      wait_fence_locked(reinterpret_cast<CUstream>(w), comm_index_[r]);
    }
    writers_[r].clear();
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
  throw_if_dead();  // whatever failed here since, the dead context is the cause
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_.empty()) throw ReduceError(error_);
}

void GpuBackend::check() {
  bool timed_out = false;
  std::shared_ptr<CommSet> set;
  {
    ContextRestore restore;
    std::lock_guard<std::mutex> lk(mu_);
    if (!closed_) timed_out = poll_locked();
    set = set_;
  }
  if (timed_out) abort_communication();
  if (set) {
    bool aborted = false;
    {
      std::lock_guard<std::mutex> launch(set->launch_mu);
      aborted = set->aborted;
    }
    if (aborted) note_abort(*set);
  }
  throw_if_failed();
}

void GpuBackend::abort_communication() {
  std::shared_ptr<CommSet> set;
  {
    std::lock_guard<std::mutex> lk(mu_);
    set = set_;
  }
  if (!set || set->comms.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    error_ += "; the kernel is left to finish (it only waits for compute)";
    return;
  }
  {
    // Under the launch lock: no launch is inside these communicators while
    // they are freed (they are non-blocking, so a launch never holds it long).
    std::lock_guard<std::mutex> launch(set->launch_mu);
    if (!set->aborted) {
      const NcclApi& n = nccl(set->nccl_path);
      // Aborting frees every rank stuck in a collective (their kernels exit),
      // so no stream and no host thread waits forever.
      for (ncclComm_t c : set->comms) n.ncclCommAbort(c);
      set->aborted = true;
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  error_ += "; NCCL communicators aborted (zero_grad() rebuilds them)";
}

void GpuBackend::recover() {
  // Lock order everywhere: a set's launch_mu before mu_, never the reverse.
  std::shared_ptr<CommSet> set;
  bool failed = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    set = set_;
    failed = !error_.empty();
  }
  bool aborted = false;
  {
    std::lock_guard<std::mutex> launch(set->launch_mu);
    aborted = set->aborted;
  }
  if (!failed && !aborted) return;
  // A dead context: rebuilding communicators on it would fail, or worse,
  // seem to work.
  throw_if_dead();
  probe_contexts(*set);
  // Aborted communicators cannot be used again: take a fresh set (the
  // registry builds one, since this one is marked aborted).
  if (aborted && rdzv_.spans_processes()) {
    // A new communicator across processes needs a new id from every process
    // at once: that is a restart of the processes, not a local repair.
    throw ReduceError(
        "the NCCL communicator across processes was aborted; it cannot be rebuilt in place: "
        "restart the processes (torchrun --max-restarts=K resumes a Trainer from its last "
        "checkpoint)");
  }
  std::shared_ptr<CommSet> fresh =
      aborted ? acquire_comm_set(set->devices, nccl_path_, timeout_s_) : set;
  std::lock_guard<std::mutex> lk(mu_);
  set_ = fresh;
  // Launches of the failed iteration are no longer watched: every stream
  // that wrote their buffers was fenced after them.
  in_flight_.clear();
  error_.clear();
}

bool GpuBackend::poll_locked() {
  if (in_flight_.empty()) return false;
  const DriverApi& d = driver();
  // Queries of events recorded outside any capture: legal in the relaxed
  // mode while this thread or another captures a graph (cuda_api.h).
  RelaxedCaptureMode relaxed;
  const auto now = std::chrono::steady_clock::now();
  while (!in_flight_.empty()) {
    InFlight& f = in_flight_.front();
    bool done = true;
    for (size_t s = 0; s < f.done.size(); ++s) {
      const CUresult r = d.cuEventQuery(f.done[s]);
      if (r == kCudaNotReady) {
        done = false;
      } else if (r != kCudaSuccess) {
        fail_locked(cu_failure(r, set_->devices[s], "pyddp: " + f.what));
        return false;
      }
    }
    if (!done) {
      if (now > f.deadline && error_.empty()) {
        fail_locked(detail::concat("pyddp: ", f.what, " on ", devices_text(devices_),
                                   " did not complete within ", timeout_s_,
                                   " s (a step already queued after it may have read partial "
                                   "gradients)"));
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
      timed_out = poll_locked();
    } catch (const std::exception& e) {
      fail_locked(e.what());
    }
    if (timed_out) {
      lk.unlock();
      abort_communication();
      lk.lock();
    }
    // Poll often enough for a timeout to fire near its deadline, rarely
    // enough to cost nothing next to a training step.
    cv_.wait_for(lk, std::chrono::milliseconds(5));
  }
}

// ------------------------------------------------------------------- NCCL

namespace {
// Must match `Ptrs` in reduce_kernels.cu: passed by value as a kernel argument.
// Room for every replica's send and receive buffer.
struct KernelPtrs {
  void* p[2 * SharedGpuBackend::kMaxReplicas];
};
static_assert(sizeof(KernelPtrs) == 128, "must match Ptrs in reduce_kernels.cu");

int nccl_dtype(DType t) {
  switch (t) {
    case DType::kFloat32: return kNcclFloat32;
    case DType::kFloat64: return kNcclFloat64;
    case DType::kFloat16: return kNcclFloat16;
    case DType::kBFloat16: return kNcclBfloat16;
  }
  return kNcclFloat32;
}

// Our kernels loop grid-stride: a few waves of blocks cover any count.
constexpr unsigned kThreads = 256;
unsigned grid_blocks(long long count) {
  return static_cast<unsigned>(std::min<long long>((count + kThreads - 1) / kThreads, 4096));
}
}  // namespace


NcclBackend::NcclBackend(std::vector<int> devices, const std::string& nccl_path, double timeout_s,
                         NcclRendezvous rdzv)
    : GpuBackend(
          [&] {
            std::vector<int> sorted = devices;
            std::sort(sorted.begin(), sorted.end());
            PYDDP_ENFORCE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(),
                          "NCCL needs one replica per GPU; replicas sharing a GPU use the device "
                          "backend");
            PYDDP_ENFORCE(!nccl_path.empty(), "no NCCL library path");
            return devices;
          }(),
          timeout_s, nccl_path, std::move(rdzv)) {}

void NcclBackend::set_compression(const std::string& dtype, const std::string& nvrtc_path) {
  const DType wire = dtype_from_name(dtype);
  PYDDP_ENFORCE(wire != DType::kFloat64, "wire compression to float16 or bfloat16, not float64");
  std::vector<const DeviceKernels*> kernels;
  if (wire != DType::kFloat32) {
    for (int dev : devices_) kernels.push_back(&device_kernels(dev, nvrtc_path));
  }
  Launch launch = lock_for_launch();  // not while a reduction is being launched
  wire_ = wire;
  wire_kernels_ = std::move(kernels);
}

void NcclBackend::set_hook(Hook hook, uintptr_t stream) {
  PYDDP_ENFORCE(devices_.size() == 1, "a communication hook on GPUs takes one GPU per process, "
                "got ", devices_.size());
  PYDDP_ENFORCE(wire_ == DType::kFloat32, "a communication hook replaces wire compression");
  PYDDP_ENFORCE(stream != 0, "a communication hook runs on a stream of its own, not the legacy "
                "default stream");
  Launch launch = lock_for_launch();  // not while a reduction is being launched
  ContextRestore restore;
  set_device(devices_[0]);
  for (CUevent* e : {&hook_in_, &hook_out_}) {
    if (*e == nullptr) PYDDP_CU(driver().cuEventCreate(e, kEventDisableTiming));
  }
  hook_ = std::move(hook);
  hook_stream_ = reinterpret_cast<CUstream>(stream);
}

void NcclBackend::launch_hooked(const std::vector<BufferRef>& bufs, int key) {
  PYDDP_ENFORCE(bufs.size() == 1 && bufs[0].device == devices_[0], "a hooked bucket is one "
                "buffer on cuda:", devices_[0]);
  const DriverApi& d = driver();
  std::shared_ptr<CommSet> held;  // the communication stream outlives the hook's call
  {
    Launch launch = lock_for_launch();
    held = launch.set;
    ContextRestore restore;
    wait_ready_locked(*launch.set, key);
    if (one_capture_locked(*launch.set) != 0) {
      throw UsageError(
          "a communication hook outside pyddp's core (a Python hook) cannot run inside a CUDA "
          "graph capture: capture steps with torch DDP's built-in hooks, or none");
    }
    // The hook's stream waits for the communication stream as it is now:
    // whatever is queued there later (another model's sums) is no
    // dependency of the hook's collectives.
    set_device(devices_[0]);
    PYDDP_CU(d.cuEventRecord(hook_in_, comm_stream(*launch.set, 0)));
    PYDDP_CU(d.cuStreamWaitEvent(hook_stream_, hook_in_, 0));
  }
  // Outside the launch lock: the hook takes the interpreter lock, which a
  // thread waiting for the launch lock may hold.
  hook_(key);
  Launch launch = lock_for_launch();
  ContextRestore restore;
  set_device(devices_[0]);
  PYDDP_CU(d.cuEventRecord(hook_out_, hook_stream_));
  PYDDP_CU(d.cuStreamWaitEvent(comm_stream(*launch.set, 0), hook_out_, 0));
  watch_locked(*launch.set,
               detail::concat("the communication hook's reduction of bucket ", key, " (",
                              bufs[0].count, " ", dtype_name(bufs[0].dtype), " elements)"),
               0);
}

void NcclBackend::convert_locked(const CommSet& set, const std::vector<BufferRef>& bufs,
                                 bool to_wire, ReduceOp op) {
  const int w = wire_ == DType::kFloat16 ? 0 : 1;
  int n = comm_ranks();
  long long count = bufs[0].count;
  int sum = op == ReduceOp::kSum ? 1 : 0;
  for (size_t r = 0; r < bufs.size(); ++r) {
    KernelPtrs ptrs{};  // the first two: from, to
    ptrs.p[0] = to_wire ? bufs[r].data : bufs[r].wire;
    ptrs.p[1] = to_wire ? bufs[r].wire : bufs[r].data;
    void* args[] = {&ptrs, &n, &count, &sum};
    const DeviceKernels& k = *wire_kernels_[r];
    set_device(devices_[r]);
    PYDDP_CU(driver().cuLaunchKernel(to_wire ? k.compress[w] : k.decompress[w],
                                     grid_blocks(count), 1, 1, kThreads, 1, 1, 0,
                                     comm_stream(set, static_cast<int>(r)), args, nullptr));
  }
}

void NcclBackend::launch_group(const std::vector<BufferRef>& bufs, int key, const std::string& what,
                               const Call& call, const Around& before, const Around& after) {
  PYDDP_ENFORCE(bufs.size() == devices_.size(), "got ", bufs.size(), " buffers for ",
                devices_.size(), " replicas");
  for (size_t r = 0; r < bufs.size(); ++r) {
    PYDDP_ENFORCE(bufs[r].device == devices_[r], "replica ", r, " buffer is on device ",
                  bufs[r].device, ", expected cuda:", devices_[r]);
  }
  Launch launch = lock_for_launch();
  const CommSet& set = *launch.set;
  const NcclApi& n = nccl(set.nccl_path);
  ContextRestore restore;
  const std::string launching = what + " launch";
  try {
    wait_ready_locked(set, key);
    const unsigned long long captured = one_capture_locked(set);
    if (before) before(set);
    // Several devices driven from one thread: the calls form one group, or
    // the first would wait for peers that are never launched.
    PYDDP_NCCL(n.ncclGroupStart());
    ncclResult_t launched = kNcclSuccess;
    for (size_t r = 0;
         r < bufs.size() && (launched == kNcclSuccess || launched == kNcclInProgress); ++r) {
      set_device(devices_[r]);
      launched = call(n, set, static_cast<int>(r));
    }
    const ncclResult_t ended = n.ncclGroupEnd();
    if (launched != kNcclInProgress) PYDDP_NCCL(launched);
    if (ended != kNcclInProgress) PYDDP_NCCL(ended);
    // Non-blocking: the kernels are on the streams only once every
    // communicator leaves ncclInProgress; the done events must come after,
    // and so must the kernels that read the result.
    wait_comms(n, set.comms,
               std::chrono::steady_clock::now() +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(timeout_s())),
               launching.c_str());
    if (after) after(set);
    watch_locked(set, what, captured);
  } catch (const ReduceError& e) {
    // A communicator in error cannot be trusted again: fail, abort (outside
    // the launch lock, which the abort takes), and let recover() rebuild.
    launch.lock.unlock();
    fail(e.what());
    abort_communication();
    throw;
  }
}

void NcclBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) {
  check_collective(*this, Collective::kAllReduce, bufs, bufs);
  if (hook_ && key >= 0) return launch_hooked(bufs, key);
  // Compressed: float32 buckets travel as 16-bit copies, already divided by
  // the ranks (so NCCL sums them), and come back into the bucket. Sums
  // outside the engine (key -1: the agreement, a sharded optimizer's
  // gradients) travel as they are: they must be exact.
  const bool squeeze =
      wire_ != DType::kFloat32 && bufs[0].dtype == DType::kFloat32 && key >= 0;
  const DType on_wire = squeeze ? wire_ : bufs[0].dtype;
  for (size_t r = 0; r < bufs.size(); ++r) {
    PYDDP_ENFORCE(!squeeze || bufs[r].wire != nullptr || bufs[r].count == 0, "replica ", r,
                  "'s float32 bucket has no ", dtype_name(wire_), " copy for the wire");
  }
  const bool convert = squeeze && bufs[0].count > 0;
  const int dtype = nccl_dtype(on_wire);
  const int nccl_op = squeeze || op == ReduceOp::kSum ? kNcclSum : kNcclAvg;
  Around before, after;
  if (convert) {
    before = [&](const CommSet& set) { convert_locked(set, bufs, true, op); };
    after = [&](const CommSet& set) { convert_locked(set, bufs, false, op); };
  }
  launch_group(
      bufs, key,
      detail::concat("NCCL all-reduce of ", bufs[0].count, " ", dtype_name(on_wire), " elements",
                     squeeze ? " (compressed float32)" : ""),
      [&](const NcclApi& n, const CommSet& set, int r) {
        void* data = squeeze ? bufs[r].wire : bufs[r].data;
        return n.ncclAllReduce(data, data, static_cast<size_t>(bufs[r].count), dtype, nccl_op,
                               set.comms[comm_index(r)], comm_stream(set, r));
      },
      before, after);
}

void NcclBackend::broadcast(const std::vector<BufferRef>& bufs, int root, int key) {
  const int64_t count = check_collective(*this, Collective::kBroadcast, bufs, bufs, root);
  const int dtype = nccl_dtype(bufs[0].dtype);
  launch_group(bufs, key,
               detail::concat("NCCL broadcast of ", count, " ", dtype_name(bufs[0].dtype),
                              " elements from rank ", root),
               [&](const NcclApi& n, const CommSet& set, int r) {
                 return n.ncclBroadcast(bufs[r].data, bufs[r].data, static_cast<size_t>(count),
                                        dtype, root, set.comms[comm_index(r)],
                                        comm_stream(set, r));
               });
}

void NcclBackend::all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                             int key) {
  const int64_t count = check_collective(*this, Collective::kAllGather, sends, recvs);
  const int dtype = nccl_dtype(sends[0].dtype);
  launch_group(recvs, key,
               detail::concat("NCCL all-gather of ", count, " ", dtype_name(sends[0].dtype),
                              " elements per rank"),
               [&](const NcclApi& n, const CommSet& set, int r) {
                 return n.ncclAllGather(sends[r].data, recvs[r].data, static_cast<size_t>(count),
                                        dtype, set.comms[comm_index(r)], comm_stream(set, r));
               });
}

void NcclBackend::reduce_scatter(const std::vector<BufferRef>& sends,
                                 const std::vector<BufferRef>& recvs, ReduceOp op, int key) {
  const int64_t count = check_collective(*this, Collective::kReduceScatter, sends, recvs);
  const int dtype = nccl_dtype(sends[0].dtype);
  const int nccl_op = op == ReduceOp::kSum ? kNcclSum : kNcclAvg;
  launch_group(sends, key,
               detail::concat("NCCL reduce-scatter of ", count, " ", dtype_name(sends[0].dtype),
                              " elements per rank"),
               [&](const NcclApi& n, const CommSet& set, int r) {
                 return n.ncclReduceScatter(sends[r].data, recvs[r].data,
                                            static_cast<size_t>(count), dtype, nccl_op,
                                            set.comms[comm_index(r)], comm_stream(set, r));
               });
}

void NcclBackend::check() {
  std::string failure;
  try {
    Launch launch = lock_for_launch();
    const CommSet& set = *launch.set;
    const NcclApi& n = nccl(set.nccl_path);
    for (size_t r = 0; r < set.comms.size() && failure.empty(); ++r) {
      ncclResult_t async = kNcclSuccess;
      PYDDP_NCCL(n.ncclCommGetAsyncError(set.comms[r], &async));
      if (async != kNcclSuccess && async != kNcclInProgress) {
        failure = detail::concat("pyddp: NCCL communicator of cuda:", set.devices[r],
                                 " failed asynchronously: ", n.ncclGetErrorString(async));
      }
    }
  } catch (const UsageError&) {
    return;  // closed
  } catch (const ReduceError&) {
    // already failed or aborted: GpuBackend::check reports it
  }
  if (!failure.empty()) {
    fail(failure);
    abort_communication();
  }
  GpuBackend::check();
}

// ------------------------------------------------- replicas on one device

SharedGpuBackend::SharedGpuBackend(int device, int replicas, double timeout_s,
                             const std::string& nvrtc_path)
    : GpuBackend(std::vector<int>(static_cast<size_t>(std::max(replicas, 1)), device), timeout_s,
                 "") {
  PYDDP_ENFORCE(replicas >= 1 && replicas <= kMaxReplicas, "the device backend handles 1 to ",
                kMaxReplicas, " replicas per GPU, got ", replicas);
  kernels_ = &device_kernels(device, nvrtc_path);
}

void SharedGpuBackend::launch_kernel(CUfunction fn, const std::vector<BufferRef>& sends,
                                     const std::vector<BufferRef>& recvs, long long count, int arg,
                                     int key, const std::string& what) {
  PYDDP_ENFORCE(sends.size() == devices_.size(), "got ", sends.size(), " buffers for ",
                devices_.size(), " replicas");
  const size_t n = sends.size();
  KernelPtrs ptrs{};
  for (size_t r = 0; r < n; ++r) {
    PYDDP_ENFORCE(sends[r].device == devices_[0] && recvs[r].device == devices_[0], "replica ", r,
                  " buffer is on device ", sends[r].device, ", expected cuda:", devices_[0]);
    ptrs.p[r] = sends[r].data;
    ptrs.p[n + r] = recvs[r].data;
  }
  int replicas = static_cast<int>(n);
  Launch launch = lock_for_launch();
  const CommSet& set = *launch.set;
  ContextRestore restore;
  wait_ready_locked(set, key);
  const unsigned long long captured = one_capture_locked(set);
  if (count > 0) {
    void* args[] = {&ptrs, &replicas, &count, &arg};
    set_device(devices_[0]);
    PYDDP_CU(driver().cuLaunchKernel(fn, grid_blocks(count), 1, 1, kThreads, 1, 1, 0,
                                     comm_stream(set, 0), args, nullptr));
  }
  watch_locked(set, detail::concat(what, " across ", n, " replicas"), captured);
}

void SharedGpuBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) {
  const int64_t count = check_collective(*this, Collective::kAllReduce, bufs, bufs);
  const DType t = bufs[0].dtype;
  launch_kernel(kernels_->fn[static_cast<int>(t)], bufs, bufs, count, op == ReduceOp::kAvg ? 1 : 0,
                key, detail::concat("on-device all-reduce of ", count, " ", dtype_name(t), " elements"));
}

void SharedGpuBackend::broadcast(const std::vector<BufferRef>& bufs, int root, int key) {
  const int64_t count = check_collective(*this, Collective::kBroadcast, bufs, bufs, root);
  const DType t = bufs[0].dtype;
  launch_kernel(kernels_->broadcast[kernel_width(t)], bufs, bufs, count, root, key,
                detail::concat("on-device broadcast of ", count, " ", dtype_name(t),
                               " elements from replica ", root));
}

void SharedGpuBackend::all_gather(const std::vector<BufferRef>& sends,
                                  const std::vector<BufferRef>& recvs, int key) {
  const int64_t count = check_collective(*this, Collective::kAllGather, sends, recvs);
  const DType t = sends[0].dtype;
  launch_kernel(kernels_->all_gather[kernel_width(t)], sends, recvs, count, 0, key,
                detail::concat("on-device all-gather of ", count, " ", dtype_name(t),
                               " elements per replica"));
}

void SharedGpuBackend::reduce_scatter(const std::vector<BufferRef>& sends,
                                      const std::vector<BufferRef>& recvs, ReduceOp op, int key) {
  const int64_t count = check_collective(*this, Collective::kReduceScatter, sends, recvs);
  const DType t = sends[0].dtype;
  launch_kernel(kernels_->reduce_scatter[static_cast<int>(t)], sends, recvs, count,
                op == ReduceOp::kAvg ? 1 : 0, key,
                detail::concat("on-device reduce-scatter of ", count, " ", dtype_name(t),
                               " elements per replica"));
}

}  // namespace pyddp
