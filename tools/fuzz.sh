#!/usr/bin/env bash
# Fuzzes every parser of untrusted files for a bounded time (docs/testing.md, "Fuzz targets").
#
#   tools/fuzz.sh [SECONDS] [KILN_BUILD_DIR]
#
# Builds the libFuzzer targets of tests/fuzz/targets.cmake with clang (tests/fuzz/CMakeLists.txt:
# the harnesses and the parsers they test, instrumented with libFuzzer's coverage, ASan and UBSan)
# against the libkiln.so of KILN_BUILD_DIR (default: build, as the README's command leaves it;
# any compiler), then runs each target for SECONDS (default 15) from its seeds and dictionary.
# Fails on a crash, a sanitizer report, an unexpected exception or a broken invariant; libFuzzer
# leaves the input that did it (crash-<sha1>, leak-..., timeout-...) in the fuzz build directory,
# which is $KILN_FUZZ_BUILD_DIR (default build-fuzz). What the targets find stays in its
# <target>_corpus folders, so that a second run starts from there.
#
# Needs clang++ and its libFuzzer runtime (Debian: apt-get install clang libclang-rt-dev).
# .ci/run runs it after the README's command, with 10 seconds a target.
set -euo pipefail

usage() {
  echo "usage: $0 [SECONDS] [KILN_BUILD_DIR]" >&2
  exit 2
}
seconds="${1:-15}"
lib_dir="${2:-build}"
[[ "$seconds" =~ ^[1-9][0-9]*$ ]] || usage
(( $# <= 2 )) || usage
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fuzz_dir="${KILN_FUZZ_BUILD_DIR:-build-fuzz}"
cxx="${CXX_FUZZ:-clang++}"

if ! command -v "$cxx" > /dev/null; then
  echo "tools/fuzz.sh: no $cxx: libFuzzer comes with clang (Debian: apt-get install clang" \
    "libclang-rt-dev)" >&2
  exit 1
fi
if [[ ! -e "$lib_dir/libkiln.so" ]]; then
  echo "tools/fuzz.sh: no libkiln.so in '$lib_dir': build kiln first (the README's command)," \
    "or name its build directory" >&2
  exit 1
fi
# libFuzzer's runtime is a separate package on Debian: say so instead of failing at the link.
probe="$(mktemp -d)"
trap 'rm -rf "$probe"' EXIT
printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
  'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' > "$probe/p.cpp"
if ! "$cxx" -fsanitize=fuzzer,address,undefined "$probe/p.cpp" -o "$probe/p" 2> "$probe/err"; then
  cat "$probe/err" >&2
  echo "tools/fuzz.sh: $cxx cannot link a libFuzzer target (Debian: apt-get install" \
    "libclang-rt-dev)" >&2
  exit 1
fi

echo "== fuzz: $("$cxx" --version | head -n 1); kiln from $lib_dir; $seconds s a target"
generator=()
[[ -e "$fuzz_dir/CMakeCache.txt" ]] || generator=(-G Ninja)
cmake -S "$repo/tests/fuzz" -B "$fuzz_dir" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
  -DKILN_BUILD_DIR="$lib_dir" -DKILN_FUZZ_SECONDS="$seconds" > "$probe/configure.log" ||
  { cat "$probe/configure.log" >&2; exit 1; }
cmake --build "$fuzz_dir"
status=0
ctest --test-dir "$fuzz_dir" -L fuzz --output-on-failure -j "$(nproc)" || status=$?

# One line a target: how many inputs it ran and the coverage it reached.
log="$fuzz_dir/Testing/Temporary/LastTest.log"
if [[ -f "$log" ]]; then
  awk '/^[0-9]+\/[0-9]+ Test: / { test = $3 }
       /DONE +cov:/ { sub(/^#/, "", $1); printf "  %-20s %9d runs, cov %s\n", test, $1, $4 }' \
    "$log"
fi
if (( status != 0 )); then
  find "$fuzz_dir" -maxdepth 1 -name 'crash-*' -o -maxdepth 1 -name 'leak-*' \
    -o -maxdepth 1 -name 'timeout-*' -o -maxdepth 1 -name 'oom-*' | sed 's/^/  input: /'
fi
exit "$status"
