// GPU backends. Both order communication after the gradients' producing work
// with events (never a host sync, invariant 5) and watch every enqueued
// reduction against a timeout (invariant 6):
//   NcclBackend    - one replica per GPU, one NCCL communicator per device,
//                    every launch inside ncclGroupStart/End;
//   DeviceBackend  - several replicas sharing one GPU (NCCL refuses two ranks
//                    on one device): a reduction kernel of ours.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"
#include "cuda_api.h"

namespace pyddp {

class GpuBackend : public Backend {
 public:
  ~GpuBackend() override;
  bool asynchronous() const override { return true; }
  void set_compute_stream(int replica, uintptr_t stream) override;
  void fence() override;
  void check() override;
  double timeout_s() const { return timeout_s_; }

 protected:
  // devices[r]: replica r's GPU. comm_per_replica: NCCL needs a stream per
  // rank; replicas sharing one GPU share one communication stream.
  GpuBackend(std::vector<int> devices, double timeout_s, bool comm_per_replica);
  // Call first in all_reduce: the communication streams wait for everything
  // already queued on the compute streams (the gradients being reduced).
  void wait_for_compute();
  // Call last in all_reduce: starts the timeout clock of this reduction.
  void watch(const std::string& what);
  // Called on timeout or asynchronous failure, after which the backend is
  // unusable; returns what it did, for the error message.
  virtual std::string abort_communication() { return "the backend is disabled"; }
  // Marks the backend failed (every later call raises `message`).
  void fail(const std::string& message);
  // Throws ReduceError if the backend failed earlier.
  void throw_if_failed() const;
  // Derived destructors call this first: no watchdog callback into a
  // half-destroyed object.
  void stop_watchdog();
  cuda::CUstream comm_stream(int replica) const { return comm_[replica]; }

  const std::vector<int> devices_;

 private:
  struct InFlight {
    std::string what;
    std::vector<cuda::CUevent> done;  // one per communication stream
    std::chrono::steady_clock::time_point deadline;
  };
  void watchdog_loop();
  // Retires completed launches; true if the oldest one passed its deadline
  // (the caller then aborts, outside mu_).
  bool poll_locked();
  void abort_after_timeout();
  cuda::CUevent take_event_locked(int stream_index);
  void fail_locked(const std::string& message);

  const double timeout_s_;
  std::vector<cuda::CUstream> compute_;  // per replica
  std::vector<cuda::CUstream> comm_;     // per replica (may repeat)
  std::vector<int> comm_owner_;          // replica index owning each distinct comm stream
  std::vector<int> comm_index_;          // per replica: index of its comm stream
  std::vector<cuda::CUevent> ready_;     // per replica
  std::vector<cuda::CUevent> fence_;     // per distinct comm stream
  std::vector<std::vector<cuda::CUevent>> free_events_;  // per distinct comm stream

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<InFlight> in_flight_;
  std::string error_;
  bool stop_ = false;
  std::thread watchdog_;
};

class NcclBackend : public GpuBackend {
 public:
  NcclBackend(std::vector<int> devices, const std::string& nccl_path, double timeout_s);
  ~NcclBackend() override;
  std::string name() const override { return "nccl"; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) override;
  void check() override;

 private:
  std::string abort_communication() override;
  std::vector<cuda::ncclComm_t> comms_;
  // NCCL forbids concurrent calls on one communicator: launches, error polls
  // and the abort take this in turn (the abort waits a bounded time, see there).
  std::timed_mutex nccl_mu_;
  bool aborted_ = false;  // guarded by nccl_mu_
};

// True when this build carries the reduction kernel (a CUDA compiler was
// found at build time).
bool device_kernel_available();

class DeviceBackend : public GpuBackend {
 public:
  static constexpr int kMaxReplicas = 8;  // = PYDDP_MAX_REPLICAS in reduce_kernels.cu
  DeviceBackend(int device, int replicas, double timeout_s);
  ~DeviceBackend() override { stop_watchdog(); }
  std::string name() const override { return "device"; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) override;

 private:
  std::string abort_communication() override {
    return "the kernel is left to finish (it only waits for compute); the backend is disabled";
  }
  cuda::CUfunction kernels_[4] = {};  // indexed by DType
};

}  // namespace pyddp
