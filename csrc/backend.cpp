// What every backend shares: the refusal of a collective it lacks, and the
// checks of a collective's buffers (backend.h).
#include "backend.h"

namespace pyddp {

const char* kind_name(Collective kind) {
  switch (kind) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
  }
  return "?";
}

void Backend::broadcast(const std::vector<BufferRef>&, int, int) {
  throw UsageError("the " + name() + " backend has no broadcast");
}
void Backend::all_gather(const std::vector<BufferRef>&, const std::vector<BufferRef>&, int) {
  throw UsageError("the " + name() + " backend has no all_gather");
}
void Backend::reduce_scatter(const std::vector<BufferRef>&, const std::vector<BufferRef>&, ReduceOp,
                             int) {
  throw UsageError("the " + name() + " backend has no reduce_scatter");
}

int64_t check_collective(const Backend& backend, Collective kind, const std::vector<BufferRef>& sends,
                         const std::vector<BufferRef>& recvs, int root) {
  const char* what = kind_name(kind);
  PYDDP_ENFORCE(!sends.empty(), what, ": no buffers");
  PYDDP_ENFORCE(sends.size() == recvs.size(), what, ": ", sends.size(), " send buffers and ",
                recvs.size(), " receive buffers");
  const int n = backend.ranks(static_cast<int>(sends.size()));
  const bool gather = kind == Collective::kAllGather, scatter = kind == Collective::kReduceScatter;
  // Elements per rank: the count of the smaller side.
  const int64_t count = scatter ? recvs[0].count : sends[0].count;
  PYDDP_ENFORCE(count >= 0, what, ": negative count ", count);
  const int64_t send_count = scatter ? count * n : count;
  const int64_t recv_count = gather ? count * n : count;
  const DType dtype = sends[0].dtype;
  const size_t es = dtype_size(dtype);
  for (size_t r = 0; r < sends.size(); ++r) {
    const BufferRef &s = sends[r], &v = recvs[r];
    PYDDP_ENFORCE(s.dtype == dtype && v.dtype == dtype, what, ": replica ", r, "'s buffers are ",
                  dtype_name(s.dtype), " and ", dtype_name(v.dtype), ", replica 0's ",
                  dtype_name(dtype));
    PYDDP_ENFORCE(s.count == send_count, what, ": replica ", r, " sends ", s.count,
                  " elements, expected ", send_count, " (", n, " ranks)");
    PYDDP_ENFORCE(v.count == recv_count, what, ": replica ", r, " receives ", v.count,
                  " elements, expected ", recv_count, " (", n, " ranks)");
    PYDDP_ENFORCE(count == 0 || (s.data != nullptr && v.data != nullptr), what,
                  ": null buffer for replica ", r);
    PYDDP_ENFORCE(s.device == v.device, what, ": replica ", r, " sends from device ", s.device,
                  " and receives on ", v.device);
    if ((gather || scatter) && count > 0) {
      // NCCL's rule: in place only at the rank's own block, else disjoint.
      const char* big = static_cast<const char*>(gather ? v.data : s.data);
      const char* small = static_cast<const char*>(gather ? s.data : v.data);
      const size_t block = static_cast<size_t>(count) * es;
      const char* own = big + static_cast<size_t>(backend.rank_of(static_cast<int>(r))) * block;
      const bool disjoint = small + block <= big || big + block * n <= small;
      PYDDP_ENFORCE(small == own || disjoint, what, ": replica ", r,
                    "'s buffers overlap other than in place (the smaller must be the larger's "
                    "block of rank ", backend.rank_of(static_cast<int>(r)), ", or apart)");
    }
  }
  if (kind == Collective::kBroadcast) {
    PYDDP_ENFORCE(root >= 0 && root < n, "broadcast: root ", root, " is not one of the ", n,
                  " ranks");
  }
  return count;
}

}  // namespace pyddp
