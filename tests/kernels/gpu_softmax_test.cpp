// The CUDA kernels of softmax and log_softmax (kernels/cuda/softmax.cu, softmax.cuh) against the
// CPU kernels (kernels/cpu/softmax.cpp) on the same random CPU inputs, within a few ulps: rows
// and columns of every floating dtype and layout, rows in shared memory (both load paths: the
// bulk copy of sm_90 and the loads through registers of earlier GPUs, through
// kernels/cuda/softmax.h) and rows too long for it, every 16-byte alignment, -inf, +inf and NaN.
// Suites are named Gpu* (ctest label gpu) and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/cuda/softmax.h"
#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::kFloatDtypes;
using test::layouts;
using test::name_of;
using test::random_cpu;
using test::to_gpu_like;
using test::Tol;
using test::tol_for;

class GpuSoftmax : public test::GpuTest {};

TEST_F(GpuSoftmax, RowsColumnsAndDtypes) {
  uint64_t seed = 4000;
  const std::vector<std::pair<Shape, int64_t>> cases = {
      {{}, 0},          {{1}, 0},        {{7}, 0},      {{9, 1000}, -1}, {{3, 5000}, 1},
      {{2, 70000}, -1}, {{4, 33, 5}, 1}, {{33, 17}, 0}, {{65537}, 0},    {{6, 1024}, 1}};
  for (ScalarType dt : kFloatDtypes) {
    for (const auto& [shape, dim] : cases) {
      const Tensor x = random_cpu(shape, dt, seed++, -8, 8);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        const std::string what = name_of("", dt, shape, layout) + " dim " + std::to_string(dim);
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        expect_match(g.softmax(dim), x.softmax(dim), tol, "softmax " + what);
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        expect_match(g.log_softmax(dim), x.log_softmax(dim), ltol, "log_softmax " + what);
      }
    }
  }
  // An integer input with a dtype, a half input computed as float, rows of -inf.
  const Tensor i = random_cpu({5, 9}, kInt64, 4100, -5, 5);
  expect_match(i.cuda().softmax(1, kFloat), i.softmax(1, kFloat), {1e-5, 1e-7}, "int as float");
  const Tensor h = random_cpu({5, 9}, kHalf, 4101);
  expect_match(h.cuda().log_softmax(0, kFloat), h.log_softmax(0, kFloat), {1e-5, 1e-5},
               "half as float");
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor s = tensor({{-inf, -inf, -inf}, {1.0, -inf, 2.0}}, TensorOptions(kFloat));
  expect_match(s.cuda().softmax(1), s.softmax(1), {1e-6, 1e-7}, "softmax -inf");
  expect_match(s.cuda().log_softmax(1), s.log_softmax(1), {1e-6, 1e-7}, "log_softmax -inf");
}

// Long rows: rows cached in shared memory (up to about 100000 16-bit elements), longer rows in
// two passes (online max and sum); 16-byte accesses after a scalar head, so rows of odd length
// and views at odd element offsets (every row aligned differently from the output) matter.
// Entries of -inf, +inf and nan, and whole rows of -inf, as on the CPU.
TEST_F(GpuSoftmax, LongRowsAlignmentAndInfinities) {
  uint64_t seed = 4200;
  const double inf = std::numeric_limits<double>::infinity();
  // 16-bit rows up to 100003 elements are cached in shared memory, f32 up to 32768 and more (the
  // device's limit); 150001 elements take the online path in every dtype.
  const std::vector<Shape> shapes = {{3, 32768}, {3, 100003}, {5, 4097},  {4, 1025},
                                     {3, 32769}, {2, 60001},  {5, 150001}};
  for (ScalarType dt : kFloatDtypes) {
    for (const Shape& shape : shapes) {
      const int64_t A = shape[0], R = shape[1];
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        // Values in double with special entries, then the dtype; the rows are a view at
        // `offset` elements into a larger buffer (on the CPU and on the GPU alike).
        Tensor base = random_cpu({A * R + offset}, kDouble, seed++, -12, 12).contiguous();
        double* p = base.data_ptr<double>() + offset;
        p[R / 3] = -inf;  // row 0: one -inf
        if (A > 1) {
          for (int64_t r = 0; r < R; r += 7) p[R + r] = -inf;  // row 1: many -inf
        }
        if (A > 2) {
          for (int64_t r = 0; r < R; ++r) p[2 * R + r] = -inf;  // row 2: all -inf (nan)
        }
        if (A > 3) p[3 * R + R - 1] = inf;  // row 3: +inf (nan)
        if (A > 4) p[4 * R + 5] = std::nan("");
        const Tensor cpu_base = base.to(dt);
        const Tensor gpu_base = cpu_base.cuda();
        const Tensor x = cpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = gpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, shape, "offset " + std::to_string(offset));
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        expect_match(g.softmax(1), x.softmax(1), tol, "softmax " + what);
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        // f64: the CPU adds each of the R terms exp(x - max) to a running sum near 1, rounding
        // each at 2^-53, so its log(sum) (the whole of log_softmax at the maximum of a row whose
        // other terms are tiny, row 0) is only good to about R * 2^-53 absolute; the GPU sums
        // partial sums first (measured: 1.1e-13 apart at R = 32771).
        if (dt == kDouble) ltol = {1e-12, static_cast<double>(R) * 0x1p-53};
        expect_match(g.log_softmax(-1), x.log_softmax(-1), ltol, "log_softmax " + what);
      }
    }
  }
  // A half input computed as float over long rows (the kernel sees the float copy).
  const Tensor h = random_cpu({3, 40000}, kHalf, 4300, -8, 8);
  expect_match(h.cuda().softmax(1, kFloat), h.softmax(1, kFloat), {1e-5, 1e-7},
               "half as float, long rows");
}

// The shared-memory kernel (the row read once: on sm_90 by a bulk copy of its 16-byte-aligned
// body, the scalar head and tail by the threads): many rows at once (several blocks per
// multiprocessor), row lengths that are and are not a multiple of the 16-byte pack (every row
// then starts at another alignment), views at odd element offsets (x aligned differently from
// y), the row maximum in the scalar head or in the tail, rows of equal values, values more than
// 87 below the maximum (exp under 2^-126), -inf entries, and a non-contiguous input (copied
// first), against the CPU; both load paths (the bulk copy of the ops on sm_90, and the loads
// through registers of earlier GPUs, through kernels/cuda/softmax.h), with the threads per row
// the row length gives (128 to 512; other counts: the kernel lab). f64 rows of 32768 and more
// take the online kernel.
TEST_F(GpuSoftmax, SharedMemoryRowsPackedAndScalarEnds) {
  uint64_t seed = 4400;
  const double inf = std::numeric_limits<double>::infinity();
  struct Case {
    int64_t A, R;
    std::vector<ScalarType> dtypes;
  };
  const std::vector<Case> cases = {
      {400, 32768, {kBFloat16, kHalf}},  // three 64 KiB rows per multiprocessor
      {9, 32771, kFloatDtypes},         {12, 2056, kFloatDtypes},
      {7, 1031, kFloatDtypes},          {6, 12345, kFloatDtypes},
  };
  for (const Case& c : cases) {
    const int64_t A = c.A, R = c.R;
    for (ScalarType dt : c.dtypes) {
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{5}}) {
        if (A > 100 && offset == 5) continue;  // the large case: aligned and one misaligned view
        Tensor base = random_cpu({A * R + offset}, kDouble, seed++, -12, 12).contiguous();
        double* p = base.data_ptr<double>() + offset;
        p[0] = 40;                                               // row 0: maximum first (head)
        p[1 * R + R - 1] = 40;                                   // row 1: maximum last (tail)
        for (int64_t r = 0; r < R; ++r) p[2 * R + r] = 1.5;      // row 2: all equal
        p[3 * R + 1] = 100;                                      // row 3: others far below
        for (int64_t r = 2; r < R; r += 5) p[4 * R + r] = -inf;  // row 4: many -inf
        const Tensor cpu_base = base.to(dt);
        const Tensor x = cpu_base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = cpu_base.cuda().slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, {A, R}, "offset " + std::to_string(offset));
        Tol tol = tol_for(dt);
        if (dt == kFloat) tol = {1e-5, 1e-7};
        Tol ltol = tol_for(dt);
        if (dt == kFloat) ltol = {1e-5, 1e-5};
        // f64: the CPU adds each of the R terms exp(x - max) to a running sum near 1, rounding
        // each at 2^-53, so its log(sum) (the whole of log_softmax at the maximum of a row whose
        // other terms are tiny, row 0) is only good to about R * 2^-53 absolute; the GPU sums
        // partial sums first (measured: 1.1e-13 apart at R = 32771).
        if (dt == kDouble) ltol = {1e-12, static_cast<double>(R) * 0x1p-53};
        const Tensor es = x.softmax(1), el = x.log_softmax(-1);
        // Rows that are not contiguous: each a prefix of a longer row.
        const bool narrow = offset == 1 && A < 100;
        const Tensor xn = x.narrow(1, 0, R - 2), gn = g.narrow(1, 0, R - 2);
        const Tensor ens = narrow ? xn.softmax(1) : Tensor();
        const Tensor enl = narrow ? xn.log_softmax(1) : Tensor();
        // The ops (the bulk copy on sm_90).
        expect_match(g.softmax(1), es, tol, "softmax " + what);
        expect_match(g.log_softmax(-1), el, ltol, "log_softmax " + what);
        if (narrow) {
          expect_match(gn.softmax(1), ens, tol, "softmax narrow " + what);
          expect_match(gn.log_softmax(1), enl, ltol, "log_softmax narrow " + what);
        }
#if defined(KILN_WITH_CUDA)
        // The loads through registers.
        using cuda::internal::SoftmaxRowLoad;
        auto by_registers = [&](const Tensor& t, bool log) {
          const Tensor out = empty(t.sizes(), TensorOptions(t.dtype()).device(t.device()));
          cuda::internal::softmax_forward(t, 1, log, out, SoftmaxRowLoad::kRegisters);
          return out;
        };
        const std::string how = what + " registers";
        expect_match(by_registers(g, false), es, tol, "softmax " + how);
        expect_match(by_registers(g, true), el, ltol, "log_softmax " + how);
        if (narrow) {
          expect_match(by_registers(gn, false), ens, tol, "softmax narrow " + how);
          expect_match(by_registers(gn, true), enl, ltol, "log_softmax narrow " + how);
        }
#endif
      }
    }
  }
}

}  // namespace
}  // namespace kiln
