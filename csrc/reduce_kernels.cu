// pyddp's GPU kernels. The on-device reduction for replicas sharing one GPU:
// every replica's buffer is read once, summed in a fixed replica order (16-bit
// types in float32), and the result written back to every buffer. And the
// wire compression of NCCL buckets (torch DDP's fp16/bf16 compression hooks):
// a float32 bucket cast to a 16-bit copy before NCCL's all-reduce, and back.
//
// Every kernel takes (Ptrs, int, long long, int): one calling convention, so
// the launcher (and the simulated driver) passes the same four arguments.
//
// How it reaches the GPU: the extension embeds this file's text and compiles it
// at run time with NVRTC for the GPU at hand (device_kernel.cpp), so users need
// no nvcc and the binary never carries a PTX ISA newer than their driver.
// That is why it includes no header (NVRTC has no CUDA include path here) and
// converts 16-bit floats with plain integer code. The GPU simulation used by
// the tests compiles this same file on the host (tests/simgpu/kernel_shim.h
// supplies blockIdx/threadIdx and empty qualifiers), so the indexing and the
// rounding below are exercised on every CI run.

#define PYDDP_MAX_REPLICAS 8  // = SharedGpuBackend::kMaxReplicas

// Every replica's buffer; for all-gather and reduce-scatter, the sends
// (p[0..n)) then the receives (p[n..2n)).
struct Ptrs {
  void* p[2 * PYDDP_MAX_REPLICAS];
};

typedef unsigned short pyddp_u16;

__device__ inline unsigned pyddp_f2u(float f) {
  union {
    float f;
    unsigned u;
  } v;
  v.f = f;
  return v.u;
}
__device__ inline float pyddp_u2f(unsigned u) {
  union {
    float f;
    unsigned u;
  } v;
  v.u = u;
  return v.f;
}

// IEEE binary16 <-> float32, round to nearest even (as __float2half_rn).
__device__ inline float pyddp_half_to_float(pyddp_u16 h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  const unsigned exp = (h >> 10) & 0x1fu;
  const unsigned mant = h & 0x3ffu;
  if (exp == 0x1fu) return pyddp_u2f(sign | 0x7f800000u | (mant << 13));  // inf / nan
  if (exp != 0) return pyddp_u2f(sign | ((exp + 112u) << 23) | (mant << 13));
  const float v = (float)mant * 5.9604644775390625e-8f;  // subnormal: mant * 2^-24, exact
  return sign ? -v : v;
}
__device__ inline pyddp_u16 pyddp_float_to_half(float f) {
  const unsigned u = pyddp_f2u(f);
  const unsigned sign = (u >> 16) & 0x8000u;
  const unsigned a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (pyddp_u16)(sign | 0x7e00u);  // nan stays a quiet nan
  if (a >= 0x477ff000u) return (pyddp_u16)(sign | 0x7c00u);  // rounds to inf
  if (a < 0x38800000u) {
    // Subnormal result: adding 0.5 (whose ulp is 2^-24, the half subnormal
    // step) makes the float adder round to nearest even for us.
    return (pyddp_u16)(sign | (pyddp_f2u(pyddp_u2f(a) + 0.5f) - 0x3f000000u));
  }
  const unsigned odd = (a >> 13) & 1u;
  return (pyddp_u16)(sign | ((a + 0xfffu + odd - 0x38000000u) >> 13));
}

// bfloat16 <-> float32, round to nearest even (as __float2bfloat16_rn).
__device__ inline float pyddp_bf16_to_float(pyddp_u16 b) { return pyddp_u2f((unsigned)b << 16); }
__device__ inline pyddp_u16 pyddp_float_to_bf16(float f) {
  const unsigned u = pyddp_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (pyddp_u16)((u >> 16) | 0x40u);
  return (pyddp_u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Element type T, accumulated in A, converted by load/store.
template <typename E>
struct Plain {
  typedef E T;
  typedef E A;
  __device__ static A load(T v) { return v; }
  __device__ static T store(A v) { return v; }
};
typedef Plain<float> F32;
typedef Plain<double> F64;
struct F16 {
  typedef pyddp_u16 T;
  typedef float A;
  __device__ static A load(T v) { return pyddp_half_to_float(v); }
  __device__ static T store(A v) { return pyddp_float_to_half(v); }
};
struct BF16 {
  typedef pyddp_u16 T;
  typedef float A;
  __device__ static A load(T v) { return pyddp_bf16_to_float(v); }
  __device__ static T store(A v) { return pyddp_float_to_bf16(v); }
};

template <typename K>
__device__ void pyddp_reduce(const Ptrs& ptrs, int n, long long count, int avg) {
  typedef typename K::T T;
  typedef typename K::A A;
  const long long stride = (long long)gridDim.x * blockDim.x;
  // Grid-stride loop: any grid covers any count.
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    A acc = K::load(((const T*)ptrs.p[0])[i]);
    for (int r = 1; r < n; ++r) acc += K::load(((const T*)ptrs.p[r])[i]);
    if (avg) acc /= (A)n;
    const T out = K::store(acc);
    for (int r = 0; r < n; ++r) ((T*)ptrs.p[r])[i] = out;
  }
}

// __grid_constant__: the pointer table is read from parameter space, not
// copied to local memory by every thread.
extern "C" __global__ void pyddp_reduce_f32(const __grid_constant__ Ptrs p, int n,
                                            long long count, int avg) {
  pyddp_reduce<F32>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_f64(const __grid_constant__ Ptrs p, int n,
                                            long long count, int avg) {
  pyddp_reduce<F64>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_f16(const __grid_constant__ Ptrs p, int n,
                                            long long count, int avg) {
  pyddp_reduce<F16>(p, n, count, avg);
}
extern "C" __global__ void pyddp_reduce_bf16(const __grid_constant__ Ptrs p, int n,
                                             long long count, int avg) {
  pyddp_reduce<BF16>(p, n, count, avg);
}

// Broadcast (replicas sharing a GPU): replica `root`'s elements into every
// other buffer. Elements are moved as raw words of their size.
template <typename W>
__device__ void pyddp_broadcast(const Ptrs& p, int n, long long count, int root) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const W v = ((const W*)p.p[root])[i];
    for (int r = 0; r < n; ++r) {
      if (r != root) ((W*)p.p[r])[i] = v;
    }
  }
}
// All-gather: every replica's `count` elements (p[k]) into block k of every
// receive buffer (p[n + r]). In place (p[k] is block k of p[n + k]), element
// i of block k is read and written by the same thread only.
template <typename W>
__device__ void pyddp_all_gather(const Ptrs& p, int n, long long count) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    for (int k = 0; k < n; ++k) {
      const W v = ((const W*)p.p[k])[i];
      for (int r = 0; r < n; ++r) ((W*)p.p[n + r])[k * count + i] = v;
    }
  }
}
// Reduce-scatter: block r of every send (p[k], n * count elements), summed
// in replica order like pyddp_reduce, into receive buffer r (p[n + r]). In
// place (p[n + r] is block r of p[r]), a thread reads all it needs of a
// block before writing that block's element.
template <typename K>
__device__ void pyddp_reduce_scatter(const Ptrs& p, int n, long long count, int avg) {
  typedef typename K::T T;
  typedef typename K::A A;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    for (int r = 0; r < n; ++r) {
      A acc = K::load(((const T*)p.p[0])[r * count + i]);
      for (int k = 1; k < n; ++k) acc += K::load(((const T*)p.p[k])[r * count + i]);
      if (avg) acc /= (A)n;
      ((T*)p.p[n + r])[i] = K::store(acc);
    }
  }
}

#define PYDDP_COPYING(W, NAME)                                                              \
  extern "C" __global__ void pyddp_broadcast_##NAME(const __grid_constant__ Ptrs p, int n,  \
                                                    long long count, int root) {            \
    pyddp_broadcast<W>(p, n, count, root);                                                  \
  }                                                                                         \
  extern "C" __global__ void pyddp_all_gather_##NAME(const __grid_constant__ Ptrs p, int n, \
                                                     long long count, int unused) {         \
    pyddp_all_gather<W>(p, n, count);                                                       \
  }
PYDDP_COPYING(unsigned short, b16)
PYDDP_COPYING(unsigned int, b32)
PYDDP_COPYING(unsigned long long, b64)

#define PYDDP_REDUCE_SCATTER(K, NAME)                                                          \
  extern "C" __global__ void pyddp_reduce_scatter_##NAME(const __grid_constant__ Ptrs p, int n, \
                                                         long long count, int avg) {           \
    pyddp_reduce_scatter<K>(p, n, count, avg);                                                 \
  }
PYDDP_REDUCE_SCATTER(F32, f32)
PYDDP_REDUCE_SCATTER(F64, f64)
PYDDP_REDUCE_SCATTER(F16, f16)
PYDDP_REDUCE_SCATTER(BF16, bf16)

// Wire compression, as torch DDP's fp16_compress_hook / bf16_compress_hook
// compute it on CUDA tensors, so results are bitwise theirs: each value cast
// to 16 bits, then scaled by 1/n (n ranks) and rounded again, which keeps
// the 16-bit sum over n ranks from overflowing. Scaled, not divided: the
// hooks' `div_(world_size)` by a CPU scalar is, on CUDA, a multiplication by
// the reciprocal computed in float (torch's BinaryDivTrueKernel.cu), which
// gives other float16 subnormals than a division for 14, 26, 28, 30, 52, 56,
// 60 ... ranks. p.p[0]: the float32 bucket, p.p[1]: its 16-bit copy.
template <typename K>
__device__ void pyddp_compress(const Ptrs& p, int n, long long count) {
  const float* src = (const float*)p.p[0];
  typename K::T* dst = (typename K::T*)p.p[1];
  const float inv = 1.0f / (float)n;  // IEEE: NVRTC divides precisely unless told otherwise
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    dst[i] = K::store(K::load(K::store(src[i])) * inv);
  }
}
// Back into the bucket: the reduced 16-bit values (the mean over n ranks),
// times n when the reduction is a sum (`sum` 1). p.p[0]: the 16-bit copy,
// p.p[1]: the float32 bucket.
template <typename K>
__device__ void pyddp_decompress(const Ptrs& p, int n, long long count, int sum) {
  const typename K::T* src = (const typename K::T*)p.p[0];
  float* dst = (float*)p.p[1];
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float v = K::load(src[i]);
    dst[i] = sum ? v * (float)n : v;
  }
}

extern "C" __global__ void pyddp_compress_f16(const __grid_constant__ Ptrs p, int n,
                                              long long count, int unused) {
  pyddp_compress<F16>(p, n, count);
}
extern "C" __global__ void pyddp_compress_bf16(const __grid_constant__ Ptrs p, int n,
                                               long long count, int unused) {
  pyddp_compress<BF16>(p, n, count);
}
extern "C" __global__ void pyddp_decompress_f16(const __grid_constant__ Ptrs p, int n,
                                                long long count, int sum) {
  pyddp_decompress<F16>(p, n, count, sum);
}
extern "C" __global__ void pyddp_decompress_bf16(const __grid_constant__ Ptrs p, int n,
                                                 long long count, int sum) {
  pyddp_decompress<BF16>(p, n, count, sum);
}
