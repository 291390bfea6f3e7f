// The one interface every communication backend implements. The engine's
// launcher thread is its only caller (invariant 1), so implementations need not
// be re-entrant.
#pragma once

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
  virtual void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op) = 0;
};

}  // namespace pyddp
