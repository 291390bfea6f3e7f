# Builds pyddp._hot (csrc/hot/CMakeLists.txt) in ${DIR}, best effort: run on
# every build of pyddp (incremental), it configures the sub-project once, then
# builds it. Where either fails (a torch whose headers pyddp's hot path does
# not compile against), the build of pyddp goes on without _hot: the failure
# is printed as a warning and recorded in ${DIR}/_hot_build.py (FAILED, with
# the end of the compiler's output), which pyddp reads at run time to say why
# it runs its Python path (python -m pyddp.doctor).
# In: SRC, DIR, GENERATOR, PYTHON, TORCH_FILE, TORCH_VERSION, BUILD_TYPE, CXX.
set(log "")
set(rc 0)
if(NOT EXISTS "${DIR}/CMakeCache.txt")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S "${SRC}" -B "${DIR}" -G "${GENERATOR}"
            "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}" "-DCMAKE_CXX_COMPILER=${CXX}"
            "-DPython_EXECUTABLE=${PYTHON}" "-DPYDDP_TORCH_FILE=${TORCH_FILE}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(log "${out}${err}")
  if(NOT rc EQUAL 0)
    file(REMOVE "${DIR}/CMakeCache.txt")  # configure again next time
  endif()
endif()
if(rc EQUAL 0)
  execute_process(COMMAND ${CMAKE_COMMAND} --build "${DIR}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(log "${out}${err}")
endif()
if(rc EQUAL 0)
  set(failed "None")
else()
  file(GLOB stale "${DIR}/_hot*.so" "${DIR}/_hot*.pyd")  # an earlier build's: not installed
  if(stale)
    file(REMOVE ${stale})
  endif()
  string(LENGTH "${log}" n)
  if(n GREATER 3000)
    math(EXPR start "${n} - 3000")
    string(SUBSTRING "${log}" ${start} 3000 log)
  endif()
  message(WARNING "pyddp: pyddp._hot did not build against torch ${TORCH_VERSION}; pyddp is "
                  "installed without it and runs its Python path. The end of the output:\n${log}")
  string(REPLACE "\\" "\\\\" log "${log}")
  string(REPLACE "\"\"\"" "'''" log "${log}")
  set(failed "\"\"\"${log}\"\"\"")
endif()
file(WRITE "${DIR}/_hot_build.py.new"
     "\"\"\"Written by the build: the torch pyddp._hot was built against, and the end\n"
     "of the build's output where it failed (then _hot is not installed).\"\"\"\n\n"
     "TORCH_VERSION = \"${TORCH_VERSION}\"\nFAILED = ${failed}\n")
configure_file("${DIR}/_hot_build.py.new" "${DIR}/_hot_build.py" COPYONLY)  # if different
