// The one interface every communication backend implements. The engine's
// launcher thread is its only caller during backward (invariant 1), so
// implementations need not be re-entrant.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace pyddp {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // In place: afterwards every buffer holds the reduction of all of them.
  // All buffers have the same count and dtype (checked by the caller).
  // Synchronous backends return when the values are written; asynchronous ones
  // (GPU) return once the reduction is enqueued, ordered after the work already
  // queued on each replica's compute stream.
  virtual void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) = 0;
  virtual bool asynchronous() const { return false; }
  // The stream (CUstream as an integer) that produces replica's gradients and
  // will consume the reduced ones. Ignored by host backends.
  virtual void set_compute_stream(int /*replica*/, uintptr_t /*stream*/) {}
  // Orders every compute stream after all reductions enqueued so far, without
  // blocking the host. No-op for synchronous backends.
  virtual void fence() {}
  // Throws ReduceError if an enqueued reduction failed or timed out.
  virtual void check() {}
};

}  // namespace pyddp
