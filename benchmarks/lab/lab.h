// The kernel lab: kernel variants that lost to the library's kernels (or that are not yet
// proven), each validated against a reference and timed beside the library's kernel in one run.
// The model is llm.c's dev/cuda: the library ships the winner; contenders live here, where
// nothing on the library's launch path can reach them.
//
//   kiln_kernel_lab [--only FAMILIES] [results.json]
//
// A family file (lab/<family>_lab.cu, the stem of the library's kernel file) holds the variants'
// kernels and registers one case per family:
//
//   KILN_LAB_CASE(rmsnorm, [] {
//     const kiln::Tensor x = kiln::bench::random({8192, 2048}, kiln::kBFloat16);
//     ...
//     const kiln::Tensor ref = reference(x.to(kiln::kCPU).to(kiln::kDouble), ...);
//     kiln::lab::check("rmsnorm v3", run_v3(x, w), ref, /*atol=*/1e-2, /*rtol=*/1e-2);
//     kiln::bench::report("rmsnorm 8192x2048 bf16 fwd [library]", time_ms(...), 0, bytes);
//     kiln::bench::report("rmsnorm 8192x2048 bf16 fwd [v3]", time_ms(...), 0, bytes);
//   });
//
// check() compares on the CPU in f64 and records a failure (the program exits non-zero at the
// end, after every case ran), so that a variant that stopped being correct is seen at once.
#pragma once

#include <functional>
#include <string>

#include "gpu/bench_util.h"
#include "tensor/tensor.h"

namespace kiln::lab {

// Registers a case (a family's validations and timings) under `family`; returns true.
bool register_case(const char* family, std::function<void()> run);

// Compares `got` (any device and floating dtype) with `ref` elementwise in f64:
// |got - ref| <= atol + rtol * |ref|. Prints the max error; a mismatch (or a shape mismatch) is
// recorded as a failure with `what` in the message.
void check(const std::string& what, const Tensor& got, const Tensor& ref, double atol,
           double rtol);

}  // namespace kiln::lab

#define KILN_LAB_CONCAT2(a, b) a##b
#define KILN_LAB_CONCAT(a, b) KILN_LAB_CONCAT2(a, b)
#define KILN_LAB_CASE(family, ...)                                               \
  static const bool KILN_LAB_CONCAT(kiln_lab_case_, __COUNTER__) = \
      ::kiln::lab::register_case(#family, __VA_ARGS__)
