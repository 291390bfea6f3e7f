// CPU backend: see cpu_backend.h.
#include "cpu_backend.h"

#include <algorithm>
#include <cstring>

#include "half.h"

namespace pyddp {

namespace {

// Elements per inner block: the accumulator stays in L1 while each replica's
// slice streams through once.
constexpr int64_t kBlock = 2048;
// Below this many bytes per buffer, waking the pool costs more than it saves.
constexpr int64_t kParallelBytes = 1 << 18;
// Chunk boundaries are multiples of this many elements (whole cache lines).
constexpr int64_t kChunkAlign = 64;

template <typename T>
struct Acc {
  using type = T;
  static type load(T v) { return v; }
  static T store(type v) { return v; }
};
template <>
struct Acc<Half> {
  using type = float;
  static float load(Half v) { return half_to_float(v); }
  static Half store(float v) { return float_to_half(v); }
};
template <>
struct Acc<BFloat16> {
  using type = float;
  static float load(BFloat16 v) { return bfloat16_to_float(v); }
  static BFloat16 store(float v) { return float_to_bfloat16(v); }
};

// Reduces elements [begin, end) of `ins` into every buffer of `outs` (all
// the same count; `outs` may be `ins`: all-reduce, or one block's buffer:
// reduce-scatter). Each block is read whole before any output is written.
template <typename T>
void reduce_typed(const std::vector<BufferRef>& ins, const std::vector<BufferRef>& outs, ReduceOp op,
                  int64_t begin, int64_t end) {
  using A = typename Acc<T>::type;
  const size_t n = ins.size();
  const A divisor = static_cast<A>(n);
  A acc[kBlock];
  for (int64_t lo = begin; lo < end; lo += kBlock) {
    const int64_t len = std::min(kBlock, end - lo);
    const T* b0 = static_cast<const T*>(ins[0].data) + lo;
    for (int64_t i = 0; i < len; ++i) acc[i] = Acc<T>::load(b0[i]);
    // Fixed replica order 0, 1, ... so the result does not depend on timing.
    for (size_t r = 1; r < n; ++r) {
      const T* br = static_cast<const T*>(ins[r].data) + lo;
      for (int64_t i = 0; i < len; ++i) acc[i] += Acc<T>::load(br[i]);
    }
    if (op == ReduceOp::kAvg) {
      for (int64_t i = 0; i < len; ++i) acc[i] /= divisor;
    }
    T* out0 = static_cast<T*>(outs[0].data) + lo;
    for (int64_t i = 0; i < len; ++i) out0[i] = Acc<T>::store(acc[i]);
    for (size_t r = 1; r < outs.size(); ++r) {
      std::memcpy(static_cast<T*>(outs[r].data) + lo, out0, static_cast<size_t>(len) * sizeof(T));
    }
  }
}

void reduce_into(const std::vector<BufferRef>& ins, const std::vector<BufferRef>& outs, ReduceOp op,
                 int64_t begin, int64_t end) {
  switch (ins[0].dtype) {
    case DType::kFloat32: return reduce_typed<float>(ins, outs, op, begin, end);
    case DType::kFloat64: return reduce_typed<double>(ins, outs, op, begin, end);
    case DType::kFloat16: return reduce_typed<Half>(ins, outs, op, begin, end);
    case DType::kBFloat16: return reduce_typed<BFloat16>(ins, outs, op, begin, end);
  }
}

// `buf` from element `at` on, `count` elements.
BufferRef block(const BufferRef& buf, int64_t at, int64_t count) {
  BufferRef b = buf;
  b.data = static_cast<char*>(buf.data) + at * static_cast<int64_t>(dtype_size(buf.dtype));
  b.count = count;
  return b;
}

// Copies `count` elements of `from` to `to` unless they are the same memory
// (a collective in place).
void copy_elements(const BufferRef& to, const BufferRef& from, int64_t begin, int64_t end) {
  const size_t es = dtype_size(from.dtype);
  char* dst = static_cast<char*>(to.data) + begin * static_cast<int64_t>(es);
  const char* src = static_cast<const char*>(from.data) + begin * static_cast<int64_t>(es);
  if (dst != src && end > begin) std::memcpy(dst, src, static_cast<size_t>(end - begin) * es);
}

}  // namespace

void reduce_range(const std::vector<BufferRef>& bufs, ReduceOp op, int64_t begin, int64_t end) {
  if (bufs.size() < 2 || begin >= end) {
    // One replica: a sum is the identity and an average divides by one.
    return;
  }
  reduce_into(bufs, bufs, op, begin, end);
}

ChunkPool::ChunkPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
}

ChunkPool::~ChunkPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ChunkPool::drain() {
  int done = 0;
  for (int c = next_.fetch_add(1); c < total_; c = next_.fetch_add(1)) {
    (*fn_)(c);
    ++done;
  }
  if (done > 0) {
    std::lock_guard<std::mutex> lk(mu_);
    finished_ += done;
    if (finished_ == total_) done_cv_.notify_all();
  }
}

void ChunkPool::worker_loop() {
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      work_cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
    }
    drain();
  }
}

void ChunkPool::run(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (workers_.empty() || n == 1) {
    for (int c = 0; c < n; ++c) fn(c);
    return;
  }
  std::lock_guard<std::mutex> one_run(run_mu_);
  {
    std::lock_guard<std::mutex> lk(mu_);
    fn_ = &fn;
    total_ = n;
    finished_ = 0;
    next_.store(0);
    ++generation_;
  }
  work_cv_.notify_all();
  drain();
  // The caller may return only when every chunk is written: the buffers are
  // handed back to compute right after.
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return finished_ == total_; });
  fn_ = nullptr;
}

CpuBackend::CpuBackend(int threads)
    : pool_(threads > 0 ? threads
                        : std::max(1, std::min(4, static_cast<int>(std::thread::hardware_concurrency())))) {}

void CpuBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int /*key*/) {
  if (bufs.empty()) return;
  check_host(bufs);
  const int64_t count = check_collective(*this, Collective::kAllReduce, bufs, bufs);
  chunked(count, dtype_size(bufs[0].dtype),
          [&](int64_t begin, int64_t end) { reduce_range(bufs, op, begin, end); });
}

void CpuBackend::broadcast(const std::vector<BufferRef>& bufs, int root, int /*key*/) {
  check_host(bufs);
  const int64_t count = check_collective(*this, Collective::kBroadcast, bufs, bufs, root);
  chunked(count, dtype_size(bufs[0].dtype), [&](int64_t begin, int64_t end) {
    for (const BufferRef& b : bufs) copy_elements(b, bufs[root], begin, end);
  });
}

void CpuBackend::all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                            int /*key*/) {
  check_host(sends);
  check_host(recvs);
  const int64_t count = check_collective(*this, Collective::kAllGather, sends, recvs);
  // In place, each send is its own block of its receive buffer, which no
  // other copy writes: the order of the copies does not matter.
  by_block(count, sends.size(), dtype_size(sends[0].dtype), [&](int64_t k, int64_t lo, int64_t hi) {
    for (const BufferRef& v : recvs) copy_elements(block(v, k * count, count), sends[k], lo, hi);
  });
}

void CpuBackend::reduce_scatter(const std::vector<BufferRef>& sends,
                                const std::vector<BufferRef>& recvs, ReduceOp op, int /*key*/) {
  check_host(sends);
  check_host(recvs);
  const int64_t count = check_collective(*this, Collective::kReduceScatter, sends, recvs);
  // Block k of every send, summed in replica order (bitwise all_reduce's
  // block k), into replica k's receive buffer.
  by_block(count, sends.size(), dtype_size(sends[0].dtype), [&](int64_t k, int64_t lo, int64_t hi) {
    std::vector<BufferRef> ins;
    for (const BufferRef& s : sends) ins.push_back(block(s, k * count, count));
    reduce_into(ins, {recvs[k]}, op, lo, hi);
  });
}

void CpuBackend::by_block(int64_t count, size_t n, size_t element_size,
                          const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int64_t blocks = static_cast<int64_t>(n);
  chunked(count * blocks, element_size, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin / std::max<int64_t>(count, 1); k < blocks && k * count < end; ++k) {
      fn(k, std::max(begin, k * count) - k * count, std::min(end, (k + 1) * count) - k * count);
    }
  });
}

void CpuBackend::check_host(const std::vector<BufferRef>& bufs) const {
  for (size_t r = 0; r < bufs.size(); ++r) {
    PYDDP_ENFORCE(bufs[r].device < 0, "cpu backend got a device buffer: replica ", r, " device ",
                  bufs[r].device);
  }
}

void CpuBackend::chunked(int64_t count, size_t element_size,
                         const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t bytes = count * static_cast<int64_t>(element_size);
  int chunks = 1;
  if (bytes >= kParallelBytes) {
    chunks = static_cast<int>(std::min<int64_t>(pool_.threads(), bytes / (kParallelBytes / 2)));
  }
  if (chunks <= 1) {
    fn(0, count);
    return;
  }
  const int64_t per = ((count + chunks - 1) / chunks + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
  pool_.run(chunks, [&](int c) {
    const int64_t begin = std::min(count, c * per);
    const int64_t end = std::min(count, begin + per);
    fn(begin, end);
  });
}

}  // namespace pyddp
