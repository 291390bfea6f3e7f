// The all-reduce queue: see engine.h.
#include "engine.h"

#include <algorithm>

namespace pyddp {

namespace {
enum PartialKind { kNoSync = 1, kCleared = 2, kFailed = 3, kLate = 4 };
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Engine::Engine(int num_replicas, std::vector<ParamInfo> params,
               std::vector<std::vector<int>> buckets, LaunchOrder order, ReduceOp op,
               std::shared_ptr<Backend> backend)
    : num_replicas_(num_replicas),
      params_(std::move(params)),
      order_(order),
      op_(op),
      backend_(std::move(backend)),
      async_(backend_ != nullptr && backend_->asynchronous()) {
  PYDDP_ENFORCE(num_replicas_ >= 1, "need at least one replica, got ", num_replicas_);
  PYDDP_ENFORCE(!params_.empty(), "need at least one parameter");
  PYDDP_ENFORCE(backend_ != nullptr, "no backend");
  replica_mu_.reset(new std::mutex[num_replicas_]);
  const size_t p = params_.size();
  param_count_.reset(new std::atomic<int>[p]);
  marked_.reset(new std::atomic<int>[p * num_replicas_]);
  expected_.assign(p * num_replicas_, 1);
  has_grad_.reset(new std::atomic<uint8_t>[p]);
  reduced_copy_.reset(new std::atomic<uint8_t>[num_replicas_]);
  ready_order_.reset(new std::atomic<int>[p]);
  for (size_t i = 0; i < p; ++i) has_grad_[i].store(0);
  for (int r = 0; r < num_replicas_; ++r) reduced_copy_[r].store(0);
  set_buckets(std::move(buckets));
  inline_launch_ = num_replicas_ == 1;
  launcher_ = std::thread([this] { launcher_loop(); });
}

Engine::~Engine() { stop_launcher(); }

void Engine::stop_launcher() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  if (launcher_.joinable() && launcher_.get_id() != std::this_thread::get_id()) launcher_.join();
}

void Engine::set_buckets(std::vector<std::vector<int>> buckets) {
  std::unique_lock<std::mutex> lk(mu_);
  PYDDP_ENFORCE(!active_.load() && !busy_, "cannot change buckets while a backward is in flight");
  const int p = num_params();
  std::vector<int> bucket_of(p, -1);
  std::vector<int64_t> counts;
  for (size_t b = 0; b < buckets.size(); ++b) {
    PYDDP_ENFORCE(!buckets[b].empty(), "bucket ", b, " is empty");
    int64_t count = 0;
    for (int param : buckets[b]) {
      PYDDP_ENFORCE(param >= 0 && param < p, "bucket ", b, " names parameter ", param,
                    " but there are ", p);
      PYDDP_ENFORCE(bucket_of[param] < 0, "parameter ", param, " is in buckets ",
                    bucket_of[param], " and ", b);
      PYDDP_ENFORCE(params_[param].dtype == params_[buckets[b][0]].dtype, "bucket ", b,
                    " mixes dtypes ", dtype_name(params_[param].dtype), " and ",
                    dtype_name(params_[buckets[b][0]].dtype));
      bucket_of[param] = static_cast<int>(b);
      count += params_[param].numel;
    }
    counts.push_back(count);
  }
  for (int i = 0; i < p; ++i) {
    PYDDP_ENFORCE(bucket_of[i] >= 0, "parameter ", i, " (", params_[i].name, ") is in no bucket");
  }
  buckets_ = std::move(buckets);
  bucket_of_ = std::move(bucket_of);
  bucket_count_ = std::move(counts);
  const size_t nb = buckets_.size();
  BufferRef unset;
  unset.count = -1;  // set_buffer not called yet
  buffers_.assign(nb * num_replicas_, unset);
  bucket_pending_.reset(new std::atomic<int>[nb]);
  replica_pending_.reset(new std::atomic<int>[nb * num_replicas_]);
  replica_streams_.assign(nb * num_replicas_, {});
  backend_->set_keys(static_cast<int>(nb));
  bucket_ready_.assign(nb, 0);
  bucket_returned_.assign(nb, 0);
  recvs_.assign(nb * num_replicas_, nullptr);
  bucket_ready_ns_.reset(new std::atomic<int64_t>[nb]);
  bucket_launch_ns_.assign(nb, 0);
  bucket_done_ns_.assign(nb, 0);
  reset_iteration_locked();
}

void Engine::set_scatter(int ranks) {
  std::unique_lock<std::mutex> lk(mu_);
  PYDDP_ENFORCE(!active_.load() && !busy_, "cannot change the reduction while a backward is in flight");
  PYDDP_ENFORCE(ranks >= 0, "scatter ranks must be >= 0, got ", ranks);
  PYDDP_ENFORCE(ranks == 0 || ranks == backend_->ranks(num_replicas_), "scatter over ", ranks,
                " ranks, but the backend spans ", backend_->ranks(num_replicas_));
  scatter_ = ranks;
  BufferRef unset;
  unset.count = -1;
  buffers_.assign(buckets_.size() * num_replicas_, unset);
  recvs_.assign(buckets_.size() * num_replicas_, nullptr);
}

int64_t Engine::padded_count(int bucket) const {
  PYDDP_ENFORCE(bucket >= 0 && static_cast<size_t>(bucket) < buckets_.size(), "bucket ", bucket,
                " out of range [0, ", buckets_.size(), ")");
  const int64_t count = bucket_count_[bucket];
  return scatter_ > 0 ? (count + scatter_ - 1) / scatter_ * scatter_ : count;
}

size_t Engine::slot(int replica, int bucket) const {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica, " out of range [0, ",
                num_replicas_, ")");
  PYDDP_ENFORCE(bucket >= 0 && static_cast<size_t>(bucket) < buckets_.size(), "bucket ", bucket,
                " out of range [0, ", buckets_.size(), ")");
  return static_cast<size_t>(replica) * buckets_.size() + bucket;
}

void Engine::set_buffer(int replica, int bucket, BufferRef buf) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t at = slot(replica, bucket);
  PYDDP_ENFORCE(!active_.load() || bucket_pending_[bucket].load() > 0,
                "cannot change bucket ", bucket, "'s buffers once its reduction may launch");
  PYDDP_ENFORCE(buf.count == padded_count(bucket), "bucket ", bucket, " holds ",
                padded_count(bucket), " elements", scatter_ > 0 ? " (padded)" : "",
                ", buffer has ", buf.count);
  const DType want = params_[buckets_[bucket][0]].dtype;
  PYDDP_ENFORCE(buf.dtype == want, "bucket ", bucket, " is ", dtype_name(want), ", buffer is ",
                dtype_name(buf.dtype));
  PYDDP_ENFORCE(buf.data != nullptr || buf.count == 0, "null buffer for bucket ", bucket);
  buffers_[at] = buf;
}

void Engine::release_buffer(int replica, int bucket) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t at = slot(replica, bucket);
  PYDDP_ENFORCE(!active_.load() || bucket_returned_[bucket],
                "cannot release bucket ", bucket, "'s buffer before its reduction returned");
  buffers_[at] = BufferRef{};
  recvs_[at] = nullptr;
}

void Engine::set_recv(int replica, int bucket, uintptr_t recv) {
  std::lock_guard<std::mutex> lk(mu_);
  const size_t at = slot(replica, bucket);
  PYDDP_ENFORCE(scatter_ > 0, "set_recv needs sharded gradients (set_scatter)");
  PYDDP_ENFORCE(!active_.load() || bucket_pending_[bucket].load() > 0,
                "cannot change bucket ", bucket, "'s receive buffer once its reduction may launch");
  recvs_[at] = reinterpret_cast<void*>(recv);
}

std::vector<int> Engine::take_completed() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<int> out;
  out.swap(completed_);
  return out;
}

void Engine::fail_mark(int replica, int param, const std::string& why) const {
  throw UsageError(detail::concat("pyddp: replica ", replica, ", parameter ", param, " (",
                                  params_[param].name, "): ", why));
}

void Engine::note_stream(int replica, int bucket, uintptr_t stream) {
  const size_t slot = static_cast<size_t>(replica) * buckets_.size() + bucket;
  std::lock_guard<std::mutex> lk(replica_mu_[replica]);
  auto& seen = replica_streams_[slot];
  if (std::find(seen.begin(), seen.end(), stream) == seen.end()) seen.push_back(stream);
}

void Engine::replica_part_done(int replica, int bucket, uintptr_t stream) {
  const size_t slot = static_cast<size_t>(replica) * buckets_.size() + bucket;
  std::vector<uintptr_t> streams;
  {
    std::lock_guard<std::mutex> lk(replica_mu_[replica]);
    auto& seen = replica_streams_[slot];
    if (std::find(seen.begin(), seen.end(), stream) == seen.end()) seen.push_back(stream);
    if (replica_pending_[slot].fetch_sub(1, std::memory_order_acq_rel) - 1 != 0) return;
    streams.swap(seen);
  }
  // Before this replica's last count below can complete the bucket: the
  // launcher must find these events recorded. Every stream that wrote part of
  // the bucket is recorded now; each already holds its earlier writes.
  backend_->record_ready(replica, bucket, streams);
}

void Engine::mark_ready(int replica, int param, uintptr_t stream) {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica,
                " out of range [0, ", num_replicas_, ")");
  PYDDP_ENFORCE(param >= 0 && param < num_params(), "parameter ", param, " out of range [0, ",
                num_params(), ")");
  if (reduced_copy_[replica].load(std::memory_order_relaxed)) {
    // The gradient was already added to a bucket that holds the reduced sum:
    // this replica now differs, so stepping is refused until zero_grad().
    mark_failed(kLate);
    fail_mark(replica, param,
              "a gradient arrived after the previous backward was reduced: finish() was called "
              "before this replica's backward returned, or a second backward ran over the same "
              "graph with no forward in between, or (pyddp.wrap) a backward ran through the "
              "wrapped model's own module (the model you wrapped, or dmodel.module) instead of "
              "dmodel(...). Call finish() only once every replica's backward has returned, run "
              "forward (through dmodel(...) when wrapped) before each backward, and call "
              "zero_grad() before the next step.");
  }
  has_grad_[param].store(1, std::memory_order_relaxed);
  if (!sync_.load(std::memory_order_relaxed)) {
    // no_sync(): accumulate locally; the next synced backward reduces the sum.
    partial_kind_.store(kNoSync);
    partial_.store(true);
    return;
  }
  const size_t slot = static_cast<size_t>(replica) * params_.size() + param;
  const int arrived = marked_[slot].fetch_add(1, std::memory_order_acq_rel) + 1;
  active_.store(true, std::memory_order_relaxed);
  const int counted = expected_[slot];
  // static_graph's first backward counts only (finish() reduces it), and an
  // arrival before the counted last one accumulates on: either way the
  // reduction must also wait for the stream that wrote it.
  if (learning_.load(std::memory_order_relaxed) || arrived < counted) {
    if (async_) note_stream(replica, bucket_of_[param], stream);
    return;
  }
  if (arrived > counted) {
    // Its bucket was reduced at the counted arrival: this one lands on a
    // reduced copy, so this replica differs until zero_grad() (GradSync's
    // finish() after this error must not make it look whole).
    mark_failed(kFailed);
  }
  if (arrived > counted && counted > 1) {
    fail_mark(replica, param,
              detail::concat("gradient arrived ", arrived, " times in one synced backward, where "
                             "static_graph's first backward counted ", counted, " (its bucket "
                             "was reduced at the last of those): the graph changed, which "
                             "static_graph=True promises it does not. Wrap without "
                             "static_graph, or keep the graph the same at every step."));
  }
  if (arrived > counted) {
    fail_mark(replica, param,
              "gradient produced twice in one synced backward. A parameter used outside the "
              "replica's forward (e.g. a loss term on dmodel.parameters()), a second backward "
              "before the first finished (with several replicas in one process, a backward of "
              "dmodel.module's own outputs, not dmodel(...)'s, never finishes: use a copy of "
              "the model for that), a parameter shared by several segments of reentrant "
              "activation checkpointing (torch.utils.checkpoint with use_reentrant=True, "
              "transformers' gradient_checkpointing_enable() default: each segment's backward "
              "accumulates it once), or (GradSync) a missing finish() after the previous "
              "backward: each gradient is reduced once per backward. Use weight_decay or "
              "no_sync(); for checkpointing, use_reentrant=False (gradient_checkpointing_kwargs="
              "{'use_reentrant': False}) or static_graph=True (its first backward counts each "
              "gradient's arrivals, as torch DDP's does); and call finish() once every "
              "replica's backward has returned.");
  }
  if (async_) replica_part_done(replica, bucket_of_[param], stream);
  const bool timed = timeline_.load(std::memory_order_relaxed);
  int64_t first = first_ready_ns_.load(std::memory_order_relaxed);
  if (timed || first == 0) {
    // One stamp for both, and first_ready_ns_ the earliest of the replicas'
    // (two stamps, or a later stamp's thread first, put a parameter's mark
    // before it: a probe saw a trace instant at -0.042 us).
    const int64_t stamp = now_ns();
    if (timed) param_ready_ns_[slot] = stamp;
    while ((first == 0 || stamp < first) &&
           !first_ready_ns_.compare_exchange_weak(first, stamp, std::memory_order_relaxed)) {
    }
  }
  if (param_count_[param].fetch_add(1, std::memory_order_acq_rel) + 1 == num_replicas_) {
    complete_param(param, nullptr);
  }
}

void Engine::complete_param(int param, std::unique_lock<std::mutex>* held) {
  ready_order_[ready_pos_.fetch_add(1)].store(param, std::memory_order_relaxed);
  const int b = bucket_of_[param];
  if (bucket_pending_[b].fetch_sub(1, std::memory_order_acq_rel) - 1 != 0) return;
  bucket_ready_ns_[b].store(now_ns(), std::memory_order_relaxed);
  if (held != nullptr) {
    enqueue_locked(b);
  } else {
    std::unique_lock<std::mutex> lk(mu_);
    enqueue_locked(b);
    // A launch that only enqueues (across processes, one replica here, a
    // bucket pyddp._hot's Wire takes): made on this thread, as torch DDP's
    // reducer launches from its hooks, unless a launch is under way; no
    // hand-off to the launcher thread on the step's critical path (the last
    // bucket's launch). Anything else (a Python launch: a comm hook, the
    // rider unfilled) stays on the launcher thread.
    while (inline_launch_ && !stop_ && !busy_ && error_.empty() && has_launchable_locked() &&
           backend_->launches_cheaply(peek_launchable_locked())) {
      launch_locked(lk);
      ++inline_launches_;
    }
  }
  // The launcher does the communication; this thread goes back to backward.
  work_cv_.notify_one();
}

void Engine::enqueue_locked(int bucket) {
  // kAfterBackward flushes in index order too: deterministic, so it also
  // holds across processes (every rank launches the same sequence).
  if (order_ == LaunchOrder::kReady) {
    ready_queue_.push_back(bucket);
  } else {
    bucket_ready_[bucket] = 1;
  }
}

bool Engine::has_launchable_locked() const {
  if (order_ == LaunchOrder::kReady) return !ready_queue_.empty();
  if (order_ == LaunchOrder::kAfterBackward && !flushing_) return false;
  return static_cast<size_t>(next_index_) < buckets_.size() && bucket_ready_[next_index_];
}

int Engine::peek_launchable_locked() const {
  return order_ == LaunchOrder::kReady ? ready_queue_.front() : next_index_;
}

int Engine::pop_launchable_locked() {
  if (order_ == LaunchOrder::kReady) {
    const int b = ready_queue_.front();
    ready_queue_.pop_front();
    return b;
  }
  return next_index_++;
}

std::vector<BufferRef> Engine::bucket_buffers(int bucket) const {
  std::vector<BufferRef> bufs(num_replicas_);
  for (int r = 0; r < num_replicas_; ++r) {
    bufs[r] = buffers_[static_cast<size_t>(r) * buckets_.size() + bucket];
    PYDDP_ENFORCE(bufs[r].count == padded_count(bucket),
                  "bucket ", bucket, " has no buffer for replica ", r,
                  bufs[r].count == 0 ? " (released, and not set again)" : " (call set_buffer)");
  }
  return bufs;
}

bool Engine::bucket_has_grad(int bucket) const {
  for (int p : buckets_[bucket]) {
    if (has_grad_[p].load(std::memory_order_relaxed)) return true;
  }
  return false;
}

void Engine::launcher_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    // Not while a launch is under way on a marking thread (inline_launch_):
    // buckets go out one at a time, in order.
    work_cv_.wait(lk, [&] { return stop_ || (!busy_ && error_.empty() && has_launchable_locked()); });
    if (stop_) return;
    launch_locked(lk);
  }
}

void Engine::launch_locked(std::unique_lock<std::mutex>& lk) {
  const int b = pop_launchable_locked();
  busy_ = true;
  const bool fault = (b == fault_bucket_);
  const std::string fault_message = fault_message_;
  if (fault) fault_bucket_ = -1;
  const bool reduce = bucket_has_grad(b);
  lk.unlock();

  const int64_t t_launch = now_ns();
  std::string err;
  try {
    if (fault) throw ReduceError(fault_message);
    if (reduce && scatter_ > 0) {
      const std::vector<BufferRef> sends = bucket_buffers(b);
      std::vector<BufferRef> recvs = sends;
      const int64_t block = sends[0].count / scatter_;
      const size_t es = dtype_size(sends[0].dtype);
      for (int r = 0; r < num_replicas_; ++r) {
        recvs[r].data = static_cast<char*>(sends[r].data) + block * backend_->rank_of(r) * es;
        // set_recv: the block lands in the replica's own memory instead.
        void* own = recvs_[static_cast<size_t>(r) * buckets_.size() + b];
        if (own != nullptr) recvs[r].data = own;
        recvs[r].count = block;
        recvs[r].wire = nullptr;
      }
      backend_->reduce_scatter(sends, recvs, op_, b);
    } else if (reduce) {
      backend_->all_reduce(bucket_buffers(b), op_, b);
    }
  } catch (const std::exception& e) {
    std::string names;
    for (size_t i = 0; i < buckets_[b].size() && i < 3; ++i) {
      names += (i ? ", " : "") + params_[buckets_[b][i]].name;
    }
    if (buckets_[b].size() > 3) names += ", ...";
    err = detail::concat("pyddp: ", scatter_ > 0 ? "reduce-scatter" : "all-reduce", " of bucket ", b, " (", names, ") across ",
                         num_replicas_, " replicas on backend '", backend_->name(),
                         "' failed: ", e.what());
  }
  const int64_t t_done = now_ns();

  lk.lock();
  busy_ = false;
  if (!err.empty()) {
    if (error_.empty()) error_ = err;
    ready_queue_.clear();
  } else {
    ++done_;
    bucket_returned_[b] = 1;
    completed_.push_back(b);
    bucket_launch_ns_[b] = t_launch;
    bucket_done_ns_[b] = t_done;
    if (reduce) {
      ++current_.launches;
      current_.bytes += padded_count(b) * static_cast<int64_t>(dtype_size(params_[buckets_[b][0]].dtype));
      if (current_.first_launch_ns == 0) current_.first_launch_ns = t_launch;
      current_.last_done_ns = t_done;
    }
  }
  done_cv_.notify_all();
  // The launcher may go on (a bucket enqueued while this launch was under way).
  work_cv_.notify_one();
}

Engine::Settled Engine::finish(const std::vector<uintptr_t>& streams) {
  if (!sync_.load()) return {};
  PYDDP_ENFORCE(!async_ || streams.size() == static_cast<size_t>(num_replicas_),
                "finish() on a GPU backend needs one stream per replica, got ", streams.size());
  const int64_t t_start = now_ns();
  Settled out;
  if (async_) {
    // The caller's streams read the reduced gradients next (optimizer step,
    // clipping): fenced with the rest, whatever else happens below.
    for (int r = 0; r < num_replicas_; ++r) backend_->use_stream(r, streams[r]);
    // Slices no replica marked were reconciled on streams[r]: the reduction
    // of their bucket waits for that too.
    for (int r = 0; r < num_replicas_; ++r) {
      for (int p = 0; p < num_params(); ++p) {
        if (!ready_marked(static_cast<size_t>(r) * params_.size() + p)) {
          replica_part_done(r, bucket_of_[p], streams[r]);
        }
      }
    }
  }
  // Every backward has returned, so no mark_ready races with this settling.
  for (int p = 0; p < num_params(); ++p) {
    const int c = param_count_[p].load();
    if (c >= num_replicas_) continue;
    // Unmarked on some replicas: their buffer slice holds what they accumulated
    // (zeros if nothing), so reducing the bucket is exact. Unmarked everywhere
    // and never given a gradient: stays None, like on one device.
    (c == 0 && !has_grad_[p].load() ? out.no_grad : out.settled).push_back(p);
    param_count_[p].store(num_replicas_);
    complete_param(p, nullptr);
  }
  std::unique_lock<std::mutex> lk(mu_);
  if (order_ == LaunchOrder::kAfterBackward) {
    flushing_ = true;
    work_cv_.notify_one();
  }
  const int64_t t_wait = now_ns();
  // Host wait, not a stream wait: on the CPU backend the reduced values are
  // read by the optimizer on this thread right after.
  done_cv_.wait(lk, [&] {
    return stop_ ||
           (!busy_ && (static_cast<size_t>(done_) == buckets_.size() || !error_.empty()));
  });
  std::string err = stop_ ? std::string("pyddp: the engine was closed during finish()") : error_;
  try {
    // Asynchronous backends: every reduction is enqueued; order the compute
    // streams after them (no host wait), on failure too, so nothing rewrites a
    // bucket a queued reduction still reads; then surface failures seen so far.
    backend_->fence();
    if (err.empty()) backend_->check();
  } catch (const std::exception& e) {
    err = err.empty() ? e.what() : err + "; then: " + e.what();
  }
  const int64_t t_end = now_ns();
  current_.iteration = ++iteration_;
  current_.buckets = static_cast<int>(buckets_.size());
  current_.first_ready_ns = first_ready_ns_.load();
  current_.forward_end_ns = forward_end_ns_.load();
  last_timeline_.bucket_ready_ns.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    last_timeline_.bucket_ready_ns[b] = bucket_ready_ns_[b].load();
  }
  last_timeline_.bucket_launch_ns = bucket_launch_ns_;
  last_timeline_.bucket_done_ns = bucket_done_ns_;
  last_timeline_.param_ready_ns = timeline_.load() ? param_ready_ns_ : std::vector<int64_t>{};
  current_.finish_start_ns = t_start;
  current_.finish_end_ns = t_end;
  current_.wait_ns = t_end - t_wait;
  last_ = current_;
  last_ready_order_.resize(ready_pos_.load());
  for (size_t i = 0; i < last_ready_order_.size(); ++i) last_ready_order_[i] = ready_order_[i].load();
  if (learning_.load()) {
    // static_graph's counting backward reduced everything after it, in
    // index order: no ready order for the bucket plan to learn from (it
    // waits for the next backward).
    last_ready_order_.clear();
    // From now on a gradient is ready at its counted arrival (at least one:
    // a parameter unused here may be used later). Not from a backward that
    // failed or where no gradient arrived (a rank shadowing under Join).
    if (err.empty() && active_.load()) {
      for (size_t i = 0; i < expected_.size(); ++i) expected_[i] = std::max(1, marked_[i].load());
      learning_.store(false);
    }
  }
  reset_iteration_locked();
  if (!err.empty()) {
    mark_failed(kFailed);
    throw ReduceError(err);
  }
  for (int r = 0; r < num_replicas_; ++r) reduced_copy_[r].store(1);
  partial_.store(false);  // (a failed or late backward's failed_ stays)
  return out;
}

void Engine::abort() {
  std::unique_lock<std::mutex> lk(mu_);
  ready_queue_.clear();
  std::fill(bucket_ready_.begin(), bucket_ready_.end(), 0);
  done_cv_.wait(lk, [&] { return !busy_; });
  reset_iteration_locked();
  mark_failed(kFailed);
  // Reductions launched before the failure may still be running on the GPU:
  // the compute streams wait for them before anything reuses the buckets.
  backend_->fence();
}

void Engine::reset_iteration_locked() {
  const size_t p = params_.size();
  for (size_t i = 0; i < p; ++i) param_count_[i].store(0);
  for (size_t i = 0; i < p * num_replicas_; ++i) marked_[i].store(0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    bucket_pending_[b].store(static_cast<int>(buckets_[b].size()));
    for (int r = 0; r < num_replicas_; ++r) {
      const size_t slot = static_cast<size_t>(r) * buckets_.size() + b;
      replica_pending_[slot].store(static_cast<int>(buckets_[b].size()));
      replica_streams_[slot].clear();
    }
  }
  ready_queue_.clear();
  std::fill(bucket_ready_.begin(), bucket_ready_.end(), 0);
  std::fill(bucket_returned_.begin(), bucket_returned_.end(), 0);
  completed_.clear();
  next_index_ = 0;
  done_ = 0;
  error_.clear();
  current_ = IterationStats{};
  first_ready_ns_.store(0);
  forward_end_ns_.store(0);
  flushing_ = false;
  for (size_t b = 0; b < buckets_.size(); ++b) bucket_ready_ns_[b].store(0);
  std::fill(bucket_launch_ns_.begin(), bucket_launch_ns_.end(), 0);
  std::fill(bucket_done_ns_.begin(), bucket_done_ns_.end(), 0);
  std::fill(param_ready_ns_.begin(), param_ready_ns_.end(), 0);
  ready_pos_.store(0);
  active_.store(false);
}

void Engine::set_sync(bool enabled) {
  PYDDP_ENFORCE(!active_.load(), "cannot switch no_sync() during a synced backward");
  sync_.store(enabled);
}

void Engine::clear_grads(bool set_to_none) {
  if (active_.load()) {
    throw UsageError(
        "pyddp: zero_grad() while a backward is still open: call finish() once every "
        "replica's backward has returned (or abort() if one raised), then zero_grad()");
  }
  // A failed iteration is dropped here: the backend rebuilds what a failure
  // broke (aborted NCCL communicators, also aborted by another model sharing
  // the GPUs) so the next step runs normally. A no-op when healthy.
  backend_->recover();
  if (set_to_none) {
    for (int p = 0; p < num_params(); ++p) has_grad_[p].store(0);
  }
  for (int r = 0; r < num_replicas_; ++r) reduced_copy_[r].store(0);
  partial_kind_.store(0);
  partial_.store(false);
  failed_.store(0);
}

void Engine::mark_failed(int kind) {
  // Sticky until zero_grad() (or clear_failed(): the caller saw every
  // gradient cleared): later no_sync() or forward events keep their own kind.
  failed_.store(kind);
}

void Engine::clear_failed() { failed_.store(0); }

void Engine::note_grad(int param, bool has_grad) {
  PYDDP_ENFORCE(param >= 0 && param < num_params(), "parameter ", param, " out of range [0, ",
                num_params(), ")");
  has_grad_[param].store(has_grad ? 1 : 0);
}

bool Engine::has_grad(int param) const {
  PYDDP_ENFORCE(param >= 0 && param < num_params(), "parameter ", param, " out of range [0, ",
                num_params(), ")");
  return has_grad_[param].load() != 0;
}

std::vector<std::pair<int, int>> Engine::unmarked() const {
  std::vector<std::pair<int, int>> out;
  if (!sync_.load()) return out;
  for (int r = 0; r < num_replicas_; ++r) {
    for (int p = 0; p < num_params(); ++p) {
      if (!ready_marked(static_cast<size_t>(r) * params_.size() + p)) out.emplace_back(r, p);
    }
  }
  return out;
}

void Engine::learn_counts() {
  PYDDP_ENFORCE(!active_.load(), "cannot learn gradient counts during a synced backward");
  learning_.store(true);
}

std::vector<int> Engine::expected_counts() const { return expected_; }

bool Engine::holds_reduced_copy(int replica) const {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica,
                " out of range [0, ", num_replicas_, ")");
  return reduced_copy_[replica].load() != 0;
}

void Engine::restore_reduced_copy(int replica, bool held) {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica,
                " out of range [0, ", num_replicas_, ")");
  reduced_copy_[replica].store(held ? 1 : 0);
}

bool Engine::take_reduced_copy(int replica) {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica,
                " out of range [0, ", num_replicas_, ")");
  const bool was = reduced_copy_[replica].exchange(0);
  if (was && replica > 0) {
    partial_kind_.store(kCleared);
    partial_.store(true);
  }
  return was;
}

std::string Engine::partial_reason() const {
  const int failed = failed_.load();
  switch (failed ? failed : partial_kind_.load()) {
    case kNoSync:
      return "gradients accumulated under no_sync() were never reduced: run the last backward of "
             "the accumulation outside no_sync() before step()";
    case kCleared:
      return "a forward ran after the last backward and cleared the other replicas' copies of "
             "the reduced gradients: call step() between backward and the next forward";
    case kLate:
      return "a gradient arrived after finish() reduced its bucket (finish() called while a "
             "replica was still in backward?), so the replicas' gradients differ: call "
             "zero_grad() and run the step again";
    case kFailed:
      return "the last backward failed, so gradients are incomplete: call zero_grad() and run "
             "the step again";
    default:
      return "";
  }
}

void Engine::note_forward_end() { forward_end_ns_.store(now_ns()); }

void Engine::set_timeline(bool enabled) {
  std::lock_guard<std::mutex> lk(mu_);
  PYDDP_ENFORCE(!active_.load(), "cannot switch the timeline during a synced backward");
  param_ready_ns_.assign(enabled ? params_.size() * num_replicas_ : 0, 0);
  timeline_.store(enabled);
}

Engine::Timeline Engine::last_timeline() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_timeline_;
}

void Engine::use_stream(int replica, uintptr_t stream) {
  PYDDP_ENFORCE(replica >= 0 && replica < num_replicas_, "replica ", replica,
                " out of range [0, ", num_replicas_, ")");
  backend_->use_stream(replica, stream);
}

void Engine::check() {
  try {
    backend_->check();
  } catch (const ReduceError&) {
    mark_failed(kFailed);
    throw;
  }
}

void Engine::close() {
  // The backend first: it unblocks a launch stuck in communication (an aborted
  // NCCL communicator, a closed cross-process callback); then the launcher,
  // whose launch callback may need the GIL this call released.
  backend_->close();
  stop_launcher();
}

void Engine::inject_fault(int bucket, std::string message) {
  std::lock_guard<std::mutex> lk(mu_);
  PYDDP_ENFORCE(bucket >= 0 && static_cast<size_t>(bucket) < buckets_.size(), "bucket ", bucket,
                " out of range");
  fault_bucket_ = bucket;
  fault_message_ = std::move(message);
}

std::vector<int> Engine::ready_order() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_ready_order_;
}

IterationStats Engine::last_stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return last_;
}

}  // namespace pyddp
