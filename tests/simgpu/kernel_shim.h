// Host compilation of csrc/reduce_kernels.cu for the simulated driver: the
// CUDA qualifiers become nothing, and the built-in index variables are
// thread-local values the simulated cuLaunchKernel sets for every (block,
// thread) of the launch's grid before calling the kernel function.
#pragma once

struct simgpu_dim3 {
  unsigned x = 0, y = 0, z = 0;
};
extern thread_local simgpu_dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __device__
#define __global__
#define __grid_constant__
