// GPU backends. Both order communication after the gradients' producing work
// with events recorded where each gradient was produced (never a host sync,
// invariant 5), and watch every enqueued reduction against a timeout
// (invariant 6):
//   NcclBackend    - one replica per GPU; non-blocking NCCL communicators,
//                    every launch inside ncclGroupStart/End;
//   SharedGpuBackend  - several replicas sharing one GPU (NCCL refuses two ranks
//                    on one device): pyddp's kernel, compiled by NVRTC.
// Communication streams and communicators come from the process-wide
// registry in comm_set.h.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "comm_set.h"
#include "cuda_api.h"
#include "device_kernel.h"

namespace pyddp {

class GpuBackend : public Backend {
 public:
  ~GpuBackend() override;
  bool asynchronous() const override { return true; }
  void set_keys(int n) override;
  void record_ready(int replica, int key, const std::vector<uintptr_t>& streams) override;
  void use_stream(int replica, uintptr_t stream) override;
  void fence() override;
  void check() override;
  void recover() override;
  void close() override;
  double timeout_s() const { return timeout_s_; }
  // Launches made into a CUDA graph capture (not watched: they run at replay).
  long long captured_launches() const override { return captured_launches_.load(); }

 protected:
  // devices[r]: replica r's GPU. nccl_path empty: the device kernel's set.
  GpuBackend(std::vector<int> devices, double timeout_s, std::string nccl_path,
             NcclRendezvous rdzv = {});
  // A launch holds its set (close() may drop the backend's reference
  // meanwhile) and the set's launch lock; the lock is released first.
  struct Launch {
    std::shared_ptr<CommSet> set;
    std::unique_lock<std::mutex> lock;
  };
  // Throws if closed, failed or aborted (an abort by another backend sharing
  // the set counts as this backend's failure too).
  Launch lock_for_launch();
  // Under the launch lock: the communication stream of each replica waits
  // for the events record_ready captured under `key`.
  void wait_ready_locked(const CommSet& set, int key);
  // Under the launch lock, after the ready waits: the CUDA graph capture every
  // communication stream takes part in (0: none), or UsageError if they differ.
  unsigned long long one_capture_locked(const CommSet& set);
  // Under the launch lock, after the launch: starts the timeout clock, unless
  // the launch was `captured` into a graph (one_capture_locked's id).
  void watch_locked(const CommSet& set, const std::string& what, unsigned long long captured);
  void fail(const std::string& message);
  void throw_if_failed() const;
  // Frees a hung collective (NCCL: abort the communicators under the launch
  // lock) and notes what it did in the error message.
  void abort_communication();
  cuda::CUstream comm_stream(const CommSet& set, int replica) const {
    return set.streams[comm_index_[replica]];
  }
  int comm_index(int replica) const { return comm_index_[replica]; }
  // The communicator's ranks: every process's GPUs.
  int comm_ranks() const {
    return rdzv_.spans_processes() ? rdzv_.nranks : static_cast<int>(devices_.size());
  }
  int first_rank() const { return rdzv_.spans_processes() ? rdzv_.first_rank : 0; }

  const std::vector<int> devices_;

 private:
  struct Slot {
    std::vector<cuda::CUevent> events;
    int used = 0;
  };
  struct InFlight {
    std::string what;
    std::vector<cuda::CUevent> done;  // one per communication stream
    std::chrono::steady_clock::time_point deadline;
  };
  Slot& slot(int replica, int key) { return slots_[(key + 1) * devices_.size() + replica]; }
  void watchdog_loop();
  bool poll_locked();  // true: the oldest launch passed its deadline
  void stop_watchdog();
  cuda::CUevent take_event_locked(const CommSet& set, int stream_index);
  // The set was aborted (by this backend or another sharing it): fail.
  void note_abort(const CommSet& set);
  void fail_locked(const std::string& message);
  void add_writer_locked(int replica, uintptr_t stream);
  // Under writers_mu_: `stream` waits on the fence of communication stream
  // `comm_index`, where CUDA's capture rules allow it.
  void wait_fence_locked(cuda::CUstream stream, int comm_index);
  // After an error that killed a CUDA context (seen by any driver call in
  // the process: cuda::dead_context_error()), every entry point raises that
  // failure itself (which call or reduction, which GPU, restart the process)
  // rather than whatever driver call fails next on the dead context.
  void throw_if_dead() const;
  // Before a rebuild: asks each communication stream's context whether it is
  // alive (a timeout or an NCCL error can be the first sign of a dead one).
  void probe_contexts(const CommSet& set);

  const double timeout_s_;
  const std::string nccl_path_;
  const NcclRendezvous rdzv_;
  std::shared_ptr<CommSet> set_;
  std::vector<int> comm_index_;        // per replica: index into set_->streams
  std::vector<cuda::CUevent> fence_;   // per communication stream
  // Per communication stream: the capture its fence was last recorded in, 0
  // outside any (under writers_mu_).
  std::vector<unsigned long long> fence_capture_;
  std::vector<Slot> slots_;            // [(key + 1) * replicas + replica]
  std::mutex writers_mu_;
  std::vector<std::vector<uintptr_t>> writers_;  // per replica, since the last fence
  std::vector<std::vector<cuda::CUevent>> free_events_;  // per communication stream

  std::atomic<long long> captured_launches_{0};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> in_flight_;
  std::string error_;
  bool closed_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

class NcclBackend : public GpuBackend {
 public:
  NcclBackend(std::vector<int> devices, const std::string& nccl_path, double timeout_s,
              NcclRendezvous rdzv = {});
  ~NcclBackend() override { close(); }
  std::string name() const override { return "nccl"; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) override;
  void broadcast(const std::vector<BufferRef>& bufs, int root, int key) override;
  void all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                  int key) override;
  void reduce_scatter(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                      ReduceOp op, int key) override;
  // NCCL's ranks: every GPU of every process; replica r is rank
  // first_rank + its device's index among this process's sorted GPUs.
  int ranks(int /*replicas*/) const override { return comm_ranks(); }
  int rank_of(int replica) const override { return first_rank() + comm_index(replica); }
  void check() override;
  // Wire compression of float32 buckets: kFloat16 or kBFloat16 (by name),
  // "float32" for none. Loads the conversion kernels on every device.
  void set_compression(const std::string& dtype, const std::string& nvrtc_path);
  std::string compression() const { return dtype_name(wire_); }
  // A communication hook outside the core (torch DDP's Python hooks:
  // PowerSGD, a user's), run on `stream`, a stream of the caller's (torch's:
  // its allocator keeps handles of the streams its tensors were used on, so
  // it never sees pyddp's own). Each bucket's all-reduce becomes: `stream`
  // waits for the communication stream, as it is after the bucket's ready
  // events; hook(key) queues the reduction on `stream` before it returns;
  // the communication stream waits for `stream`; the watch and the fence
  // then cover it as they cover NCCL's. One GPU per process: the hook
  // reduces this process's bucket across processes, as under torch DDP.
  // Sums outside the engine (key -1) stay NCCL's.
  using Hook = std::function<void(int)>;
  void set_hook(Hook hook, uintptr_t stream);

 private:
  void launch_hooked(const std::vector<BufferRef>& bufs, int key);
  // One NCCL call per replica (`call(api, replica)`, on the replica's
  // device) as one group, after the ready events of `key`, then the poll of
  // the non-blocking launch and the timeout clock for `what`. `before` and
  // `after` run under the launch lock around the group (wire compression).
  using Call = std::function<cuda::ncclResult_t(const cuda::NcclApi&, const CommSet&, int)>;
  using Around = std::function<void(const CommSet&)>;
  void launch_group(const std::vector<BufferRef>& bufs, int key, const std::string& what,
                    const Call& call, const Around& before = {}, const Around& after = {});
  // Launches one conversion kernel per replica on its communication stream.
  void convert_locked(const CommSet& set, const std::vector<BufferRef>& bufs, bool to_wire,
                      ReduceOp op);

  DType wire_ = DType::kFloat32;  // kFloat32: no compression
  Hook hook_;  // set once, before the first launch
  cuda::CUstream hook_stream_ = nullptr;
  cuda::CUevent hook_in_ = nullptr, hook_out_ = nullptr;  // left to the context, as all events
  std::vector<const DeviceKernels*> wire_kernels_;  // per replica
};

class SharedGpuBackend : public GpuBackend {
 public:
  static constexpr int kMaxReplicas = 8;  // = PYDDP_MAX_REPLICAS in reduce_kernels.cu
  SharedGpuBackend(int device, int replicas, double timeout_s, const std::string& nvrtc_path);
  ~SharedGpuBackend() override { close(); }
  std::string name() const override { return "device"; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) override;
  void broadcast(const std::vector<BufferRef>& bufs, int root, int key) override;
  void all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                  int key) override;
  void reduce_scatter(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                      ReduceOp op, int key) override;
  int ranks(int replicas) const override { return replicas; }
  int rank_of(int replica) const override { return replica; }
  std::string kernel_description() const { return kernels_->how; }

 private:
  // One kernel over `count` elements on the GPU's communication stream,
  // after the ready events of `key`; `ptrs`: sends then receives.
  void launch_kernel(cuda::CUfunction fn, const std::vector<BufferRef>& sends,
                     const std::vector<BufferRef>& recvs, long long count, int arg, int key,
                     const std::string& what);

  const DeviceKernels* kernels_ = nullptr;
};

}  // namespace pyddp
