#!/usr/bin/env bash
# Builds kiln with AddressSanitizer and UndefinedBehaviorSanitizer (KILN_SANITIZE) and runs the
# whole CPU suite under them (docs/testing.md, "The sanitizer build").
#
#   tools/sanitize.sh                  every CPU test
#   tools/sanitize.sh -L nn            extra arguments go to ctest: one folder, -R, -E ...
#
# The build goes in $KILN_SANITIZE_BUILD_DIR (default build-san), with $CXX or the system's c++
# (g++, the CI's compiler), CPU only, at -O1 with line tables. Any
# report fails its test: an undefined-behaviour report stops the program
# (-fno-sanitize-recover=undefined), an ASan report (over-read, use after free, leak at exit)
# always does. The fuzz targets replay their seeds there (with g++) or fuzz (with clang).
# Slow: the build takes about twice as long as the regular one, the tests three to five times.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${KILN_SANITIZE_BUILD_DIR:-build-san}"

generator=()
[[ -e "$build/CMakeCache.txt" ]] || generator=(-G Ninja)
# -O1 -g1 (line tables): half the compile time of -O2 -g under the sanitizers (kernels/cpu's
# dispatch files take minutes each), and reports still name file and line.
cmake -S "$repo" -B "$build" "${generator[@]}" -DKILN_SANITIZE=ON -DKILN_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" \
  -DKILN_BUILD_BENCHMARKS=OFF
cmake --build "$build"

# detect_stack_use_after_return finds a pointer to a dead stack frame; strict_string_checks reads
# C strings to their end. Leak detection is on by default (Linux).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_stack_use_after_return=1:strict_string_checks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1}"
ctest --test-dir "$build" -L cpu --output-on-failure -j "$(nproc)" "$@"
