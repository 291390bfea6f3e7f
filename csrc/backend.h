// The one interface every communication backend implements. The engine's
// launcher thread is its only caller of collectives during backward
// (invariant 1); record_ready comes from the threads that produce gradients.
//
// Four collectives, NCCL's: all_reduce, broadcast, all_gather and
// reduce_scatter. Their "ranks" are every buffer of every process the
// backend spans (ranks(); replica r of this process is rank_of(r)), and
// element blocks are laid out in rank order, as NCCL lays them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace pyddp {

enum class Collective : uint8_t { kAllReduce, kBroadcast, kAllGather, kReduceScatter };
const char* kind_name(Collective kind);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // In place: afterwards every buffer holds the reduction of all of them.
  // All buffers have the same count and dtype (checked by the caller).
  // Synchronous backends return when the values are written; asynchronous ones
  // (GPU) return once the reduction is enqueued, ordered after the work that
  // record_ready(replica, key, ...) captured for every replica.
  virtual void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) = 0;
  // In place: afterwards every buffer holds the values of rank `root`'s.
  virtual void broadcast(const std::vector<BufferRef>& bufs, int root, int key);
  // sends[r]: `count` elements; recvs[r]: ranks() * count, block k is rank
  // k's send. In place when sends[r] is recvs[r]'s own block (rank_of(r)).
  virtual void all_gather(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                          int key);
  // sends[r]: ranks() * count elements; recvs[r]: `count`, the reduction
  // over every rank of block rank_of(r). In place when recvs[r] is that
  // block of sends[r].
  virtual void reduce_scatter(const std::vector<BufferRef>& sends,
                              const std::vector<BufferRef>& recvs, ReduceOp op, int key);
  // How many ranks the collectives span, and replica r's among them.
  // `replicas`: how many buffers this process passes.
  virtual int ranks(int replicas) const { return replicas; }
  virtual int rank_of(int replica) const { return replica; }
  virtual bool asynchronous() const { return false; }
  // Launches made into a CUDA graph capture, which run at each replay (GPUs).
  virtual long long captured_launches() const { return 0; }
  // Whether the reduction of bucket `key` over one replica's buffer only
  // enqueues work (no reduction on the calling thread, no Python, nothing
  // waited for): the engine then launches it from the thread that completed
  // it.
  virtual bool launches_cheaply(int /*key*/) const { return false; }
  // Keys are bucket indices in [0, n); key -1 is for one-off collectives.
  virtual void set_keys(int /*n*/) {}
  // GPU: the data of `key` on `replica` is produced by work already queued on
  // `streams` (CUstream handles; 0 is the legacy default stream of replica's
  // device). Records events there now, on the calling thread, so the
  // reduction waits for exactly that work and not for what is queued later.
  virtual void record_ready(int /*replica*/, int /*key*/, const std::vector<uintptr_t>& /*streams*/) {}
  // GPU: `stream` is about to write replica's buffers: it waits (on the GPU)
  // for every reduction enqueued so far, and fence() will order it after the
  // ones to come.
  virtual void use_stream(int /*replica*/, uintptr_t /*stream*/) {}
  // Orders every stream that wrote a buffer since the last fence after all
  // reductions enqueued so far, without blocking the host.
  virtual void fence() {}
  // Throws ReduceError if an enqueued reduction failed or timed out.
  virtual void check() {}
  // After a failure was reported: make the next reduction start clean
  // (GPU: rebuild aborted communicators). No-op when healthy.
  virtual void recover() {}
  // Releases threads and communicators now; later calls raise. Idempotent.
  virtual void close() {}
};

// Checks one collective's buffers against the backend's ranks (recvs ==
// sends for all_reduce and broadcast): one pair per replica, one dtype, the
// counts the kind needs, in place only at the rank's own block; returns the
// elements per rank. Throws UsageError naming what is wrong.
int64_t check_collective(const Backend& backend, Collective kind, const std::vector<BufferRef>& sends,
                         const std::vector<BufferRef>& recvs, int root = 0);

}  // namespace pyddp
