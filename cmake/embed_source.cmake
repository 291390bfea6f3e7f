# Writes the text of ${SRC} into ${OUT} as the C++ string constant ${NAME}:
# the extension carries the kernel's source and compiles it with NVRTC at run
# time for the GPU it finds (see csrc/device_kernel.cpp).
file(READ "${SRC}" text)
file(WRITE "${OUT}" "// Generated from ${SRC} by cmake/embed_source.cmake.\n"
  "namespace pyddp {\nextern const char* const ${NAME};\n"
  "const char* const ${NAME} = R\"PYDDP_SRC(${text})PYDDP_SRC\";\n}\n")
