// The slice of the CUDA driver API, NCCL and NVRTC that pyddp uses, declared
// here and loaded at run time with dlopen (libcuda.so.1 or $PYDDP_CUDA_LIBRARY,
// libnccl.so.2, libnvrtc.so.*): one build imports on machines without CUDA and
// runs with CUDA 12 or 13 wheels; the test suite points the variables at a
// simulated driver (tests/simgpu). Every call goes through PYDDP_CU /
// PYDDP_NCCL / PYDDP_NVRTC, which throw with the call, file and line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "common.h"

namespace pyddp {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;

constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaNotReady = 600;
constexpr unsigned kStreamNonBlocking = 1;
constexpr unsigned kEventDisableTiming = 2;
constexpr int kCaptureModeRelaxed = 2;  // CU_STREAM_CAPTURE_MODE_RELAXED
constexpr int kAttrComputeCapabilityMajor = 75;  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
constexpr int kAttrComputeCapabilityMinor = 76;

struct DriverApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuStreamQuery)(CUstream);
  // Optional (null where the driver lacks them; capture_supported()):
  // cuStreamGetCaptureInfo_v2 (CUDA 11.3+): (stream, CUstreamCaptureStatus*,
  // capture id*, graph*, dependencies*, count*), and _v3 (12.3+), which adds
  // edge data* before the count.
  CUresult (*cuStreamGetCaptureInfo2)(CUstream, int*, unsigned long long*, void**, const void**,
                                      size_t*);
  CUresult (*cuStreamGetCaptureInfo3)(CUstream, int*, unsigned long long*, void**, const void**,
                                      const void**, size_t*);
  CUresult (*cuThreadExchangeStreamCaptureMode)(int*);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void**, void**);
};

using ncclResult_t = int;
using ncclComm_t = struct ncclComm*;
struct ncclUniqueId {
  char internal[128];  // NCCL_UNIQUE_ID_BYTES
};
// The ncclConfig_t of NCCL 2.14, the first with non-blocking communicators.
// NCCL reads `size` and `version` to know which fields a caller's struct has,
// so this prefix stays valid with later releases.
struct ncclConfig {
  size_t size = sizeof(ncclConfig);
  unsigned magic = 0xcafebeef;  // NCCL_API_MAGIC
  unsigned version = 21400;     // NCCL_VERSION(2, 14, 0)
  int blocking = -2147483648;   // NCCL_CONFIG_UNDEF_INT
  int cgaClusterSize = -2147483648;
  int minCTAs = -2147483648;
  int maxCTAs = -2147483648;
  const char* netName = nullptr;
};
constexpr ncclResult_t kNcclSuccess = 0;
constexpr ncclResult_t kNcclInProgress = 7;
// ncclDataType_t / ncclRedOp_t values from nccl.h (stable since NCCL 2.10).
constexpr int kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9;
constexpr int kNcclSum = 0, kNcclAvg = 4;

struct NcclApi {
  ncclResult_t (*ncclGetVersion)(int*);
  ncclResult_t (*ncclGetUniqueId)(ncclUniqueId*);
  ncclResult_t (*ncclCommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfig*);
  ncclResult_t (*ncclCommFinalize)(ncclComm_t);
  ncclResult_t (*ncclCommDestroy)(ncclComm_t);
  ncclResult_t (*ncclCommAbort)(ncclComm_t);
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*ncclGetErrorString)(ncclResult_t);
  ncclResult_t (*ncclAllReduce)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  // (send, recv, count, datatype, root, comm, stream)
  ncclResult_t (*ncclBroadcast)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  // (send, recv, sendcount, datatype, comm, stream)
  ncclResult_t (*ncclAllGather)(const void*, void*, size_t, int, ncclComm_t, CUstream);
  // (send, recv, recvcount, datatype, op, comm, stream)
  ncclResult_t (*ncclReduceScatter)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  ncclResult_t (*ncclGroupStart)();
  ncclResult_t (*ncclGroupEnd)();
};

using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram*;
constexpr nvrtcResult kNvrtcSuccess = 0;

struct NvrtcApi {
  nvrtcResult (*nvrtcVersion)(int*, int*);
  nvrtcResult (*nvrtcGetNumSupportedArchs)(int*);
  nvrtcResult (*nvrtcGetSupportedArchs)(int*);
  nvrtcResult (*nvrtcCreateProgram)(nvrtcProgram*, const char*, const char*, int,
                                    const char* const*, const char* const*);
  nvrtcResult (*nvrtcCompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*nvrtcGetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcGetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*nvrtcGetPTX)(nvrtcProgram, char*);
  nvrtcResult (*nvrtcDestroyProgram)(nvrtcProgram*);
  const char* (*nvrtcGetErrorString)(nvrtcResult);
};

// Loaded once per process from $PYDDP_CUDA_LIBRARY or libcuda.so.1; throws
// UsageError saying what is missing and why.
const DriverApi& driver();
std::string driver_library();  // the path or soname driver() loads
// True when the loaded driver is the test suite's simulation (it exports
// simgpu_version): doctor says so rather than report it as a GPU.
bool driver_is_simulated();
// Same rules as nccl(): one library per process.
const NvrtcApi& nvrtc(const std::string& path);
std::string nvrtc_version(const std::string& path);  // "12.4"
int compute_capability(int device);                   // 80 for sm_80
// `path` may be a file path or a bare soname searched by the dynamic loader.
// Loading a second, different path in one process is refused.
const NcclApi& nccl(const std::string& path);
std::string nccl_path();  // "" until nccl() succeeded
int nccl_version(const std::string& path);
int driver_version();
int device_count();
std::string device_name(int device);

// "CUDA error 700 (an illegal memory access was encountered)", with advice
// when the error is sticky.
std::string cu_error_text(CUresult r);
// [CUDA, "Error handling"]: after these the context is unusable for the rest
// of the process (every later call returns the same error; "the process must
// be terminated and relaunched"): illegal address, launch timeout, hardware
// stack error, illegal instruction, misaligned address, invalid address
// space, invalid PC, launch failure; and, treated alike, uncorrectable ECC
// and NVLink errors and the unknown error (999), after which nothing on the
// context can be trusted.
bool cu_error_is_sticky(CUresult r);
// Every failed driver result pyddp checks (PYDDP_CU, the watchdog's event
// query) becomes its message here: "<what> failed on cuda:<device> with
// CUDA error ...". `device` -1: the calling thread's current context's. The
// first sticky one is remembered for the process (dead_context_error()) and
// is the message of every later sticky one, so whichever call sees it first,
// pyddp reports that failure and rebuilds nothing on the dead context.
std::string cu_failure(CUresult r, int device, const std::string& what);
// The first sticky failure's message, "" while there was none.
std::string dead_context_error();
void check_cu(CUresult r, const char* call, const char* file, int line);
void check_nccl(ncclResult_t r, const char* call, const char* file, int line);
void check_nvrtc(nvrtcResult r, const char* call, const char* file, int line);

// Makes the device's primary context (the one torch uses) current on this thread.
void set_device(int device);

// Restores the calling thread's current context on scope exit: the CUDA
// runtime adopts a context made current through the driver API, so leaving
// another device's context current would move torch's current device.
class ContextRestore {
 public:
  ContextRestore();
  ~ContextRestore();
  ContextRestore(const ContextRestore&) = delete;
  ContextRestore& operator=(const ContextRestore&) = delete;

 private:
  CUcontext saved_ = nullptr;
};

// Runs the calling thread in CUDA's relaxed capture mode for its scope: its
// queries of events recorded outside any capture (pyddp's own watch events)
// stay legal while a stream capture is under way on this or another thread,
// which CUDA's default global mode forbids (invalidating the capture).
// torch's NCCL watchdog, which met the same rule, uses the thread-local mode;
// pyddp also queries from the capturing thread itself (finish()'s check),
// which only the relaxed mode allows.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode();
  ~RelaxedCaptureMode();
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  int saved_ = kCaptureModeRelaxed;
  bool exchanged_ = false;
};

// The id of the CUDA graph capture `stream` takes part in (unique in the
// process), 0 when it captures nothing; an invalidated capture counts. 0
// where the driver cannot say (capture_supported() false).
unsigned long long capture_id(CUstream stream);
// Whether the driver has what pyddp's captured steps use (its capture info
// and the thread capture modes).
bool capture_supported();

}  // namespace cuda
}  // namespace pyddp

#define PYDDP_CU(call) ::pyddp::cuda::check_cu((call), #call, __FILE__, __LINE__)
#define PYDDP_NCCL(call) ::pyddp::cuda::check_nccl((call), #call, __FILE__, __LINE__)
#define PYDDP_NVRTC(call) ::pyddp::cuda::check_nvrtc((call), #call, __FILE__, __LINE__)
