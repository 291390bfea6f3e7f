// Local reduction, then the cross-process launch: see process_group_backend.h.
#include "process_group_backend.h"

namespace pyddp {

ProcessGroupBackend::ProcessGroupBackend(std::shared_ptr<Backend> local, std::function<void(int)> launch,
                           std::string name, int first_rank, int nranks,
                           std::function<bool(int)> cheap)
    : local_(std::move(local)),
      launch_(std::move(launch)),
      name_(std::move(name)),
      first_rank_(first_rank),
      nranks_(nranks),
      cheap_(std::move(cheap)) {
  PYDDP_ENFORCE(first_rank_ >= 0 && nranks_ > first_rank_, "ranks ", first_rank_, " of ", nranks_);
  PYDDP_ENFORCE(local_ != nullptr, "ProcessGroupBackend needs a local backend");
  PYDDP_ENFORCE(static_cast<bool>(launch_), "ProcessGroupBackend needs a launch callback");
}

void ProcessGroupBackend::all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) {
  PYDDP_ENFORCE(key >= 0, "cross-process reductions are per bucket, got key ", key);
  // One replica in this process: its buffer already is the process's sum.
  if (bufs.size() > 1) local_->all_reduce(bufs, op, key);
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw ReduceError("the cross-process backend was closed");
  launch_(key);
}

void ProcessGroupBackend::reduce_scatter(const std::vector<BufferRef>& sends,
                                         const std::vector<BufferRef>& recvs, ReduceOp op, int key) {
  PYDDP_ENFORCE(key >= 0, "cross-process reductions are per bucket, got key ", key);
  check_collective(*this, Collective::kReduceScatter, sends, recvs);
  if (sends.size() > 1) local_->all_reduce(sends, op, key);
  std::lock_guard<std::mutex> lk(mu_);
  if (closed_) throw ReduceError("the cross-process backend was closed");
  launch_(key);
}

void ProcessGroupBackend::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  local_->close();
}

}  // namespace pyddp
