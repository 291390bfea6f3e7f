# Writes the PTX file ${PTX} into ${OUT} as a C++ string constant, so the
# extension carries its kernel without linking any CUDA library.
file(READ "${PTX}" ptx)
file(WRITE "${OUT}" "// Generated from csrc/reduce_kernels.cu by cmake/embed_ptx.cmake.\n"
  "namespace pyddp {\nextern const char* const kReduceKernelPtx;\n"
  "const char* const kReduceKernelPtx = R\"PYDDP_PTX(${ptx})PYDDP_PTX\";\n}\n")
