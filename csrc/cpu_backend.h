// In-process collectives across N host buffers (several replicas in one
// process): all-reduce, broadcast, all-gather and reduce-scatter. Large
// buffers are split into chunks handled by a small thread pool so they run
// near memory bandwidth; 16-bit types accumulate in fp32.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "backend.h"

namespace pyddp {

// Fixed pool that runs `fn(chunk)` for chunk in [0, n); the caller takes part.
class ChunkPool {
 public:
  explicit ChunkPool(int threads);
  ~ChunkPool();
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  void run(int n, const std::function<void(int)>& fn);

 private:
  void worker_loop();
  void drain();

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // one run() at a time: callers may share a pool
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int total_ = 0;
  std::atomic<int> next_{0};
  int finished_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

class CpuBackend : public Backend {
 public:
  // threads <= 0: min(4, hardware threads).
  explicit CpuBackend(int threads = 0);
  std::string name() const override { return "cpu"; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) override;
  void broadcast(const std::vector<BufferRef>& bufs, int root, int key) override;
  void all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                  int key) override;
  void reduce_scatter(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                      ReduceOp op, int key) override;
  int threads() const { return pool_.threads(); }

 private:
  void check_host(const std::vector<BufferRef>& bufs) const;
  // fn(begin, end) over [0, count) elements, in chunks on the pool when the
  // bytes are worth waking it.
  void chunked(int64_t count, size_t element_size, const std::function<void(int64_t, int64_t)>& fn);
  // chunked() over n blocks of `count` elements laid end to end:
  // fn(block, first, end) for the part of each block a chunk covers.
  void by_block(int64_t count, size_t n, size_t element_size,
                const std::function<void(int64_t, int64_t, int64_t)>& fn);

  ChunkPool pool_;
};

// Reduces elements [begin, end) of every buffer in place. Exposed for tests.
void reduce_range(const std::vector<BufferRef>& bufs, ReduceOp op, int64_t begin, int64_t end);

}  // namespace pyddp
