// "fused_cuda" (compiler/fused_cuda.h): the code generator and the disk cache on any machine, and
// on a GPU (GpuFusedCuda.*) compiled programs against eager CUDA code, bit for bit.
#include "compiler/fused_cuda.h"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "compiler/compile.h"
#include "compiler/executor.h"
#include "compiler/fuse.h"
#include "compiler/fused_cuda_codegen.h"
#include "kiln.h"
#include "test_util.h"

namespace kiln {
namespace {

using compiler::Trace;

int count(const std::string& s, const std::string& what) {
  int n = 0;
  for (size_t at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

// The traced (first) stage of `fn` on CPU tensors, with every value moved to cuda:0 except 0-d
// CPU externals (wrapped scalars): what tracing the same program on a GPU records.
template <typename F, typename... Args>
Trace traced_on_cuda(F fn, const Args&... args) {
  auto f = compile(fn, CompileOptions().executors({"eager"}));
  f(args...);
  Trace t = f.traces().front();
  const Device gpu(kCUDA, 0);
  for (size_t v = 0; v < t.values.size(); ++v) {
    compiler::ValueInfo& info = t.values[v];
    const bool wrapped_scalar =
        t.roles[v] == compiler::ValueRole::kExternal && info.spec.sizes.empty();
    if (!wrapped_scalar) info.spec.device = gpu;
  }
  for (compiler::BoundOp& op : t.ops) {
    for (Attr& a : op.attrs) {
      if (std::holds_alternative<Device>(a)) a = gpu;
    }
  }
  return t;
}

std::string temp_dir(const std::string& name) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kiln_fused_cuda_test_" + name)).string();
  std::filesystem::remove_all(dir);
  return dir;
}

// --- The generator (no GPU needed) ---------------------------------------------------------------

TEST(FusedCudaCodegen, ChainSourceHasTheMembersAndIsDeterministic) {
  auto fn = [](const Tensor& x, const Tensor& w, const Tensor& b) {
    return silu(x * w + b).to(kBFloat16);
  };
  const Tensor x = randn({8, 16}), w = randn({16}), b = randn({8, 1});
  const Trace t = traced_on_cuda(fn, x, w, b);
  ASSERT_EQ(t.ops.size(), 4u) << t.str();
  std::string why;
  const std::optional<compiler::internal::FusedKernel> k =
      compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), &why);
  ASSERT_TRUE(k.has_value()) << why;
  const std::string& s = k->source;
  EXPECT_EQ(k->sizes, Shape({8, 16}));
  EXPECT_EQ(k->inputs.size(), 3u);
  ASSERT_EQ(k->outputs.size(), 1u) << "only the returned value reaches memory";
  EXPECT_EQ(k->outputs[0].dtype, kBFloat16);
  EXPECT_NE(s.find("kiln_fused_strided"), std::string::npos) << s;
  // w and b broadcast: no dense entry.
  EXPECT_FALSE(k->has_dense);
  EXPECT_EQ(count(s, "kiln_fused_dense"), 0) << s;
  EXPECT_NE(s.find("f_add<float>"), std::string::npos) << s;                 // alpha as a parameter
  EXPECT_NE(s.find("scalar::Silu::apply<float>("), std::string::npos) << s;  // scalar_fn.h's
  EXPECT_NE(s.find("kbf("), std::string::npos) << s;      // the bf16 rounding of to_copy
  EXPECT_NE(s.find("kopaque("), std::string::npos) << s;  // no contraction across members
  EXPECT_EQ(k->constants.size(), 1u);                     // add's alpha
  // Deterministic, and the same for the same program traced again (other value ids).
  EXPECT_EQ(compiler::fused_cuda_source(t, 0, t.ops.size()), s);
  const Trace again = traced_on_cuda(fn, x, w, b);
  EXPECT_EQ(compiler::fused_cuda_source(again, 0, again.ops.size()), s);
}

TEST(FusedCudaCodegen, KernelsIncludeEagersScalarFunctionsHeader) {
  namespace I = compiler::internal;
  // NVRTC gets kernels/scalar_fn.h itself (embedded at build time) and the stand-ins for the
  // C++ library it includes under NVRTC.
  std::vector<std::string> names;
  for (const I::RtcHeader& h : I::rtc_headers()) {
    names.push_back(h.name);
    const std::string text = h.text;
    if (names.back() == "kernels/scalar_fn.h") {
      EXPECT_NE(text.find("KILN_SCALAR_HD M floor_div_float(M a, M b)"), std::string::npos);
      EXPECT_NE(text.find("#if defined(__CUDACC_RTC__)"), std::string::npos);
    } else {
      EXPECT_NE(text.find("make_unsigned_t"), std::string::npos) << names.back();
    }
  }
  EXPECT_EQ(names, (std::vector<std::string>{"kernels/scalar_fn.h", "compiler/fused_cuda_rtc.h"}));
  // Each source names the headers' digest (the kernel caches are keyed by the source).
  const Trace t =
      traced_on_cuda([](const Tensor& a, const Tensor& b) { return div(a, b, "floor") * 2.0; },
                     randn({4, 8}), randn({4, 8}));
  const std::string s = compiler::fused_cuda_source(t, 0, t.ops.size()).value();
  EXPECT_EQ(s.rfind("// Headers " + I::rtc_headers_digest() + "\n", 0), 0u) << s;
  EXPECT_NE(s.find("#include \"kernels/scalar_fn.h\""), std::string::npos) << s;
  EXPECT_NE(s.find("scalar::floor_div_float<float>("), std::string::npos) << s;
  EXPECT_EQ(s.find("fmod"), std::string::npos) << "the formula is the header's, not restated";
}

TEST(FusedCudaCodegen, DenseEntryWhenEveryOperandHasTheDomainsShape) {
  auto fn = [](const Tensor& x, const Tensor& y) { return sigmoid(x) * y - 2.5; };
  const Tensor x = randn({4, 32}), y = randn({4, 32});
  const Trace t = traced_on_cuda(fn, x, y);
  const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  EXPECT_TRUE(k->has_dense);
  EXPECT_NE(k->source.find("kiln_fused_dense"), std::string::npos) << k->source;
  // The wrapped 2.5 is a 0-d CPU input passed by value.
  int host = 0;
  for (const auto& in : k->inputs) host += in.host_scalar ? 1 : 0;
  EXPECT_EQ(host, 1);
}

TEST(FusedCudaCodegen, VectorEntryMoves16BytesOfTheNarrowestOperand) {
  namespace I = compiler::internal;
  // bf16 in, f32 math, bf16 and f32 out: 8 elements per thread (16 bytes of bf16, 2 x 16 of f32).
  auto fn = [](const Tensor& x, const Tensor& y) {
    const Tensor xf = x.to(kFloat);
    const Tensor s = xf * sigmoid(xf) * y.to(kFloat);
    return std::vector<Tensor>{s.to(kBFloat16), s};
  };
  const Tensor x = randn({4, 33}).to(kBFloat16), y = randn({4, 33}).to(kBFloat16);
  const Trace t = traced_on_cuda(fn, x, y);
  const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  const std::string& s = k->source;
  EXPECT_EQ(k->vector_width, 8);
  EXPECT_EQ(count(s, "kiln_fused_vector"), 1) << s;
  EXPECT_NE(s.find("kpack<bf16, 8>"), std::string::npos) << s;
  EXPECT_NE(s.find("kpack<float, 8>"), std::string::npos) << s;
  EXPECT_NE(s.find("n / 8LL"), std::string::npos) << s;           // whole packs
  EXPECT_NE(s.find("packs * 8LL + id"), std::string::npos) << s;  // then the scalar tail
  // The members are written out for the packs' elements and the tail, the same way: the
  // strided and dense entries, the vector entry's two loops.
  EXPECT_EQ(count(s, "scalar::Sigmoid::apply<float>("), 4) << s;
  // f32 only: 4 per thread. A broadcast operand: no dense entry, hence no vector one.
  const Trace f32 = traced_on_cuda([](const Tensor& a, const Tensor& b) { return exp(a) * b; },
                                   randn({8, 8}), randn({8, 8}));
  const auto k32 = I::generate_fused_kernel(f32, 0, f32.ops.size(), nullptr);
  ASSERT_TRUE(k32.has_value());
  EXPECT_EQ(k32->vector_width, 4);
  EXPECT_NE(k32->source.find("kpack<float, 4>"), std::string::npos) << k32->source;
  const Trace row = traced_on_cuda([](const Tensor& a, const Tensor& b) { return a + b * 2.0; },
                                   randn({8, 8}), randn({8}));
  const auto kr = I::generate_fused_kernel(row, 0, row.ops.size(), nullptr);
  ASSERT_TRUE(kr.has_value());
  EXPECT_FALSE(kr->has_dense);
  EXPECT_EQ(kr->vector_width, 0);
  EXPECT_EQ(count(kr->source, "kiln_fused_vector"), 0) << kr->source;
}

TEST(FusedCudaCodegen, LaunchChoosesVectorOnlyWhenEveryOperandIsAlignedAndContiguous) {
  namespace I = compiler::internal;
  using E = I::FusedEntry;
  // x (bf16), a wrapped 0.5 (host scalar), y (f32): one output.
  auto fn = [](const Tensor& x, const Tensor& y) { return x * 0.5 + y; };
  const Trace t = traced_on_cuda(fn, randn({4, 10}).to(kBFloat16), randn({4, 10}));
  const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  ASSERT_EQ(k->vector_width, 8);
  ASSERT_EQ(k->inputs.size(), 3u);
  ASSERT_EQ(k->outputs.size(), 1u);
  std::vector<I::OperandLayout> in(3), out(1);
  for (size_t j = 0; j < 3; ++j) in[j] = {true, 0x1000 + 0x100 * j};
  out[0] = {true, 0x2000};
  for (size_t j = 0; j < 3; ++j) {
    if (k->inputs[j].host_scalar) in[j] = {false, 3};  // ignored: passed by value
  }
  EXPECT_EQ(I::choose_fused_entry(*k, in, out), E::kVector);
  // An input view 2 bytes in (a bf16 offset of 1): dense.
  std::vector<I::OperandLayout> shifted = in;
  for (size_t j = 0; j < 3; ++j) {
    if (!k->inputs[j].host_scalar && k->inputs[j].dtype == kBFloat16) shifted[j].address += 2;
  }
  EXPECT_EQ(I::choose_fused_entry(*k, shifted, out), E::kDense);
  // A misaligned output: dense; 8-byte aligned is not enough.
  EXPECT_EQ(I::choose_fused_entry(*k, in, {{true, 0x2008}}), E::kDense);
  // A non-contiguous operand: strided, aligned or not.
  std::vector<I::OperandLayout> strided = in;
  for (size_t j = 0; j < 3; ++j) {
    if (!k->inputs[j].host_scalar) strided[j].contiguous = false;
  }
  EXPECT_EQ(I::choose_fused_entry(*k, strided, out), E::kStrided);
  EXPECT_EQ(I::choose_fused_entry(*k, in, {{false, 0x2000}}), E::kStrided);
  // Fewer elements than one pack: dense.
  const Trace small = traced_on_cuda(fn, randn({1, 5}).to(kBFloat16), randn({1, 5}));
  const auto ks = I::generate_fused_kernel(small, 0, small.ops.size(), nullptr);
  ASSERT_TRUE(ks.has_value());
  EXPECT_EQ(I::choose_fused_entry(*ks, in, out), E::kDense);
  // A kernel without a dense entry is always strided.
  const Trace row = traced_on_cuda([](const Tensor& a, const Tensor& b) { return a + b; },
                                   randn({8, 8}), randn({8}));
  const auto kr = I::generate_fused_kernel(row, 0, row.ops.size(), nullptr);
  ASSERT_TRUE(kr.has_value());
  EXPECT_EQ(I::choose_fused_entry(*kr, {{true, 0x1000}, {true, 0x2000}}, {{true, 0x3000}}),
            E::kStrided);
}

// An input the trace records transposed in the domain's last two dims gets the tiled entry,
// which reads it into a shared-memory tile along its contiguous dim; the launch takes that entry
// where the input is still transposed, and never over the dense ones.
TEST(FusedCudaCodegen, TransposedInputsGetATiledEntry) {
  namespace I = compiler::internal;
  using E = I::FusedEntry;
  auto fn = [](const Tensor& x, const Tensor& y, const Tensor& bias) {
    return (x.t() + y) * 0.5 + bias;
  };
  const Trace t = traced_on_cuda(fn, randn({70, 40}), randn({40, 70}), randn({70}));
  // The transpose is a view (permute) before the region, as the fuse pass leaves it.
  ASSERT_EQ(t.ops[0].name(), "permute");
  const auto k = I::generate_fused_kernel(t, 1, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value()) << t.str();
  ASSERT_EQ(k->inputs.size(), 4u) << k->source;  // x, y, 0.5, bias
  std::vector<bool> want(4, false);
  for (size_t j = 0; j < 4; ++j) {
    want[j] = k->inputs[j].value == t.ops[0].outputs[0];
  }
  EXPECT_EQ(k->tiled, want) << t.str();
  const std::string& s = k->source;
  EXPECT_NE(s.find("kiln_fused_tiled("), std::string::npos) << s;
  EXPECT_EQ(count(s, "[32][33];"), 1) << s;  // one tile: x's
  const std::string x = std::to_string(std::find(want.begin(), want.end(), true) - want.begin());
  EXPECT_EQ(count(s, "kt" + x + "[q][tx] = in" + x + "["), 1) << s;
  EXPECT_EQ(count(s, " = kt" + x + "[tx][q];"), 1) << s;
  // Both dims even: the entries in packs of two f32 (8 bytes) too, of 64 x 64 and of 64 x 32
  // elements (half: kiln_fused_tiled_packs_half), six and eight blocks a multiprocessor (16 and
  // 8 KiB of tiles). x is read a pack of two rows at a time, two columns of them, stored transposed
  // and swizzled; y and the output a pair of columns at a time (the bias, varying along them, too).
  EXPECT_EQ(k->tiled_pack, 2);
  EXPECT_NE(s.find("__launch_bounds__(256, 6) kiln_fused_tiled_packs("), std::string::npos) << s;
  EXPECT_NE(s.find("__launch_bounds__(256, 8) kiln_fused_tiled_packs_half("), std::string::npos)
      << s;
  EXPECT_EQ(count(s, "kpack<float, 2> kt" + x + "[64][32];"), 1) << s;
  EXPECT_EQ(count(s, "kpack<float, 2> kt" + x + "[64][16];"), 1) << s;
  EXPECT_EQ(count(s, "v" + x + "[h] = *(const kpack<float, 2>*)(in" + x), 2) << s;
  EXPECT_EQ(count(s, "for (int h = 0; h < 2; ++h) w" + x + ".v[h] = v" + x + "[h].v[e];"), 2) << s;
  EXPECT_EQ(count(s, "kt" + x + "[2 * tx + e][(qb / 2) ^ (tx & 31)] = w" + x + ";"), 1) << s;
  EXPECT_EQ(count(s, "kt" + x + "[2 * tx + e][(qb / 2) ^ (tx & 15)] = w" + x + ";"), 1) << s;
  EXPECT_EQ(count(s, " = kt" + x + "[q][tx ^ ((q / 2) & 31)];"), 1) << s;
  EXPECT_EQ(count(s, " = kt" + x + "[q][(tx & 15) ^ ((q / 2) & 15)];"), 1) << s;
  EXPECT_EQ(count(s, " = tv" + x + ".v[e];"), 2) << s;
  EXPECT_EQ(count(s, "const kpack<float, 2> vp"), 4) << s;
  EXPECT_EQ(count(s, "*(kpack<float, 2>*)po0 = vy0;"), 2) << s;
  // Layouts: x transposed, the others contiguous -> tiled, in packs where every pack is aligned;
  // x no longer stride 1 along the rows' dim -> strided; everything contiguous -> the dense
  // entries, tile or not.
  std::vector<I::OperandLayout> in(4), out = {{true, 0x9000, {70, 1}}};
  for (size_t j = 0; j < 4; ++j) {
    in[j] = k->inputs[j].sizes.size() == 1 ? I::OperandLayout{true, 0x1000 + 0x1000 * j, {1}}
                                           : I::OperandLayout{true, 0x1000 + 0x1000 * j, {70, 1}};
    if (want[j]) in[j] = {false, 0x1000 + 0x1000 * j, {1, 40}};
  }
  EXPECT_EQ(I::choose_fused_entry(*k, in, out), E::kTiledPacks);
  for (size_t j = 0; j < 4; ++j) {
    if (k->inputs[j].host_scalar) continue;
    std::vector<I::OperandLayout> odd = in;
    odd[j].address += 4;  // one f32 in: its packs are misaligned
    EXPECT_EQ(I::choose_fused_entry(*k, odd, out), E::kTiled) << j;
    if (k->inputs[j].sizes.size() == 1) continue;
    odd = in;
    odd[j].strides[want[j] ? 1 : 0] = 71;  // an odd stride across the packs' dim
    EXPECT_EQ(I::choose_fused_entry(*k, odd, out), E::kTiled) << j;
  }
  EXPECT_EQ(I::choose_fused_entry(*k, in, {{true, 0x9004, {70, 1}}}), E::kTiled);
  std::vector<I::OperandLayout> sliced = in;
  for (size_t j = 0; j < 4; ++j) {
    if (want[j]) sliced[j].strides = {2, 80};
  }
  EXPECT_EQ(I::choose_fused_entry(*k, sliced, out), E::kStrided);
  // Without the bias the kernel has dense entries: all contiguous takes them.
  const Trace plain = traced_on_cuda([](const Tensor& a, const Tensor& b) { return a.t() + b; },
                                     randn({70, 40}), randn({40, 70}));
  const auto kp = I::generate_fused_kernel(plain, 1, plain.ops.size(), nullptr);
  ASSERT_TRUE(kp.has_value());
  ASSERT_TRUE(kp->has_dense);
  EXPECT_EQ(kp->tiled, std::vector<bool>({true, false}));
  EXPECT_EQ(I::choose_fused_entry(*kp, {{true, 0x1000, {70, 1}}, {true, 0x2000, {70, 1}}},
                                  {{true, 0x3000, {70, 1}}}),
            E::kVector);
  EXPECT_EQ(I::choose_fused_entry(*kp, {{false, 0x1000, {1, 40}}, {true, 0x2000, {70, 1}}},
                                  {{true, 0x3000, {70, 1}}}),
            E::kTiledPacks);
  // 16-bit operands: packs of 4 (128 x 128 tiles), aligned to 8 bytes; of 2 where a dim is not a
  // multiple of 4 or two tiles of 4 would take more than 40 KiB; none for an odd dim.
  const auto mul_t = [](const Tensor& a, const Tensor& b) { return a.t() * b; };
  const auto both_t = [](const Tensor& a, const Tensor& b) { return a.t() * b.t(); };
  struct Case {
    Trace t;
    int pack;
    const char* tile;
  };
  const std::vector<Case> cases = {
      {traced_on_cuda(mul_t, randn({72, 40}).to(kBFloat16), randn({40, 72}).to(kBFloat16)), 4,
       "kpack<bf16, 4> kt0[128][32];"},
      {traced_on_cuda(mul_t, randn({70, 40}).to(kBFloat16), randn({40, 70}).to(kBFloat16)), 2,
       "kpack<bf16, 2> kt0[64][32];"},
      {traced_on_cuda(both_t, randn({72, 40}).to(kHalf), randn({72, 40}).to(kHalf)), 2,
       "kpack<f16, 2> kt1[64][32];"},
      {traced_on_cuda(mul_t, randn({71, 40}), randn({40, 71})), 0, ""}};
  for (const Case& c : cases) {
    size_t first = 0;  // after the transposes' views
    while (c.t.ops[first].name() == "permute") ++first;
    const auto kc = I::generate_fused_kernel(c.t, first, c.t.ops.size(), nullptr);
    ASSERT_TRUE(kc.has_value()) << c.t.str();
    EXPECT_FALSE(kc->tiled.empty()) << c.t.str();
    EXPECT_EQ(kc->tiled_pack, c.pack) << c.t.str();
    if (c.pack == 0) {
      EXPECT_EQ(kc->source.find("kiln_fused_tiled_packs"), std::string::npos) << kc->source;
      continue;
    }
    EXPECT_NE(kc->source.find(c.tile), std::string::npos) << kc->source;
    if (c.pack == 4) {
      // 32 KiB of tiles: six blocks a multiprocessor of sm_90's 228 KiB, eight of half tiles;
      // three and five where a block may opt in to 99 KiB (sm_86).
      EXPECT_NE(kc->source.find("(256, 6) kiln_fused_tiled_packs("), std::string::npos);
      EXPECT_NE(kc->source.find("(256, 8) kiln_fused_tiled_packs_half("), std::string::npos);
      const auto small = I::generate_fused_kernel(c.t, first, c.t.ops.size(), nullptr, 99 * 1024);
      ASSERT_TRUE(small.has_value());
      EXPECT_NE(small->source.find("(256, 3) kiln_fused_tiled_packs("), std::string::npos);
      EXPECT_NE(small->source.find("(256, 5) kiln_fused_tiled_packs_half("), std::string::npos);
    }
    const std::string pk = c.pack == 4 ? "kpack<bf16, 4>" : "kpack<";
    EXPECT_NE(kc->source.find("*(" + pk), std::string::npos) << kc->source;
    std::vector<I::OperandLayout> lin(kc->inputs.size());
    for (size_t j = 0; j < lin.size(); ++j) {
      lin[j] = kc->tiled[j] ? I::OperandLayout{false, 0x1000, {1, 40}}
                            : I::OperandLayout{true, 0x1000, {kc->sizes[1], 1}};
    }
    const std::vector<I::OperandLayout> lout = {{true, 0x2000, {kc->sizes[1], 1}}};
    EXPECT_EQ(I::choose_fused_entry(*kc, lin, lout), E::kTiledPacks);
    lin[0].address = 0x1002;  // one element off the pack's alignment (8 or 4 bytes)
    EXPECT_EQ(I::choose_fused_entry(*kc, lin, lout), E::kTiled);
  }
  // Contiguous inputs, a broadcast one, or a vector domain: no tiled entry.
  const auto add = [](const Tensor& a, const Tensor& b) { return a + b; };
  const auto add_t = [](const Tensor& a, const Tensor& b) { return a + b.t(); };
  const auto twice = [](const Tensor& a) { return a * 2.0; };
  const std::vector<Trace> untiled = {traced_on_cuda(add, randn({40, 70}), randn({40, 70})),
                                      traced_on_cuda(add_t, randn({40, 70}), randn({70, 1})),
                                      traced_on_cuda(twice, randn({70}))};
  for (const Trace& u : untiled) {
    const size_t first = u.ops[0].name() == "permute" ? 1 : 0;
    const auto ku = I::generate_fused_kernel(u, first, u.ops.size(), nullptr);
    ASSERT_TRUE(ku.has_value()) << u.str();
    EXPECT_TRUE(ku->tiled.empty()) << u.str();
    EXPECT_EQ(ku->source.find("kiln_fused_tiled"), std::string::npos);
  }
}

// The tiled entry's width in packs: the tiles that fill their last wave better, the half ones
// where both fill it alike, the full ones where the slots are unknown; tests may fix it.
TEST(FusedCudaCodegen, TileWidthFillsTheWaves) {
  namespace I = compiler::internal;
  using W = I::TileWidth;
  // H200, bf16 tiles of 32 and 16 KiB: 6 and 8 blocks a multiprocessor of 132.
  EXPECT_EQ(I::choose_tile_width(1024, 792, 2048, 1056), W::kHalf);   // 65% against 97%
  EXPECT_EQ(I::choose_tile_width(768, 792, 1536, 1056), W::kFull);    // 97% against 73%
  EXPECT_EQ(I::choose_tile_width(4, 792, 8, 1056), W::kHalf);         // less than a wave
  EXPECT_EQ(I::choose_tile_width(1056, 1056, 2112, 1056), W::kHalf);  // both whole waves
  EXPECT_EQ(I::choose_tile_width(3072, 792, 6144, 1056), W::kHalf);   // f32 [16384, 768]
  EXPECT_EQ(I::choose_tile_width(1024, 0, 2048, 1056), W::kFull);
  I::set_tile_width_for_testing(W::kHalf);
  EXPECT_EQ(I::choose_tile_width(768, 792, 1536, 1056), W::kHalf);
  I::set_tile_width_for_testing(W::kFull);
  EXPECT_EQ(I::choose_tile_width(1024, 792, 2048, 1056), W::kFull);
  I::set_tile_width_for_testing(W::kAuto);
  EXPECT_EQ(I::choose_tile_width(1024, 792, 2048, 1056), W::kHalf);
}

TEST(FusedCudaCodegen, AnIntermediateReadAfterTheRegionIsAnOutput) {
  auto fn = [](const Tensor& x, const Tensor& y) {
    const Tensor a = x * y;
    return std::vector<Tensor>{exp(a) + 1.0, a};
  };
  const Trace t = traced_on_cuda(fn, randn({4, 8}), randn({4, 8}));
  const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  EXPECT_EQ(k->outputs.size(), 2u);
  // Only the first three ops: then a is read outside (by the return) as well.
  const auto part = compiler::internal::generate_fused_kernel(t, 0, 2, nullptr);
  ASSERT_TRUE(part.has_value());
  EXPECT_EQ(part->outputs.size(), 2u);  // a (returned) and exp(a) (read by the add)
}

TEST(FusedCudaCodegen, UnsupportedOpsAreNotGenerated) {
  auto fn = [](const Tensor& a, const Tensor& b) {
    return std::vector<Tensor>{div(a, b, "floor"), isclose(a.to(kFloat), b.to(kFloat)),
                               (a + b).sum({1})};
  };
  const Tensor a = randint(1, 5, {4, 4}), b = randint(1, 5, {4, 4});
  const Trace t = traced_on_cuda(fn, a, b);
  int checked = 0;
  for (const compiler::BoundOp& op : t.ops) {
    const bool gen = compiler::internal::fused_cuda_generates(t, op);
    if (op.name() == "div" || op.name() == "isclose" || op.name() == "sum") {
      EXPECT_FALSE(gen) << op.name();  // integer floor division raises on 0; not written yet
      ++checked;
    }
    if (op.name() == "add" || op.name() == "to_copy") {
      EXPECT_TRUE(gen) << op.name();
    }
  }
  EXPECT_EQ(checked, 3) << t.str();
  std::string why;
  EXPECT_FALSE(compiler::fused_cuda_source(t, 0, t.ops.size(), &why).has_value());
  EXPECT_NE(why.find("does not write"), std::string::npos) << why;
}

// Softmax written with ops: max, exp(x - max), sum, divide (what a model's code traces to).
Tensor softmax_with_ops(const Tensor& x) {
  const Tensor e = exp(x - amax(x, {-1}, true));
  return e / sum(e, {-1}, true);
}
// RMSNorm written with ops, in f32 for a 16-bit x, as models write it.
Tensor rms_norm_with_ops(const Tensor& x, const Tensor& w) {
  const Tensor xf = x.to(kFloat);
  return (xf * rsqrt(mean(xf * xf, {-1}, true) + 1e-6)).to(x.dtype()) * w;
}
Tensor logsumexp_with_ops(const Tensor& x) {
  const Tensor m = amax(x, {-1}, true);
  return log(sum(exp(x - m), {-1}, true)) + m;
}
// log_softmax written with ops: x - max kept from the sum's pass for the output's.
Tensor log_softmax_with_ops(const Tensor& x) {
  const Tensor z = x - amax(x, {-1}, true);
  return z - log(sum(exp(z), {-1}, true));
}
// The same as programs of check_rows (a list of arguments, a list of results).
std::vector<Tensor> softmax_rows(const std::vector<Tensor>& a) { return {softmax_with_ops(a[0])}; }
std::vector<Tensor> logsumexp_rows(const std::vector<Tensor>& a) {
  return {logsumexp_with_ops(a[0])};
}
std::vector<Tensor> log_softmax_rows(const std::vector<Tensor>& a) {
  return {log_softmax_with_ops(a[0])};
}

TEST(FusedCudaCodegen, RowKernelForSoftmaxWrittenWithOps) {
  const Trace t = traced_on_cuda(softmax_with_ops, randn({64, 2048}).to(kBFloat16));
  std::string why;
  const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), &why);
  ASSERT_TRUE(k.has_value()) << why << t.str();
  const std::string& s = k->source;
  EXPECT_TRUE(k->row_kernel);
  EXPECT_EQ(k->rows, 64);
  EXPECT_EQ(k->cols, 2048);
  EXPECT_EQ(k->vector_width, 8);  // 16 bytes of bf16
  // 256 packs of 8 over 64 threads, 4 rows per block of 256.
  EXPECT_EQ(k->row_threads, 64);
  EXPECT_EQ(k->rows_per_block, 4);
  EXPECT_EQ(count(s, "kiln_rows_vector"), 1) << s;
  EXPECT_EQ(count(s, "kiln_rows_dense"), 1) << s;
  // Two reduction passes (max, then the sum of exp(x - max)) and the pass writing the output,
  // all from registers: the row is read once (4 packs of 8 per thread, the vector entry; 32
  // elements, the dense one), and exp(x - max) is computed once, kept (two bf16 to a register)
  // from the sum's pass for the division's.
  EXPECT_EQ(count(s, ": reductions\n"), 4) << s;  // two per entry
  EXPECT_EQ(count(s, ": the outputs\n"), 2) << s;
  EXPECT_EQ(count(s, "// The row, read once into registers"), 2) << s;
  EXPECT_NE(s.find("kpack<bf16, 8> xc0[4];"), std::string::npos) << s;
  EXPECT_NE(s.find("bf16 xc0[32];"), std::string::npos) << s;
  EXPECT_EQ(count(s, "= *(const kpack<bf16, 8>*)(rin0 + c0);"), 1) << s;  // the only load
  // exp (kexp_bf16): in pairs in the vector entry (the sum's pass), one at a time in the dense.
  EXPECT_EQ(count(s, "kexp_bf16(kf("), 3) << s;
  // The division by the row's sum: through its reciprocal (kdiv_row_bf16), once per entry.
  EXPECT_EQ(count(s, "kbf(kdiv_row_bf16(kf(y2), kf(y3)))"), 2) << s;
  EXPECT_NE(s.find("u32 yc2[16];"), std::string::npos) << s;
  EXPECT_NE(s.find("kpick<true>("), std::string::npos) << s;
  EXPECT_NE(s.find("__shfl_xor_sync"), std::string::npos) << s;
  ASSERT_EQ(k->outputs.size(), 1u);
  EXPECT_EQ(k->outputs[0].sizes, Shape({64, 2048}));
  // Deterministic.
  EXPECT_EQ(compiler::fused_cuda_source(t, 0, t.ops.size()), s);
}

// kdiv_row_bf16's claim (compiler/fused_cuda_prelude.cpp), on every pair of bf16 values x, y: x
// times the float reciprocal of y scaled by s into the normal range, scaled back by s, rounds to
// the same bf16 as the IEEE float quotient x / y (round to nearest even, as the generated kernels'
// conversion; NaN as NaN). The host's float arithmetic is IEEE binary32 with subnormals, as the
// generated kernels' (--ftz=false).
TEST(FusedCudaCodegen, RowReciprocalRoundsAsTheBf16Quotient) {
  const auto to_bf16 = [](float f) -> uint32_t {
    return std::isnan(f) ? 0x7fc0 : BFloat16(f).x;  // every NaN alike
  };
  const auto value = [](uint32_t bits) { return std::bit_cast<float>(bits << 16); };
  std::atomic<int64_t> differ{0};
  std::atomic<uint64_t> first{~uint64_t{0}};
  const auto sweep = [&](uint32_t y_begin, uint32_t y_end) {
    int64_t bad = 0;
    for (uint32_t yb = y_begin; yb < y_end; ++yb) {
      const float y = value(yb), ay = std::fabs(y);
      const float s = ay < 0x1p-126f                           ? 0x1p64f
                      : ay > 0x1p126f && ay <= 0x1.fffffep127f ? 0x1p-64f
                                                               : 1.0f;
      const float r = 1.0f / (y * s);
      for (uint32_t xb = 0; xb < 0x10000; ++xb) {
        const float x = value(xb);
        if (to_bf16(x * r * s) != to_bf16(x / y)) {
          if (bad++ == 0) first = uint64_t{xb} << 16 | yb;
        }
      }
    }
    differ += bad;
  };
  std::thread half(sweep, 0, 0x8000);
  sweep(0x8000, 0x10000);
  half.join();
  EXPECT_EQ(differ.load(), 0) << "first: x bits 0x" << std::hex << (first.load() >> 16)
                              << ", y bits 0x" << (first.load() & 0xffff);
}

// Only a bf16 quotient of a divisor known per row takes the reciprocal: not f32 or f16 ones, nor a
// divisor that varies along the row.
TEST(FusedCudaCodegen, RowReciprocalOnlyForBf16DivisorsOfTheRow) {
  const auto source = [](const Trace& t) {
    std::string why;
    const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), &why);
    EXPECT_TRUE(k.has_value()) << why << t.str();
    return k ? k->source : std::string();
  };
  for (ScalarType dt : {kFloat, kHalf}) {
    const std::string s = source(traced_on_cuda(softmax_with_ops, randn({8, 256}).to(dt)));
    EXPECT_EQ(count(s, "kbf(kdiv_row_bf16("), 0) << dtype_name(dt) << s;
    EXPECT_EQ(count(s, " / kf("), dt == kHalf ? 2 : 0) << dtype_name(dt) << s;
  }
  // x / (x * sum(x)): the divisor varies along the row.
  const auto varying = [](const Tensor& x) { return x / (x * sum(x, {-1}, true)); };
  const std::string v = source(traced_on_cuda(varying, randn({8, 256}).to(kBFloat16)));
  EXPECT_EQ(count(v, "kbf(kdiv_row_bf16("), 0) << v;
  // x / s for a per-row input s: the reciprocal.
  const auto by_input = [](const Tensor& x, const Tensor& s) {
    const Tensor q = x / s;
    return q + sum(q, {-1}, true);
  };
  const std::string r =
      source(traced_on_cuda(by_input, randn({8, 256}).to(kBFloat16), randn({8, 1}).to(kBFloat16)));
  EXPECT_EQ(count(r, "kdiv_row_bf16(kf("), 3) << r;  // a pair in the vector entry, one in the dense
}

// The row planner's choices the kernel lab varies (RowPlanOptions): accesses a thread set the
// threads a row, block_threads the rows a block; the defaults are the library's.
TEST(FusedCudaCodegen, RowPlanOptionsSetTheGeometry) {
  namespace I = compiler::internal;
  const Trace t = traced_on_cuda(softmax_with_ops, randn({64, 2048}).to(kBFloat16));
  const auto plan = [&](I::RowPlanOptions o) {
    return I::generate_fused_kernel(t, 0, t.ops.size(), nullptr, I::kDefaultSharedLimit, o);
  };
  const auto lib = plan({});
  ASSERT_TRUE(lib.has_value());
  EXPECT_EQ(lib->source, I::generate_fused_kernel(t, 0, t.ops.size(), nullptr)->source);
  // 256 packs of 8 bf16: 8 a thread is one warp a row, 8 rows to a block of 256.
  const auto warp = plan({8, 256});
  ASSERT_TRUE(warp.has_value());
  EXPECT_EQ(warp->row_threads, 32);
  EXPECT_EQ(warp->rows_per_block, 8);
  EXPECT_EQ(count(warp->source, "__syncthreads"), 0) << warp->source;  // a warp's shuffles only
  EXPECT_NE(warp->source.find("kpack<bf16, 8> xc0[8];"), std::string::npos) << warp->source;
  const auto wide = plan({2, 512});
  ASSERT_TRUE(wide.has_value());
  EXPECT_EQ(wide->row_threads, 128);
  EXPECT_EQ(wide->rows_per_block, 4);
  EXPECT_KILN_ERROR(plan({0, 256}), "[fused_cuda] RowPlanOptions: accesses_per_thread must be");
  EXPECT_KILN_ERROR(plan({4, 100}), "block_threads a multiple of 32 in [32, 1024], got 4 and 100");
}

// CompileOptions::emulate_precision_casts(false) (Trace::emulate_precision_casts): the region's
// bf16 values stay in float, and only what the kernel stores is rounded; its operands are the
// same. An amax of the bf16 input stays bf16 (it rounds nothing). f32 regions are unchanged.
TEST(FusedCudaCodegen, UnemulatedCastsRoundOnlyWhatIsStored) {
  namespace I = compiler::internal;
  const auto both = [](Trace t) {
    std::string why;
    auto exact = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    EXPECT_TRUE(exact.has_value()) << why << t.str();
    t.emulate_precision_casts = false;
    auto relaxed = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    EXPECT_TRUE(relaxed.has_value()) << why << t.str();
    if (exact && relaxed) {
      EXPECT_EQ(relaxed->row_kernel, exact->row_kernel);
      EXPECT_EQ(relaxed->vector_width, exact->vector_width);
      for (auto [a, b] : {std::pair{&exact->inputs, &relaxed->inputs},
                          std::pair{&exact->outputs, &relaxed->outputs}}) {
        EXPECT_EQ(a->size(), b->size());
        if (a->size() != b->size()) continue;
        for (size_t i = 0; i < a->size(); ++i) {
          EXPECT_EQ((*a)[i].value, (*b)[i].value);
          EXPECT_EQ((*a)[i].dtype, (*b)[i].dtype);
        }
      }
    }
    return std::pair{exact ? exact->source : "", relaxed ? relaxed->source : ""};
  };
  // A pointwise chain: each of its four members rounded, or only the stored result.
  const auto [pe, pr] =
      both(traced_on_cuda([](const Tensor& a, const Tensor& b) { return exp(a * b + a) * 0.5; },
                          randn({8, 64}).to(kBFloat16), randn({8, 64}).to(kBFloat16)));
  // (Each source starts with the prelude's "kbf(".)
  const auto defs = count(std::string(I::kPrelude), "kbf(");
  EXPECT_EQ(count(pe, "kbf(") - defs, 4 * (count(pr, "kbf(") - defs)) << pe << pr;
  EXPECT_GE(count(pr, "kbf(") - defs, 3) << pr;  // the strided, dense and vector entries' stores
  // softmax: the subtraction, exp, sum and division in float; one rounding, at the store, and
  // the division is a float one (no kdiv_row_bf16).
  const auto [se, sr] = both(traced_on_cuda(softmax_with_ops, randn({8, 256}).to(kBFloat16)));
  EXPECT_GT(count(se, "kbf(kdiv_row_bf16("), 0) << se;
  EXPECT_EQ(count(sr, "kdiv_row_bf16("), 1) << sr;  // the prelude's definition only
  EXPECT_LT(count(sr, "kbf("), count(se, "kbf(")) << sr;
  // The float members as torch.compile's: no kopaque between them (contraction allowed), exp as
  // __expf, the division by the row's sum a multiply by its reciprocal.
  EXPECT_EQ(count(sr, "= kopaque("), 0) << sr;
  EXPECT_GT(count(sr, "= __expf("), 0) << sr;
  EXPECT_GT(count(sr, " * (1.0f / y"), 0) << sr;
  // Float programs are left as they are.
  Trace f32 = traced_on_cuda(softmax_with_ops, randn({8, 256}));
  const std::string f32_source = I::generate_fused_kernel(f32, 0, f32.ops.size(), nullptr)->source;
  f32.emulate_precision_casts = false;
  EXPECT_EQ(I::generate_fused_kernel(f32, 0, f32.ops.size(), nullptr)->source, f32_source);
  EXPECT_GT(count(f32_source, "= kopaque("), 0) << f32_source;
  // RMSNorm as models write it: the cast to bf16 before the weight's multiply is dropped.
  const auto [re, rr] = both(traced_on_cuda(rms_norm_with_ops, randn({8, 2048}).to(kBFloat16),
                                            randn({2048}).to(kBFloat16)));
  EXPECT_EQ(count(re, "kbf(") - defs, 2 * (count(rr, "kbf(") - defs)) << re << rr;
  // The listing says so.
  Trace t = traced_on_cuda(softmax_with_ops, randn({8, 256}).to(kBFloat16));
  EXPECT_EQ(t.str().find("precision casts not emulated"), std::string::npos);
  t.emulate_precision_casts = false;
  EXPECT_NE(t.str().find(", precision casts not emulated"), std::string::npos) << t.str();
}

// The option reaches every compiled stage's trace; CPU programs (fused_cpu) compute as before.
TEST(CompileOptions, EmulatePrecisionCastsIsTheTracesFlag) {
  const auto fn = [](const Tensor& a) { return softmax_with_ops(a * 2.0); };
  const Tensor x = randn({4, 33}).to(kBFloat16);
  auto f = compile(fn, CompileOptions().emulate_precision_casts(false));
  EXPECT_TRUE(CompileOptions().emulate_precision_casts());  // the default
  const Tensor got = f(x);
  EXPECT_EQ((got.to(kFloat) - fn(x).to(kFloat)).abs().max().item<double>(), 0.0);
  const std::vector<Trace>& traces = f.traces();
  ASSERT_GE(traces.size(), 2u);
  EXPECT_TRUE(traces.front().emulate_precision_casts);  // the traced stage, before the passes
  EXPECT_FALSE(traces.back().emulate_precision_casts) << traces.back().str();
  EXPECT_NE(traces.back().str().find("precision casts not emulated"), std::string::npos);
}

TEST(FusedCudaCodegen, RowKernelsForRmsNormLogsumexpAndRowSums) {
  namespace I = compiler::internal;
  const Trace rms = traced_on_cuda(rms_norm_with_ops, randn({8, 2048}).to(kBFloat16),
                                   randn({2048}).to(kBFloat16));
  std::string why;
  const auto kr = I::generate_fused_kernel(rms, 0, rms.ops.size(), &why);
  ASSERT_TRUE(kr.has_value()) << why << rms.str();
  EXPECT_EQ(count(kr->source, ": reductions\n"), 2) << kr->source;  // one per entry
  EXPECT_EQ(count(kr->source, ": the outputs\n"), 2) << kr->source;
  // The mean's 1 / 2048 is a parameter (eager's scale), rsqrt(mean + eps) computed once per row.
  bool scale = false;
  for (const auto& [slot, bits] : kr->constants)
    scale = scale || bits == compiler::internal::bits_of(1.0f / 2048);
  EXPECT_TRUE(scale);
  // logsumexp: every output is per row, no pass writes a row.
  const Trace lse = traced_on_cuda(logsumexp_with_ops, randn({8, 1000}));
  const auto kl = I::generate_fused_kernel(lse, 0, lse.ops.size(), &why);
  ASSERT_TRUE(kl.has_value()) << why << lse.str();
  EXPECT_EQ(count(kl->source, ": the outputs\n"), 0) << kl->source;
  EXPECT_EQ(kl->vector_width, 4);
  ASSERT_EQ(kl->outputs.size(), 1u);
  EXPECT_EQ(kl->outputs[0].sizes, Shape({8, 1}));
  EXPECT_NE(kl->source.find("if (active && lane == 0) out0["), std::string::npos) << kl->source;
  // A row sum of broadcasting producers without keepdim: its output is aligned with the
  // domain's leading dims. 77 is not a multiple of 4: no vector entry; short rows: one warp.
  const Trace sum_t = traced_on_cuda(
      [](const Tensor& x, const Tensor& w, const Tensor& b) { return sum(x * w + b, {-1}); },
      randn({8, 77}), randn({77}), randn({8, 1}));
  const auto ks = I::generate_fused_kernel(sum_t, 0, sum_t.ops.size(), &why);
  ASSERT_TRUE(ks.has_value()) << why << sum_t.str();
  EXPECT_EQ(ks->vector_width, 0);
  EXPECT_EQ(ks->row_threads, 32);
  EXPECT_EQ(ks->rows_per_block, 8);
  ASSERT_EQ(ks->outputs.size(), 1u);
  EXPECT_TRUE(ks->outputs[0].leading);
  EXPECT_EQ(count(ks->source, "__syncthreads"), 0) << "one warp per row: shuffles only";
  // A vocabulary-long row: 1024 threads, re-read by each pass (too long for registers), 8
  // elements per thread loaded before any is used.
  const Trace vocab = traced_on_cuda(softmax_with_ops, randn({2, 128256}));
  const auto kv = I::generate_fused_kernel(vocab, 0, vocab.ops.size(), &why);
  ASSERT_TRUE(kv.has_value()) << why;
  EXPECT_EQ(kv->row_threads, 1024);
  EXPECT_EQ(kv->source.find(" xc0["), std::string::npos) << kv->source;
  EXPECT_EQ(count(kv->source, "kpack<float, 4> xv0[2];"), 3) << kv->source;  // one per pass
  // 32000 columns of f32, 1024 threads: the row fits in registers (not twice in a
  // multiprocessor's shared memory), exp(x - max) is computed again in the output pass. Of bf16:
  // the shared-memory row cache (RowsOfLongMultiPassRowsUseSharedMemory).
  {
    const Trace t = traced_on_cuda(softmax_with_ops, randn({2, 32000}));
    const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    ASSERT_TRUE(k.has_value()) << why;
    EXPECT_EQ(k->row_threads, 1024);
    EXPECT_EQ(k->row_shared_bytes, 0);
    EXPECT_EQ(count(k->source, "// The row, read once into registers"), 2) << k->source;
    EXPECT_EQ(count(k->source, "scalar::Exp::apply"), 4) << k->source;
  }
  // Reductions over a trailing pair of dims, one-element rows.
  const Trace two = traced_on_cuda(
      [](const Tensor& x) {
        return x - mean(x, {1, 2}, true);
      },
      randn({4, 3, 5}).to(kDouble));
  const auto k2 = I::generate_fused_kernel(two, 0, two.ops.size(), &why);
  ASSERT_TRUE(k2.has_value()) << why;
  EXPECT_EQ(k2->rows, 4);
  EXPECT_EQ(k2->cols, 15);
  // Rows of one element.
  const Trace one = traced_on_cuda(softmax_with_ops, randn({16, 1}));
  const auto k1 = I::generate_fused_kernel(one, 0, one.ops.size(), &why);
  ASSERT_TRUE(k1.has_value()) << why;
  EXPECT_EQ(k1->cols, 1);
}

// Long rows read by several passes: the first pass reading the row stores it in shared memory,
// the later ones read it there (one row per block of 512 threads, two or three blocks to a
// multiprocessor as their rows fit); where two rows do not fit a multiprocessor's shared memory
// (or the device allows none), the registers or a read per pass.
TEST(FusedCudaCodegen, RowsOfLongMultiPassRowsUseSharedMemory) {
  namespace I = compiler::internal;
  std::string why;
  const Trace t = traced_on_cuda(softmax_with_ops, randn({2, 32000}).to(kBFloat16));
  const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
  ASSERT_TRUE(k.has_value()) << why;
  const std::string& s = k->source;
  EXPECT_EQ(k->row_threads, 512);
  EXPECT_EQ(k->rows_per_block, 1);
  EXPECT_EQ(k->row_shared_bytes, 64000);
  EXPECT_EQ(count(s, "extern __shared__ __align__(16) unsigned char ksm[];"), 2) << s;
  EXPECT_EQ(count(s, "// The row, read once into registers"), 0) << s;
  // Per entry: one load from global memory (the max's pass), stored; one from shared memory (the
  // sum's pass), which keeps exp(x - max) in x's place for the output's pass to read back.
  EXPECT_EQ(count(s, "= *(const kpack<bf16, 8>*)(rin0 + c0);"), 1) << s;
  EXPECT_EQ(count(s, "*(kpack<bf16, 8>*)(sin0 + c0) = xv0[u];"), 1) << s;
  EXPECT_EQ(count(s, "= *(const kpack<bf16, 8>*)(sin0 + c0);"), 1) << s;
  EXPECT_EQ(count(s, "bf16* skm2 = (bf16*)(ksm + 0);  // y2, kept in x0's place"), 2) << s;
  EXPECT_EQ(count(s, "*(kpack<bf16, 8>*)(skm2 + c0) = kw2;"), 1) << s;
  EXPECT_EQ(count(s, "kv2[u] = *(const kpack<bf16, 8>*)(skm2 + c0);"), 1) << s;
  EXPECT_EQ(count(s, "= rin0[c0];"), 1) << s;  // the dense entry's
  EXPECT_EQ(count(s, "*(bf16*)(sin0 + c0) = xv0[u];"), 1) << s;
  EXPECT_EQ(count(s, "= *(const bf16*)(sin0 + c0);"), 1) << s;
  EXPECT_EQ(count(s, "skm2[c] = y2;"), 1) << s;
  EXPECT_EQ(count(s, "kv2[u] = *(const bf16*)(skm2 + c0);"), 1) << s;
  // The output's pass computes only the division.
  EXPECT_EQ(count(s, "kexp_bf16(kf("), 3) << s;  // the sum's pass: a pair, and the dense entry's
  // The division, written out: a pair at a time in the vector entry, from the kept pairs.
  EXPECT_EQ(count(s,
                  "yp4[h] = kbf2(kdiv_row_bf16(kf(kv2[u].v[2 * h]), kf(y3)), "
                  "kdiv_row_bf16(kf(kv2[u].v[2 * h + 1]), kf(y3)));"),
            1)
      << s;
  EXPECT_EQ(count(s, "const bf16 y2 = kv2[u]"), 2) << s;
  // Rows written out element by element: two blocks to a multiprocessor.
  EXPECT_EQ(count(s, "__launch_bounds__(512, 2)"), 2) << s;
  EXPECT_FALSE(I::row_source_at_two_blocks(s).has_value());
  // Rows only reduced (logsumexp): three rows of 64000 bytes fit a multiprocessor's 227 KB, so
  // three blocks to one; at 160 KB, two.
  const Trace reduced = traced_on_cuda(logsumexp_with_ops, randn({2, 32000}).to(kBFloat16));
  const auto three = I::generate_fused_kernel(reduced, 0, reduced.ops.size(), &why);
  ASSERT_TRUE(three.has_value()) << why;
  EXPECT_EQ(three->row_shared_bytes, 64000);
  EXPECT_EQ(count(three->source, "__launch_bounds__(512, 3)"), 2) << three->source;
  const auto two = I::generate_fused_kernel(reduced, 0, reduced.ops.size(), &why, 160 * 1024);
  ASSERT_TRUE(two.has_value()) << why;
  EXPECT_EQ(two->row_shared_bytes, 64000);
  EXPECT_EQ(count(two->source, "__launch_bounds__(512, 2)"), 2) << two->source;
  // What the executor builds where the kernel at three blocks spills: the same at two; a kernel
  // planned at two has nothing to rewrite.
  const std::optional<std::string> rewritten = I::row_source_at_two_blocks(three->source);
  ASSERT_TRUE(rewritten.has_value());
  EXPECT_EQ(*rewritten, two->source);
  EXPECT_FALSE(I::row_source_at_two_blocks(two->source).has_value());
  // A device without the opt-in shared memory: as before, the row in registers.
  const auto none = I::generate_fused_kernel(t, 0, t.ops.size(), &why, 48 * 1024);
  ASSERT_TRUE(none.has_value()) << why;
  EXPECT_EQ(none->row_shared_bytes, 0);
  EXPECT_EQ(none->row_threads, 1024);
  EXPECT_EQ(count(none->source, "ksm"), 0) << none->source;
  // logsumexp(x * y) over odd rows of f32: the max's pass keeps x * y in x's 16-byte aligned
  // place, and the sum's pass reads it back; neither input is stored, and y takes no place, so
  // that three blocks fit where plan_row_cache counted two inputs.
  const Trace lse =
      traced_on_cuda([](const Tensor& x, const Tensor& y) { return logsumexp_with_ops(x * y); },
                     randn({3, 12345}), randn({3, 12345}));
  const auto kl = I::generate_fused_kernel(lse, 0, lse.ops.size(), &why);
  ASSERT_TRUE(kl.has_value()) << why;
  EXPECT_EQ(kl->vector_width, 0);
  EXPECT_EQ(kl->row_shared_bytes, 49392);
  EXPECT_EQ(count(kl->source, "__launch_bounds__(512, 3)"), 1) << kl->source;
  EXPECT_EQ(count(kl->source, " sin"), 0) << kl->source;
  EXPECT_EQ(count(kl->source, "float* skm0 = (float*)(ksm + 0);  // y0, kept in x0's place"), 1)
      << kl->source;
  // With a 16-bit x, x * y (f32) is kept in the place of its size, y's.
  const Trace lse16 =
      traced_on_cuda([](const Tensor& x, const Tensor& y) { return logsumexp_with_ops(x * y); },
                     randn({3, 12345}).to(kBFloat16), randn({3, 12345}));
  const auto kl16 = I::generate_fused_kernel(lse16, 0, lse16.ops.size(), &why);
  ASSERT_TRUE(kl16.has_value()) << why;
  EXPECT_EQ(kl16->row_shared_bytes, 49392);
  EXPECT_EQ(count(kl16->source, "float* skm0 = (float*)(ksm + 0);  // y0, kept in x1's place"), 1)
      << kl16->source;
  // A member finding no place of its size is computed again by each pass: exp(x) in f64 of a
  // 16-bit x, both passes reading x back.
  const Trace wide = traced_on_cuda(
      [](const Tensor& x) {
        const Tensor e = exp(x.to(kDouble) * 2.0);
        return e / sum(e, {-1}, true);
      },
      randn({2, 32000}).to(kBFloat16));
  const auto kw = I::generate_fused_kernel(wide, 0, wide.ops.size(), &why);
  ASSERT_TRUE(kw.has_value()) << why;
  EXPECT_EQ(kw->row_shared_bytes, 64000);
  EXPECT_EQ(count(kw->source, "skm"), 0) << kw->source;
  EXPECT_EQ(count(kw->source, "= *(const kpack<bf16, 8>*)(sin0 + c0);"), 1) << kw->source;
  // Only the inputs several passes read: softmax(x) * z stores x (read by the max's and the sum's
  // passes; exp(x - max) then takes its place for the output's), not z (the output's pass only);
  // z * rsqrt(mean(x * x)) reads each input in one pass: no cache.
  const Trace sz =
      traced_on_cuda([](const Tensor& x, const Tensor& z) { return softmax_with_ops(x) * z; },
                     randn({2, 32000}).to(kBFloat16), randn({2, 32000}).to(kBFloat16));
  const auto ksz = I::generate_fused_kernel(sz, 0, sz.ops.size(), &why);
  ASSERT_TRUE(ksz.has_value()) << why;
  EXPECT_EQ(ksz->row_shared_bytes, 64000);
  EXPECT_EQ(count(ksz->source, "(sin0 + c0) = xv0[u];"), 2) << ksz->source;
  EXPECT_EQ(count(ksz->source, " sin1"), 0) << ksz->source;
  EXPECT_EQ(count(ksz->source, "bf16* skm2 = (bf16*)(ksm + 0);"), 2) << ksz->source;
  // softmax(x) * x: the output's pass reads x too, so x's place is taken until then and
  // exp(x - max) finds none: computed again there, x read back by both later passes.
  const Trace sx = traced_on_cuda([](const Tensor& x) { return softmax_with_ops(x) * x; },
                                  randn({2, 32000}).to(kBFloat16));
  const auto ksx = I::generate_fused_kernel(sx, 0, sx.ops.size(), &why);
  ASSERT_TRUE(ksx.has_value()) << why;
  EXPECT_EQ(ksx->row_shared_bytes, 64000);
  EXPECT_EQ(count(ksx->source, "skm"), 0) << ksx->source;
  EXPECT_EQ(count(ksx->source, "= *(const kpack<bf16, 8>*)(sin0 + c0);"), 2) << ksx->source;
  // Two passes, two entries: in pairs in the vector entry's sum pass only.
  EXPECT_EQ(count(ksx->source, "kexp_bf16(kf("), 5) << ksx->source;
  const Trace two_inputs = traced_on_cuda(
      [](const Tensor& x, const Tensor& z) { return z * rsqrt(mean(x * x, {-1}, true) + 1e-6); },
      randn({2, 16000}), randn({2, 16000}));
  const auto kt = I::generate_fused_kernel(two_inputs, 0, two_inputs.ops.size(), &why);
  ASSERT_TRUE(kt.has_value()) << why;
  EXPECT_EQ(kt->row_shared_bytes, 0);
  EXPECT_EQ(count(kt->source, "ksm"), 0) << kt->source;
  // Rows of one pass (a row sum) and short rows: none.
  const Trace rsum = traced_on_cuda([](const Tensor& x) { return sum(x * 2.0, {-1}, true); },
                                    randn({2, 32000}).to(kBFloat16));
  const auto ks = I::generate_fused_kernel(rsum, 0, rsum.ops.size(), &why);
  ASSERT_TRUE(ks.has_value()) << why;
  EXPECT_EQ(ks->row_shared_bytes, 0);
  const Trace short_rows = traced_on_cuda(softmax_with_ops, randn({64, 2048}).to(kBFloat16));
  const auto kk = I::generate_fused_kernel(short_rows, 0, short_rows.ops.size(), &why);
  ASSERT_TRUE(kk.has_value()) << why;
  EXPECT_EQ(kk->row_shared_bytes, 0);
}

// A bf16 add or sub (alpha 1 or -1) of two bf16 operands, each a pair of the pack (an input the
// pass reads, or such a member) or the row's value, is computed two elements at a time by one
// bf16x2 fma in the vector entries: logsumexp's x - max; x + z of two inputs; not a scaled sum, a
// float one, the dense entry, or with casts not emulated.
TEST(FusedCudaCodegen, RowBf16SumsInPairs) {
  namespace I = compiler::internal;
  std::string why;
  const Trace lse = traced_on_cuda(logsumexp_with_ops, randn({2, 32000}).to(kBFloat16));
  const auto k = I::generate_fused_kernel(lse, 0, lse.ops.size(), &why);
  ASSERT_TRUE(k.has_value()) << why;
  const std::string& s = k->source;
  EXPECT_EQ(count(s, "u32 yp1[4];  // y1 = sub(x0, y0; <scalar>)"), 1) << s;  // the vector entry
  EXPECT_EQ(count(s,
                  "yp1[h] = kfma_bf16x2(kbf_pair(y0, y0), 0xbf80bf80u, "
                  "kbf_pair(xv0[u].v[2 * h], xv0[u].v[2 * h + 1]));"),
            1)
      << s;
  EXPECT_EQ(count(s, "const bf16 y1 = kbf_half(yp1[e >> 1], e & 1);"), 1) << s;
  // exp(x - max), read by the sum: in pairs too, each half by kexp_bf16, rounded together.
  EXPECT_EQ(count(s,
                  "yp2[h] = kbf2(kexp_bf16(kf(kbf_half(yp1[h], 0))), "
                  "kexp_bf16(kf(kbf_half(yp1[h], 1))));"),
            1)
      << s;
  // Two inputs of the row, then a scaled sum (alpha 2) of them: the first in pairs only.
  const Trace two = traced_on_cuda(
      [](const Tensor& x, const Tensor& z) {
        const Tensor s1 = x + z, s2 = sub(x, z, 2.0);
        return amax(s1, {-1}, true) + amax(s2, {-1}, true);
      },
      randn({4, 256}).to(kBFloat16), randn({4, 256}).to(kBFloat16));
  const auto k2 = I::generate_fused_kernel(two, 0, two.ops.size(), &why);
  ASSERT_TRUE(k2.has_value()) << why;
  EXPECT_EQ(count(k2->source,
                  "kfma_bf16x2(kbf_pair(xv1[u].v[2 * h], xv1[u].v[2 * h + 1]), "
                  "0x3f803f80u, kbf_pair(xv0[u].v[2 * h], xv0[u].v[2 * h + 1]))"),
            1)
      << k2->source;
  EXPECT_EQ(count(k2->source, "= kfma_bf16x2("), 1) << k2->source;
  // log_softmax keeps x - max in shared memory for its output's pass: there, read back, it is
  // not an operand of a pair (its registers spilled so), only the sum's pass's x - max is.
  const Trace ls = traced_on_cuda(log_softmax_with_ops, randn({2, 32000}).to(kBFloat16));
  const auto kls = I::generate_fused_kernel(ls, 0, ls.ops.size(), &why);
  ASSERT_TRUE(kls.has_value()) << why;
  EXPECT_GT(kls->row_shared_bytes, 0);
  EXPECT_EQ(count(kls->source, "= kfma_bf16x2("), 1) << kls->source;
  // f32 rows, and casts not emulated: none.
  const Trace f32 = traced_on_cuda(logsumexp_with_ops, randn({2, 32000}));
  EXPECT_EQ(count(I::generate_fused_kernel(f32, 0, f32.ops.size(), &why)->source, "= kfma_bf16x2("),
            0);
  Trace relaxed = lse;
  relaxed.emulate_precision_casts = false;
  EXPECT_EQ(count(I::generate_fused_kernel(relaxed, 0, relaxed.ops.size(), &why)->source,
                  "= kfma_bf16x2("),
            0);
}

// A row of 1024 threads held in registers, one block to a multiprocessor, prefetches into L2 the
// row its multiprocessor likely runs next, where the kernel writes only per-row results: f32
// logsumexp over rows of 32000, one prefetch a 128-byte line in each entry; not log_softmax (it
// writes its rows), bf16 logsumexp (rows in shared memory, three blocks) or short rows.
TEST(FusedCudaCodegen, RegisterRowsReducedOnlyPrefetchTheNextRow) {
  namespace I = compiler::internal;
  const auto source = [](const Trace& t) {
    std::string why;
    const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    EXPECT_TRUE(k.has_value()) << why << t.str();
    return k ? k->source : std::string();
  };
  const std::string lse = source(traced_on_cuda(logsumexp_with_ops, randn({2, 32000})));
  EXPECT_EQ(count(lse, "// The row, read once into registers"), 2) << lse;
  EXPECT_EQ(count(lse, "asm(\"mov.u32 %0, %%nsmid;\" : \"=r\"(nsm));"), 2) << lse;
  EXPECT_EQ(count(lse,
                  "if ((lane & 7) == 0 && c0 < C) asm volatile(\"prefetch.global.L2 [%0];\" :: "
                  "\"l\"(rin0 + (long long)nsm * C + c0));"),
            1)
      << lse;  // the vector entry: 16 bytes a lane
  EXPECT_EQ(count(lse, "if ((lane & 31) == 0 && c0 < C)"), 1) << lse;  // the dense entry
  for (const auto& [what, t] :
       {std::pair{"f32 log_softmax", traced_on_cuda(log_softmax_with_ops, randn({2, 32000}))},
        std::pair{"bf16 logsumexp",
                  traced_on_cuda(logsumexp_with_ops, randn({2, 32000}).to(kBFloat16))},
        std::pair{"f32 logsumexp, rows of 2048",
                  traced_on_cuda(logsumexp_with_ops, randn({8, 2048}))}}) {
    const std::string s = source(t);
    EXPECT_EQ(count(s, "prefetch.global.L2"), 0) << what << s;
  }
}

// exp of bf16 (a bf16 value in, rounded to bf16) is kexp_bf16 (the prelude's ex2 of the product
// in two parts, eager's bits: GpuFusedCuda.Bf16ExpRoundsAsEagersOnEveryValue); f32 and f16 keep
// eager's expf, and with casts not emulated exp is __expf.
TEST(FusedCudaCodegen, Bf16ExpThroughKexpBf16) {
  namespace I = compiler::internal;
  const auto chain = [](const Tensor& x) { return exp(x) * x; };
  for (ScalarType dt : {kBFloat16, kFloat, kHalf}) {
    std::string why;
    Trace t = traced_on_cuda(chain, randn({4, 64}).to(dt));
    const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    ASSERT_TRUE(k.has_value()) << why;
    const bool bf16 = dt == kBFloat16;
    const int entries = count(k->source, "extern \"C\" __global__");  // an exp in each
    EXPECT_GE(entries, 2);
    EXPECT_GE(count(k->source, bf16 ? "kbf(kexp_bf16(kf(x0)))" : "scalar::Exp::apply<float>("),
              entries)
        << k->source;
    EXPECT_EQ(count(k->source, bf16 ? "scalar::Exp::apply<float>(" : "kexp_bf16(kf("), 0)
        << k->source;
    if (!bf16) continue;
    t.emulate_precision_casts = false;
    const auto relaxed = I::generate_fused_kernel(t, 0, t.ops.size(), &why);
    ASSERT_TRUE(relaxed.has_value()) << why;
    EXPECT_EQ(count(relaxed->source, "kexp_bf16(kf("), 0) << relaxed->source;
    EXPECT_GT(count(relaxed->source, "__expf("), 0) << relaxed->source;
  }
}

// amax and amin of a bf16 operand in pairs fold two elements an instruction into a pair of partial
// results (kpick_bf16x2), combined into the thread's result after the pass; float partials combine
// by kpick (max.NaN.f32). The dense entry and f32 rows reduce element by element.
TEST(FusedCudaCodegen, RowAmaxAminFoldBf16Pairs) {
  namespace I = compiler::internal;
  std::string why;
  const Trace lse = traced_on_cuda(logsumexp_with_ops, randn({2, 32000}).to(kBFloat16));
  const auto k = I::generate_fused_kernel(lse, 0, lse.ops.size(), &why);
  ASSERT_TRUE(k.has_value()) << why;
  const std::string& s = k->source;
  const std::string vector = s.substr(s.find("kiln_rows_vector("));
  EXPECT_EQ(count(vector, "u32 ap0 = 0xff80ff80u;"), 1) << s;
  EXPECT_EQ(count(vector,
                  "ap0 = kpick_bf16x2<true>(ap0, kbf_pair(xv0[u].v[2 * h], xv0[u].v[2 * h + 1]));"),
            1)
      << s;
  EXPECT_EQ(count(vector,
                  "a0 = kpick<true>(a0, kpick<true>(__uint_as_float(ap0 << 16), "
                  "__uint_as_float(ap0 & 0xffff0000u)));"),
            1)
      << s;
  EXPECT_EQ(count(vector, "a0 = kpick<true>(a0, (float)"), 0) << s;  // no element by element
  const std::string dense = s.substr(0, s.find("kiln_rows_vector("));
  EXPECT_EQ(count(dense, "kpick_bf16x2<"), count(std::string(I::kPrelude), "kpick_bf16x2<")) << s;
  EXPECT_EQ(count(dense, "a0 = kpick<true>(a0, (float)"), 1) << s;
  // amin, of a member in pairs (x + z): the other sign's infinities, its pair.
  const Trace mn = traced_on_cuda(
      [](const Tensor& x, const Tensor& z) {
        const Tensor t = x + z;
        return t - amin(t, {-1}, true);
      },
      randn({4, 256}).to(kBFloat16), randn({4, 256}).to(kBFloat16));
  const auto kmn = I::generate_fused_kernel(mn, 0, mn.ops.size(), &why);
  ASSERT_TRUE(kmn.has_value()) << why;
  EXPECT_EQ(count(kmn->source, " = 0x7f807f80u;"), 1) << kmn->source;
  EXPECT_EQ(count(kmn->source, " = kpick_bf16x2<false>(ap1, yp0[h]);"), 1) << kmn->source;
  // f32 rows: element by element, each pick one instruction.
  const Trace f32 = traced_on_cuda(logsumexp_with_ops, randn({2, 32000}));
  const auto k32 = I::generate_fused_kernel(f32, 0, f32.ops.size(), &why);
  ASSERT_TRUE(k32.has_value()) << why;
  EXPECT_EQ(count(k32->source, "ap0"), 0) << k32->source;
  EXPECT_EQ(count(k32->source, "a0 = kpick<true>(a0, (float)"), 2) << k32->source;
}

// The shrunk programs of GpuRandomProgram that differed from eager on an H100 (seeds 20261414,
// 20261652, 20261806: compiled 1, 0 and -0 where eager had other values). Each returns a per-row
// value of rows of one element (which has the domain's shape) and no per-element one: the tree
// that ran there (2f1d664) wrote an output per element or per row by its shape, so no pass
// wrote these (bea80cb: by its member's kind). Every row kernel of every sub-range of their
// traces writes each of its outputs, in each entry.
TEST(FusedCudaCodegen, RowKernelsWriteEveryOutputOfTheProgramsThatDifferedOnAGpu) {
  namespace I = compiler::internal;
  auto writes_every_output = [](const Trace& t) {
    int kernels = 0;
    for (size_t b = 0; b < t.ops.size(); ++b) {
      for (size_t e = b + 1; e <= t.ops.size(); ++e) {
        const auto k = I::generate_fused_kernel(t, b, e, nullptr);
        if (!k || !k->row_kernel) continue;
        ++kernels;
        const int entries = k->vector_width > 0 ? 2 : 1;
        for (size_t j = 0; j < k->outputs.size(); ++j) {
          const std::string o = std::to_string(j);
          const int stores = count(k->source, "lane == 0) out" + o + "[") +
                             count(k->source, "(rout" + o + " + c0) = vy") +
                             count(k->source, "rout" + o + "[c] = ");
          EXPECT_EQ(stores, entries) << "[" << b << ", " << e << ") output " << j << "\n"
                                     << t.str() << k->source;
        }
      }
    }
    return kernels;
  };
  // Seed 20261414 (compiled true, eager false), in both orders of its reductions.
  const Tensor x11 = randn({1, 1}, kFloat64);
  EXPECT_GT(writes_every_output(traced_on_cuda(
                [](const Tensor& v0) {
                  return gt(sum(v0, {1}, true), sum(v0, {0, -1}, false));
                },
                x11)),
            0);
  EXPECT_GT(writes_every_output(traced_on_cuda(
                [](const Tensor& v0) {
                  const Tensor v2 = sum(v0, {0, -1}, false);
                  return gt(sum(v0, {1}, true), v2);
                },
                x11)),
            0);
  // Seed 20261652's start (compiled 0): a full sum, a row sum, a 0-d bool.
  EXPECT_GT(writes_every_output(traced_on_cuda(
                [](const Tensor& v0, const Tensor& v4) {
                  const Tensor v1 = sum(v0, {0, 1}, false);
                  const Tensor v3 = sum(v0.permute({0, 1}), {-1}, true);
                  return where(v4, v3, v1);
                },
                randn({4, 1}), randn({}) > 0.0)),
            0);
  // Seed 20261806's start (compiled -0): a selected and an index-selected [3, 1] f64.
  EXPECT_GT(writes_every_output(traced_on_cuda(
                [](const Tensor& v0, const Tensor& v2) {
                  const Tensor v5 = v0.select(1, 0).select(0, 1);
                  const Tensor v3 = index_select(v0, 1, v2);
                  return sum(v3 / v5, {-1}, true);
                },
                randn({3, 1}, kFloat64), randint(0, 1, {1}, kInt64))),
            0);
  // A 0-d GPU value read in a row region of longer rows: read once per row.
  std::string why;
  const Trace zero_d =
      traced_on_cuda([](const Tensor& x, const Tensor& s) { return sum(x, {-1}, true) * s; },
                     randn({4, 8}), randn({}).to(kBFloat16));
  const auto kz = I::generate_fused_kernel(zero_d, 0, zero_d.ops.size(), &why);
  ASSERT_TRUE(kz.has_value()) << why;
  EXPECT_NE(kz->source.find("const bf16 x1 = in1[0];"), std::string::npos) << kz->source;
  EXPECT_EQ(writes_every_output(zero_d), 2);  // the sum alone, and with the product
}

TEST(FusedCudaCodegen, RowKernelsDeclineWhatTheyDoNotWrite) {
  namespace I = compiler::internal;
  std::string why;
  // Not the trailing dims.
  const Trace mid =
      traced_on_cuda([](const Tensor& x) { return sum(x * 2.0, {1}, true); }, randn({4, 3, 5}));
  for (const auto& op : mid.ops) {
    if (op.name() == "sum") {
      EXPECT_FALSE(I::row_op_generated(mid, op));
    }
  }
  // A member reading a reduction without keepdim (its dims would align with the trailing ones).
  const Trace drop =
      traced_on_cuda([](const Tensor& x) { return sum(x, {-1}) * 2.0; }, randn({4, 4}));
  EXPECT_FALSE(I::generate_fused_kernel(drop, 0, drop.ops.size(), &why).has_value());
  EXPECT_NE(why.find("without keepdim"), std::string::npos) << why;
  // Reductions of two shapes.
  const Trace two = traced_on_cuda(
      [](const Tensor& x) { return sum(sum(x, {-1}, true), {-2}, true); }, randn({4, 3, 5}));
  EXPECT_FALSE(I::generate_fused_kernel(two, 0, two.ops.size(), &why).has_value());
  // Integer sums are eager's.
  const Trace ints =
      traced_on_cuda([](const Tensor& x) { return sum(x * 2, {-1}, true); }, randint(0, 5, {4, 4}));
  for (const auto& op : ints.ops) {
    if (op.name() == "sum") {
      EXPECT_FALSE(I::row_op_generated(ints, op));
    }
  }
}

TEST(FusedCudaCodegen, RowEntryNeedsContiguousRows) {
  namespace I = compiler::internal;
  const Trace t =
      traced_on_cuda(rms_norm_with_ops, randn({8, 64}).to(kBFloat16), randn({64}).to(kBFloat16));
  const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  ASSERT_EQ(k->inputs.size(), 3u);  // x, the wrapped eps, w
  std::vector<I::OperandLayout> in = {{true, 4096}, {true, 0}, {true, 8192, {1}}};
  std::vector<I::OperandLayout> out = {{true, 8192}};
  // w varies along the rows as x does: the vector entry reads it in packs of 8, where it is
  // aligned with unit stride; else the dense entry reads it through its strides.
  EXPECT_FALSE(k->inputs[0].row_packed);
  EXPECT_TRUE(k->inputs[2].row_packed);
  EXPECT_NE(k->source.find("const kpack<bf16, 8> vr2 = *(const kpack<bf16, 8>*)(in2 + ri2 + c0);"),
            std::string::npos)
      << k->source;
  EXPECT_EQ(I::choose_row_entry(*k, in, out), I::FusedEntry::kVector);
  in[2] = {true, 8194, {1}};
  EXPECT_EQ(I::choose_row_entry(*k, in, out), I::FusedEntry::kDense);
  in[2] = {false, 8192, {2}};
  EXPECT_EQ(I::choose_row_entry(*k, in, out), I::FusedEntry::kDense);
  in[2] = {true, 8192, {1}};
  in[0].address = 4098;
  EXPECT_EQ(I::choose_row_entry(*k, in, out), I::FusedEntry::kDense);
  in[0].contiguous = false;
  EXPECT_EQ(I::choose_row_entry(*k, in, out), I::FusedEntry::kStrided);
  // A weight [2, 1, 64] of rows [2, 4, 64]: packs where its rows are a multiple of 8 elements
  // apart (72), not where they are not (68).
  const Trace t2 =
      traced_on_cuda([](const Tensor& x, const Tensor& w) { return softmax_with_ops(x * w); },
                     randn({2, 4, 64}).to(kBFloat16), randn({2, 1, 64}).to(kBFloat16));
  const auto k2 = I::generate_fused_kernel(t2, 0, t2.ops.size(), nullptr);
  ASSERT_TRUE(k2.has_value());
  ASSERT_EQ(k2->inputs.size(), 2u);
  const size_t w = k2->inputs[0].sizes == Shape{2, 1, 64} ? 0 : 1;
  EXPECT_TRUE(k2->inputs[w].row_packed);
  EXPECT_FALSE(k2->inputs[1 - w].row_packed);  // of the domain's shape
  std::vector<I::OperandLayout> in2(2, I::OperandLayout{true, 4096, {256, 64, 1}});
  in2[w] = {false, 8192, {72, 64, 1}};
  const std::vector<I::OperandLayout> out2 = {{true, 16384}};
  EXPECT_EQ(I::choose_row_entry(*k2, in2, out2), I::FusedEntry::kVector);
  in2[w].strides = {68, 64, 1};
  EXPECT_EQ(I::choose_row_entry(*k2, in2, out2), I::FusedEntry::kDense);
}

TEST(FusedCudaCodegen, RowVectorEntryForABroadcastRow) {
  namespace I = compiler::internal;
  // a + b * s[D] in bf16: no dense entry (s broadcasts); 64 is a multiple of 8 bf16.
  const Trace t = traced_on_cuda(
      [](const Tensor& a, const Tensor& b, const Tensor& s) { return a + b * s; },
      randn({16, 64}).to(kBFloat16), randn({16, 64}).to(kBFloat16), randn({64}).to(kBFloat16));
  const auto k = I::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  EXPECT_FALSE(k->has_dense);
  EXPECT_EQ(k->rowvec_width, 8);
  EXPECT_EQ(count(k->source, "kiln_fused_rowvec"), 1) << k->source;
  EXPECT_EQ(count(k->source, "kpack<bf16, 8> vx"), 3) << k->source;
  ASSERT_EQ(k->inputs.size(), 3u);
  // Layouts for the inputs (b and s, read first, then a) and the output; `first` for b.
  const I::OperandLayout row = {true, 4096, {64, 1}}, s = {true, 8192, {1}};
  auto entry = [&](const I::OperandLayout& first) {
    std::vector<I::OperandLayout> in;
    for (size_t j = 0; j < k->inputs.size(); ++j) {
      in.push_back(k->inputs[j].sizes.size() == 1 ? s : j == 0 ? first : row);
    }
    return I::choose_fused_entry(*k, in, {row});
  };
  EXPECT_EQ(entry(row), I::FusedEntry::kRowVector);
  // Misaligned, a row stride that breaks the packs' alignment, a strided last dim: strided.
  EXPECT_EQ(entry({true, 4098, {64, 1}}), I::FusedEntry::kStrided);
  EXPECT_EQ(entry({false, 4096, {69, 1}}), I::FusedEntry::kStrided);
  EXPECT_EQ(entry({false, 4096, {1, 16}}), I::FusedEntry::kStrided);
  // A last dim that is not a multiple of the pack, or an output smaller than the domain: none.
  const Trace t2 = traced_on_cuda([](const Tensor& a, const Tensor& s) { return a * s; },
                                  randn({4, 36}).to(kBFloat16), randn({36}).to(kBFloat16));
  EXPECT_EQ(I::generate_fused_kernel(t2, 0, t2.ops.size(), nullptr)->rowvec_width, 0);
}

// run_fused_kernel (the kernel lab's way in) checks its inputs, and without a GPU says so.
TEST(FusedCudaCodegen, RunFusedKernelChecksItsInputs) {
  const Trace t = traced_on_cuda(softmax_with_ops, randn({8, 256}).to(kBFloat16));
  const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  EXPECT_KILN_ERROR(compiler::internal::run_fused_kernel(*k, {}),
                    "[run_fused_kernel] the kernel has 1 inputs, given 0");
  if (cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  EXPECT_KILN_ERROR(compiler::internal::run_fused_kernel(*k, {randn({8, 256}).to(kBFloat16)}),
                    "[run_fused_kernel] needs a");
}

TEST(FusedCudaCodegen, DefaultExecutorsAndNoClaimsWithoutAGpu) {
  const std::vector<std::string> want = {"matmul_epilogue", "fused_cuda", "fused_cpu", "eager"};
  EXPECT_EQ(CompileOptions().executors(), want);
  if (cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  auto fn = [](const Tensor& x) { return exp(x) * 2.0; };
  const Trace t = traced_on_cuda(fn, randn({4, 4}));
  const auto e = compiler::find_executor("fused_cuda");
  for (const compiler::BoundOp& op : t.ops) EXPECT_FALSE(e->fuses(t, op)) << op.name();
  // A CPU program is unaffected: fused_cpu still takes its region.
  auto f = compile([](const Tensor& x) { return exp(x) * 2.0 + 1.0; });
  const Tensor x = randn({64, 64});
  EXPECT_TRUE(equal(f(x), exp(x) * 2.0 + 1.0));
  std::string s;
  for (const Trace& tr : f.traces()) s += tr.str();
  EXPECT_EQ(count(s, "[fused_cuda]"), 0) << s;
}

// --- The disk cache (no GPU needed) --------------------------------------------------------------

TEST(FusedCudaCache, RoundTripAndRejectsBadFiles) {
  namespace I = compiler::internal;
  const std::string dir = temp_dir("cache");
  const I::KernelKey key{"extern \"C\" __global__ void k() {}", "sm_90", "13.0"};
  EXPECT_FALSE(I::read_cached_kernel(dir, key).has_value());  // no directory yet
  const std::string payload(
      "\x7f"
      "ELF binary \0 bytes",
      18);
  ASSERT_TRUE(I::write_cached_kernel(dir, key, payload));
  bool rejected = true;
  EXPECT_EQ(I::read_cached_kernel(dir, key, &rejected), payload);
  EXPECT_FALSE(rejected);
  const std::string path = dir + "/" + key.file_name();
  // No temporary files are left behind.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  // Another architecture is another file.
  const I::KernelKey other{key.source, "sm_80", key.nvrtc};
  EXPECT_NE(other.file_name(), key.file_name());
  EXPECT_FALSE(I::read_cached_kernel(dir, other, &rejected).has_value());
  EXPECT_FALSE(rejected);
  // A flipped payload byte, a truncated file, another key's file under this name: rejected.
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  auto write_raw = [&](const std::string& b) {
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(b.data(), static_cast<std::streamsize>(b.size()));
  };
  std::string flipped = bytes;
  flipped.back() ^= 0x20;
  write_raw(flipped);
  EXPECT_FALSE(I::read_cached_kernel(dir, key, &rejected).has_value());
  EXPECT_TRUE(rejected);
  write_raw(bytes.substr(0, bytes.size() / 2));
  EXPECT_FALSE(I::read_cached_kernel(dir, key, &rejected).has_value());
  EXPECT_TRUE(rejected);
  ASSERT_TRUE(I::write_cached_kernel(dir, other, payload));
  std::filesystem::copy_file(dir + "/" + other.file_name(), path,
                             std::filesystem::copy_options::overwrite_existing);
  EXPECT_FALSE(I::read_cached_kernel(dir, key, &rejected).has_value());
  EXPECT_TRUE(rejected);
  // Rewritten, it reads back.
  ASSERT_TRUE(I::write_cached_kernel(dir, key, payload));
  EXPECT_EQ(I::read_cached_kernel(dir, key, &rejected), payload);
  std::filesystem::remove_all(dir);
}

TEST(FusedCudaCache, DirectoryFollowsTheSetterAndTheEnvironment) {
  compiler::set_kernel_cache_dir("/tmp/kiln_kernels_here");
  EXPECT_EQ(compiler::kernel_cache_dir(), "/tmp/kiln_kernels_here");
  compiler::set_kernel_cache_dir("");
  const char* saved = std::getenv("KILN_KERNEL_CACHE");
  const std::string keep = saved != nullptr ? saved : "";
  setenv("KILN_KERNEL_CACHE", "/tmp/kiln_env_kernels", 1);
  EXPECT_EQ(compiler::kernel_cache_dir(), "/tmp/kiln_env_kernels");
  if (saved != nullptr) {
    setenv("KILN_KERNEL_CACHE", keep.c_str(), 1);
  } else {
    unsetenv("KILN_KERNEL_CACHE");
    EXPECT_NE(compiler::kernel_cache_dir().find("kiln/kernels"), std::string::npos);
  }
}

// --- On a GPU: compiled == eager, bit for bit ----------------------------------------------------

// The same dtype, shape and bytes (NaNs included).
void expect_bitwise(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const Tensor a = got.to(kCPU).contiguous(), b = want.to(kCPU).contiguous();
  EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0)
      << what << ": compiled differs from eager; max difference "
      << (a.to(kDouble) - b.to(kDouble)).abs().max().item<double>();
}

std::string listings(const std::vector<Trace>& traces) {
  std::string s;
  for (const Trace& t : traces) s += t.str();
  return s;
}

// The generated source of every fused_cuda region of the traces' executors stages (printed with
// a failure, for a report from a GPU run).
std::string generated_sources(const std::vector<Trace>& traces) {
  std::string s;
  for (const Trace& t : traces) {
    if (t.stage != "executors") continue;
    for (size_t i = 0; i < t.ops.size();) {
      size_t end = i + 1;
      if (t.ops[i].region >= 0 && t.ops[i].executor == "fused_cuda") {
        while (end < t.ops.size() && t.ops[end].region == t.ops[i].region) ++end;
        s += "--- " + t.region_names[static_cast<size_t>(t.ops[i].region)] + ":\n" +
             compiler::fused_cuda_source(t, i, end).value_or("(declined)");
      }
      i = end;
    }
  }
  return s;
}

#define SKIP_WITHOUT_GPU() \
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason()

// Runs fn compiled and eagerly on `args`, expects a fused_cuda region and equal bits.
template <typename F>
void check_program(const std::string& what, F fn, const std::vector<Tensor>& args) {
  const bool failed_before = ::testing::Test::HasFailure();
  auto f = compile([&](const std::vector<Tensor>& a) { return fn(a); });
  const std::vector<Tensor> got = f(args);
  const std::vector<Tensor> want = fn(args);
  const std::string s = listings(f.traces());
  EXPECT_GE(count(s, "# region [fused_cuda]"), 1) << what << "\n" << s;
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    expect_bitwise(got[i], want[i], what + ", output " + std::to_string(i));
  if (!failed_before && ::testing::Test::HasFailure()) {
    ADD_FAILURE() << what << ": the program and its kernels\n"
                  << s << generated_sources(f.traces());
  }
  // A second call runs the cached program.
  const std::vector<Tensor> again = f(args);
  for (size_t i = 0; i < got.size(); ++i) expect_bitwise(again[i], want[i], what + ", again");
}

TEST(GpuFusedCuda, ChainsWithBroadcasting) {
  SKIP_WITHOUT_GPU();
  manual_seed(1);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf, kDouble}) {
    const std::vector<Tensor> args = {randn({64, 257}).to(dt).to(gpu), randn({257}).to(dt).to(gpu),
                                      randn({64, 1}).to(dt).to(gpu)};
    check_program(
        std::string("silu(x * w + b) ") + std::string(dtype_name(dt)),
        [](const std::vector<Tensor>& a) { return std::vector<Tensor>{silu(a[0] * a[1] + a[2])}; },
        args);
    check_program(
        std::string("gelu, sigmoid, tanh, rsqrt ") + std::string(dtype_name(dt)),
        [](const std::vector<Tensor>& a) {
          const Tensor h = gelu(a[0], "tanh") * sigmoid(a[1]) - tanh(a[2]);
          return std::vector<Tensor>{gelu(h, "none") + rsqrt(abs(h) + 1e-3) * 0.5};
        },
        args);
  }
}

TEST(GpuFusedCuda, MixedDtypesAndCasts) {
  SKIP_WITHOUT_GPU();
  manual_seed(2);
  const Device gpu(kCUDA, 0);
  const std::vector<Tensor> args = {randn({32, 128}).to(kBFloat16).to(gpu),
                                    randn({32, 128}).to(gpu), randint(-4, 5, {32, 128}).to(gpu)};
  check_program(
      "bf16 * f32, exp, casts",
      [](const std::vector<Tensor>& a) {
        const Tensor s = (a[0] * a[1]).exp();             // f32
        const Tensor r = (s.to(kBFloat16) + a[0]).neg();  // bf16
        return std::vector<Tensor>{r, (a[2] * 3 + 1).to(kFloat) / a[1], relu(a[2])};
      },
      args);
  check_program(
      "f16 and int64 to double",
      [](const std::vector<Tensor>& a) {
        const Tensor h = a[1].to(kHalf) * 1.7;
        return std::vector<Tensor>{(h.to(kDouble) + a[2]).sqrt(), pow(h, 2.0) - pow(h, 3.0)};
      },
      args);
}

TEST(GpuFusedCuda, StridedAndTransposedInputs) {
  SKIP_WITHOUT_GPU();
  manual_seed(3);
  const Device gpu(kCUDA, 0);
  const Tensor x = randn({96, 48}).to(gpu), y = randn({48, 96}).to(gpu);
  const Tensor z = randn({48, 192}).to(gpu).narrow(1, 5, 96);  // rows 192 apart
  check_program("x.t() * y + z",
                [](const std::vector<Tensor>& a) {
                  return std::vector<Tensor>{exp(a[0] * a[1] + a[2]) - 1.0};
                },
                {x.t(), y, z});
  check_program(
      "expanded operand",
      [](const std::vector<Tensor>& a) { return std::vector<Tensor>{log(abs(a[0]) + 1.0) * a[1]}; },
      {y, randn({1, 96}).to(gpu).expand({48, 96})});
}

// Transposed inputs run the tiled entry (FusedKernel::tiled), eager's bits: tiles cut by the
// domain's edges (odd sizes, fewer than 32 rows or columns), a batch dim, a transposed argument
// and a transpose inside the program, other operands contiguous, strided along the rows or
// broadcast, 16-bit and 32-bit, an output of another dtype. Even sizes run it in packs
// (FusedKernel::tiled_pack: of 4 16-bit elements where the sizes allow, else 2), but where an
// operand's packs are misaligned (z, one element into its buffer).
TEST(GpuFusedCuda, TransposedInputsRunTiled) {
  SKIP_WITHOUT_GPU();
  namespace I = compiler::internal;
  manual_seed(4);
  const Device gpu(kCUDA, 0);
  // Both widths of tiles in packs, then the launch's choice.
  for (I::TileWidth width : {I::TileWidth::kFull, I::TileWidth::kHalf, I::TileWidth::kAuto}) {
    I::set_tile_width_for_testing(width);
    for (ScalarType dt : {kBFloat16, kFloat, kHalf}) {
      for (const Shape& s : {Shape{333, 1000}, Shape{31, 65}, Shape{64, 7}, Shape{130, 200},
                             Shape{2, 64}, Shape{256, 96}}) {
        const bool even = s[0] % 2 == 0 && s[1] % 2 == 0;
        const int64_t rows = s[0], cols = s[1];
        const Tensor x = randn({cols, rows}).to(dt).to(gpu);
        const Tensor y = randn({rows, cols}).to(dt).to(gpu);
        const Tensor z = randn({rows, 2 * cols}).to(dt).to(gpu).narrow(1, 1, cols);
        const Tensor bias = randn({cols}).to(dt).to(gpu);
        const std::string what = "x.t() + y " + std::string(dtype_name(dt)) + shape_str(s) +
                                 " width " + std::to_string(static_cast<int>(width));
        compiler::reset_fused_cuda_stats();
        check_program(what,
                      [](const std::vector<Tensor>& a) {
                        return std::vector<Tensor>{((a[0] + a[1]) * 0.5).to(kFloat)};
                      },
                      {x.t(), y});
        EXPECT_EQ(compiler::fused_cuda_stats().tiled_pack_launches, even ? 2 : 0) << what;
        check_program(what + ", z strided, bias",
                      [](const std::vector<Tensor>& a) {
                        return std::vector<Tensor>{silu(a[0].t() * a[1] + a[2]) - a[3]};
                      },
                      {x, y, z, bias});
        EXPECT_GE(compiler::fused_cuda_stats().tiled_launches, 4) << what;
        EXPECT_EQ(compiler::fused_cuda_stats().tiled_pack_launches, even ? 2 : 0) << what;
        if (width != I::TileWidth::kAuto) {
          EXPECT_EQ(compiler::fused_cuda_stats().tiled_half_launches,
                    even && width == I::TileWidth::kHalf ? 2 : 0)
              << what;
        }
      }
    }
  }
  // A batch dim: transpose(1, 2) of [3, 70, 40] (and of [5, 136, 264], several tiles a matrix),
  // in both widths.
  for (I::TileWidth width : {I::TileWidth::kFull, I::TileWidth::kHalf}) {
    I::set_tile_width_for_testing(width);
    for (const Shape& s : {Shape{3, 70, 40}, Shape{5, 136, 264}}) {
      const Tensor b = randn(s).to(kBFloat16).to(gpu);
      const std::string what =
          "batched transpose" + shape_str(s) + " width " + std::to_string(static_cast<int>(width));
      compiler::reset_fused_cuda_stats();
      check_program(what,
                    [](const std::vector<Tensor>& a) {
                      return std::vector<Tensor>{exp(a[0].transpose(1, 2)) * a[1]};
                    },
                    {b, randn({s[2], s[1]}).to(kBFloat16).to(gpu)});
      EXPECT_GE(compiler::fused_cuda_stats().tiled_launches, 2) << what;
      EXPECT_GE(compiler::fused_cuda_stats().tiled_pack_launches, 2) << what;
      EXPECT_EQ(compiler::fused_cuda_stats().tiled_half_launches,
                width == I::TileWidth::kHalf ? compiler::fused_cuda_stats().tiled_pack_launches : 0)
          << what;
    }
  }
  I::set_tile_width_for_testing(I::TileWidth::kAuto);
}

TEST(GpuFusedCuda, VectorEntryTailAndMisalignedViews) {
  SKIP_WITHOUT_GPU();
  manual_seed(7);
  const Device gpu(kCUDA, 0);
  auto chain = [](const std::vector<Tensor>& a) {
    const Tensor x = a[0].to(kFloat);
    const Tensor s = x * sigmoid(x) * a[1].to(kFloat) + a[2];
    return std::vector<Tensor>{s.to(a[0].dtype()), s * 0.5};
  };
  // check_program on `args`, whose compiled runs launch `entry` and no other.
  using Count = int64_t compiler::FusedCudaStats::*;
  auto check_entry = [&](const std::string& what, Count entry, const std::vector<Tensor>& args) {
    compiler::reset_fused_cuda_stats();
    check_program(what, chain, args);
    const compiler::FusedCudaStats s = compiler::fused_cuda_stats();
    EXPECT_GE(s.*entry, 2) << what;  // two compiled runs
    EXPECT_EQ(s.strided_launches + s.dense_launches + s.vector_launches, s.*entry) << what;
  };
  const Count vector = &compiler::FusedCudaStats::vector_launches;
  const Count dense = &compiler::FusedCudaStats::dense_launches;
  for (ScalarType dt : {kBFloat16, kFloat, kHalf}) {
    const std::string name(dtype_name(dt));
    // 7 x 37 = 259 and 1000003 elements: whole packs, then a tail of numel % width.
    for (const Shape& shape : {Shape{7, 37}, Shape{1000003}}) {
      const int64_t n = numel_of(shape);
      const std::vector<Tensor> args = {randn(shape).to(dt).to(gpu), randn(shape).to(dt).to(gpu),
                                        randn(shape).to(gpu)};
      check_entry("vector entry and tail " + name + " " + shape_str(shape), vector, args);
      // The same program on views one element in: contiguous, not 16-byte aligned (the dense
      // entry), the first input's or the last's.
      const Tensor a = randn({n + 1}).to(dt).to(gpu).narrow(0, 1, n).view(shape);
      const Tensor c = randn({n + 1}).to(gpu).narrow(0, 1, n).view(shape);
      check_entry("misaligned first input " + name + " " + shape_str(shape), dense,
                  {a, args[1], args[2]});
      check_entry("misaligned f32 input " + name + " " + shape_str(shape), dense,
                  {args[0], args[1], c});
    }
  }
  // Fewer elements than one pack (4 f32: the dense entry), and bool and uint8 operands (16 per
  // pack).
  check_entry("3 elements", dense, {randn({3}).to(gpu), randn({3}).to(gpu), randn({3}).to(gpu)});
  const Tensor m = randn({3, 67}).to(gpu);
  compiler::reset_fused_cuda_stats();
  check_program(
      "bool and uint8",
      [](const std::vector<Tensor>& a) {
        const Tensor pos = a[0] > 0.25;
        return std::vector<Tensor>{logical_and(pos, a[1].to(kBool)), (a[1] + a[1]).to(kUInt8)};
      },
      {m, randint(0, 3, {3, 67}).to(kUInt8).to(gpu)});
  EXPECT_GE(compiler::fused_cuda_stats().vector_launches, 2);
}

TEST(GpuFusedCuda, ScalarsWhereAndComparisons) {
  SKIP_WITHOUT_GPU();
  manual_seed(4);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kFloat, kBFloat16}) {
    const std::vector<Tensor> args = {randn({16, 100}).to(dt).to(gpu),
                                      randn({16, 100}).to(dt).to(gpu), randn({}).to(dt).to(gpu)};
    check_program(
        std::string("where, clamp, comparisons ") + std::string(dtype_name(dt)),
        [](const std::vector<Tensor>& a) {
          const Tensor m = a[0] > a[1];
          const Tensor w = where(m, a[0] * 0.1, a[1] / 7.0);
          const Tensor c = clamp(w * a[2] + 0.3, -0.5, 0.75);
          return std::vector<Tensor>{c, logical_not(m) == (a[0] <= 0.2),
                                     maximum(c, a[1]) - 2 * a[0]};
        },
        args);
  }
}

TEST(GpuFusedCuda, IntermediateReadOutsideTheRegion) {
  SKIP_WITHOUT_GPU();
  manual_seed(5);
  const Device gpu(kCUDA, 0);
  const std::vector<Tensor> args = {randn({64, 64}).to(gpu), randn({64, 64}).to(gpu)};
  check_program(
      "a = x * y returned and reduced",
      [](const std::vector<Tensor>& a) {
        const Tensor p = a[0] * a[1];
        const Tensor q = sigmoid(p) * 3.0;
        // A sum over dim 0 is no row op: it stays outside and reads p (one over dim 1 would
        // join the region as a row kernel, equal to eager only within rounding).
        return std::vector<Tensor>{q + p, p, p.sum({0})};
      },
      args);
}

TEST(GpuFusedCuda, GradientsMatchEager) {
  SKIP_WITHOUT_GPU();
  manual_seed(6);
  const Device gpu(kCUDA, 0);
  auto fn = [](const Tensor& x, const Tensor& w) { return (silu(x * w) * 0.5 + x).sum(); };
  Tensor x = randn({32, 64}).to(gpu).requires_grad_(true);
  Tensor w = randn({64}).to(gpu).requires_grad_(true);
  auto f = compile(fn);
  const Tensor got = f(x, w);
  const auto g = autograd::grad({got}, {x, w});
  const Tensor want = fn(x, w);
  const auto ge = autograd::grad({want}, {x, w});
  expect_bitwise(got, want, "loss");
  expect_bitwise(g[0], ge[0], "grad x");
  expect_bitwise(g[1], ge[1], "grad w");
  if (::testing::Test::HasFailure()) {
    ADD_FAILURE() << listings(f.traces()) << generated_sources(f.traces());
  }
}

// --- On a GPU: row kernels, compiled == eager within the reductions' rounding ------------------

// Compiled and eager differ only in the order a reduction adds its terms. For a sum of n terms
// of one sign (softmax's, RMSNorm's mean of squares) either order is within (n - 1) u of the
// exact sum, so the two within 2 (n - 1) u relative; in practice a few u (both sum short serial
// runs, then trees). A 16-bit value rounded from such a sum flips by at most one ulp of its type
// (2^-8 bf16, 2^-11 f16), and the members after it (x / sum, x * rsqrt) keep that relative
// difference: rtol 2^-7 (bf16), 2^-9 (f16), 1e-5 (f32); atol = rtol * max |eager| for sums
// that cancel. amax and amin are exact.
void expect_close(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double rtol = want.dtype() == kBFloat16 ? 1.0 / 128
                      : want.dtype() == kHalf   ? 1.0 / 512
                      : want.dtype() == kDouble ? 1e-12
                                                : 1e-5;
  const Tensor a = got.to(kCPU).to(kDouble).contiguous(),
               b = want.to(kCPU).to(kDouble).contiguous();
  const double atol = rtol * b.abs().max().item<double>();
  const Tensor bad = (a - b).abs() > (b.abs() * rtol + atol);
  EXPECT_EQ(bad.sum().item<int64_t>(), 0)
      << what << ": compiled differs from eager beyond the reductions' rounding; max difference "
      << (a - b).abs().max().item<double>();
}

// Runs fn compiled and eagerly, expects a row kernel (a fused_cuda region with a reduction) and
// close values.
template <typename F>
void check_rows(const std::string& what, F fn, const std::vector<Tensor>& args) {
  const bool failed_before = ::testing::Test::HasFailure();
  compiler::reset_fused_cuda_stats();
  auto f = compile([&](const std::vector<Tensor>& a) { return fn(a); });
  const std::vector<Tensor> got = f(args);
  const std::vector<Tensor> want = fn(args);
  EXPECT_GE(compiler::fused_cuda_stats().row_regions, 1) << what << "\n" << listings(f.traces());
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) expect_close(got[i], want[i], what);
  if (!failed_before && ::testing::Test::HasFailure()) {
    ADD_FAILURE() << what << ": the program and its kernels\n"
                  << listings(f.traces()) << generated_sources(f.traces());
  }
  const std::vector<Tensor> again = f(args);  // the same kernel again: the same bits
  for (size_t i = 0; i < got.size(); ++i) expect_bitwise(again[i], got[i], what + ", again");
}

std::string named(const std::string& what, ScalarType dt, const Shape& s) {
  return what + " " + std::string(dtype_name(dt)) + shape_str(s);
}

// softmax, logsumexp and log_softmax of x's rows (check_rows).
void check_softmax_family(const Tensor& x) {
  const Shape s = to_shape(x.sizes());
  check_rows(named("softmax", x.dtype(), s), softmax_rows, {x});
  check_rows(named("logsumexp", x.dtype(), s), logsumexp_rows, {x});
  check_rows(named("log_softmax", x.dtype(), s), log_softmax_rows, {x});
}

// softmax of rows that start one element into a buffer of randn * scale: the dense entry, never
// the vector one.
void check_misaligned_softmax(ScalarType dt, const Shape& s, double scale) {
  const Tensor flat = (randn({numel_of(s) + 1}) * scale).to(dt).to(Device(kCUDA, 0));
  const Tensor shifted = flat.narrow(0, 1, numel_of(s)).view(s);
  check_rows(named("softmax, misaligned", dt, s), softmax_rows, {shifted});
  EXPECT_EQ(compiler::fused_cuda_stats().vector_launches, 0) << dtype_name(dt);
  EXPECT_GE(compiler::fused_cuda_stats().dense_launches, 1) << dtype_name(dt);
}

TEST(GpuFusedCuda, RowsSoftmaxWrittenWithOps) {
  SKIP_WITHOUT_GPU();
  manual_seed(11);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf, kDouble}) {
    for (const Shape& s : {Shape{64, 2048}, Shape{37, 1000}, Shape{3, 5, 7}}) {
      check_rows(named("softmax", dt, s), softmax_rows, {(randn(s) * 3.0).to(dt).to(gpu)});
    }
  }
}

// fn compiled (fused_cuda's stats reset first) and run on args, and fn run eagerly; with the
// compiled program's traces for the listings.
struct CompiledAndEager {
  std::vector<Tensor> got, want;
  std::vector<Trace> traces;
};
CompiledAndEager compiled_and_eager(
    const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
    const std::vector<Tensor>& args) {
  compiler::reset_fused_cuda_stats();
  auto f = compile(fn);
  std::vector<Tensor> got = f(args);
  return {std::move(got), fn(args), f.traces()};
}

// Two bf16 tensors of the same bits (any NaN equal to any NaN), the first differences reported.
void expect_same_bf16_bits(const Tensor& got, const Tensor& want, const std::string& what) {
  const Tensor g = got.to(Device(kCPU)).contiguous(), w = want.to(Device(kCPU)).contiguous();
  ASSERT_EQ(g.sizes(), w.sizes()) << what;
  const BFloat16* gp = g.data_ptr<BFloat16>();
  const BFloat16* wp = w.data_ptr<BFloat16>();
  int64_t differ = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    const bool nan = std::isnan(static_cast<float>(gp[i])) && std::isnan(static_cast<float>(wp[i]));
    if (gp[i].x != wp[i].x && !nan && differ++ < 4) {
      ADD_FAILURE() << what << " [" << i << "]: compiled 0x" << std::hex << gp[i].x << ", eager 0x"
                    << wp[i].x;
    }
  }
  EXPECT_EQ(differ, 0) << what;
}

// A bf16 division by a value of the row (softmax's by its sum) goes through the row's reciprocal
// (kdiv_row_bf16): the quotients' bits are eager's for every bf16 numerator, over divisors of
// every class (normal, either side of 2^-126 and 2^126, subnormal, zero, infinite, NaN), from
// registers (rows of 2048) and read again (rows of 65536); so are the rows' amax and amin (kpick).
TEST(GpuFusedCuda, RowsDivideByTheRowsValueAsEagerDoes) {
  SKIP_WITHOUT_GPU();
  manual_seed(17);
  const Device gpu(kCUDA, 0);
  std::vector<uint16_t> divisors = {0x3f80, 0xbf80, 0x4049, 0x4580, 0x3a83, 0x0080, 0x0081,
                                    0x007f, 0x0001, 0x8001, 0x7e80, 0x7e81, 0xfe81, 0x7f7f,
                                    0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x2f00};
  const Tensor more = randn({12}).to(kBFloat16).contiguous();
  for (int64_t i = 0; i < 12; ++i) divisors.push_back(more.data_ptr<BFloat16>()[i].x);
  const auto K = static_cast<int64_t>(divisors.size());
  std::vector<uint16_t> xs(static_cast<size_t>(K) * 0x10000), ds(divisors);
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = static_cast<uint16_t>(i);
  const Tensor x_all = from_blob(xs.data(), {K, 0x10000}, TensorOptions().dtype(kBFloat16)).clone();
  const Tensor d_all = from_blob(ds.data(), {K, 1}, TensorOptions().dtype(kBFloat16)).clone();
  const auto fn = [](const std::vector<Tensor>& a) {
    const Tensor q = a[0] / a[1];
    return std::vector<Tensor>{q, amax(q, {-1}, true), amin(q, {-1}, true)};
  };
  for (int64_t cols : {int64_t{0x10000}, int64_t{2048}}) {
    // Rows of 2048: each divisor's row of 65536 numerators cut into 32 rows.
    const int64_t rows = K * (0x10000 / cols);
    const Tensor x = x_all.view({rows, cols}).to(gpu);
    const Tensor d = d_all.expand({K, 0x10000 / cols}).reshape({rows, 1}).to(gpu);
    const auto [got, want, traces] = compiled_and_eager(fn, {x, d});
    const std::string what = "rows of " + std::to_string(cols);
    EXPECT_GE(compiler::fused_cuda_stats().row_regions, 1) << what << listings(traces);
    EXPECT_NE(generated_sources(traces).find("kbf(kdiv_row_bf16("), std::string::npos) << what;
    ASSERT_EQ(got.size(), 3u);
    for (size_t i = 0; i < 3; ++i)
      expect_same_bf16_bits(got[i], want[i], what + ", output " + std::to_string(i));
  }
}

// run_fused_kernel runs a generated kernel as the executor does: the compiled program's bits.
// The bf16 members computed in pairs (FusedCudaCodegen.RowBf16SumsInPairs) give eager's bits:
// every bf16 value minus each of a row's values (zeros, infinities, NaN, subnormals, the largest
// and random ones), every bf16 value plus another (a permutation of them), and the exp and the
// product of those (formulas on each half, rounded together), in rows of 65536 (read again by
// each pass), 16384 (the shared-memory cache) and 2048 (registers).
TEST(GpuFusedCuda, RowBf16SumsInPairsAsEagerDoes) {
  SKIP_WITHOUT_GPU();
  manual_seed(19);
  const Device gpu(kCUDA, 0);
  std::vector<uint16_t> ms = {0x3f80, 0xbf80, 0x4049, 0x0080, 0x8080, 0x007f, 0x0001, 0x8001,
                              0x7f7f, 0xff7f, 0x0000, 0x8000, 0x7f80, 0xff80, 0x7fc0, 0x3780};
  const Tensor more = randn({16}).to(kBFloat16).contiguous();
  for (int64_t i = 0; i < 16; ++i) ms.push_back(more.data_ptr<BFloat16>()[i].x);
  const auto K = static_cast<int64_t>(ms.size());
  std::vector<uint16_t> xs(static_cast<size_t>(K) * 0x10000), zs(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    xs[i] = static_cast<uint16_t>(i);
    zs[i] = static_cast<uint16_t>(i * 7 + (i >> 16) * 4099);  // 7 is odd: a permutation
  }
  const auto bf16s = [](std::vector<uint16_t>& v, Shape s) {
    return from_blob(v.data(), std::move(s), TensorOptions().dtype(kBFloat16)).clone();
  };
  const Tensor x_all = bf16s(xs, {K, 0x10000}), z_all = bf16s(zs, {K, 0x10000});
  const Tensor m_all = bf16s(ms, {K, 1});
  const auto fn = [](const std::vector<Tensor>& a) {
    const Tensor d = a[0] - a[1], s = a[0] + a[2];
    return std::vector<Tensor>{d, s, amax(d, {-1}, true), exp(d), d * s};
  };
  for (int64_t cols : {int64_t{0x10000}, int64_t{16384}, int64_t{2048}}) {
    const int64_t rows = K * (0x10000 / cols);
    const std::vector<Tensor> args = {x_all.view({rows, cols}).to(gpu),
                                      m_all.expand({K, 0x10000 / cols}).reshape({rows, 1}).to(gpu),
                                      z_all.view({rows, cols}).to(gpu)};
    const auto [got, want, traces] = compiled_and_eager(fn, args);
    const std::string what = "rows of " + std::to_string(cols);
    EXPECT_GE(compiler::fused_cuda_stats().row_regions, 1) << what << listings(traces);
    EXPECT_EQ(compiler::fused_cuda_stats().vector_launches, 1) << what;
    EXPECT_NE(generated_sources(traces).find("= kfma_bf16x2("), std::string::npos) << what;
    EXPECT_NE(generated_sources(traces).find("= kbf2("), std::string::npos) << what;
    ASSERT_EQ(got.size(), 5u);
    for (size_t i = 0; i < 5; ++i)
      expect_same_bf16_bits(got[i], want[i], what + ", output " + std::to_string(i));
  }
}

// kexp_bf16 (compiler/fused_cuda_prelude.cpp) rounds as eager's exp does, on every bf16 value:
// an elementwise exp; an exp that a row's sum reads in pairs (each row one value among -inf, so
// that its sum is that value's exp); and logsumexp over rows of all of them.
TEST(GpuFusedCuda, Bf16ExpRoundsAsEagersOnEveryValue) {
  SKIP_WITHOUT_GPU();
  const Device gpu(kCUDA, 0);
  std::vector<uint16_t> xs(0x10000), rows(size_t{0x10000} * 64, 0xff80);  // -inf
  for (size_t i = 0; i < xs.size(); ++i) xs[i] = rows[i * 64] = static_cast<uint16_t>(i);
  const auto bf16s = [&](std::vector<uint16_t>& v, Shape s) {
    return from_blob(v.data(), std::move(s), TensorOptions().dtype(kBFloat16)).clone().to(gpu);
  };
  const Tensor x = bf16s(xs, {32, 2048}), r = bf16s(rows, {0x10000, 64});
  using Program = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  const std::vector<std::tuple<std::string, Program, Tensor, std::string>> programs = {
      {"exp(x), exp(x) * x",
       [](const std::vector<Tensor>& a) {
         const Tensor e = exp(a[0]);
         return std::vector<Tensor>{e, e * a[0]};
       },
       x, "kbf(kexp_bf16(kf("},
      {"sum(exp(x)) of one value and -inf",
       [](const std::vector<Tensor>& a) { return std::vector<Tensor>{sum(exp(a[0]), {-1}, true)}; },
       r, "kbf2(kexp_bf16(kf("},
      {"logsumexp", logsumexp_rows, x, "kbf2(kexp_bf16(kf("},
  };
  for (const auto& [what, fn, arg, line] : programs) {
    const auto [got, want, traces] = compiled_and_eager(fn, {arg});
    EXPECT_NE(generated_sources(traces).find(line), std::string::npos) << what << listings(traces);
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i)
      expect_same_bf16_bits(got[i], want[i], what + ", output " + std::to_string(i));
  }
}

// amax and amin in the row kernels: a bf16 operand folded two elements an instruction
// (kpick_bf16x2), the partial results combined in the kernel's own order (kpick) and not eager's.
// The bits are eager's all the same, since amax and amin do not depend on the order
// (kernels/reduce_fn.h's pick): rows of zeros of both signs in either order, NaN first and last,
// infinities, subnormals, ties and random values, in rows read from shared memory, from registers
// and from global memory; f32 too, and eager on the GPU against the CPU's.
TEST(GpuFusedCuda, AmaxAminRowsMatchEagerBitwise) {
  SKIP_WITHOUT_GPU();
  manual_seed(23);
  const Device gpu(kCUDA, 0);
  // Each program compiled alone, so that each is one row kernel: the bf16 operand an input, a
  // member in pairs (x - m, one bf16x2 fma), and f32 (no fold). (A reduction of an argument
  // that nothing else in the program reads runs eagerly: each has an elementwise consumer.)
  using Program = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  const std::vector<std::pair<Program, std::vector<std::string>>> programs = {
      {[](const std::vector<Tensor>& a) {  // x - amax(x): a region, not an eager reduction
         const Tensor mx = amax(a[0], {-1}, true);
         return std::vector<Tensor>{mx, a[0] - mx};
       },
       {"= kpick_bf16x2<true>("}},
      {[](const std::vector<Tensor>& a) {
         const Tensor mn = amin(a[0], {-1}, true);
         return std::vector<Tensor>{mn, a[0] - mn};
       },
       {"= kpick_bf16x2<false>("}},
      {[](const std::vector<Tensor>& a) {
         return std::vector<Tensor>{amax(a[0] - a[1], {-1}, true)};
       },
       {"= kpick_bf16x2<true>(", ", yp"}},
      {[](const std::vector<Tensor>& a) {
         const Tensor f = a[0].to(kFloat);
         return std::vector<Tensor>{amax(f, {-1}, true), amin(f, {-1}, true)};
       },
       {}},
  };
  constexpr uint16_t kPos0 = 0x0000, kNeg0 = 0x8000, kNaN = 0x7fc0, kInf = 0x7f80, kNegInf = 0xff80;
  for (int64_t cols : {int64_t{32000}, int64_t{2048}, int64_t{24}}) {
    const int64_t rows = 12;
    Tensor x = (randn({rows, cols}) * 4.0).to(kBFloat16).contiguous();
    BFloat16* p = x.data_ptr<BFloat16>();
    auto row = [&](int64_t r, const std::function<uint16_t(int64_t c, uint16_t was)>& f) {
      for (int64_t c = 0; c < cols; ++c) p[r * cols + c].x = f(c, p[r * cols + c].x);
    };
    row(0, [](int64_t c, uint16_t) { return c % 2 == 0 ? kNeg0 : kPos0; });      // -0 first
    row(1, [&](int64_t c, uint16_t) { return c == cols - 1 ? kPos0 : kNeg0; });  // +0 last
    row(2, [](int64_t, uint16_t) { return kNeg0; });
    row(3, [&](int64_t c, uint16_t w) {  // negatives, -0 first and +0 in the middle
      return c == 0 ? kNeg0 : c == cols / 2 ? kPos0 : static_cast<uint16_t>(w | 0x8000);
    });
    row(4, [&](int64_t c, uint16_t w) { return c == cols - 1 ? kNaN : w; });
    row(5, [](int64_t c, uint16_t w) { return c == 0 ? kNaN : w; });
    row(6, [](int64_t, uint16_t) { return kNegInf; });
    row(7, [&](int64_t c, uint16_t w) { return c == cols / 3 ? kInf : w; });
    row(8, [](int64_t c, uint16_t) {  // subnormals of both signs among zeros of both signs
      const uint16_t v[4] = {0x8001, kNeg0, 0x0001, kPos0};
      return v[c % 4];
    });
    row(9, [](int64_t c, uint16_t) { return static_cast<uint16_t>(c % 3 == 0 ? 0x8001 : kNeg0); });
    row(10, [&](int64_t c, uint16_t w) { return c % 5 == 1 ? static_cast<uint16_t>(0x4300) : w; });
    // row 11: random values
    const Tensor m = zeros({rows, 1}).to(kBFloat16);
    const std::vector<Tensor> args = {x.to(gpu), m.to(gpu)};
    std::vector<Tensor> extrema;  // amax and amin of x, eager on the GPU
    for (size_t pi = 0; pi < programs.size(); ++pi) {
      const auto& [fn, folds] = programs[pi];
      const std::string what =
          "rows of " + std::to_string(cols) + ", program " + std::to_string(pi);
      const auto [got, want, traces] = compiled_and_eager(fn, args);
      const std::vector<Tensor> on_cpu = fn({x, m});
      EXPECT_EQ(compiler::fused_cuda_stats().row_regions, 1) << what << listings(traces);
      if (cols % 8 == 0) {
        EXPECT_EQ(compiler::fused_cuda_stats().vector_launches, 1) << what;
        const std::string source = generated_sources(traces);
        for (const std::string& fold : folds)
          EXPECT_NE(source.find(fold), std::string::npos) << what << ": " << fold << "\n" << source;
      }
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t i = 0; i < got.size(); ++i) {
        const std::string out = what + ", output " + std::to_string(i);
        expect_bitwise(got[i], want[i], out);  // NaN too: the device's canonical NaN
        // Eager on the GPU against the CPU: the same values (bf16, exactly) and zeros' signs.
        expect_same_bf16_bits(want[i].to(kBFloat16), on_cpu[i].to(kBFloat16),
                              out + ", eager on the GPU against the CPU");
      }
      if (pi < 2) extrema.push_back(want[0]);
    }
    // The zeros' signs (eager's, so the compiled kernel's): +0 above -0 in either order.
    const std::string what = "rows of " + std::to_string(cols);
    const Tensor mx = extrema[0].to(kCPU).to(kFloat).contiguous();
    const Tensor mn = extrema[1].to(kCPU).to(kFloat).contiguous();
    for (int r : {0, 1, 3}) EXPECT_FALSE(std::signbit(mx.data_ptr<float>()[r])) << what << r;
    for (int r : {2, 9}) EXPECT_TRUE(std::signbit(mx.data_ptr<float>()[r])) << what << r;
    for (int r : {0, 1, 2}) EXPECT_TRUE(std::signbit(mn.data_ptr<float>()[r])) << what << r;
  }
}

// A row kernel caching its rows in shared memory and reducing them only is planned at three blocks
// a multiprocessor (42 registers a thread); one whose registers spill so is built again at two
// (64): four reductions of x - max (NVRTC of CUDA 13 for sm_90: 40 bytes), where logsumexp does
// not spill. Rows written element by element (softmax, log_softmax) are planned at two. The bits
// are eager's either way.
TEST(GpuFusedCuda, SpillingRowKernelsBuildAtTwoBlocks) {
  SKIP_WITHOUT_GPU();
  manual_seed(24);
  const Tensor x = (randn({64, 32000}) * 3.0).to(kBFloat16).to(Device(kCUDA, 0));
  const auto four = [](const Tensor& a) {
    const Tensor z = a - amax(a, {-1}, true);
    return log(sum(exp(z), {-1}, true)) + sum(z * z, {-1}, true) + amin(z, {-1}, true) +
           sum(sigmoid(z), {-1}, true);
  };
  using Program = std::function<Tensor(const Tensor&)>;
  for (const auto& [name, fn, blocks, builds] :
       {std::tuple<std::string, Program, int, int64_t>{"four reductions", four, 3, 1},
        {"logsumexp", logsumexp_with_ops, 3, 0},
        {"log_softmax", log_softmax_with_ops, 2, 0},
        {"softmax", softmax_with_ops, 2, 0}}) {
    compiler::clear_fused_cuda_memory_cache();  // built again, from the disk cache or NVRTC
    compiler::reset_fused_cuda_stats();
    auto f = compile(fn);
    const Tensor got = f(x);
    EXPECT_EQ(compiler::fused_cuda_stats().row_regions, 1) << name;
    EXPECT_EQ(compiler::fused_cuda_stats().row_two_block_builds, builds) << name;
    const std::string bounds = "__launch_bounds__(512, " + std::to_string(blocks) + ")";
    EXPECT_NE(generated_sources(f.traces()).find(bounds), std::string::npos)
        << name << ": the generated source is planned at " << blocks << " blocks";
    expect_bitwise(got, fn(x), name);
  }
}

TEST(GpuFusedCuda, RunFusedKernelMatchesTheCompiledProgram) {
  SKIP_WITHOUT_GPU();
  manual_seed(18);
  const Tensor x = (randn({64, 2048}) * 3.0).to(kBFloat16).to(Device(kCUDA, 0));
  auto f = compile(softmax_with_ops);
  const Tensor want = f(x);
  const Trace t = traced_on_cuda(softmax_with_ops, x.to(kCPU));
  const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
  ASSERT_TRUE(k.has_value());
  const std::vector<Tensor> got = compiler::internal::run_fused_kernel(*k, {x});
  ASSERT_EQ(got.size(), 1u);
  expect_bitwise(got[0], want, "softmax bf16 64x2048");
  // A CPU input where the kernel reads a GPU tensor.
  EXPECT_KILN_ERROR(compiler::internal::run_fused_kernel(*k, {x.to(kCPU)}),
                    "[run_fused_kernel] input 0 is on cpu");
}

// CompileOptions::emulate_precision_casts(false): 16-bit programs computed in float and rounded
// where stored. Each output is within one rounding of the same program run eagerly in f32 (the
// float arithmetic differs from it only by FMA contraction and __expf, far below a bf16 or f16
// ulp), and row kernels within the sums' rounding.
TEST(GpuFusedCuda, UnemulatedCastsRoundOnceAtTheStore) {
  SKIP_WITHOUT_GPU();
  manual_seed(19);
  const Device gpu(kCUDA, 0);
  const auto relaxed = [](auto fn) {
    return compile([fn](const std::vector<Tensor>& a) { return fn(a); },
                   CompileOptions().emulate_precision_casts(false));
  };
  const auto in_f32 = [](const std::vector<Tensor>& a) {
    std::vector<Tensor> f;
    for (const Tensor& t : a) f.push_back(t.to(kFloat));
    return f;
  };
  // |got - want| <= ulp * |want| elementwise (want unrounded, f32): got is want's rounding,
  // give or take the float arithmetic's differences (2^-16 of the largest output, for the
  // outputs near zero where the chain's two terms cancel).
  const auto within_one_rounding = [](const Tensor& got, const Tensor& want, double ulp,
                                      const std::string& what) {
    const Tensor g = got.to(kDouble).to(kCPU), w = want.to(kDouble).to(kCPU);
    const double atol = w.abs().max().item<double>() * 0x1p-16;
    const int64_t bad = ((g - w).abs() > w.abs() * ulp + atol).sum().item<int64_t>();
    EXPECT_EQ(bad, 0) << what << ": max difference " << (g - w).abs().max().item<double>();
  };
  const auto chain = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{silu(a[0] * a[1] + a[0]) * 0.5 - exp(a[1])};
  };
  for (ScalarType dt : {kBFloat16, kHalf}) {
    const std::vector<Tensor> args = {randn({333, 1000}).to(dt).to(gpu),
                                      randn({333, 1000}).to(dt).to(gpu)};
    compiler::reset_fused_cuda_stats();
    auto f = relaxed(chain);
    const Tensor got = f(args)[0];
    EXPECT_EQ(compiler::fused_cuda_stats().regions, 1) << listings(f.traces());
    EXPECT_EQ(got.dtype(), dt);
    within_one_rounding(got, chain(in_f32(args))[0], dt == kBFloat16 ? 0x1p-8 : 0x1p-11,
                        named("chain", dt, {333, 1000}));
    // Not eager's per-op rounding: some elements differ from it.
    EXPECT_GT((got.to(kFloat) - chain(args)[0].to(kFloat)).abs().max().item<double>(), 0.0);
  }
  const auto softmax = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{softmax_with_ops(a[0])};
  };
  for (const Shape& s : {Shape{64, 2048}, Shape{4, 32000}}) {
    const std::vector<Tensor> x = {(randn(s) * 3.0).to(kBFloat16).to(gpu)};
    compiler::reset_fused_cuda_stats();
    auto f = relaxed(softmax);
    const Tensor got = f(x)[0];
    EXPECT_EQ(compiler::fused_cuda_stats().row_regions, 1) << listings(f.traces());
    expect_close(got, softmax(in_f32(x))[0].to(kBFloat16), named("softmax", kBFloat16, s));
  }
  const std::vector<Tensor> xw = {randn({64, 2048}).to(kBFloat16).to(gpu),
                                  randn({2048}).to(kBFloat16).to(gpu)};
  auto g = relaxed([](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{rms_norm_with_ops(a[0], a[1])};
  });
  const std::vector<Tensor> w32 = in_f32(xw);
  expect_close(g(xw)[0], rms_norm_with_ops(w32[0], w32[1]).to(kBFloat16), "rms_norm bf16");
}

TEST(GpuFusedCuda, RowsRmsNormWrittenWithOps) {
  SKIP_WITHOUT_GPU();
  manual_seed(12);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kBFloat16, kHalf, kFloat}) {
    for (const Shape& s : {Shape{64, 2048}, Shape{2, 9, 333}}) {
      check_rows(named("rms_norm", dt, s),
                 [](const std::vector<Tensor>& a) {
                   return std::vector<Tensor>{rms_norm_with_ops(a[0], a[1])};
                 },
                 {randn(s).to(dt).to(gpu), randn({s.back()}).to(dt).to(gpu)});
    }
  }
}

TEST(GpuFusedCuda, RowsLogsumexpAndRowSums) {
  SKIP_WITHOUT_GPU();
  manual_seed(13);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kFloat, kBFloat16, kHalf}) {
    check_rows(
        named("logsumexp", dt, {64, 1000}),
        [](const std::vector<Tensor>& a) { return std::vector<Tensor>{logsumexp_with_ops(a[0])}; },
        {randn({64, 1000}).to(dt).to(gpu)});
    // f32 rows of 32000: a block of 1024 threads a row, holding it in registers, that prefetches
    // the row %nsmid on (FusedCudaCodegen.RegisterRowsReducedOnlyPrefetchTheNextRow); more rows
    // than multiprocessors, so that the last ones have none to prefetch.
    if (dt == kFloat) {
      check_rows(named("logsumexp", dt, {300, 32000}),
                 [](const std::vector<Tensor>& a) {
                   return std::vector<Tensor>{logsumexp_with_ops(a[0])};
                 },
                 {randn({300, 32000}).to(dt).to(gpu)});
    }
    // Broadcasting producers; a sum without keepdim, a mean and an amin with it.
    check_rows(
        named("row sums", dt, {40, 77}),
        [](const std::vector<Tensor>& a) {
          const Tensor h = a[0] * a[1] + a[2];
          return std::vector<Tensor>{sum(h, {-1}), mean(h, {-1}, true) * 2.0, amin(h, {-1}, true)};
        },
        {randn({40, 77}).to(dt).to(gpu), randn({77}).to(dt).to(gpu),
         randn({40, 1}).to(dt).to(gpu)});
  }
}

TEST(GpuFusedCuda, RowsOfOddLengthOneElementAndAVocabulary) {
  SKIP_WITHOUT_GPU();
  manual_seed(14);
  const Device gpu(kCUDA, 0);
  for (ScalarType dt : {kFloat, kBFloat16}) {
    for (const Shape& s : {Shape{33, 7}, Shape{16, 2}, Shape{5, 1023}, Shape{4, 128256}}) {
      check_rows(named("softmax", dt, s), softmax_rows, {randn(s).to(dt).to(gpu)});
      check_rows(named("centered", dt, s),
                 [](const std::vector<Tensor>& a) {
                   const Tensor m = mean(a[0], {-1}, true);
                   return std::vector<Tensor>{a[0] - m, m + 1.0};  // per element, per row
                 },
                 {randn(s).to(dt).to(gpu)});
    }
  }
}

// GpuRandomProgram's programs that differed from eager (FusedCudaCodegen.RowKernelsWriteEvery
// OutputOfTheProgramsThatDifferedOnAGpu): rows of one element, 0-d GPU values and reductions of
// different extents next to row reductions, run as row kernels, compiled against eager, three
// times (the later runs replay CUDA graphs) with new arguments.
TEST(GpuFusedCuda, RowsOfOneElementAndZeroDimValuesMatchEager) {
  SKIP_WITHOUT_GPU();
  manual_seed(15);
  const Device gpu(kCUDA, 0);
  using Fn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
  auto check = [&](const std::string& what, const Fn& fn,
                   const std::function<std::vector<Tensor>()>& make_args, bool row_kernel = true) {
    const bool failed_before = ::testing::Test::HasFailure();
    compiler::reset_fused_cuda_stats();
    auto f = compile([&](const std::vector<Tensor>& a) { return fn(a); });
    for (int call = 0; call < 3; ++call) {
      const std::vector<Tensor> args = make_args();
      const std::vector<Tensor> got = f(args), want = fn(args);
      ASSERT_EQ(got.size(), want.size()) << what;
      for (size_t i = 0; i < got.size(); ++i) {
        expect_close(got[i], want[i], what + ", call " + std::to_string(call));
      }
    }
    if (row_kernel) {
      EXPECT_GE(compiler::fused_cuda_stats().row_regions, 1) << what << "\n"
                                                             << listings(f.traces());
    }
    if (!failed_before && ::testing::Test::HasFailure()) {
      ADD_FAILURE() << what << ": the program and its kernels\n"
                    << listings(f.traces()) << generated_sources(f.traces());
    }
  };
  check(
      "seed 20261414",
      [](const std::vector<Tensor>& a) {
        return std::vector<Tensor>{gt(sum(a[0], {1}, true), sum(a[0], {0, -1}, false))};
      },
      [&] {
        return std::vector<Tensor>{randn({1, 1}, kFloat64).to(gpu)};
      });
  check(
      "seed 20261652",
      [](const std::vector<Tensor>& a) {
        const Tensor v1 = sum(a[0], {0, 1}, false);
        const Tensor v3 = sum(a[0].permute({0, 1}), {-1}, true);
        return std::vector<Tensor>{where(a[1], v3, v1) * a[0], v3 + v1};
      },
      [&] {
        return std::vector<Tensor>{randn({4, 1}).to(gpu), (randn({}) > 0.0).to(gpu)};
      });
  check(
      "seed 20261806",
      [](const std::vector<Tensor>& a) {
        const Tensor v1 = a[0].select(1, 0);
        const Tensor v3 = index_select(a[0], 1, a[1]);
        return std::vector<Tensor>{sum(v3, {-1}, true) * a[0] + sum(v1, {0}, false), v3 * 2.0};
      },
      [&] {
        return std::vector<Tensor>{randn({3, 1}, kFloat64).to(gpu),
                                   randint(0, 1, {1}, kInt64).to(gpu)};
      });
  // The shrunk programs as they failed: a per-row output only, of rows of one element.
  check(
      "seed 20261414, the full sum first",
      [](const std::vector<Tensor>& a) {
        const Tensor v2 = sum(a[0], {0, -1}, false);
        return std::vector<Tensor>{gt(sum(a[0], {1}, true), v2), v2.lt(1.0)};
      },
      [&] {
        return std::vector<Tensor>{randn({1, 1}, kFloat64).to(gpu)};
      });
  check(
      "seed 20261652, a per-row output",
      [](const std::vector<Tensor>& a) {
        const Tensor v5 = sum(a[0], {0, 1}, false);
        const Tensor v7 = sum(a[0].permute({0, 1}), {-1}, true);
        return std::vector<Tensor>{where(a[1], abs(v5 * a[2]), v7).select(0, -2), v5};
      },
      [&] {
        return std::vector<Tensor>{randn({4, 1}).to(gpu), (randn({}) > 0.0).to(gpu),
                                   randn({}).to(gpu)};
      });
  check(
      "seed 20261806, a per-row output",
      [](const std::vector<Tensor>& a) {
        const Tensor v5 = a[0].select(1, 0).select(0, 1);
        const Tensor v12 = index_select(a[0], 1, a[1]).permute({0, 1});
        return std::vector<Tensor>{sum(v12 / v5, {-1}, true), v12};
      },
      [&] {
        return std::vector<Tensor>{randn({3, 1}, kFloat64).to(gpu),
                                   randint(0, 1, {1}, kInt64).to(gpu)};
      });
  // Reductions of different extents in one program: rows of 8 and rows of one element. The
  // fused region mixes the two extents, which the row planner declines (no row kernel on the
  // H100: session 19's fifth call): its ops run one by one, and must still equal eager.
  check(
      "rows of 8 and of 1",
      [](const std::vector<Tensor>& a) {
        const Tensor r8 = amax(a[0], {-1}, true), r1 = sum(a[1] * 2.0, {-1}, true);
        return std::vector<Tensor>{r8 + r1, a[0] - r8, r1 * a[1]};
      },
      [&] {
        return std::vector<Tensor>{randn({4, 8}).to(gpu), randn({4, 1}).to(gpu)};
      },
      /*row_kernel=*/false);
  check(
      "0-d GPU scale of row sums",
      [](const std::vector<Tensor>& a) {
        return std::vector<Tensor>{sum(a[0], {-1}, true) * a[1], mean(a[0] * a[1], {-1}, true)};
      },
      [&] {
        return std::vector<Tensor>{randn({8, 33}).to(gpu), randn({}).to(gpu)};
      });
  for (ScalarType dt : {kFloat, kBFloat16}) {
    check(named("softmax", dt, {16, 1}), softmax_rows, [&] {
      return std::vector<Tensor>{randn({16, 1}).to(dt).to(gpu)};
    });
    check(
        named("centered", dt, {16, 1}),
        [](const std::vector<Tensor>& a) {
          const Tensor m = mean(a[0], {-1}, true);
          return std::vector<Tensor>{a[0] - m, m + 1.0};
        },
        [&] {
          return std::vector<Tensor>{randn({16, 1}).to(dt).to(gpu)};
        });
  }
}

// The row kernels' forms (fused_cuda_rows.cpp): rows kept in registers with a member kept too
// (softmax's exp(x - max), log_softmax's x - max), rows of 32000 in 1024 threads (f32) or in
// shared memory (bf16, f16), rows re-read in chunks (128256), lengths that are not a multiple of
// the pack, rows and a weight one element past 16-byte alignment (the dense entry), in bf16, f16
// and f32.
TEST(GpuFusedCuda, RowsLongOddAndMisaligned) {
  SKIP_WITHOUT_GPU();
  manual_seed(17);
  const Device gpu(kCUDA, 0);
  auto rms = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{rms_norm_with_ops(a[0], a[1])};
  };
  for (ScalarType dt : {kBFloat16, kHalf, kFloat}) {
    for (const Shape& s :
         {Shape{3, 32000}, Shape{2, 128256}, Shape{6, 1001}, Shape{4, 2052}, Shape{5, 2048}}) {
      const Tensor x = (randn(s) * 4.0).to(dt).to(gpu);
      check_softmax_family(x);
      check_rows(named("rms_norm", dt, s), rms, {x, randn({s.back()}).to(dt).to(gpu)});
    }
    const int64_t rows = 7, cols = 2048;
    check_misaligned_softmax(dt, {rows, cols}, 1.0);
    // RMSNorm's weight read in packs by the vector entry; one element past alignment, by the
    // dense entry through its strides.
    const Tensor x = randn({rows, cols}).to(dt).to(gpu);
    const Tensor wbuf = randn({cols + 1}).to(dt).to(gpu);
    check_rows(named("rms_norm, aligned weight", dt, {rows, cols}), rms,
               {x, wbuf.narrow(0, 0, cols)});
    EXPECT_GE(compiler::fused_cuda_stats().vector_launches, 1) << dtype_name(dt);
    check_rows(named("rms_norm, misaligned weight", dt, {rows, cols}), rms,
               {x, wbuf.narrow(0, 1, cols)});
    EXPECT_EQ(compiler::fused_cuda_stats().vector_launches, 0) << dtype_name(dt);
    EXPECT_GE(compiler::fused_cuda_stats().dense_launches, 1) << dtype_name(dt);
  }
}

// Rows that take the shared-memory row cache (FusedCudaCodegen.RowsOfLongMultiPassRowsUseShared
// Memory): more than 48 KiB of it (the launch's opt-in), lengths that are not a multiple of the
// pack (the dense entry), a view one element past alignment, two inputs of the domain's shape,
// a row per block over more rows than blocks fit at once, in bf16, f16, f32 and f64.
TEST(GpuFusedCuda, RowsInSharedMemory) {
  SKIP_WITHOUT_GPU();
  manual_seed(23);
  const Device gpu(kCUDA, 0);
  auto softmax_of_product = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{softmax_with_ops(a[0] * a[1])};
  };
  struct Case {
    ScalarType dt;
    Shape s;
  };
  for (const Case& c :
       {Case{kBFloat16, {3, 32000}}, Case{kHalf, {5, 30001}}, Case{kBFloat16, {600, 32000}},
        Case{kFloat, {4, 16000}}, Case{kFloat, {3, 12345}}, Case{kDouble, {3, 8001}}}) {
    const Tensor x = (randn(c.s) * 4.0).to(c.dt).to(gpu);
    const Trace t = traced_on_cuda(softmax_with_ops, x.cpu());
    const auto k = compiler::internal::generate_fused_kernel(t, 0, t.ops.size(), nullptr);
    ASSERT_TRUE(k.has_value());
    EXPECT_GT(k->row_shared_bytes, 48 * 1024) << dtype_name(c.dt) << shape_str(c.s);
    check_softmax_family(x);
    check_misaligned_softmax(c.dt, c.s, 4.0);
  }
  auto scaled_softmax = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{softmax_with_ops(a[0]) * a[1]};
  };
  for (ScalarType dt : {kBFloat16, kFloat}) {
    const Shape s{3, 16384};
    check_rows(named("softmax of a product", dt, s), softmax_of_product,
               {randn(s).to(dt).to(gpu), (randn(s) * 2.0).to(dt).to(gpu)});
    // x in shared memory, z read once from global memory by the output's pass.
    check_rows(named("softmax times z", dt, s), scaled_softmax,
               {(randn(s) * 4.0).to(dt).to(gpu), randn(s).to(dt).to(gpu)});
  }
}

TEST(GpuFusedCuda, RowsOfNonContiguousInputsRunOpByOp) {
  SKIP_WITHOUT_GPU();
  manual_seed(15);
  const Device gpu(kCUDA, 0);
  const Tensor x = randn({256, 64}).to(gpu);
  auto fn = [](const Tensor& a) { return softmax_with_ops(a * 2.0); };
  auto f = compile(fn);
  compiler::reset_fused_cuda_stats();
  // The transposed view: its rows are strided, so the region runs its eager kernels (the same
  // bits as eager), counted as a row fallback.
  const Tensor t = x.t();
  expect_bitwise(f(t), fn(t), "transposed");
  EXPECT_GE(compiler::fused_cuda_stats().row_fallbacks, 1) << listings(f.traces());
  const Tensor c = x.t().contiguous();
  expect_close(f(c), fn(c), "contiguous");
}

TEST(GpuFusedCuda, RowVectorEntryForBroadcastRows) {
  SKIP_WITHOUT_GPU();
  manual_seed(16);
  const Device gpu(kCUDA, 0);
  auto chain = [](const std::vector<Tensor>& a) {
    return std::vector<Tensor>{a[0] + a[1] * a[2], (a[0].to(kFloat) * a[3]).to(a[0].dtype())};
  };
  for (ScalarType dt : {kBFloat16, kFloat, kHalf}) {
    const std::string name(dtype_name(dt));
    const std::vector<Tensor> args = {randn({33, 96}).to(dt).to(gpu),
                                      randn({33, 96}).to(dt).to(gpu), randn({96}).to(dt).to(gpu),
                                      randn({33, 1}).to(gpu)};
    compiler::reset_fused_cuda_stats();
    check_program("broadcast row and column " + name, chain, args);
    EXPECT_GE(compiler::fused_cuda_stats().rowvec_launches, 2) << name;
    // A view one element in (misaligned): the strided entry; a transposed one: the tiled
    // entry (TransposedInputsRunTiled); same bits.
    const Tensor shifted = randn({33 * 96 + 1}).to(dt).to(gpu).narrow(0, 1, 33 * 96).view({33, 96});
    const Tensor transposed = randn({96, 33}).to(dt).to(gpu).t();
    for (const Tensor& x : {shifted, transposed}) {
      compiler::reset_fused_cuda_stats();
      check_program("strided views " + name, chain, {x, args[1], args[2], args[3]});
      const compiler::FusedCudaStats st = compiler::fused_cuda_stats();
      EXPECT_EQ(st.rowvec_launches, 0) << name;
      EXPECT_GE(x.is_same(shifted) ? st.strided_launches : st.tiled_launches, 2) << name;
    }
  }
}

TEST(GpuFusedCuda, DiskCacheHitAndCorruptFileRebuilt) {
  SKIP_WITHOUT_GPU();
  const std::string dir = temp_dir("gpu_cache");
  compiler::set_kernel_cache_dir(dir);
  struct Restore {
    ~Restore() { compiler::set_kernel_cache_dir(""); }
  } restore;
  const Device gpu(kCUDA, 0);
  const Tensor x = randn({128, 33}).to(gpu), y = randn({128, 33}).to(gpu);
  auto fn = [](const Tensor& a, const Tensor& b) { return tanh(a * b + 0.25) * a; };
  const Tensor want = fn(x, y);
  compiler::clear_fused_cuda_memory_cache();
  compiler::reset_fused_cuda_stats();
  expect_bitwise(compile(fn)(x, y), want, "cold");
  compiler::FusedCudaStats s = compiler::fused_cuda_stats();
  EXPECT_GE(s.regions, 1);
  EXPECT_GE(s.nvrtc_compiles, 1);
  EXPECT_EQ(s.disk_writes, s.nvrtc_compiles);
  // Same program in a fresh callable: the in-memory cache.
  expect_bitwise(compile(fn)(x, y), want, "memory");
  EXPECT_GE(compiler::fused_cuda_stats().memory_hits, 1);
  // As a new process would: the disk cache, no NVRTC.
  compiler::clear_fused_cuda_memory_cache();
  const int64_t compiles = compiler::fused_cuda_stats().nvrtc_compiles;
  expect_bitwise(compile(fn)(x, y), want, "disk");
  s = compiler::fused_cuda_stats();
  EXPECT_GE(s.disk_hits, 1);
  EXPECT_EQ(s.nvrtc_compiles, compiles);
  // Corrupt every cache file: ignored, compiled again, rewritten.
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::fstream f(e.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char last = static_cast<char>(f.get());
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(last ^ 0x5a));
  }
  compiler::clear_fused_cuda_memory_cache();
  expect_bitwise(compile(fn)(x, y), want, "after corruption");
  s = compiler::fused_cuda_stats();
  EXPECT_GE(s.disk_rejected, 1);
  EXPECT_GT(s.nvrtc_compiles, compiles);
  compiler::clear_fused_cuda_memory_cache();
  const int64_t hits = s.disk_hits;
  expect_bitwise(compile(fn)(x, y), want, "rewritten");
  EXPECT_GT(compiler::fused_cuda_stats().disk_hits, hits);
  std::filesystem::remove_all(dir);
}

TEST(GpuFusedCuda, TraceDirHoldsTheGeneratedSource) {
  SKIP_WITHOUT_GPU();
  const std::string dir = temp_dir("trace_dir");
  const Device gpu(kCUDA, 0);
  auto f = compile([](const Tensor& a) { return exp(a) * 2.0 + 1.0; },
                   CompileOptions().trace_dir(dir).name("gen"));
  const Tensor x = randn({8, 8}).to(gpu);
  expect_bitwise(f(x), exp(x) * 2.0 + 1.0, "result");
  int sources = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.ends_with(".fusion0.cu")) {
      ++sources;
      std::ifstream in(e.path());
      const std::string text((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
      EXPECT_NE(text.find("kiln_fused_strided"), std::string::npos) << text;
    }
  }
  EXPECT_EQ(sources, 1);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
