// CUDA kernel coverage of the op registry: in a build with CUDA, every op that has a CPU kernel
// must have a CUDA kernel too, unless it is listed below with the reason it needs none. A new
// op fails CudaKernelCoverage.EveryCpuKernelHasACudaKernel until it gets a kernel in
// kernels/cuda/ (or an entry here). The test only inspects the registry, so it runs (and
// guards) on machines without a GPU; in a build without CUDA it skips.
//
//   build/tests/kernels_tests --gtest_filter='CudaKernelCoverage*'
#include <gtest/gtest.h>

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tensor/registry.h"

namespace kiln {
namespace {

// Ops with a CPU kernel that need no CUDA kernel of their own. View ops (OpKind::kView) are
// left out automatically: the dispatcher runs their CPU kernel for every device, because a view
// only computes sizes and strides over the input's storage.
// (increment_ was one until its CUDA kernel came with the GPU step counts of a capturable AdamW.)
const std::set<std::string> kNoCudaKernelNeeded = {};

bool has_kernel(const OpDef& op, DeviceType device) {
  return op.first_kernel(device) != nullptr;
}

TEST(CudaKernelCoverage, EveryCpuKernelHasACudaKernel) {
#if !defined(KILN_WITH_CUDA)
  GTEST_SKIP() << "kiln was built without CUDA (configure with -DKILN_CUDA=ON)";
#else
  Registry& registry = Registry::get();
  std::ostringstream missing;
  int count = 0;
  for (const std::string& name : registry.names()) {
    const OpDef& op = registry.entry(name);
    if (op.kind == OpKind::kView || !has_kernel(op, kCPU) || has_kernel(op, kCUDA)) continue;
    // A fused op without a CUDA kernel runs its decomposition there (sgd_update_).
    if (op.decomposition != nullptr) continue;
    if (kNoCudaKernelNeeded.count(name) > 0) continue;
    missing << "  " << name << "\n";
    ++count;
  }
  EXPECT_EQ(count, 0) << "ops with a CPU kernel but no CUDA kernel (add one in kernels/cuda/ or "
                         "list the op in gpu_coverage_test.cpp with the reason):\n"
                      << missing.str();
#endif
}

// The allow-list names only ops that exist, have a CPU kernel, still lack a CUDA kernel (in a
// CUDA build) and are not views: a stale entry would hide nothing and mislead the reader.
TEST(CudaKernelCoverage, AllowListIsCurrent) {
  Registry& registry = Registry::get();
  const std::vector<std::string> names = registry.names();
  const std::set<std::string> registered(names.begin(), names.end());
  for (const std::string& name : kNoCudaKernelNeeded) {
    SCOPED_TRACE(name);
    ASSERT_EQ(registered.count(name), 1u) << "not a registered op";
    const OpDef& op = registry.entry(name);
    EXPECT_NE(op.kind, OpKind::kView) << "view ops need no entry";
    EXPECT_TRUE(has_kernel(op, kCPU)) << "has no CPU kernel, so it needs no entry";
#if defined(KILN_WITH_CUDA)
    EXPECT_FALSE(has_kernel(op, kCUDA)) << "has a CUDA kernel now: remove the entry";
#endif
  }
}

// The registry's view of the kernels this test relies on: a sanity check that the CUDA
// kernels registered themselves at all (a build that dropped kernels/cuda/ from the library
// would otherwise pass the coverage test only if it also dropped the CPU kernels).
TEST(CudaKernelCoverage, RegistryReportsCudaKernels) {
  Registry& registry = Registry::get();
  const OpDef& add = registry.op("add");
  EXPECT_TRUE(has_kernel(add, kCPU));
#if defined(KILN_WITH_CUDA)
  EXPECT_TRUE(has_kernel(add, kCUDA));
#else
  EXPECT_FALSE(has_kernel(add, kCUDA));
#endif
}

}  // namespace
}  // namespace kiln
