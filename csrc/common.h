// Shared vocabulary of the engine: element types, reduction ops, the buffer
// descriptor that crosses the Python boundary, and the PYDDP_ENFORCE macro.
// Nothing here knows about torch: buffers are (pointer, count, dtype, device).
#pragma once

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

namespace pyddp {

enum class DType : uint8_t { kFloat32, kFloat64, kFloat16, kBFloat16 };
enum class ReduceOp : uint8_t { kSum, kAvg };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
  }
  return 0;
}

const char* dtype_name(DType t);
DType dtype_from_name(const std::string& name);
ReduceOp reduce_op_from_name(const std::string& name);

// One replica's view of a flat buffer. device < 0 means host memory.
struct BufferRef {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kFloat32;
  int device = -1;
  // NCCL with wire compression: `count` 16-bit values on `device` for the
  // compressed copy of a float32 bucket (null otherwise).
  void* wire = nullptr;
};

// Thrown for broken preconditions the caller can fix (bad index, bad state).
class UsageError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// Thrown when a reduction failed; the engine is reset and reusable afterwards.
class ReduceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace pyddp

// PYDDP_ENFORCE(cond, "message parts", values...): throws UsageError naming the
// failed condition, the source location and the values that broke it.
#define PYDDP_ENFORCE(cond, ...)                                                   \
  do {                                                                             \
    if (!(cond)) {                                                                 \
      throw ::pyddp::UsageError(::pyddp::detail::concat(__VA_ARGS__, " [", #cond, \
                                                        " failed at ", __FILE__,   \
                                                        ":", __LINE__, "]"));      \
    }                                                                              \
  } while (0)
