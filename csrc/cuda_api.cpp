// Run-time loading of the CUDA driver API and NCCL: see cuda_api.h.
#include "cuda_api.h"

#include <dlfcn.h>

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
std::vector<CUcontext> g_contexts;

template <typename Fn>
void bind(void* lib, Fn& slot, const char* symbol, const std::string& what) {
  void* p = dlsym(lib, symbol);
  if (p == nullptr) {
    throw UsageError(detail::concat(what, " lacks symbol ", symbol,
                                    ": not the library pyddp expects (too old?)"));
  }
  slot = reinterpret_cast<Fn>(p);
}

}  // namespace

const DriverApi& driver() {
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_driver_loaded) return g_driver;  // never changes once loaded
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    throw UsageError(detail::concat("CUDA driver not found (dlopen libcuda.so.1: ",
                                    err ? err : "?",
                                    "): no NVIDIA driver on this machine; use CPU replicas"));
  }
  DriverApi d{};
  const std::string what = "libcuda.so.1";
  bind(lib, d.cuInit, "cuInit", what);
  bind(lib, d.cuDriverGetVersion, "cuDriverGetVersion", what);
  bind(lib, d.cuDeviceGetCount, "cuDeviceGetCount", what);
  bind(lib, d.cuDeviceGet, "cuDeviceGet", what);
  bind(lib, d.cuDeviceGetName, "cuDeviceGetName", what);
  bind(lib, d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", what);
  bind(lib, d.cuCtxSetCurrent, "cuCtxSetCurrent", what);
  bind(lib, d.cuCtxGetCurrent, "cuCtxGetCurrent", what);
  bind(lib, d.cuStreamCreate, "cuStreamCreate", what);
  bind(lib, d.cuStreamDestroy, "cuStreamDestroy_v2", what);
  bind(lib, d.cuStreamWaitEvent, "cuStreamWaitEvent", what);
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
  return g_driver;
}

const NcclApi& nccl(const std::string& path) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (!g_nccl_path.empty()) {
    PYDDP_ENFORCE(g_nccl_path == path, "NCCL already loaded from ", g_nccl_path,
                  "; cannot also load ", path, " in one process");
    return g_nccl;
  }
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    throw UsageError(detail::concat("cannot load NCCL from '", path, "': ", err ? err : "?"));
  }
  NcclApi n{};
  const std::string what = "'" + path + "'";
  bind(lib, n.ncclGetVersion, "ncclGetVersion", what);
  bind(lib, n.ncclCommInitAll, "ncclCommInitAll", what);
  bind(lib, n.ncclCommDestroy, "ncclCommDestroy", what);
  bind(lib, n.ncclCommAbort, "ncclCommAbort", what);
  bind(lib, n.ncclCommGetAsyncError, "ncclCommGetAsyncError", what);
  bind(lib, n.ncclGetErrorString, "ncclGetErrorString", what);
  bind(lib, n.ncclAllReduce, "ncclAllReduce", what);
  bind(lib, n.ncclGroupStart, "ncclGroupStart", what);
  bind(lib, n.ncclGroupEnd, "ncclGroupEnd", what);
  g_nccl = n;
  g_nccl_path = path;
  return g_nccl;
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

void check_cu(CUresult r, const char* call, const char* file, int line) {
  if (r == kCudaSuccess) return;
  const char* msg = nullptr;
  auto get_error_string = driver().cuGetErrorString;  // loaded: a call returned r
  get_error_string(r, &msg);
  throw ReduceError(detail::concat("CUDA error ", r, " (", msg ? msg : "unknown", ") in ", call,
                                   " at ", file, ":", line));
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

}  // namespace cuda
}  // namespace pyddp
