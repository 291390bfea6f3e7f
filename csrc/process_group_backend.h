// Across processes: the replicas of this process reduce in process (a local
// backend), then one cross-process all-reduce per bucket is launched through a
// callback that the Python layer provides (torch.distributed, usually gloo),
// so rendezvous and transport come from the existing stack (DESIGN.md,
// invariant 10). The launch is asynchronous: the callback enqueues the work and
// returns; the Python layer waits for it at the end of backward.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"

namespace pyddp {

class ProcessGroupBackend : public Backend {
 public:
  // launch(key): starts the cross-process reduction of bucket `key` (replica
  // 0's buffer, already holding this process's sum). Called from the engine's
  // launcher thread only, in bucket-index order.
  ProcessGroupBackend(std::shared_ptr<Backend> local, std::function<void(int)> launch, std::string name);
  std::string name() const override { return name_; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) override;
  void close() override;

 private:
  std::shared_ptr<Backend> local_;
  std::function<void(int)> launch_;
  const std::string name_;
  std::mutex mu_;  // close() vs a launch in progress
  bool closed_ = false;
};

}  // namespace pyddp
