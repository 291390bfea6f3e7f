// Names for the enums in common.h, shared by the bindings and error messages.
#include "common.h"

namespace pyddp {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  if (name == "float32") return DType::kFloat32;
  if (name == "float64") return DType::kFloat64;
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  throw UsageError("unsupported dtype '" + name +
                   "': pyddp reduces float32, float64, float16 and bfloat16");
}

ReduceOp reduce_op_from_name(const std::string& name) {
  if (name == "sum") return ReduceOp::kSum;
  if (name == "avg" || name == "mean") return ReduceOp::kAvg;
  throw UsageError("unknown reduce op '" + name + "': use 'sum' or 'avg'");
}

}  // namespace pyddp
