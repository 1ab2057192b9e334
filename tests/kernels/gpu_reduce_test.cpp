// The CUDA kernels of the reductions and of cumsum (kernels/cuda/reduce.cu, reduce.cuh) against
// the CPU kernels (kernels/cpu/reduce.cpp): the same op on the same random CPU inputs, run on the
// CPU and on the GPU, must agree bit for bit for integer, bool, extremum and index results and
// within the rounding of another summation order for float sums. Every dtype, reduced dims that
// do and do not form one run in memory, 0-d and empty tensors, long rows and columns (split over
// several blocks, deterministic), rows at every 16-byte alignment, NaN and infinities, every row
// kernel. Suites are named Gpu* (ctest label gpu) and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kernels/gpu_test_util.h"
#include "tensor/ops.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::expect_same;
using test::kAllDtypes;
using test::kFloatDtypes;
using test::kNumericDtypes;
using test::layouts;
using test::name_of;
using test::random_cpu;
using test::to_gpu_like;
using test::Tol;
using test::tol_for;

class GpuReduce : public test::GpuTest {};

// Float reductions accumulate in float on the GPU and in double on the CPU: the tolerance grows
// with the number of reduced elements.
Tol reduce_tol(ScalarType dt, int64_t reduced) {
  Tol t = tol_for(dt);
  if (dt == kFloat) t = {1e-5, 1e-6 * std::sqrt(static_cast<double>(reduced) + 1) * 4};
  if (dt == kDouble) t = {1e-11, 1e-11};
  return t;
}

struct ReduceShape {
  Shape shape;
  std::vector<Shape> dims;  // each entry one call; {} = all dims
};

const std::vector<ReduceShape> kReduceShapes = {
    {{}, {{}}},
    {{1}, {{}, {0}}},
    {{7}, {{0}}},
    {{1000}, {{}}},
    {{65537}, {{}}},                          // one long row: the multi-block path
    {{3, 65537}, {{1}, {0}}},                 // few long rows; long columns of width 65537
    {{65537, 3}, {{0}, {1}}},                 // narrow columns over a long R (split), short rows
    {{37, 129}, {{1}, {0}, {}}},              // warp rows, columns
    {{5, 7, 9}, {{1}, {0, 2}, {2}, {0, 1}}},  // middle dim, interleaved dims (copied)
    {{4, 5000}, {{1}}},                       // block rows without a split
};

TEST_F(GpuReduce, SumMeanProdExtremaEveryDtype) {
  uint64_t seed = 2000;
  for (const ReduceShape& rs : kReduceShapes) {
    for (ScalarType dt : kAllDtypes) {
      const Tensor x = random_cpu(rs.shape, dt, seed++, -1, 1);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (const Shape& dims : rs.dims) {
          for (bool keepdim : {false, true}) {
            const std::string what = name_of("", dt, rs.shape, layout) + " dims " +
                                     shape_str(dims) + (keepdim ? " keepdim" : "");
            int64_t reduced = 1;
            for (int64_t d : dims) reduced *= x.size(d);
            if (dims.empty()) reduced = x.numel();
            const Tensor es = x.sum(dims, keepdim);
            expect_match(g.sum(dims, keepdim), es, reduce_tol(es.dtype(), reduced), "sum " + what);
            if (is_floating_point(dt)) {
              const Tensor em = x.mean(dims, keepdim);
              expect_match(g.mean(dims, keepdim), em, reduce_tol(dt, reduced), "mean " + what);
            }
            expect_same(g.amax(dims, keepdim), x.amax(dims, keepdim), "amax " + what);
            expect_same(g.amin(dims, keepdim), x.amin(dims, keepdim), "amin " + what);
            if (dims.size() == 1) {
              const int64_t d = dims[0];
              if (dt != kBool) {
                expect_same(g.argmax(d, keepdim), x.argmax(d, keepdim), "argmax " + what);
                expect_same(g.argmin(d, keepdim), x.argmin(d, keepdim), "argmin " + what);
              }
              const auto [gv, gi] = g.max(d, keepdim);
              const auto [cv, ci] = x.max(d, keepdim);
              expect_same(gv, cv, "max values " + what);
              expect_same(gi, ci, "max indices " + what);
              const auto [gv2, gi2] = g.min(d, keepdim);
              const auto [cv2, ci2] = x.min(d, keepdim);
              expect_same(gv2, cv2, "min values " + what);
              expect_same(gi2, ci2, "min indices " + what);
              expect_same(g.all(d, keepdim), x.all(d, keepdim), "all " + what);
              expect_same(g.any(d, keepdim), x.any(d, keepdim), "any " + what);
            }
          }
        }
        expect_same(g.max(), x.max(), "max() " + name_of("", dt, rs.shape, layout));
        expect_same(g.min(), x.min(), "min() " + name_of("", dt, rs.shape, layout));
        expect_same(g.all(), x.all(), "all() " + name_of("", dt, rs.shape, layout));
        expect_same(g.any(), x.any(), "any() " + name_of("", dt, rs.shape, layout));
        if (dt != kBool) {
          expect_same(g.argmax(), x.argmax(), "argmax() " + name_of("", dt, rs.shape, layout));
          expect_same(g.argmin(), x.argmin(), "argmin() " + name_of("", dt, rs.shape, layout));
        }
      }
    }
  }
}

TEST_F(GpuReduce, ProdAndDtypeArgument) {
  uint64_t seed = 2500;
  for (ScalarType dt : kNumericDtypes) {
    const Tensor x = is_floating_point(dt) ? random_cpu({9, 61}, dt, seed++, 0.8, 1.2)
                                           : random_cpu({9, 61}, dt, seed++, -2, 2);
    for (int64_t d : {0, 1}) {
      const Tensor e = x.prod(d);
      expect_match(x.cuda().prod(d), e, reduce_tol(e.dtype(), 61),
                   "prod " + std::string(dtype_name(dt)));
    }
    const Tensor e = x.prod();
    expect_match(x.cuda().prod(), e, {1e-3, 1e-6}, "prod() " + std::string(dtype_name(dt)));
  }
  const Tensor i = random_cpu({1000}, kInt32, 2600, -100, 100);
  expect_same(i.cuda().sum({0}, false, kInt32), i.sum({0}, false, kInt32), "sum int32 dtype");
  const Tensor h = random_cpu({1000}, kHalf, 2601);
  expect_match(h.cuda().sum({0}, false, kFloat), h.sum({0}, false, kFloat),
               reduce_tol(kFloat, 1000), "sum half as float");
  expect_match(h.cuda().mean({}, false, kDouble), h.mean({}, false, kDouble),
               reduce_tol(kDouble, 1000), "mean half as double");
}

TEST_F(GpuReduce, VarStdNormLogsumexp) {
  uint64_t seed = 3000;
  for (const ReduceShape& rs : kReduceShapes) {
    for (ScalarType dt : kFloatDtypes) {
      const Tensor x = random_cpu(rs.shape, dt, seed++, -2, 2);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (const Shape& dims : rs.dims) {
          int64_t reduced = 1;
          for (int64_t d : dims) reduced *= x.size(d);
          if (dims.empty()) reduced = x.numel();
          const Tol tol = reduce_tol(dt, reduced);
          const Tol loose = {tol.rtol * 10, tol.atol * 10};
          const std::string what = name_of("", dt, rs.shape, layout) + " dims " + shape_str(dims);
          for (int64_t correction : {0, 1}) {
            expect_match(g.var(dims, correction), x.var(dims, correction), loose, "var " + what);
            expect_match(g.std(dims, correction, true), x.std(dims, correction, true), loose,
                         "std " + what);
          }
          for (double p : {0.0, 1.0, 2.0, 3.0, 0.5, std::numeric_limits<double>::infinity(),
                           -std::numeric_limits<double>::infinity()}) {
            expect_match(g.norm(p, dims), x.norm(p, dims), loose,
                         "norm " + std::to_string(p) + " " + what);
          }
          if (!dims.empty()) {
            expect_match(g.logsumexp(dims), x.logsumexp(dims), loose, "logsumexp " + what);
          }
        }
      }
    }
  }
  // Infinities and NaN in logsumexp and the extrema.
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor s =
      tensor({{-inf, -inf, -inf}, {1.0, inf, 2.0}, {1.0, std::nan(""), 3.0}, {-inf, 0.5, -inf}},
             TensorOptions(kFloat));
  expect_match(s.cuda().logsumexp({1}), s.logsumexp({1}), tol_for(kFloat), "logsumexp inf/nan");
  expect_same(s.cuda().amax({1}), s.amax({1}), "amax nan");
  expect_same(s.cuda().argmax(1), s.argmax(1), "argmax nan");
  expect_same(s.cuda().argmin(1), s.argmin(1), "argmin nan");
  // Empty reductions.
  const Tensor empty_rows = zeros({3, 0}, TensorOptions(kFloat));
  expect_same(empty_rows.cuda().sum({1}), empty_rows.sum({1}), "sum over nothing");
  expect_match(empty_rows.cuda().mean({1}), empty_rows.mean({1}), tol_for(kFloat), "mean nothing");
  expect_same(empty_rows.cuda().logsumexp({1}), empty_rows.logsumexp({1}), "lse over nothing");
  EXPECT_KILN_ERROR(empty_rows.cuda().amax({1}), "[amax]");
}

TEST_F(GpuReduce, Cumsum) {
  uint64_t seed = 3500;
  for (ScalarType dt : kAllDtypes) {
    for (const Shape& shape : std::vector<Shape>{{}, {1}, {7}, {65537}, {33, 17}, {5, 7, 9}}) {
      const Tensor x = random_cpu(shape, dt, seed++, -2, 2);
      for (const auto& [layout, xv] : layouts(x)) {
        const Tensor g = to_gpu_like(layout, x);
        for (int64_t d = 0; d < std::max<int64_t>(x.dim(), 1); ++d) {
          const Tensor e = x.cumsum(d);
          const int64_t len = x.dim() == 0 ? 1 : x.size(d);
          expect_match(g.cumsum(d), e, reduce_tol(e.dtype(), len),
                       name_of("cumsum", dt, shape, layout) + " dim " + std::to_string(d));
        }
      }
    }
  }
}

// Full reductions (one wave of blocks over 16-byte-aligned chunks, merged by one block) and long
// row reductions read with 16-byte loads after a scalar head: odd lengths and views at odd
// element offsets, against the CPU; argmax/argmin ties must keep the lowest index. The sum of a
// full reduction is deterministic: two runs agree bit for bit.
TEST_F(GpuReduce, VectorisedRowsAndFullReductions) {
  uint64_t seed = 5200;
  const std::vector<Shape> shapes = {
      {1, (int64_t{1} << 22) + 5}, {1, 1000003}, {64, 8193}, {300, 5001}, {100, 4095}, {7, 33}};
  for (ScalarType dt : kAllDtypes) {
    for (const Shape& shape : shapes) {
      const int64_t A = shape[0], R = shape[1];
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{5}}) {
        // Few distinct values for the 16-bit types and integers: many ties for argmax.
        const Tensor base = random_cpu({A * R + offset}, dt, seed++, -2, 2);
        const Tensor x = base.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = base.cuda().slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string what = name_of("", dt, shape, "offset " + std::to_string(offset));
        const Tensor all_sum = x.sum();
        expect_match(g.sum(), all_sum, reduce_tol(all_sum.dtype(), A * R), "sum() " + what);
        const Tensor row_sum = x.sum({1});
        expect_match(g.sum({1}), row_sum, reduce_tol(row_sum.dtype(), R), "sum rows " + what);
        expect_same(g.amax({}), x.amax({}), "amax() " + what);
        expect_same(g.amin({1}), x.amin({1}), "amin rows " + what);
        expect_same(g.any(1), x.any(1), "any rows " + what);
        expect_same(g.all(), x.all(), "all() " + what);
        if (dt != kBool) {
          expect_same(g.argmax(), x.argmax(), "argmax() " + what);
          expect_same(g.argmin(), x.argmin(), "argmin() " + what);
          expect_same(g.argmax(1), x.argmax(1), "argmax rows " + what);
          const auto [gv, gi] = g.min(1);
          const auto [cv, ci] = x.min(1);
          expect_same(gv, cv, "min values " + what);
          expect_same(gi, ci, "min indices " + what);
        }
        if (is_floating_point(dt)) {
          const Tol tol = reduce_tol(dt, A * R);
          const Tol loose = {tol.rtol * 10, tol.atol * 10};
          expect_match(g.mean(), x.mean(), tol, "mean() " + what);
          expect_match(g.var({}, 1), x.var({}, 1), loose, "var() " + what);
          expect_match(g.norm(2.0, {1}), x.norm(2.0, {1}), loose, "norm rows " + what);
          expect_match(g.logsumexp({1}), x.logsumexp({1}), loose, "logsumexp rows " + what);
          expect_same(g.sum(), g.sum().cpu(), "sum() deterministic " + what);
        }
      }
    }
  }
}

// Row reductions read in 16-byte packs (8 bf16/f16, 4 f32, 2 f64, 16 bool) after a scalar head,
// with a scalar tail, for every reducer: rows whose length is and is not a multiple of the pack
// (every row then starts at another alignment), views at odd element offsets, a non-contiguous
// view (copied first) and a transposed one, each row kernel: the warp kernel (rows up to 4096) and
// the block kernel at each of its thread counts (64 to 512, chosen by the bytes of a row or chunk:
// 5000 bf16 128 threads, 8192 bf16 256, 8192 f32 512, the chunks of split rows 64 and more), on
// 300 rows (no split) and on few rows (split into chunks). NaN, +inf and -inf sit in the head, the
// tail and the middle of some rows for the reducers whose results they define (extrema,
// argmax/argmin: the first NaN and the lowest index of equal values win); prod and var/std get
// clean inputs. The CPU results are computed once per input. (Other thread counts per row length:
// the kernel lab, benchmarks/lab/reduce_lab.cu.)
TEST_F(GpuReduce, PackedRowsEveryReducerAndRowKernel) {
  struct Check {
    std::string what;
    std::function<Tensor(const Tensor&)> fn;  // applied to the CPU and the GPU input
    Tol tol;                                  // {0, 0}: bit for bit
  };
  struct Case {
    int64_t A, R;
  };
  // 300 rows fill a GPU of up to 150 multiprocessors without a split; fewer rows of the block
  // kernel are split when longer than 4096 (40 x 4101: two chunks; 3 x 70001: about 18).
  const std::vector<Case> cases = {{300, 8192}, {300, 8199}, {300, 5000}, {40, 4096},
                                   {40, 4101},  {300, 37},   {3, 70001}};
  const double inf = std::numeric_limits<double>::infinity();
  uint64_t seed = 6000;
  for (ScalarType dt : kAllDtypes) {
    const bool fp = is_floating_point(dt);
    for (const Case& c : cases) {
      const int64_t A = c.A, R = c.R;
      for (int64_t offset : {int64_t{0}, int64_t{1}, int64_t{3}}) {
        // A flat buffer viewed at `offset` elements as [A, R], with special values for floats.
        auto make = [&](double lo, double hi, bool special) {
          Tensor base = random_cpu({A * R + offset}, fp ? kDouble : dt, seed++, lo, hi);
          if (fp && special) {
            double* p = base.data_ptr<double>() + offset;
            p[1 * R + R - 1] = std::nan("");  // row 1: NaN in the tail
            p[2 * R + 0] = inf;               // row 2: +inf in the head
            p[0 * R + R / 2] = -inf;          // row 0: -inf in the middle
            p[0 * R + R / 3] = std::nan("");  // and a NaN before it
          }
          return fp ? base.to(dt) : base;
        };
        const Tensor xbase = make(-2, 2, true);
        const Tensor gbase = xbase.cuda();
        const Tensor x = xbase.slice(0, offset, offset + A * R).reshape({A, R});
        const Tensor g = gbase.slice(0, offset, offset + A * R).reshape({A, R});
        ASSERT_EQ(g.storage_offset(), offset);
        const std::string name = name_of("", dt, {A, R}, "offset " + std::to_string(offset));
        const Tol sum_tol = reduce_tol(fp ? dt : kInt64, R);
        // Extrema are exact, but a 16-bit NaN may come back with another payload (the GPU's cvt
        // writes the canonical NaN): floats are compared as values, NaN matching NaN.
        const Tol exact = fp ? Tol{0, 1e-300} : Tol{0, 0};
        std::vector<Check> checks = {
            {"sum", [](const Tensor& t) { return t.sum({1}); }, sum_tol},
            {"amax", [](const Tensor& t) { return t.amax({1}); }, exact},
            {"amin", [](const Tensor& t) { return t.amin({1}, true); }, exact},
            {"max values", [](const Tensor& t) { return std::get<0>(t.max(1)); }, exact},
            {"max indices", [](const Tensor& t) { return std::get<1>(t.max(1)); }, {0, 0}},
            {"min values", [](const Tensor& t) { return std::get<0>(t.min(1)); }, exact},
            {"min indices", [](const Tensor& t) { return std::get<1>(t.min(1)); }, {0, 0}},
            {"all", [](const Tensor& t) { return t.all(1); }, {0, 0}},
            {"any", [](const Tensor& t) { return t.any(1); }, {0, 0}},
        };
        if (dt != kBool) {
          checks.push_back({"argmax", [](const Tensor& t) { return t.argmax(1); }, {0, 0}});
          checks.push_back({"argmin", [](const Tensor& t) { return t.argmin(1, true); }, {0, 0}});
        }
        if (fp) {
          const Tol loose = {sum_tol.rtol * 10, sum_tol.atol * 10};
          checks.push_back({"mean", [](const Tensor& t) { return t.mean({1}); }, sum_tol});
          checks.push_back({"logsumexp", [](const Tensor& t) { return t.logsumexp({1}); }, loose});
          for (double p : {0.0, 1.0, 2.0, 3.0, inf, -inf}) {
            checks.push_back({"norm " + std::to_string(p),
                              [p](const Tensor& t) { return t.norm(p, {1}); }, loose});
          }
        }
        // The CPU results, once.
        std::vector<Tensor> expected;
        for (const Check& ch : checks) expected.push_back(ch.fn(x));
        // prod over values near 1 (no overflow in float), var/std over clean values.
        Tensor xp, gp, xv, gv, ep, evar, estd;
        if (fp) {
          const Tensor pbase = make(0.97, 1.03, false), vbase = make(-2, 2, false);
          xp = pbase.slice(0, offset, offset + A * R).reshape({A, R});
          gp = pbase.cuda().slice(0, offset, offset + A * R).reshape({A, R});
          xv = vbase.slice(0, offset, offset + A * R).reshape({A, R});
          gv = vbase.cuda().slice(0, offset, offset + A * R).reshape({A, R});
          ep = xp.prod(1);
          evar = xv.var({1}, 1);
          estd = xv.std({1}, 0, true);
        }
        // A non-contiguous view (every row a prefix of a longer row; copied before the kernel)
        // and a transposed one (reduced over its dim 0, which is contiguous in memory).
        const Tensor wide = random_cpu({A, R + 3}, dt, seed++, -2, 2);
        const Tensor xn = wide.narrow(1, 1, R);
        const Tensor gn = wide.cuda().narrow(1, 1, R);
        const Tensor en = xn.sum({1}), en_max = xn.amax({1}), et = x.t().sum({0});
        const Tensor en_arg = dt == kBool ? Tensor() : xn.argmax(1);
        const Tensor et_arg = dt == kBool ? Tensor() : x.t().argmin(0);

        const std::string& what = name;
        for (size_t i = 0; i < checks.size(); ++i) {
          expect_match(checks[i].fn(g), expected[i], checks[i].tol, checks[i].what + " " + what);
        }
        if (fp) {
          Tol ptol = sum_tol;
          if (dt == kFloat) ptol = {1e-4, 1e-6};
          expect_match(gp.prod(1), ep, ptol, "prod " + what);
          const Tol vtol = {sum_tol.rtol * 10, sum_tol.atol * 10};
          expect_match(gv.var({1}, 1), evar, vtol, "var " + what);
          expect_match(gv.std({1}, 0, true), estd, vtol, "std " + what);
        }
        expect_match(gn.sum({1}), en, sum_tol, "sum narrow " + what);
        expect_same(gn.amax({1}), en_max, "amax narrow " + what);
        expect_match(g.t().sum({0}), et, sum_tol, "sum transposed " + what);
        if (dt != kBool) {
          expect_same(gn.argmax(1), en_arg, "argmax narrow " + what);
          expect_same(g.t().argmin(0), et_arg, "argmin transposed " + what);
        }
      }
    }
  }
}

// Column reductions (over a dim with elements after it): the column kernel on 16-byte packs (V =
// 16 / sizeof(T) columns a thread) where the column count is a multiple of V and the block is
// 16-byte aligned, else one element a thread. Column counts that are and are not a multiple of
// the pack and of a block's 256 bf16 / 128 f32 columns, one pack a row, views at aligned and odd
// element offsets, an outer dim (several [R, K] blocks), long R split into chunks with a short last
// chunk; every reducer against the CPU (extrema and indices bit for bit, NaN and infinities in
// some columns), and the sums deterministic.
TEST_F(GpuReduce, PackedColumnsEveryReducer) {
  struct Case {
    int64_t A, R, K;
  };
  const std::vector<Case> cases = {{1, 300, 2048}, {1, 4099, 264}, {1, 1000, 4104}, {1, 37, 8},
                                   {1, 20001, 16}, {1, 129, 12},   {3, 500, 1024}};
  const double inf = std::numeric_limits<double>::infinity();
  uint64_t seed = 7000;
  for (ScalarType dt : kAllDtypes) {
    const bool fp = is_floating_point(dt);
    for (const Case& c : cases) {
      const int64_t A = c.A, R = c.R, K = c.K, n = A * R * K;
      for (int64_t offset : {int64_t{0}, int64_t{8}, int64_t{1}}) {
        Tensor base = random_cpu({n + offset}, fp ? kDouble : dt, seed++, -2, 2);
        if (fp) {
          double* p = base.data_ptr<double>() + offset;
          p[(R - 1) * K + 1] = std::nan("");  // column 1: NaN in the last row
          p[0 * K + K - 1] = inf;             // the last column: +inf in the first row
          p[(R / 2) * K + 0] = -inf;          // column 0: -inf in the middle
          base = base.to(dt);
        }
        const Tensor x = base.slice(0, offset, offset + n).reshape({A, R, K});
        const Tensor g = base.cuda().slice(0, offset, offset + n).reshape({A, R, K});
        const std::string what = name_of("", dt, {A, R, K}, "offset " + std::to_string(offset));
        const Tol sum_tol = reduce_tol(fp ? dt : kInt64, R);
        const Tol exact = fp ? Tol{0, 1e-300} : Tol{0, 0};
        expect_match(g.sum({1}), x.sum({1}), sum_tol, "sum " + what);
        expect_match(g.amax({1}), x.amax({1}), exact, "amax " + what);
        expect_match(g.amin({1}, true), x.amin({1}, true), exact, "amin " + what);
        expect_same(g.all(1), x.all(1), "all " + what);
        expect_same(g.any(1), x.any(1), "any " + what);
        if (dt != kBool) {
          expect_same(g.argmax(1), x.argmax(1), "argmax " + what);
          const auto [gv, gi] = g.min(1);
          const auto [cv, ci] = x.min(1);
          expect_match(gv, cv, exact, "min values " + what);
          expect_same(gi, ci, "min indices " + what);
        }
        if (fp) {
          const Tol loose = {sum_tol.rtol * 10, sum_tol.atol * 10};
          expect_match(g.mean({1}), x.mean({1}), sum_tol, "mean " + what);
          expect_match(g.norm(2.0, {1}), x.norm(2.0, {1}), loose, "norm " + what);
          expect_match(g.logsumexp({1}), x.logsumexp({1}), loose, "logsumexp " + what);
          // var and prod over clean values (prod near 1, so no overflow in float).
          const Tensor clean = random_cpu({A, R, K}, kDouble, seed++, -2, 2).to(dt);
          expect_match(clean.cuda().var({1}, 1), clean.var({1}, 1), loose, "var " + what);
          const Tensor near1 = random_cpu({A, R, K}, kDouble, seed++, 0.97, 1.03).to(dt);
          const Tol ptol = dt == kFloat ? Tol{1e-4, 1e-6} : sum_tol;
          expect_match(near1.cuda().prod(1), near1.prod(1), ptol, "prod " + what);
          expect_same(g.sum({1}), g.sum({1}).cpu(), "sum deterministic " + what);
        }
      }
    }
  }
}

}  // namespace
}  // namespace kiln
