// pyddp's kernels (reduce_kernels.cu), compiled at run time: the reduction for
// replicas sharing one GPU, and the wire compression of NCCL buckets.
//
// Why NVRTC and not PTX embedded at build time: PTX carries the ISA version of
// the nvcc that wrote it (nvcc 13 writes 9.0), and a driver older than that
// nvcc rejects it (CUDA_ERROR_UNSUPPORTED_PTX_VERSION); most users also have no
// nvcc when they pip-install. NVRTC ships as a wheel with every CUDA build of
// torch (nvidia-cuda-nvrtc-cu12 / -cu13), so pyddp compiles the embedded
// source for the exact GPU it finds and loads a cubin: no JIT, and CUDA's
// minor-version compatibility lets any driver of that major version load it.
// Only a GPU newer than the NVRTC (not in its architecture list) gets PTX for
// the newest architecture NVRTC knows, JIT-compiled by the driver.
#pragma once

#include <string>

#include "common.h"
#include "cuda_api.h"

namespace pyddp {

struct DeviceKernels {
  cuda::CUfunction fn[4] = {};  // the reduction, indexed by DType
  // Wire compression of float32 buckets: [0] float16, [1] bfloat16.
  cuda::CUfunction compress[2] = {};
  cuda::CUfunction decompress[2] = {};
  // Replicas sharing a GPU: broadcast and all-gather move elements of 2, 4
  // or 8 bytes (indexed by kernel_width), reduce-scatter is typed (DType).
  cuda::CUfunction broadcast[3] = {};
  cuda::CUfunction all_gather[3] = {};
  cuda::CUfunction reduce_scatter[4] = {};
  std::string how;              // what was built and loaded, for doctor
};

// The index of a copying kernel for elements of t's size: 2, 4, 8 bytes.
inline int kernel_width(DType t) {
  const size_t size = dtype_size(t);
  return size == 2 ? 0 : size == 4 ? 1 : 2;
}

// Compiled and loaded once per device and process (later calls return the
// cached module); throws UsageError with NVRTC's log or the driver's error.
const DeviceKernels& device_kernels(int device, const std::string& nvrtc_path);

}  // namespace pyddp
