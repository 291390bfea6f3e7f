// The per-parameter all-reduce queue. Autograd threads call mark_ready(replica,
// param); when a parameter is ready on every replica its bucket's count drops,
// and a complete bucket is handed to the single launcher thread, which reduces
// it in place through the backend while backward goes on. finish() settles what
// was never marked and waits for every reduction (docs/design.md, invariants 1-3, 6).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend.h"

namespace pyddp {

struct ParamInfo {
  std::string name;
  int64_t numel = 0;
  DType dtype = DType::kFloat32;
};

// In one process every device gets the same order from one thread, so buckets
// may launch as they complete; across processes every rank must agree, so
// buckets launch in index order. kAfterBackward holds every launch until
// finish(): the no-overlap baseline the benchmarks compare against.
enum class LaunchOrder : uint8_t { kReady, kIndex, kAfterBackward };

// Times are nanoseconds on the steady clock; 0 means "did not happen".
struct IterationStats {
  int64_t iteration = 0;
  int64_t bytes = 0;
  int launches = 0;
  int buckets = 0;
  int64_t forward_end_ns = 0;  // set by note_forward_end(); 0 if never called
  int64_t first_ready_ns = 0;
  int64_t first_launch_ns = 0;
  int64_t last_done_ns = 0;
  int64_t finish_start_ns = 0;
  int64_t finish_end_ns = 0;
  int64_t wait_ns = 0;  // time finish() blocked on outstanding reductions
};

int64_t now_ns();

class Engine {
 public:
  Engine(int num_replicas, std::vector<ParamInfo> params, std::vector<std::vector<int>> buckets,
         LaunchOrder order, ReduceOp op, std::shared_ptr<Backend> backend);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Layout: replaces the bucket plan (only between iterations); every buffer
  // must be set again before the next synced backward.
  void set_buckets(std::vector<std::vector<int>> buckets);
  // During a synced backward too, for a bucket not complete yet: sharded
  // gradients allocate a replica's bucket at its first gradient.
  void set_buffer(int replica, int bucket, BufferRef buf);
  // The bucket's buffer is gone (sharded gradients free a bucket once its
  // block is copied out): allowed between backwards, or once the bucket's
  // reduction returned; launching it again without set_buffer raises.
  void release_buffer(int replica, int bucket);
  // Sharded gradients: replica's block of the bucket's reduce-scatter lands
  // at `recv` (its own memory, `padded_count / ranks` elements) instead of
  // in place in the bucket; 0 restores in place. Set like set_buffer; the
  // backend must honour receive buffers (not the cross-process one).
  void set_recv(int replica, int bucket, uintptr_t recv);
  // Buckets whose reduction call returned since the last call, in that
  // order (for backends that reduce within the call, the CPU one: done).
  std::vector<int> take_completed();
  // Sharded gradients (ZeRO stage 2): `ranks` > 0 makes every bucket a
  // reduce-scatter over the backend's `ranks` ranks instead of an
  // all-reduce: a bucket's buffers then hold its elements padded to a
  // multiple of `ranks` (padded_count), and afterwards replica r holds the
  // reduction in its block only (block backend.rank_of(r)); 0: all-reduce.
  // Only between iterations; buffers must be set again after.
  void set_scatter(int ranks);
  int scatter_ranks() const { return scatter_; }
  int64_t inline_launches() {
    std::lock_guard<std::mutex> lk(mu_);
    return inline_launches_;
  }
  int64_t padded_count(int bucket) const;

  // Hot path: thread-safe, never waits for communication. `stream` (GPU
  // backends) is the stream current where the gradient was accumulated: the
  // reduction waits for the work queued there so far, on the GPU.
  void mark_ready(int replica, int param, uintptr_t stream = 0);

  void set_sync(bool enabled);
  bool sync_enabled() const { return sync_.load(); }

  // End of a synced backward: launches every bucket not launched yet (unused
  // parameters) and waits for all reductions. Returns the parameters with no
  // gradient at all (they stay None) and those settled here that have one (a
  // replica that did not produce it must now point its grad at the bucket).
  // Raises ReduceError on failure, after resetting so the next iteration starts clean.
  struct Settled {
    std::vector<int> no_grad;
    std::vector<int> settled;
  };
  // `streams[r]` (GPU backends): the stream the caller reconciled replica r's
  // unmarked slices on; empty for host backends.
  Settled finish(const std::vector<uintptr_t>& streams = {});
  // A backward failed: wait for in-flight work, drop the iteration.
  void abort();
  // Gradients were zeroed; with set_to_none they are logically None again.
  void clear_grads(bool set_to_none);
  // Whether the parameter holds a gradient, when it changed behind the
  // engine's back (grads present at construction, or set to None by torch).
  void note_grad(int param, bool has_grad);
  bool has_grad(int param) const;
  // (replica, param) pairs not marked in the current synced backward: the
  // caller reconciles their buffer slices before finish() reduces them.
  std::vector<std::pair<int, int>> unmarked() const;
  bool active() const { return active_.load(); }
  // torch DDP's static_graph: the next synced backward counts how many times
  // each (replica, parameter) gradient arrives (a parameter shared by
  // segments of reentrant activation checkpointing arrives once per segment)
  // and reduces every bucket after it; later backwards mark a gradient ready
  // at its counted arrival, and refuse one more.
  void learn_counts();
  bool learning() const { return learning_.load(); }
  std::vector<int> expected_counts() const;  // [replica * P + param]
  // After a reduction every replica holds the same reduced sum. Before that
  // replica accumulates again, the caller zeroes its copy (except replica 0)
  // and calls take_reduced_copy(replica), which returns whether it held such a copy.
  bool take_reduced_copy(int replica);
  // The same flag read and set back without taking it: a backward shadowed
  // under torch's Join leaves the gradients it found (GradSync.shadow_backward).
  bool holds_reduced_copy(int replica) const;
  void restore_reduced_copy(int replica, bool held);
  // Replicas hold gradients that were not reduced yet (no_sync accumulation,
  // cleared copies, or a failed backward): stepping now would diverge replicas.
  bool partial() const { return partial_.load() || failed_.load() != 0; }
  // A failed or late backward's refusal, kept until zero_grad().
  bool failed() const { return failed_.load() != 0; }
  void clear_failed();
  std::string partial_reason() const;

  void inject_fault(int bucket, std::string message);
  // GPU backends: `stream` is about to write replica's buckets (a forward
  // whose backward accumulates there, a zeroing): ordered after the
  // reductions that read them, and fenced at the end of this backward.
  void use_stream(int replica, uintptr_t stream);
  // Raises ReduceError for a failure the backend saw after finish() returned
  // (a GPU timeout); the engine then counts the step as failed.
  void check();
  // Releases the backend's threads and communicators; later use raises.
  void close();

  int num_replicas() const { return num_replicas_; }
  int num_params() const { return static_cast<int>(params_.size()); }
  const std::vector<std::vector<int>>& buckets() const { return buckets_; }
  const std::vector<ParamInfo>& params() const { return params_; }
  std::vector<int> ready_order() const;  // completion order of the last synced iteration
  IterationStats last_stats() const;
  std::string backend_name() const { return backend_->name(); }

  // Observability. note_forward_end() marks the end of the forward that this
  // backward differentiates (DDP's "backward compute" starts there).
  void note_forward_end();
  // Per-(replica, parameter) ready times, kept only while enabled (one clock
  // read per mark); per-bucket times are always kept.
  void set_timeline(bool enabled);
  struct Timeline {
    std::vector<int64_t> bucket_ready_ns, bucket_launch_ns, bucket_done_ns;
    std::vector<int64_t> param_ready_ns;  // [replica * P + param], empty if disabled
  };
  Timeline last_timeline() const;

 private:
  void reset_iteration_locked();
  void complete_param(int param, std::unique_lock<std::mutex>* lk);
  void enqueue_locked(int bucket);
  bool has_launchable_locked() const;
  int pop_launchable_locked();
  void launcher_loop();
  int peek_launchable_locked() const;
  // Pops the next launchable bucket and launches it (lk unlocked meanwhile).
  void launch_locked(std::unique_lock<std::mutex>& lk);
  void stop_launcher();
  std::vector<BufferRef> bucket_buffers(int bucket) const;
  // buffers_/recvs_ index of (replica, bucket), both checked in range.
  size_t slot(int replica, int bucket) const;
  bool bucket_has_grad(int bucket) const;
  // Marked ready in this synced backward: its last expected arrival came.
  bool ready_marked(size_t slot) const {
    return !learning_.load(std::memory_order_relaxed) &&
           marked_[slot].load(std::memory_order_relaxed) >= expected_[slot];
  }
  // A stream that wrote part of replica's bucket, recorded with the others
  // when the replica's part is done (GPU backends).
  void note_stream(int replica, int bucket, uintptr_t stream);
  [[noreturn]] void fail_mark(int replica, int param, const std::string& why) const;
  // GPU: one more of replica's parameters in `bucket` is written (by
  // `stream`); when it was the last, the backend records the ready events.
  void replica_part_done(int replica, int bucket, uintptr_t stream);

  const int num_replicas_;
  const std::vector<ParamInfo> params_;
  const LaunchOrder order_;
  const ReduceOp op_;
  std::shared_ptr<Backend> backend_;
  const bool async_;  // GPU backend: ready events per (replica, bucket)

  std::vector<std::vector<int>> buckets_;
  std::vector<int> bucket_of_;
  std::vector<int64_t> bucket_count_;
  std::vector<BufferRef> buffers_;  // [replica * num_buckets + bucket]
  std::vector<void*> recvs_;           // set_recv's, [replica * num_buckets + bucket]
  std::vector<char> bucket_returned_;  // this iteration, guarded by mu_
  std::vector<int> completed_;         // take_completed's, guarded by mu_
  int scatter_ = 0;                 // set_scatter's ranks; 0: all-reduce

  // Per-iteration counters, reset by finish()/abort().
  std::unique_ptr<std::atomic<int>[]> param_count_;
  std::unique_ptr<std::atomic<int>[]> bucket_pending_;
  std::unique_ptr<std::atomic<int>[]> replica_pending_;     // [replica * B + bucket], GPU only
  std::vector<std::vector<uintptr_t>> replica_streams_;     // same index, under replica_mu_
  std::unique_ptr<std::mutex[]> replica_mu_;                // [replica]
  std::unique_ptr<std::atomic<int>[]> marked_;  // arrivals, [replica * P + param]
  std::vector<int> expected_;                   // arrivals that make it ready, same index
  std::atomic<bool> learning_{false};           // learn_counts(): this backward counts them
  std::unique_ptr<std::atomic<uint8_t>[]> has_grad_;
  std::unique_ptr<std::atomic<uint8_t>[]> reduced_copy_;   // [replica]
  std::unique_ptr<std::atomic<int>[]> ready_order_;
  std::atomic<int> ready_pos_{0};
  std::vector<int> last_ready_order_;  // guarded by mu_
  std::atomic<bool> sync_{true};
  std::atomic<bool> active_{false};
  std::atomic<bool> partial_{false};
  std::atomic<int> partial_kind_{0};
  std::atomic<int> failed_{0};  // kFailed or kLate until zero_grad() (partial_ is per iteration)
  void mark_failed(int kind);
  std::atomic<int64_t> first_ready_ns_{0};
  std::atomic<int64_t> forward_end_ns_{0};
  std::atomic<bool> timeline_{false};
  std::unique_ptr<std::atomic<int64_t>[]> bucket_ready_ns_;
  std::vector<int64_t> bucket_launch_ns_, bucket_done_ns_;  // guarded by mu_
  std::vector<int64_t> param_ready_ns_;                     // written by the marking slot only
  Timeline last_timeline_;                                  // guarded by mu_
  bool flushing_ = false;  // kAfterBackward: finish() released the launches

  // Launcher state, guarded by mu_.
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<int> ready_queue_;      // ready order
  std::vector<char> bucket_ready_;   // index order
  int next_index_ = 0;
  int done_ = 0;
  bool busy_ = false;  // a launch is under way (on the launcher thread or a marking thread)
  bool inline_launch_ = false;  // one replica: a cheap launch from the thread completing a bucket
  int64_t inline_launches_ = 0;  // made so (under mu_; counted for the tests)
  bool stop_ = false;
  std::string error_;
  int fault_bucket_ = -1;
  std::string fault_message_;
  IterationStats current_;
  IterationStats last_;
  int64_t iteration_ = 0;

  std::thread launcher_;
};

}  // namespace pyddp
