// Run-time loading of the CUDA driver API and NCCL: see cuda_api.h.
#include "cuda_api.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace pyddp {
namespace cuda {

namespace {

std::mutex g_mu;
DriverApi g_driver{};
bool g_driver_loaded = false;
NcclApi g_nccl{};
std::string g_nccl_path;
NvrtcApi g_nvrtc{};
std::string g_nvrtc_path;
bool g_simulated = false;
std::vector<CUcontext> g_contexts;

void* open_library(const std::string& path, const std::string& what) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    throw UsageError(detail::concat("cannot load ", what, " from '", path, "': ", err ? err : "?"));
  }
  return lib;
}

// Loads `path` into `api` the first time, binding its symbols with `bind_all`;
// later calls get the same table, and another path in one process is refused
// (two copies of NCCL or NVRTC would not share state). Caller holds g_mu.
template <typename Api, typename BindAll>
const Api& load_once(Api& api, std::string& loaded, const std::string& path, const char* what,
                     BindAll bind_all) {
  if (!loaded.empty()) {
    PYDDP_ENFORCE(loaded == path, what, " already loaded from ", loaded, "; cannot also load ",
                  path, " in one process");
    return api;
  }
  void* lib = open_library(path, what);
  Api fresh{};
  bind_all(lib, fresh, "'" + path + "'");
  api = fresh;
  loaded = path;
  return api;
}

template <typename Fn>
void bind(void* lib, Fn& slot, const char* symbol, const std::string& what) {
  void* p = dlsym(lib, symbol);
  if (p == nullptr) {
    throw UsageError(detail::concat(what, " lacks symbol ", symbol,
                                    ": not the library pyddp expects (too old?)"));
  }
  slot = reinterpret_cast<Fn>(p);
}

// Leaves `slot` null where the library lacks `symbol`.
template <typename Fn>
void bind_optional(void* lib, Fn& slot, const char* symbol) {
  slot = reinterpret_cast<Fn>(dlsym(lib, symbol));
}

}  // namespace

std::string driver_library() {
  const char* env = std::getenv("PYDDP_CUDA_LIBRARY");
  return env != nullptr && *env != '\0' ? env : "libcuda.so.1";
}

bool driver_is_simulated() {
  driver();
  std::lock_guard<std::mutex> lk(g_mu);
  return g_simulated;
}

const DriverApi& driver() {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_driver_loaded) return g_driver;  // never changes once loaded
  const std::string what = driver_library();
  void* lib = dlopen(what.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    throw UsageError(detail::concat("CUDA driver not found (dlopen ", what, ": ", err ? err : "?",
                                    "): no NVIDIA driver on this machine; use CPU replicas"));
  }
  DriverApi d{};
  bind(lib, d.cuInit, "cuInit", what);
  bind(lib, d.cuDriverGetVersion, "cuDriverGetVersion", what);
  bind(lib, d.cuDeviceGetCount, "cuDeviceGetCount", what);
  bind(lib, d.cuDeviceGet, "cuDeviceGet", what);
  bind(lib, d.cuDeviceGetName, "cuDeviceGetName", what);
  bind(lib, d.cuDeviceGetAttribute, "cuDeviceGetAttribute", what);
  bind(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", what);
  bind(lib, d.cuCtxSetCurrent, "cuCtxSetCurrent", what);
  bind(lib, d.cuCtxGetCurrent, "cuCtxGetCurrent", what);
  bind(lib, d.cuStreamCreate, "cuStreamCreate", what);
  bind(lib, d.cuStreamDestroy, "cuStreamDestroy_v2", what);
  bind(lib, d.cuStreamWaitEvent, "cuStreamWaitEvent", what);
  bind(lib, d.cuStreamQuery, "cuStreamQuery", what);
  bind_optional(lib, d.cuStreamGetCaptureInfo2, "cuStreamGetCaptureInfo_v2");
  bind_optional(lib, d.cuStreamGetCaptureInfo3, "cuStreamGetCaptureInfo_v3");
  bind_optional(lib, d.cuThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode");
  bind(lib, d.cuEventCreate, "cuEventCreate", what);
  bind(lib, d.cuEventDestroy, "cuEventDestroy_v2", what);
  bind(lib, d.cuEventRecord, "cuEventRecord", what);
  bind(lib, d.cuEventQuery, "cuEventQuery", what);
  bind(lib, d.cuGetErrorString, "cuGetErrorString", what);
  bind(lib, d.cuModuleLoadData, "cuModuleLoadData", what);
  bind(lib, d.cuModuleGetFunction, "cuModuleGetFunction", what);
  bind(lib, d.cuLaunchKernel, "cuLaunchKernel", what);
  const CUresult r = d.cuInit(0);
  if (r != kCudaSuccess) {
    throw UsageError(detail::concat("cuInit failed with CUDA error ", r,
                                    ": the driver is installed but no usable GPU was found"));
  }
  g_driver = d;
  g_driver_loaded = true;
  g_simulated = dlsym(lib, "simgpu_version") != nullptr;
  return g_driver;
}

const NcclApi& nccl(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  return load_once(g_nccl, g_nccl_path, path, "NCCL",
                   [](void* lib, NcclApi& n, const std::string& what) {
                     bind(lib, n.ncclGetVersion, "ncclGetVersion", what);
                     bind(lib, n.ncclGetUniqueId, "ncclGetUniqueId", what);
                     bind(lib, n.ncclCommInitRankConfig, "ncclCommInitRankConfig", what);
                     bind(lib, n.ncclCommFinalize, "ncclCommFinalize", what);
                     bind(lib, n.ncclCommDestroy, "ncclCommDestroy", what);
                     bind(lib, n.ncclCommAbort, "ncclCommAbort", what);
                     bind(lib, n.ncclCommGetAsyncError, "ncclCommGetAsyncError", what);
                     bind(lib, n.ncclGetErrorString, "ncclGetErrorString", what);
                     bind(lib, n.ncclAllReduce, "ncclAllReduce", what);
                     bind(lib, n.ncclBroadcast, "ncclBroadcast", what);
                     bind(lib, n.ncclAllGather, "ncclAllGather", what);
                     bind(lib, n.ncclReduceScatter, "ncclReduceScatter", what);
                     bind(lib, n.ncclGroupStart, "ncclGroupStart", what);
                     bind(lib, n.ncclGroupEnd, "ncclGroupEnd", what);
                   });
}

const NvrtcApi& nvrtc(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  return load_once(g_nvrtc, g_nvrtc_path, path, "NVRTC",
                   [](void* lib, NvrtcApi& n, const std::string& what) {
                     bind(lib, n.nvrtcVersion, "nvrtcVersion", what);
                     bind(lib, n.nvrtcGetNumSupportedArchs, "nvrtcGetNumSupportedArchs", what);
                     bind(lib, n.nvrtcGetSupportedArchs, "nvrtcGetSupportedArchs", what);
                     bind(lib, n.nvrtcCreateProgram, "nvrtcCreateProgram", what);
                     bind(lib, n.nvrtcCompileProgram, "nvrtcCompileProgram", what);
                     bind(lib, n.nvrtcGetProgramLogSize, "nvrtcGetProgramLogSize", what);
                     bind(lib, n.nvrtcGetProgramLog, "nvrtcGetProgramLog", what);
                     bind(lib, n.nvrtcGetCUBINSize, "nvrtcGetCUBINSize", what);
                     bind(lib, n.nvrtcGetCUBIN, "nvrtcGetCUBIN", what);
                     bind(lib, n.nvrtcGetPTXSize, "nvrtcGetPTXSize", what);
                     bind(lib, n.nvrtcGetPTX, "nvrtcGetPTX", what);
                     bind(lib, n.nvrtcDestroyProgram, "nvrtcDestroyProgram", what);
                     bind(lib, n.nvrtcGetErrorString, "nvrtcGetErrorString", what);
                   });
}

std::string nvrtc_version(const std::string& path) {
  int major = 0, minor = 0;
  PYDDP_NVRTC(nvrtc(path).nvrtcVersion(&major, &minor));
  return std::to_string(major) + "." + std::to_string(minor);
}

int compute_capability(int device) {
  const DriverApi& d = driver();
  CUdevice dev = 0;
  PYDDP_CU(d.cuDeviceGet(&dev, device));
  int major = 0, minor = 0;
  PYDDP_CU(d.cuDeviceGetAttribute(&major, kAttrComputeCapabilityMajor, dev));
  PYDDP_CU(d.cuDeviceGetAttribute(&minor, kAttrComputeCapabilityMinor, dev));
  return major * 10 + minor;
}

std::string nccl_path() {
  std::lock_guard<std::mutex> lk(g_mu);
  return g_nccl_path;
}

int nccl_version(const std::string& path) {
  int v = 0;
  PYDDP_NCCL(nccl(path).ncclGetVersion(&v));
  return v;
}

int driver_version() {
  int v = 0;
  PYDDP_CU(driver().cuDriverGetVersion(&v));
  return v;
}

int device_count() {
  int n = 0;
  PYDDP_CU(driver().cuDeviceGetCount(&n));
  return n;
}

std::string device_name(int device) {
  CUdevice dev = 0;
  PYDDP_CU(driver().cuDeviceGet(&dev, device));
  char name[256] = {0};
  PYDDP_CU(driver().cuDeviceGetName(name, sizeof name - 1, dev));
  return name;
}

void set_device(int device) {
  const DriverApi& d = driver();
  CUcontext ctx = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (static_cast<size_t>(device) < g_contexts.size()) ctx = g_contexts[device];
  }
  if (ctx == nullptr) {
    CUdevice dev = 0;
    PYDDP_CU(d.cuDeviceGet(&dev, device));
    // The primary context is the one the CUDA runtime (and so torch) uses:
    // streams and events made here are valid on torch's streams.
    PYDDP_CU(d.cuDevicePrimaryCtxRetain(&ctx, dev));
    std::lock_guard<std::mutex> lk(g_mu);
    if (g_contexts.size() <= static_cast<size_t>(device)) g_contexts.resize(device + 1, nullptr);
    g_contexts[device] = ctx;
  }
  PYDDP_CU(d.cuCtxSetCurrent(ctx));
}

ContextRestore::ContextRestore() { PYDDP_CU(driver().cuCtxGetCurrent(&saved_)); }

ContextRestore::~ContextRestore() {
  driver().cuCtxSetCurrent(saved_);  // best effort: a destructor must not throw
}

RelaxedCaptureMode::RelaxedCaptureMode() {
  const DriverApi& d = driver();
  if (d.cuThreadExchangeStreamCaptureMode == nullptr) return;  // no capture without it
  PYDDP_CU(d.cuThreadExchangeStreamCaptureMode(&saved_));
  exchanged_ = true;
}

RelaxedCaptureMode::~RelaxedCaptureMode() {
  // Best effort: a destructor must not throw.
  if (exchanged_) driver().cuThreadExchangeStreamCaptureMode(&saved_);
}

unsigned long long capture_id(CUstream stream) {
  const DriverApi& d = driver();
  int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE, _ACTIVE, _INVALIDATED
  unsigned long long id = 0;
  if (d.cuStreamGetCaptureInfo2 != nullptr) {
    PYDDP_CU(d.cuStreamGetCaptureInfo2(stream, &status, &id, nullptr, nullptr, nullptr));
  } else if (d.cuStreamGetCaptureInfo3 != nullptr) {
    PYDDP_CU(d.cuStreamGetCaptureInfo3(stream, &status, &id, nullptr, nullptr, nullptr, nullptr));
  } else {
    return 0;
  }
  if (status == 0) return 0;
  return status == 1 && id != 0 ? id : ~0ull;  // (an invalidated capture's id is not given)
}

bool capture_supported() {
  const DriverApi& d = driver();
  return (d.cuStreamGetCaptureInfo2 != nullptr || d.cuStreamGetCaptureInfo3 != nullptr) &&
         d.cuThreadExchangeStreamCaptureMode != nullptr;
}

namespace {
std::atomic<bool> g_dead{false};  // read on every launch: no lock until it is set
std::string g_dead_error;         // under g_mu

// Why the context died, for the advice: what a user can look at.
const char* sticky_cause(CUresult r) {
  switch (r) {
    case 700:
    case 716:
    case 717: return "a kernel touched memory it does not own, pyddp's or another";
    case 702: return "a kernel ran past the launch timeout";
    case 214: return "an uncorrectable ECC memory error; see nvidia-smi -q -d ECC";
    case 220: return "an uncorrectable NVLink error";
    case 999: return "an unknown driver error";
    default: return "a kernel faulted, pyddp's or another";
  }
}

// The device of the calling thread's current context, -1 if none of ours.
int current_device() {
  CUcontext ctx = nullptr;
  if (driver().cuCtxGetCurrent(&ctx) != kCudaSuccess || ctx == nullptr) return -1;
  std::lock_guard<std::mutex> lk(g_mu);
  for (size_t i = 0; i < g_contexts.size(); ++i) {
    if (g_contexts[i] == ctx) return static_cast<int>(i);
  }
  return -1;
}
}  // namespace

std::string cu_error_text(CUresult r) {
  const char* msg = nullptr;
  auto get_error_string = driver().cuGetErrorString;  // loaded: a call returned r
  get_error_string(r, &msg);
  const std::string text = detail::concat("CUDA error ", r, " (", msg ? msg : "unknown", ")");
  if (!cu_error_is_sticky(r)) return text;
  return detail::concat(text, ": the CUDA context is unusable for the rest of the process (",
                        sticky_cause(r), "); restart the process");
}

bool cu_error_is_sticky(CUresult r) {
  return r == 700 || r == 702 || (r >= 714 && r <= 719) || r == 214 || r == 220 || r == 999;
}

std::string cu_failure(CUresult r, int device, const std::string& what) {
  if (device < 0) device = current_device();
  std::string message =
      detail::concat(what, " failed", device >= 0 ? detail::concat(" on cuda:", device) : "",
                     " with ", cu_error_text(r));
  if (!cu_error_is_sticky(r)) return message;
  // Every later call fails the same way: the first is the one to report
  // (several threads may meet the dead context at once).
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_dead_error.empty()) g_dead_error = message;
  g_dead = true;
  return g_dead_error;
}

std::string dead_context_error() {
  if (!g_dead.load()) return "";
  std::lock_guard<std::mutex> lk(g_mu);
  return g_dead_error;
}

void check_cu(CUresult r, const char* call, const char* file, int line) {
  if (r == kCudaSuccess) return;
  throw ReduceError(cu_failure(r, -1, detail::concat("pyddp: ", call, " at ", file, ":", line)));
}

void check_nccl(ncclResult_t r, const char* call, const char* file, int line) {
  if (r == kNcclSuccess) return;
  const char* (*get_error_string)(ncclResult_t) = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    get_error_string = g_nccl.ncclGetErrorString;
  }
  const char* msg = get_error_string ? get_error_string(r) : nullptr;
  throw ReduceError(detail::concat("NCCL error ", r, " (", msg ? msg : "unknown", ") in ", call,
                                   " at ", file, ":", line));
}

void check_nvrtc(nvrtcResult r, const char* call, const char* file, int line) {
  if (r == kNvrtcSuccess) return;
  const char* (*get_error_string)(nvrtcResult) = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    get_error_string = g_nvrtc.nvrtcGetErrorString;
  }
  const char* msg = get_error_string ? get_error_string(r) : nullptr;
  throw UsageError(detail::concat("NVRTC error ", r, " (", msg ? msg : "unknown", ") in ", call,
                                  " at ", file, ":", line));
}

}  // namespace cuda
}  // namespace pyddp
