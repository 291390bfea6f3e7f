// Bucket planning: see bucket_plan.h.
#include "bucket_plan.h"

#include <algorithm>
#include <map>

namespace pyddp {

std::vector<std::vector<int>> plan_buckets(const std::vector<int64_t>& numels,
                                           const std::vector<DType>& dtypes,
                                           const std::vector<int>& order, int64_t first_cap_bytes,
                                           int64_t cap_bytes, bool taper) {
  const size_t n = numels.size();
  PYDDP_ENFORCE(dtypes.size() == n, "dtypes has ", dtypes.size(), " entries, numels has ", n);
  PYDDP_ENFORCE(order.size() == n, "order has ", order.size(), " entries, expected ", n);
  PYDDP_ENFORCE(cap_bytes >= 0 && first_cap_bytes >= 0, "bucket caps must be >= 0, got ",
                first_cap_bytes, " and ", cap_bytes);
  std::vector<char> seen(n, 0);
  for (int p : order) {
    PYDDP_ENFORCE(p >= 0 && static_cast<size_t>(p) < n, "order names parameter ", p,
                  " but there are ", n);
    PYDDP_ENFORCE(!seen[p], "order names parameter ", p, " twice");
    seen[p] = 1;
  }

  std::vector<std::vector<int>> buckets;
  if (cap_bytes == 0) {
    for (int p : order) buckets.push_back({p});
    return buckets;
  }
  struct Open {
    std::vector<int> params;
    int64_t bytes = 0;
    int64_t unplaced_at_open = 0;  // bytes of its dtype not yet in a bucket, itself included
  };
  auto bytes_of = [&](int p) { return numels[p] * static_cast<int64_t>(dtype_size(dtypes[p])); };
  std::map<DType, int64_t> unplaced;
  for (int p : order) unplaced[dtypes[p]] += bytes_of(p);
  std::map<DType, Open> open;
  const int64_t first_cap = std::max<int64_t>(first_cap_bytes, 1);
  bool first_closed = false;
  for (int p : order) {
    Open& b = open[dtypes[p]];
    int64_t& left = unplaced[dtypes[p]];
    if (b.params.empty()) b.unplaced_at_open = left;
    b.params.push_back(p);
    b.bytes += bytes_of(p);
    left -= bytes_of(p);
    const int64_t cap = !first_closed ? first_cap
                        : taper ? std::min(cap_bytes, std::max(first_cap, b.unplaced_at_open / 2))
                                : cap_bytes;
    if (b.bytes >= cap) {
      buckets.push_back(std::move(b.params));
      b = Open{};
      first_closed = true;
    }
  }
  // Leftover partial buckets launch after the full ones, in the order their
  // first parameter appears.
  std::vector<std::vector<int>> rest;
  for (auto& kv : open) {
    if (!kv.second.params.empty()) rest.push_back(std::move(kv.second.params));
  }
  std::vector<int> position(n);
  for (size_t i = 0; i < n; ++i) position[order[i]] = static_cast<int>(i);
  std::sort(rest.begin(), rest.end(), [&](const std::vector<int>& a, const std::vector<int>& b) {
    return position[a.front()] < position[b.front()];
  });
  for (auto& b : rest) buckets.push_back(std::move(b));
  return buckets;
}

}  // namespace pyddp
