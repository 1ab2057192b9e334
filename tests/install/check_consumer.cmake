# Builds and runs tests/install/consumer against kiln, as a user would:
#   MODE=package:      cmake --install the current build into a fresh prefix, then
#                      find_package(kiln) from that prefix only.
#   MODE=subdirectory: add_subdirectory(<kiln source tree>) from the consumer. With Ninja only
#                      the consumer's own source is compiled (include paths, C++20 and
#                      definitions reach it through the kiln::kiln target); building all of
#                      kiln a second time would test nothing the package mode does not.
# Run by ctest (tests/CMakeLists.txt) as
#   cmake -DMODE=... -DKILN_SOURCE_DIR=... -DKILN_BUILD_DIR=... -DWORK_DIR=... -DGENERATOR=...
#         [-DCXX_COMPILER=...] [-DCXX_LAUNCHER=...] -P check_consumer.cmake
cmake_minimum_required(VERSION 3.24)

foreach(var MODE KILN_SOURCE_DIR WORK_DIR GENERATOR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "check_consumer.cmake: ${var} is not set")
  endif()
endforeach()

# Runs a command, echoing it; stops the test with its output when it fails.
function(run_step what)
  string(JOIN " " command_line ${ARGN})
  message(STATUS "[${MODE}] ${what}: ${command_line}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "[${MODE}] ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(configure_args -S "${KILN_SOURCE_DIR}/tests/install/consumer" -B "${WORK_DIR}/build"
    -G "${GENERATOR}" -DKILN_CONSUMER_MODE=${MODE}
    # Only what the test names may be found: no user or system package registry.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(CXX_COMPILER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
if(CXX_LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${CXX_LAUNCHER}")
endif()

if(MODE STREQUAL "package")
  if(NOT DEFINED KILN_BUILD_DIR)
    message(FATAL_ERROR "check_consumer.cmake: KILN_BUILD_DIR is not set")
  endif()
  set(prefix "${WORK_DIR}/prefix")
  run_step("install" "${CMAKE_COMMAND}" --install "${KILN_BUILD_DIR}" --prefix "${prefix}")
  # The layout users rely on: the umbrella header and the folders under include/kiln.
  foreach(f include/kiln/kiln.h include/kiln/tensor/tensor.h include/kiln/tensor/registry.h)
    if(NOT EXISTS "${prefix}/${f}")
      message(FATAL_ERROR "[package] ${f} is missing from the install")
    endif()
  endforeach()
  # The installed tool runs from its prefix (its RPATH is relative to the binary).
  file(GLOB_RECURSE installed_tool "${prefix}/bin/kiln")
  if(NOT installed_tool)
    message(FATAL_ERROR "[package] bin/kiln is missing from the install")
  endif()
  run_step("installed tool" "${installed_tool}" help)
  run_step("configure" "${CMAKE_COMMAND}" ${configure_args} "-DCMAKE_PREFIX_PATH=${prefix}"
           -DCMAKE_BUILD_TYPE=Release)
  if(NOT step_output MATCHES "using the kiln package in ([^\n]*)")
    message(FATAL_ERROR "[package] the consumer did not report where kiln was found")
  endif()
  set(found_dir "${CMAKE_MATCH_1}")
  cmake_path(IS_PREFIX prefix "${found_dir}" NORMALIZE found_in_prefix)
  if(NOT found_in_prefix)
    message(FATAL_ERROR "[package] kiln was found in ${found_dir}, not in ${prefix}")
  endif()
elseif(MODE STREQUAL "subdirectory")
  # Only the wiring is under test here: no optimisation (quicker to compile), no CUDA.
  run_step("configure" "${CMAKE_COMMAND}" ${configure_args}
           "-DKILN_SOURCE_DIR=${KILN_SOURCE_DIR}" -DCMAKE_BUILD_TYPE= -DKILN_CUDA=OFF)
  if(step_output MATCHES "kiln: CUDA backend ON")
    message(FATAL_ERROR "[subdirectory] KILN_CUDA=OFF was ignored")
  endif()
else()
  message(FATAL_ERROR "check_consumer.cmake: unknown MODE ${MODE}")
endif()

if(MODE STREQUAL "subdirectory" AND GENERATOR STREQUAL "Ninja")
  run_step("compile the consumer" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build"
           --target CMakeFiles/app.dir/main.cpp.o)
  message(STATUS "[subdirectory] the consumer compiled against the in-tree kiln::kiln target")
  return()
endif()
run_step("build" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build" --target app)
run_step("run" "${WORK_DIR}/build/app")
message(STATUS "[${MODE}] app printed:\n${step_output}")
if(NOT step_output MATCHES "kiln_consumer: OK")
  message(FATAL_ERROR "[${MODE}] the consumer did not report success")
endif()
