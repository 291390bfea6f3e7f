// Run-time compilation of reduce_kernels.cu: see device_kernel.h.
#include "device_kernel.h"

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace pyddp {

extern const char* const kReduceKernelSource;  // reduce_kernels.cu, embedded by CMake

using namespace cuda;

namespace {

std::mutex g_mu;
std::map<int, std::unique_ptr<DeviceKernels>> g_loaded;

struct Program {
  const NvrtcApi& api;
  nvrtcProgram prog = nullptr;
  ~Program() {
    if (prog != nullptr) api.nvrtcDestroyProgram(&prog);
  }
};

// Compiles for `arch` ("sm_80" gives a cubin, "compute_90" PTX) and returns
// the image cuModuleLoadData takes.
std::vector<char> compile(const NvrtcApi& n, const std::string& arch) {
  Program p{n};
  PYDDP_NVRTC(n.nvrtcCreateProgram(&p.prog, kReduceKernelSource, "pyddp_reduce_kernels.cu", 0,
                                   nullptr, nullptr));
  const std::string option = "--gpu-architecture=" + arch;
  const char* options[] = {option.c_str()};
  const nvrtcResult compiled = n.nvrtcCompileProgram(p.prog, 1, options);
  if (compiled != kNvrtcSuccess) {
    size_t size = 0;
    n.nvrtcGetProgramLogSize(p.prog, &size);
    std::string log(size, '\0');
    if (size > 0) n.nvrtcGetProgramLog(p.prog, &log[0]);
    throw UsageError(detail::concat("NVRTC could not compile pyddp's reduction kernel for ", arch,
                                    " (error ", compiled, "): ", log));
  }
  const bool cubin = arch.rfind("sm_", 0) == 0;
  size_t size = 0;
  PYDDP_NVRTC(cubin ? n.nvrtcGetCUBINSize(p.prog, &size) : n.nvrtcGetPTXSize(p.prog, &size));
  PYDDP_ENFORCE(size > 0, "NVRTC produced an empty image for ", arch);
  std::vector<char> image(size);
  PYDDP_NVRTC(cubin ? n.nvrtcGetCUBIN(p.prog, image.data()) : n.nvrtcGetPTX(p.prog, image.data()));
  return image;
}

}  // namespace

const DeviceKernels& device_kernels(int device, const std::string& nvrtc_path) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_loaded.find(device);
  if (it != g_loaded.end()) return *it->second;

  const NvrtcApi& n = nvrtc(nvrtc_path);
  const std::string version = nvrtc_version(nvrtc_path);
  const int cc = compute_capability(device);
  int count = 0;
  PYDDP_NVRTC(n.nvrtcGetNumSupportedArchs(&count));
  std::vector<int> archs(count);
  if (count > 0) PYDDP_NVRTC(n.nvrtcGetSupportedArchs(archs.data()));
  std::string arch;
  if (std::find(archs.begin(), archs.end(), cc) != archs.end()) {
    arch = "sm_" + std::to_string(cc);
  } else {
    // A GPU newer than this NVRTC: PTX for the newest architecture it knows
    // that the GPU can run, JIT-compiled by the driver.
    int best = 0;
    for (int a : archs) {
      if (a <= cc) best = std::max(best, a);
    }
    PYDDP_ENFORCE(best > 0, "NVRTC ", version, " (", nvrtc_path, ") supports no architecture ",
                  "up to this GPU's sm_", cc, ": install the NVRTC of torch's CUDA version");
    arch = "compute_" + std::to_string(best);
  }
  const std::vector<char> image = compile(n, arch);

  auto out = std::make_unique<DeviceKernels>();
  const DriverApi& d = driver();
  ContextRestore restore;
  set_device(device);
  CUmodule module = nullptr;
  const CUresult loaded = d.cuModuleLoadData(&module, image.data());
  if (cu_error_is_sticky(loaded)) PYDDP_CU(loaded);  // a dead context, not a bad image
  if (loaded != kCudaSuccess) {
    const char* msg = nullptr;
    d.cuGetErrorString(loaded, &msg);
    int driver = 0;
    d.cuDriverGetVersion(&driver);
    throw UsageError(detail::concat(
        "the CUDA driver (", driver / 1000, ".", (driver % 1000) / 10, ") rejected the reduction ",
        "kernel NVRTC ", version, " built for ", arch, " on cuda:", device, ": CUDA error ",
        loaded, " (", msg ? msg : "unknown", "). Use an NVRTC no newer than the driver's CUDA ",
        "version (set PYDDP_NVRTC_LIBRARY), or update the driver"));
  }
  const char* names[4] = {"pyddp_reduce_f32", "pyddp_reduce_f64", "pyddp_reduce_f16",
                          "pyddp_reduce_bf16"};
  for (int i = 0; i < 4; ++i) PYDDP_CU(d.cuModuleGetFunction(&out->fn[i], module, names[i]));
  const char* wire[2] = {"f16", "bf16"};
  for (int i = 0; i < 2; ++i) {
    const std::string c = std::string("pyddp_compress_") + wire[i];
    const std::string dc = std::string("pyddp_decompress_") + wire[i];
    PYDDP_CU(d.cuModuleGetFunction(&out->compress[i], module, c.c_str()));
    PYDDP_CU(d.cuModuleGetFunction(&out->decompress[i], module, dc.c_str()));
  }
  const char* widths[3] = {"b16", "b32", "b64"};
  for (int i = 0; i < 3; ++i) {
    const std::string b = std::string("pyddp_broadcast_") + widths[i];
    const std::string g = std::string("pyddp_all_gather_") + widths[i];
    PYDDP_CU(d.cuModuleGetFunction(&out->broadcast[i], module, b.c_str()));
    PYDDP_CU(d.cuModuleGetFunction(&out->all_gather[i], module, g.c_str()));
  }
  const char* typed[4] = {"f32", "f64", "f16", "bf16"};  // DType order
  for (int i = 0; i < 4; ++i) {
    const std::string rs = std::string("pyddp_reduce_scatter_") + typed[i];
    PYDDP_CU(d.cuModuleGetFunction(&out->reduce_scatter[i], module, rs.c_str()));
  }
  out->how = detail::concat(arch.rfind("sm_", 0) == 0 ? "cubin for " : "PTX (driver JIT) for ",
                            arch, " by NVRTC ", version);
  return *g_loaded.emplace(device, std::move(out)).first->second;
}

}  // namespace pyddp
