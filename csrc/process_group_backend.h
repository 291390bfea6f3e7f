// Across processes: the replicas of this process reduce in process (a local
// backend), then one cross-process all-reduce per bucket is launched through a
// callback that the Python layer provides (torch.distributed, usually gloo),
// so rendezvous and transport come from the existing stack (docs/design.md,
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
  // `first_rank`, `nranks`: this process's replicas are ranks first_rank..
  // of nranks over every process (for reduce_scatter's blocks).
  // `cheap(key)`: whether launch(key) only enqueues (pyddp._hot's Wire
  // takes the bucket, from C++); none: never.
  ProcessGroupBackend(std::shared_ptr<Backend> local, std::function<void(int)> launch, std::string name,
                      int first_rank, int nranks, std::function<bool(int)> cheap = nullptr);
  std::string name() const override { return name_; }
  void all_reduce(const std::vector<BufferRef>& bufs, ReduceOp op, int key) override;
  // Sharded gradients: the local sum (every local replica holds the
  // process's), then launch(key): the cross-process part writes each
  // replica's block (the Python layer's reduce-scatter over processes).
  void reduce_scatter(const std::vector<BufferRef>& sends, const std::vector<BufferRef>& recvs,
                      ReduceOp op, int key) override;
  int ranks(int /*replicas*/) const override { return nranks_; }
  int rank_of(int replica) const override { return first_rank_ + replica; }
  bool launches_cheaply(int key) const override { return cheap_ && cheap_(key); }
  void close() override;

 private:
  std::shared_ptr<Backend> local_;
  std::function<void(int)> launch_;
  const std::string name_;
  const int first_rank_, nranks_;
  const std::function<bool(int)> cheap_;
  std::mutex mu_;  // close() vs a launch in progress
  bool closed_ = false;
};

}  // namespace pyddp
