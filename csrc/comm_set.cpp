// The registry of CommSets: see comm_set.h.
#include "comm_set.h"

#include <algorithm>
#include <map>
#include <thread>

namespace pyddp {

using namespace cuda;

namespace {

std::mutex g_sets_mu;
std::map<std::string, std::weak_ptr<CommSet>> g_sets;

}  // namespace

std::string devices_text(const std::vector<int>& devices) {
  std::string out;
  for (int d : devices) out += (out.empty() ? "cuda:" : ", cuda:") + std::to_string(d);
  return out;
}

// Non-blocking communicators return ncclInProgress while NCCL finishes a call
// in the background; the caller polls the communicator's state (NCCL docs,
// "Non-blocking communicators"). Never a blocking call, so never a hang: the
// wait is bounded by the deadline.
void wait_comms(const NcclApi& n, const std::vector<ncclComm_t>& comms,
                std::chrono::steady_clock::time_point deadline, const char* what) {
  for (ncclComm_t c : comms) {
    for (;;) {
      ncclResult_t state = kNcclSuccess;
      PYDDP_NCCL(n.ncclCommGetAsyncError(c, &state));
      if (state == kNcclSuccess) break;
      if (state != kNcclInProgress) {
        throw ReduceError(detail::concat("pyddp: NCCL ", what, " failed: ",
                                         n.ncclGetErrorString(state)));
      }
      if (std::chrono::steady_clock::now() > deadline) {
        throw ReduceError(detail::concat("pyddp: NCCL ", what, " still in progress at the deadline"));
      }
      std::this_thread::yield();
    }
  }
}

namespace {

std::mutex& nccl_launch_mutex() {
  static auto* mu = new std::mutex;  // never destroyed: outlives every set
  return *mu;
}

bool streams_idle(const CommSet& s) {
  RelaxedCaptureMode relaxed;  // (queries, legal during a capture on another thread)
  for (CUstream st : s.streams) {
    if (driver().cuStreamQuery(st) != kCudaSuccess) return false;
  }
  return true;
}

}  // namespace

CommSet::CommSet(bool nccl) : launch_mu(nccl ? nccl_launch_mutex() : own_mu) {}

CommSet::~CommSet() {
  // Best effort, never throws: destroy communicators only when nothing is in
  // flight (ncclCommDestroy would wait for a stuck reduction forever);
  // otherwise abort them, which makes their kernels exit.
  try {
    std::lock_guard<std::mutex> lk(launch_mu);
    ContextRestore restore;
    comms.erase(std::remove(comms.begin(), comms.end(), nullptr), comms.end());
    if (!comms.empty() && !aborted) {
      const NcclApi& n = nccl(nccl_path);
      // Never initialised, or work in flight: abort (destroy would wait).
      bool idle = ready && streams_idle(*this);
      if (idle) {
        try {
          for (ncclComm_t c : comms) {
            const ncclResult_t r = n.ncclCommFinalize(c);  // non-blocking: may be in progress
            if (r != kNcclInProgress) PYDDP_NCCL(r);
          }
          wait_comms(n, comms, std::chrono::steady_clock::now() + std::chrono::seconds(10),
                     "finalize");
        } catch (const std::exception&) {
          idle = false;
        }
      }
      for (ncclComm_t c : comms) idle ? n.ncclCommDestroy(c) : n.ncclCommAbort(c);
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      set_device(devices[i]);
      // Documented as safe with work still queued: resources are released
      // once the stream's work completes.
      driver().cuStreamDestroy(streams[i]);
    }
  } catch (const std::exception&) {
  }
}

std::string nccl_unique_id(const std::string& nccl_path) {
  ncclUniqueId id{};
  PYDDP_NCCL(nccl(nccl_path).ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

std::shared_ptr<CommSet> acquire_comm_set(const std::vector<int>& devices,
                                          const std::string& nccl_path, double timeout_s,
                                          const NcclRendezvous& rdzv) {
  std::string key = (nccl_path.empty() ? "device:" : "nccl:") + devices_text(devices);
  if (rdzv.spans_processes()) {
    PYDDP_ENFORCE(!nccl_path.empty(), "a communicator across processes needs NCCL");
    PYDDP_ENFORCE(rdzv.id.size() == sizeof(ncclUniqueId::internal), "NCCL unique id has ",
                  rdzv.id.size(), " bytes, expected ", sizeof(ncclUniqueId::internal));
    PYDDP_ENFORCE(rdzv.first_rank >= 0 && rdzv.first_rank + static_cast<int>(devices.size()) <=
                                              rdzv.nranks,
                  "ranks ", rdzv.first_rank, "..", rdzv.first_rank + devices.size() - 1,
                  " do not fit in ", rdzv.nranks);
    key += detail::concat(":ranks ", rdzv.first_rank, "/", rdzv.nranks, ":id ",
                          std::hash<std::string>{}(rdzv.id));
  }
  std::lock_guard<std::mutex> lk(g_sets_mu);
  auto it = g_sets.find(key);
  if (it != g_sets.end()) {
    if (auto live = it->second.lock()) {
      std::lock_guard<std::mutex> launch(live->launch_mu);
      if (!live->aborted) return live;
    }
  }
  auto set = std::make_shared<CommSet>(!nccl_path.empty());
  set->key = key;
  set->devices = devices;
  set->nccl_path = nccl_path;
  const DriverApi& d = driver();
  ContextRestore restore;
  for (int dev : devices) {
    set_device(dev);
    CUstream s = nullptr;
    // Non-blocking: no implicit ordering with the legacy default stream;
    // every dependency is an explicit event.
    PYDDP_CU(d.cuStreamCreate(&s, kStreamNonBlocking));
    set->streams.push_back(s);
  }
  if (!nccl_path.empty()) {
    // Init is a call into NCCL on these GPUs too: under the launch lock.
    std::lock_guard<std::mutex> launch(set->launch_mu);
    const NcclApi& n = nccl(nccl_path);
    ncclUniqueId id{};
    int nranks = static_cast<int>(devices.size());
    int first_rank = 0;
    if (rdzv.spans_processes()) {
      std::copy(rdzv.id.begin(), rdzv.id.end(), id.internal);
      nranks = rdzv.nranks;
      first_rank = rdzv.first_rank;
    } else {
      PYDDP_NCCL(n.ncclGetUniqueId(&id));
    }
    set->comms.assign(devices.size(), nullptr);
    ncclConfig config;
    config.blocking = 0;
    // One group: a single thread initialises every rank; outside a group the
    // first blocking init would wait for peers that are never started.
    PYDDP_NCCL(n.ncclGroupStart());
    ncclResult_t first = kNcclSuccess;
    for (size_t r = 0; r < devices.size(); ++r) {
      set_device(devices[r]);  // NCCL binds a communicator to the current device
      const ncclResult_t res = n.ncclCommInitRankConfig(&set->comms[r], nranks, id,
                                                        first_rank + static_cast<int>(r), &config);
      if (first == kNcclSuccess && res != kNcclInProgress) first = res;
    }
    const ncclResult_t ended = n.ncclGroupEnd();
    PYDDP_NCCL(first);
    if (ended != kNcclInProgress) PYDDP_NCCL(ended);
    wait_comms(n, set->comms,
               std::chrono::steady_clock::now() +
                   std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                       std::chrono::duration<double>(timeout_s)),
               "communicator initialisation");
  }
  set->ready = true;
  g_sets[key] = set;
  return set;
}

}  // namespace pyddp
