// Tests of the CUDA kernels of advanced indexing (index, index_put_), nonzero, masked_select,
// one_hot, sort/topk/argsort, multinomial and randperm (kernels/cuda/{index_adv,sort,random}.cu)
// against the CPU kernels: the same op on the same random CPU inputs, run on the CPU and on the
// GPU, must agree bit for bit (data movement, indices, random draws), except index_put_ with
// accumulate on floats, whose atomic additions may round in another order. Inputs have odd
// sizes, strided and broadcast layouts, duplicates and ties, and every supported dtype; large
// cases sort 1M elements and take topk of 128256-wide rows. Backward passes of the
// differentiable ops run on both devices. Suites are named Gpu* and skip without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/cuda.h"
#include "kernels/gpu_test_util.h"
#include "tensor/indexing.h"
#include "tensor/ops.h"
#include "tensor/registry.h"
#include "tensor/tensor_data.h"
#include "test_util.h"

namespace kiln {
namespace {

using test::expect_match;
using test::expect_same;
using test::kAllDtypes;
using test::kFloatDtypes;
using test::kGpu;
using test::random_cpu;

using indexing::Slice;
using indexing::TensorIndex;

class GpuIndexSortTest : public test::GpuTest {};

class GpuAdvancedIndex : public GpuIndexSortTest {};
class GpuNonzero : public GpuIndexSortTest {};
class GpuMaskedSelect : public GpuIndexSortTest {};
class GpuOneHot : public GpuIndexSortTest {};
class GpuSort : public GpuIndexSortTest {};
class GpuTopk : public GpuIndexSortTest {};
class GpuMultinomial : public GpuIndexSortTest {};
class GpuRandperm : public GpuIndexSortTest {};
class GpuIndexSortBackward : public GpuIndexSortTest {};

// Random integers in [lo, hi] of `dtype` (the index dtypes).
Tensor random_index(IntArrayRef sizes, int64_t lo, int64_t hi, uint64_t seed,
                    ScalarType dtype = kInt64) {
  manual_seed(seed);
  return randint(lo, hi + 1, sizes, TensorOptions(dtype));
}

// Tolerance of a sum whose terms are added in another order (atomics).
std::pair<double, double> sum_tol(ScalarType dtype) {
  switch (dtype) {
    case kFloat:
      return {1e-5, 1e-5};
    case kDouble:
      return {1e-12, 1e-12};
    case kHalf:
      return {4e-3, 4e-3};
    case kBFloat16:
      return {3e-2, 3e-2};
    default:
      return {0, 0};
  }
}

std::string name_of(ScalarType dtype) { return std::string(dtype_name(dtype)); }

// x (CPU) and a GPU tensor with the same values and the transposed layout of the last two dims.
Tensor gpu_transposed(const Tensor& x) {
  return x.transpose(-1, -2).contiguous().to(kGpu).transpose(-1, -2);
}

// self.index_put_ with accumulate, through the op (the indexing API always overwrites).
Tensor index_put_accumulate(const Tensor& self, const Tensor& values, const TensorVec& idx,
                            const Shape& dims) {
  static const OpDef& op = KILN_OP(index_put_);
  TensorVec in{self, values};
  in.insert(in.end(), idx.begin(), idx.end());
  return call_op(op, std::move(in), {dims, true})[0];
}

// --- index --------------------------------------------------------------------------------------

TEST_F(GpuAdvancedIndex, IndexMatchesCpu) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const Tensor x = random_cpu({5, 7, 9}, dt, 100);
    const Tensor gx = x.to(kGpu);
    // One index tensor with negatives and repeats, int64 and int32.
    const Tensor i0 = random_index({11}, -5, 4, 101);
    const Tensor i0_32 = i0.to(kInt32);
    expect_same(gx.index({i0.to(kGpu)}), x.index({i0}), d + " x[i]");
    expect_same(gx.index({i0_32.to(kGpu)}), x.index({i0_32}), d + " x[i int32]");
    // Adjacent indexed dims after a slice, 2-d broadcast index tensors.
    const Tensor i1 = random_index({3, 1}, 0, 6, 102);
    const Tensor i2 = random_index({1, 4}, -9, 8, 103, kInt32);
    expect_same(gx.index({Slice(), i1.to(kGpu), i2.to(kGpu)}), x.index({Slice(), i1, i2}),
                d + " x[:, i1, i2]");
    // Non-adjacent indexed dims: the broadcast dims go first.
    const Tensor j0 = random_index({4, 1}, 0, 4, 104);
    const Tensor j2 = random_index({3}, 0, 8, 105);
    expect_same(gx.index({j0.to(kGpu), Slice(), j2.to(kGpu)}), x.index({j0, Slice(), j2}),
                d + " x[j0, :, j2]");
    // A transposed (strided) self, a strided index view and a boolean mask.
    const Tensor xt = x.transpose(0, 2);
    const Tensor gxt = gx.transpose(0, 2);
    const Tensor wide = random_index({10}, 0, 8, 106);
    expect_same(gxt.index({wide.to(kGpu).slice(0, 0, std::nullopt, 3)}),
                xt.index({wide.slice(0, 0, std::nullopt, 3)}), d + " xt[strided idx]");
    const Tensor mask = random_cpu({9, 7}, kBool, 107);
    expect_same(gxt.index({mask.to(kGpu)}), xt.index({mask}), d + " xt[mask]");
    // Empty index tensor.
    const Tensor none = random_index({0}, 0, 1, 108);
    expect_same(gx.index({Slice(), none.to(kGpu)}), x.index({Slice(), none}), d + " x[:, []]");
  }
}

TEST_F(GpuAdvancedIndex, LargeGatherOfRows) {
  const Tensor x = random_cpu({100003, 24}, kBFloat16, 110);
  const Tensor idx = random_index({65537}, -100003, 100002, 111);
  expect_same(x.to(kGpu).index({idx.to(kGpu)}), x.index({idx}), "large rows");
}

TEST_F(GpuAdvancedIndex, OutOfRangeIndexRaises) {
  const Tensor gx = random_cpu({4, 6}, kFloat, 120).to(kGpu);
  const Tensor bad = tensor({0, 6, 1}).to(kGpu);
  EXPECT_KILN_ERROR(gx.index({Slice(), bad}),
                    "[index] index 6 is out of bounds for dimension 1 with size 6");
  const Tensor neg = tensor({-5}).to(kGpu);
  EXPECT_KILN_ERROR(gx.index({neg}),
                    "[index] index -5 is out of bounds for dimension 0 with size 4");
  Tensor target = gx.clone();
  EXPECT_KILN_ERROR(target.index_put_({Slice(), bad}, 1.0),
                    "[index_put_] index 6 is out of bounds");
}

// --- index_put_ ---------------------------------------------------------------------------------

TEST_F(GpuAdvancedIndex, IndexPutOverwritesAndLastWriteWins) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const Tensor x = random_cpu({6, 5, 7}, dt, 200);
    // Many repeats among 40 indices into 6 rows: the last write of each must win.
    const Tensor i0 = random_index({40}, -6, 5, 201);
    const Tensor v = random_cpu({40, 5, 7}, dt, 202);
    Tensor cpu = x.clone(), gpu = x.to(kGpu);
    cpu.index_put_({i0}, v);
    gpu.index_put_({i0.to(kGpu)}, v.to(kGpu));
    expect_same(gpu, cpu, d + " x[i] = v (repeats)");
    // Two non-adjacent index tensors into a transposed self (result [9, 3, 5]), values
    // broadcast from [3, 5].
    const Tensor a = random_index({9, 1}, 0, 6, 203), b = random_index({1, 3}, -6, 5, 204);
    const Tensor vb = random_cpu({3, 5}, dt, 205);
    Tensor ct = x.clone().transpose(0, 2);
    Tensor gt = x.to(kGpu).transpose(0, 2);
    ct.index_put_({a, Slice(), b}, vb);
    gt.index_put_({a.to(kGpu), Slice(), b.to(kGpu)}, vb.to(kGpu));
    expect_same(gt, ct, d + " xt[a, :, b] = broadcast v");
    // A scalar value and a boolean mask.
    const Tensor mask = random_cpu({6, 5}, kBool, 206);
    Tensor cm = x.clone(), gm = x.to(kGpu);
    cm.index_put_({mask}, 1);
    gm.index_put_({mask.to(kGpu)}, 1);
    expect_same(gm, cm, d + " x[mask] = 1");
  }
}

TEST_F(GpuAdvancedIndex, IndexPutAccumulatesRepeats) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const auto [rtol, atol] = sum_tol(dt);
    const Tensor x = random_cpu({7, 9}, dt, 300);
    const Tensor i0 = random_index({300}, -7, 6, 301);
    const Tensor i1 = random_index({300}, 0, 8, 302, kInt32);
    const Tensor v = random_cpu({300}, dt, 303, -1, 1);
    const Tensor cpu = index_put_accumulate(x.clone(), v, {i0, i1}, Shape{0, 1});
    const Tensor gpu =
        index_put_accumulate(x.to(kGpu), v.to(kGpu), {i0.to(kGpu), i1.to(kGpu)}, Shape{0, 1});
    expect_match(gpu, cpu, rtol, atol, d + " x[i0, i1] += v");
    // Broadcast value rows into a strided self: x[:, i] += row.
    const Tensor row = random_cpu({7, 1}, dt, 304, -1, 1);
    const Tensor j = random_index({50}, 0, 8, 305);
    const Tensor cpu2 = index_put_accumulate(x.t().contiguous().t(), row, {j}, Shape{1});
    const Tensor gpu2 =
        index_put_accumulate(gpu_transposed(x), row.to(kGpu), {j.to(kGpu)}, Shape{1});
    expect_match(gpu2, cpu2, rtol, atol, d + " xt[:, j] += row");
  }
}

TEST_F(GpuAdvancedIndex, LargeIndexPut) {
  const Tensor x = random_cpu({50000, 16}, kFloat, 310);
  const Tensor idx = random_index({200001}, 0, 49999, 311);
  const Tensor v = random_cpu({200001, 16}, kFloat, 312);
  Tensor cpu = x.clone(), gpu = x.to(kGpu);
  cpu.index_put_({idx}, v);
  gpu.index_put_({idx.to(kGpu)}, v.to(kGpu));
  expect_same(gpu, cpu, "large overwrite");
  const Tensor cacc = index_put_accumulate(x.clone(), v, {idx}, Shape{0});
  const Tensor gacc = index_put_accumulate(x.to(kGpu), v.to(kGpu), {idx.to(kGpu)}, Shape{0});
  expect_match(gacc, cacc, 1e-5, 1e-4, "large accumulate");
}

// --- nonzero, masked_select, one_hot ----------------------------------------------------------

Tensor nonzero_of(const Tensor& t) {
  static const OpDef& op = KILN_OP(nonzero);
  return call_op1(op, {t});
}

TEST_F(GpuNonzero, MatchesCpu) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    // About a third zeros (integers in [-1, 1], rounded floats), with -0.0 and NaN for floats.
    Tensor x = random_cpu({13, 17}, dt, 400, -1.4, 1.4);
    if (is_floating_point(dt)) {
      x = x.round();
      x.index_put_({0, 0}, -0.0);
      x.index_put_({1, 2}, std::numeric_limits<double>::quiet_NaN());
    }
    expect_same(nonzero_of(x.to(kGpu)), nonzero_of(x), d + " 2-d");
    expect_same(nonzero_of(gpu_transposed(x.t().contiguous())), nonzero_of(x.t()),
                d + " transposed");
    const Tensor x3 = random_cpu({3, 1, 5, 7}, dt, 401, -1, 1);
    expect_same(nonzero_of(x3.to(kGpu)), nonzero_of(x3), d + " 4-d");
    const Tensor x0 = random_cpu({}, dt, 402, 1, 2);
    expect_same(nonzero_of(x0.to(kGpu)), nonzero_of(x0), d + " 0-d");
    const Tensor empty0 = random_cpu({0, 4}, dt, 403);
    expect_same(nonzero_of(empty0.to(kGpu)), nonzero_of(empty0), d + " empty");
    const Tensor zeros0 = zeros({5, 3}, TensorOptions(dt));
    expect_same(nonzero_of(zeros0.to(kGpu)), nonzero_of(zeros0), d + " all zeros");
  }
  const Tensor big = random_cpu({1000003}, kInt32, 404, -1, 1);
  expect_same(nonzero_of(big.to(kGpu)), nonzero_of(big), "1M int32");
}

TEST_F(GpuMaskedSelect, MatchesCpu) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const Tensor x = random_cpu({7, 9}, dt, 500);
    const Tensor m = random_cpu({7, 9}, kBool, 501);
    expect_same(x.to(kGpu).masked_select(m.to(kGpu)), x.masked_select(m), d + " same shape");
    const Tensor row = random_cpu({1, 9}, kBool, 502);
    expect_same(x.to(kGpu).masked_select(row.to(kGpu)), x.masked_select(row), d + " mask row");
    const Tensor col = random_cpu({7, 1}, dt, 503);
    expect_same(col.to(kGpu).masked_select(m.to(kGpu)), col.masked_select(m), d + " self column");
    expect_same(
        gpu_transposed(x.t().contiguous()).masked_select(gpu_transposed(m.t().contiguous())),
        x.t().masked_select(m.t()), d + " transposed");
    const Tensor none = zeros({7, 9}, TensorOptions(kBool));
    expect_same(x.to(kGpu).masked_select(none.to(kGpu)), x.masked_select(none), d + " none");
    // A 0-d CPU mask joins a CUDA self.
    const Tensor yes = ones({}, TensorOptions(kBool));
    expect_same(x.to(kGpu).masked_select(yes), x.masked_select(yes), d + " cpu scalar mask");
  }
  const Tensor big = random_cpu({1000, 1001}, kFloat, 504);
  const Tensor bm = random_cpu({1000, 1001}, kBool, 505);
  expect_same(big.to(kGpu).masked_select(bm.to(kGpu)), big.masked_select(bm), "1M float");
}

TEST_F(GpuOneHot, MatchesCpu) {
  const Tensor idx = random_index({5, 11}, 0, 9, 600);
  expect_same(one_hot(idx.to(kGpu), 10), one_hot(idx, 10), "explicit classes");
  expect_same(one_hot(idx.to(kGpu), 13), one_hot(idx, 13), "more classes");
  expect_same(one_hot(idx.to(kGpu)), one_hot(idx), "inferred classes");
  expect_same(one_hot(gpu_transposed(idx.t().contiguous()), 10), one_hot(idx.t(), 10),
              "transposed");
  const Tensor empty_idx = random_index({0, 3}, 0, 1, 601);
  expect_same(one_hot(empty_idx.to(kGpu), 4), one_hot(empty_idx, 4), "empty");
  const Tensor big = random_index({100003}, 0, 127, 602);
  expect_same(one_hot(big.to(kGpu), 128), one_hot(big, 128), "large");
}

TEST_F(GpuOneHot, BadClassRaises) {
  const Tensor idx = tensor({1, 4, 2}).to(kGpu);
  EXPECT_KILN_ERROR(one_hot(idx, 3), "[one_hot] class values must be smaller than num_classes (3)");
  const Tensor neg = tensor({1, -1}).to(kGpu);
  EXPECT_KILN_ERROR(one_hot(neg, 3), "[one_hot] class values must be non-negative");
}

// --- sort, argsort, topk ----------------------------------------------------------------------

// Sorts x (CPU) and its GPU copy `g` along dim both ways and compares values and indices.
void check_sort(const Tensor& x, const Tensor& g, int64_t dim, const std::string& what) {
  for (bool descending : {false, true}) {
    const std::string w = what + (descending ? " descending" : " ascending");
    const auto [cv, ci] = x.sort(dim, descending, /*stable=*/true);
    const auto [gv, gi] = g.sort(dim, descending, /*stable=*/true);
    expect_same(gv, cv, w + " values");
    expect_same(gi, ci, w + " indices");
  }
}

// Floats with ties, signed zeros, infinities and NaNs; integers and bools from a small range.
Tensor tricky_values(IntArrayRef sizes, ScalarType dt, uint64_t seed) {
  Tensor x = random_cpu(sizes, dt, seed, -3, 3);
  if (!is_floating_point(dt)) return x;
  x = x.round();  // ties
  Tensor flat = x.reshape({-1});
  const int64_t n = flat.numel();
  const double specials[] = {-0.0,
                             0.0,
                             std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN(),
                             -0.0,
                             std::numeric_limits<double>::quiet_NaN()};
  for (int64_t k = 0; k < 7 && k < n; ++k) flat.index_put_({(k * 7919) % n}, specials[k]);
  return flat.reshape(sizes);
}

TEST_F(GpuSort, MatchesCpuEveryDtype) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const Tensor row = tricky_values({1001}, dt, 700);
    check_sort(row, row.to(kGpu), 0, d + " one row");
    const Tensor x = tricky_values({7, 33}, dt, 701);
    check_sort(x, x.to(kGpu), 1, d + " rows");
    check_sort(x, x.to(kGpu), 0, d + " columns");
    check_sort(x, gpu_transposed(x), -1, d + " transposed input");
    const Tensor x3 = tricky_values({3, 65, 5}, dt, 702);
    check_sort(x3, x3.to(kGpu), 1, d + " middle dim");
    const Tensor s = random_cpu({}, dt, 703);
    check_sort(s, s.to(kGpu), 0, d + " 0-d");
    const Tensor e = random_cpu({4, 0}, dt, 704);
    check_sort(e, e.to(kGpu), 1, d + " empty");
    // argsort is sort's indices.
    expect_same(x.to(kGpu).argsort(1, true), x.argsort(1, true), d + " argsort");
  }
}

TEST_F(GpuSort, StableWithManyTies) {
  // Integers in [0, 3]: every value repeats, so stable indices are fully determined.
  const Tensor x = random_cpu({9, 2049}, kInt32, 710, 0, 3);
  check_sort(x, x.to(kGpu), 1, "int32 ties");
  const Tensor b = random_cpu({5000}, kBool, 711);
  check_sort(b, b.to(kGpu), 0, "bool ties");
  const Tensor h = random_cpu({3, 3001}, kHalf, 712, -2, 2).round();
  check_sort(h, h.to(kGpu), 1, "half ties");
}

TEST_F(GpuSort, OneMillionElements) {
  for (ScalarType dt : {kFloat, kBFloat16, kInt64}) {
    const Tensor x = random_cpu({1000000}, dt, 720, -1000, 1000);
    check_sort(x, x.to(kGpu), 0, name_of(dt) + " 1M");
  }
  const Tensor rows = random_cpu({16, 65536}, kFloat, 721);
  check_sort(rows, rows.to(kGpu), 1, "16 x 65536");
}

void check_topk(const Tensor& x, const Tensor& g, int64_t k, int64_t dim, const std::string& what) {
  for (bool largest : {true, false}) {
    const std::string w = what + (largest ? " largest" : " smallest") + " k=" + std::to_string(k);
    const auto [cv, ci] = x.topk(k, dim, largest, /*sorted=*/true);
    const auto [gv, gi] = g.topk(k, dim, largest, /*sorted=*/true);
    expect_same(gv, cv, w + " values");
    expect_same(gi, ci, w + " indices");
  }
}

TEST_F(GpuTopk, MatchesCpuEveryDtype) {
  for (ScalarType dt : kAllDtypes) {
    const std::string d = name_of(dt);
    const Tensor x = tricky_values({6, 37}, dt, 800);
    for (int64_t k : {0, 1, 5, 37}) check_topk(x, x.to(kGpu), k, 1, d);
    check_topk(x, x.to(kGpu), 3, 0, d + " dim 0");
    check_topk(x, gpu_transposed(x), 4, 1, d + " transposed");
    const Tensor row = tricky_values({513}, dt, 801);
    check_topk(row, row.to(kGpu), 10, 0, d + " one row");
  }
}

TEST_F(GpuTopk, VocabularyWideRows) {
  // Logit-like rows as wide as Llama 3's vocabulary.
  for (ScalarType dt : {kFloat, kBFloat16}) {
    const Tensor x = random_cpu({4, 128256}, dt, 810, -10, 10);
    check_topk(x, x.to(kGpu), 50, 1, name_of(dt) + " 4 x 128256");
    const Tensor one = random_cpu({1, 128256}, dt, 811, -10, 10);
    check_topk(one, one.to(kGpu), 1, -1, name_of(dt) + " 1 x 128256");
  }
}

// --- multinomial, randperm --------------------------------------------------------------------

// multinomial on the CPU and the GPU from the same seed.
std::pair<Tensor, Tensor> both_multinomial(const Tensor& p_cpu, const Tensor& p_gpu, int64_t n,
                                           bool replacement, uint64_t seed) {
  manual_seed(seed);
  const Tensor c = multinomial(p_cpu, n, replacement);
  manual_seed(seed);
  const Tensor g = multinomial(p_gpu, n, replacement);
  return {c, g};
}

TEST_F(GpuMultinomial, SameDrawsAsCpu) {
  for (ScalarType dt : kFloatDtypes) {
    const std::string d = name_of(dt);
    Tensor p = random_cpu({5, 1000}, dt, 900, 0, 1);
    p.index_put_({Slice(), Slice(0, 100)}, 0.0);  // zero-probability categories
    for (bool replacement : {true, false}) {
      const std::string w = d + (replacement ? " with" : " without") + " replacement";
      auto [c, g] = both_multinomial(p, p.to(kGpu), 200, replacement, 901);
      expect_same(g, c, w);
      // 1-d and strided probabilities.
      std::tie(c, g) =
          both_multinomial(p.select(0, 2), p.to(kGpu).select(0, 2), 37, replacement, 902);
      expect_same(g, c, w + " 1-d");
      const Tensor pt = random_cpu({300, 4}, dt, 903, 0, 1);
      std::tie(c, g) =
          both_multinomial(pt.t(), gpu_transposed(pt.t().contiguous()), 9, replacement, 904);
      expect_same(g, c, w + " transposed");
    }
  }
  // A vocabulary-wide row, one draw (sampling a token).
  const Tensor logits = random_cpu({2, 128256}, kFloat, 905, -5, 5);
  const Tensor probs = logits.softmax(1);
  auto [c, g] = both_multinomial(probs, probs.to(kGpu), 1, true, 906);
  expect_same(g, c, "vocabulary row");
}

TEST_F(GpuMultinomial, BadDistributionsRaise) {
  const Tensor neg = tensor({0.5, -0.1, 0.6}).to(kGpu);
  EXPECT_KILN_ERROR(multinomial(neg, 1, true), "[multinomial] probability tensor contains");
  const Tensor zero = zeros({2, 3}).to(kGpu);
  EXPECT_KILN_ERROR(multinomial(zero, 1, true), "sum of probabilities <= 0");
  const Tensor sparse = tensor({0.0, 1.0, 0.0, 2.0}).to(kGpu);
  EXPECT_KILN_ERROR(multinomial(sparse, 3, false), "not enough non-negative category");
}

TEST_F(GpuRandperm, SameAsCpu) {
  const std::vector<std::pair<ScalarType, int64_t>> cases = {
      {kInt64, 1},    {kInt64, 7},     {kInt64, 1000}, {kInt64, 1000003}, {kInt32, 65537},
      {kFloat, 4097}, {kDouble, 1001}, {kHalf, 2048},  {kBFloat16, 256},  {kInt64, 0}};
  for (const auto& [dt, n] : cases) {
    manual_seed(1000 + n);
    const Tensor c = randperm(n, TensorOptions(dt));
    manual_seed(1000 + n);
    const Tensor g = randperm(n, TensorOptions(dt).device(kGpu));
    ASSERT_TRUE(g.is_cuda());
    expect_same(g, c, name_of(dt) + " n=" + std::to_string(n));
  }
}

// --- backward ---------------------------------------------------------------------------------

// Runs f on leaves made from x0 (and w0) on `device`, backward from (f(x) * w).sum(), and
// returns the gradients of x (and of the value leaf v, when f uses one).
template <typename F>
std::pair<Tensor, Tensor> grads_on(Device device, const Tensor& x0, const Tensor& v0, F&& f) {
  Tensor x = x0.to(device).detach().requires_grad_(true);
  Tensor v = v0.defined() ? v0.to(device).detach().requires_grad_(true) : Tensor();
  const Tensor y = f(x, v);
  const Tensor w = random_cpu(y.sizes(), kFloat, 1099).to(device);
  (y * w).sum().backward();
  return {x.grad(), v.defined() ? v.grad() : Tensor()};
}

template <typename F>
void check_grads(const Tensor& x0, const Tensor& v0, F&& f, const std::string& what) {
  const auto [cx, cv] = grads_on(Device(kCPU), x0, v0, f);
  const auto [gx, gv] = grads_on(kGpu, x0, v0, f);
  ASSERT_TRUE(gx.defined() && gx.is_cuda()) << what;
  expect_match(gx, cx, 1e-5, 1e-5, what + " dx");
  if (v0.defined()) expect_match(gv, cv, 1e-5, 1e-5, what + " dv");
}

TEST_F(GpuIndexSortBackward, IndexAndIndexPut) {
  const Tensor x0 = random_cpu({8, 6}, kFloat, 1100);
  const Tensor idx = random_index({30}, -8, 7, 1101);  // repeats: gradients accumulate
  const Tensor cols = random_index({30}, 0, 5, 1102);
  check_grads(
      x0, Tensor(), [&](const Tensor& x, const Tensor&) { return x.index({idx.to(x.device())}); },
      "x[idx]");
  check_grads(
      x0, Tensor(),
      [&](const Tensor& x, const Tensor&) {
        return x.index({idx.to(x.device()), cols.to(x.device())});
      },
      "x[idx, cols]");
  const Tensor mask = random_cpu({8, 6}, kBool, 1103);
  check_grads(
      x0, Tensor(), [&](const Tensor& x, const Tensor&) { return x.index({mask.to(x.device())}); },
      "x[mask]");
  check_grads(
      x0, Tensor(),
      [&](const Tensor& x, const Tensor&) { return x.masked_select(mask.to(x.device())); },
      "masked_select");
  // index_put_: the overwritten positions get no gradient, the value gets what they receive;
  // unique rows so that the value gradient does not depend on which repeat won.
  const Tensor rows = tensor({5, 0, 3});
  const Tensor v0 = random_cpu({3, 6}, kFloat, 1104);
  check_grads(
      x0, v0,
      [&](const Tensor& x, const Tensor& v) {
        Tensor z = x * 1.0;
        z.index_put_({rows.to(x.device())}, v);
        return z;
      },
      "z[rows] = v");
  const Tensor v1 = random_cpu({6}, kFloat, 1105);
  check_grads(
      x0, v1,
      [&](const Tensor& x, const Tensor& v) {
        return index_put_accumulate(x * 1.0, v, {idx.to(x.device())}, Shape{0});
      },
      "z[idx] += v");
}

TEST_F(GpuIndexSortBackward, SortAndTopkValues) {
  const Tensor x0 = random_cpu({5, 129}, kFloat, 1200);
  check_grads(
      x0, Tensor(),
      [](const Tensor& x, const Tensor&) { return std::get<0>(x.sort(1, false, true)); },
      "sort values");
  check_grads(
      x0, Tensor(),
      [](const Tensor& x, const Tensor&) { return std::get<0>(x.sort(0, true, true)); },
      "sort values dim 0 descending");
  check_grads(
      x0, Tensor(),
      [](const Tensor& x, const Tensor&) { return std::get<0>(x.topk(7, 1, true, true)); },
      "topk values");
  check_grads(
      x0, Tensor(),
      [](const Tensor& x, const Tensor&) { return x.slice(1, 3, 50, 2).select(0, 1); },
      "slice and select");
}

}  // namespace
}  // namespace kiln
