// The slice of the CUDA driver API and of NCCL that pyddp uses, declared here
// and loaded at run time with dlopen (libcuda.so.1, libnccl.so.2): one build
// imports on machines without CUDA and runs with CUDA 12 or 13 wheels. Every
// call goes through PYDDP_CU / PYDDP_NCCL, which throw with the call, file and
// line (see DESIGN.md, invariant 7).
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

struct DriverApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDriverGetVersion)(int*);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetName)(char*, int, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuStreamCreate)(CUstream*, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
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
constexpr ncclResult_t kNcclSuccess = 0;
constexpr ncclResult_t kNcclInProgress = 7;
// ncclDataType_t / ncclRedOp_t values from nccl.h (stable since NCCL 2.10).
constexpr int kNcclFloat16 = 6, kNcclFloat32 = 7, kNcclFloat64 = 8, kNcclBfloat16 = 9;
constexpr int kNcclSum = 0, kNcclAvg = 4;

struct NcclApi {
  ncclResult_t (*ncclGetVersion)(int*);
  ncclResult_t (*ncclCommInitAll)(ncclComm_t*, int, const int*);
  ncclResult_t (*ncclCommDestroy)(ncclComm_t);
  ncclResult_t (*ncclCommAbort)(ncclComm_t);
  ncclResult_t (*ncclCommGetAsyncError)(ncclComm_t, ncclResult_t*);
  const char* (*ncclGetErrorString)(ncclResult_t);
  ncclResult_t (*ncclAllReduce)(const void*, void*, size_t, int, int, ncclComm_t, CUstream);
  ncclResult_t (*ncclGroupStart)();
  ncclResult_t (*ncclGroupEnd)();
};

// Loaded once per process; throws UsageError saying what is missing and why.
const DriverApi& driver();
// `path` may be a file path or a bare soname searched by the dynamic loader.
// Loading a second, different path in one process is refused.
const NcclApi& nccl(const std::string& path);
std::string nccl_path();  // "" until nccl() succeeded
int nccl_version(const std::string& path);
int driver_version();
int device_count();
std::string device_name(int device);

void check_cu(CUresult r, const char* call, const char* file, int line);
void check_nccl(ncclResult_t r, const char* call, const char* file, int line);

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

}  // namespace cuda
}  // namespace pyddp

#define PYDDP_CU(call) ::pyddp::cuda::check_cu((call), #call, __FILE__, __LINE__)
#define PYDDP_NCCL(call) ::pyddp::cuda::check_nccl((call), #call, __FILE__, __LINE__)
