// The on-device reduction for replicas sharing one GPU: every replica's buffer
// is read once, summed in a fixed replica order (16-bit types in float32), and
// the result written back to every buffer. Compiled to PTX at build time and
// loaded through the driver API (gpu_backend.cpp), so the extension itself
// links no CUDA library. __grid_constant__: the pointer table is read from
// parameter space, not copied to local memory by every thread. The PTX
// (ISA of the nvcc that built it) needs a driver at least as new as that nvcc.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define PYDDP_MAX_REPLICAS 8  // = DeviceBackend::kMaxReplicas

struct Ptrs {
  void* p[PYDDP_MAX_REPLICAS];
};

template <typename T>
struct Acc {
  using type = T;
  __device__ static T load(T v) { return v; }
  __device__ static T store(T v) { return v; }
};
template <>
struct Acc<__half> {
  using type = float;
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename T>
__device__ void reduce(const Ptrs& ptrs, int n, long long count, int avg) {
  using A = typename Acc<T>::type;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    A acc = Acc<T>::load(static_cast<const T*>(ptrs.p[0])[i]);
    for (int r = 1; r < n; ++r) acc += Acc<T>::load(static_cast<const T*>(ptrs.p[r])[i]);
    if (avg) acc /= static_cast<A>(n);
    const T out = Acc<T>::store(acc);
    for (int r = 0; r < n; ++r) static_cast<T*>(ptrs.p[r])[i] = out;
  }
}

extern "C" __global__ void pyddp_reduce_f32(const __grid_constant__ Ptrs p, int n, long long count, int avg) {
  reduce<float>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_f64(const __grid_constant__ Ptrs p, int n, long long count, int avg) {
  reduce<double>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_f16(const __grid_constant__ Ptrs p, int n, long long count, int avg) {
  reduce<__half>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_bf16(const __grid_constant__ Ptrs p, int n, long long count, int avg) {
  reduce<__nv_bfloat16>(p, n, count, avg);
}
