// The process-wide registry of communication resources for GPU backends: one
// CommSet (streams, NCCL communicators, launch lock) per device tuple, shared
// by every backend on those devices (GradSyncs, collectives). NCCL documents
// that several communicators on the same GPUs driven from different threads
// can deadlock, so there is one set and one launch lock.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_api.h"

namespace pyddp {

// Streams (one per distinct device) and, for NCCL, one communicator per device.
struct CommSet {
  explicit CommSet(bool nccl);
  std::string key;
  std::vector<int> devices;
  std::vector<cuda::CUstream> streams;
  std::vector<cuda::ncclComm_t> comms;  // empty for the device kernel
  std::string nccl_path;
  // Serializes every call into these communicators and streams: launches,
  // async-error polls, init, abort and destroy. For NCCL sets it is one
  // process-wide lock: NCCL forbids two threads inside one communicator, and
  // warns that communicators sharing GPUs (also overlapping sets, [0,1] and
  // [1,2]) driven from different threads can deadlock. The communicators are
  // non-blocking, so no holder waits long.
  std::mutex own_mu;
  std::mutex& launch_mu;
  bool aborted = false;  // guarded by launch_mu
  bool ready = false;    // communicators initialised
  ~CommSet();
};

// Across processes: the communicator spans `nranks` GPUs of several
// processes; this process's devices are ranks first_rank, first_rank + 1, ...
// `id` is ncclGetUniqueId's bytes from one process, passed to the others
// through torch.distributed's store. Empty id: this process's GPUs alone.
struct NcclRendezvous {
  std::string id;
  int nranks = 0;
  int first_rank = 0;
  bool spans_processes() const { return !id.empty(); }
};

// The live set for (kind, devices), or a new one if there is none or it was
// aborted. NCCL sets initialise their communicators here (one group,
// non-blocking), waiting at most timeout_s.
std::shared_ptr<CommSet> acquire_comm_set(const std::vector<int>& devices,
                                          const std::string& nccl_path, double timeout_s,
                                          const NcclRendezvous& rdzv = {});

// A new NCCL unique id (ncclGetUniqueId), as bytes.
std::string nccl_unique_id(const std::string& nccl_path);

// "cuda:0, cuda:1", for messages.
std::string devices_text(const std::vector<int>& devices);

// Waits until every non-blocking communicator in `comms` finished its call
// (ncclCommGetAsyncError no longer ncclInProgress), at most until `deadline`;
// throws ReduceError naming `what` on an error or at the deadline.
void wait_comms(const cuda::NcclApi& n, const std::vector<cuda::ncclComm_t>& comms,
                std::chrono::steady_clock::time_point deadline, const char* what);

}  // namespace pyddp
