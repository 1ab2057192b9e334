// Helpers the compiler's pass tests share: counting a trace's ops by name, a compilation's stage by
// name, and compiled against eager bit for bit.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "compiler/trace.h"
#include "tensor/ops.h"
#include "tensor/tensor.h"

namespace kiln::test {

inline int count_ops(const compiler::Trace& t, const std::string& name) {
  int n = 0;
  for (const auto& op : t.ops) n += op.name() == name;
  return n;
}

// The stage `name` of a compilation's traces (CompiledFunction::traces()); a failure when absent.
inline const compiler::Trace& stage(const std::vector<compiler::Trace>& traces,
                                    const std::string& name) {
  for (const compiler::Trace& t : traces) {
    if (t.stage == name) return t;
  }
  ADD_FAILURE() << "no stage " << name;
  return traces.back();
}

// Both undefined, or the same sizes, dtype and values.
inline void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.defined(), want.defined()) << what;
  if (!want.defined()) return;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  EXPECT_TRUE(equal(got, want)) << what << ": compiled\n" << got << "\neager\n" << want;
}

}  // namespace kiln::test
