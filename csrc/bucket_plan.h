// Which parameter lives in which bucket. Pure bookkeeping, no threads: the
// engine consumes the plan, the Python layer lays out flat buffers from it.
#pragma once

#include <cstdint>
#include <vector>

#include "common.h"

namespace pyddp {

// Groups parameters into buckets in `order` (the order their gradients are
// expected to become ready). Parameters of different dtypes never share a
// bucket. The first bucket closes at `first_cap_bytes` so communication starts
// early, later ones at `cap_bytes`. cap_bytes == 0 puts every parameter in its
// own bucket (the per-parameter mode). Buckets are returned in launch order.
//
// `taper`: the last buckets shrink too, so that little is left to reduce once
// backward ends (the last bucket's reduction can only start then, and nothing
// hides it). A bucket opened when R bytes of its dtype are still unplaced
// (itself included) closes at min(cap_bytes, max(first_cap_bytes, R / 2)):
// the tail halves down to the first bucket's size, mirroring the head. A
// parameter is never split, so a large last parameter (a tied embedding)
// still ends in a large bucket.
std::vector<std::vector<int>> plan_buckets(const std::vector<int64_t>& numels,
                                           const std::vector<DType>& dtypes,
                                           const std::vector<int>& order, int64_t first_cap_bytes,
                                           int64_t cap_bytes, bool taper = false);

}  // namespace pyddp
