// The fold_index_add pass (compiler/passes.h): `add(g, index_add(zeros, idx, src))` becomes
// `index_add(g, idx, src)` on CUDA values. On the CPU (traced on proxies of CUDA tensors): the
// pattern folds in either order of the add's inputs, and what it must keep is kept (CPU values,
// the zero table handed out, the rows read twice, g made after the index_add, alpha other than
// one, a fill other than zero); the rows go into g in place when nothing else reads g's memory.
// An index_add that no add folds adds its rows in place where its table dies (also through
// in-place ops), on any device. On a GPU: a tied table's gradient compiled equals eager.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "compiler/compile.h"
#include "compiler/passes.h"
#include "compiler/tracer.h"
#include "kernels/cuda.h"
#include "kiln.h"
#include "trace_test_util.h"

namespace kiln {
namespace {

using compiler::Trace;
using test::count_ops;

using Body = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;

Trace folded(const Body& fn, const std::vector<Tensor>& args) {
  NoGradGuard no_grad;
  return compiler::fold_index_add(compiler::trace_callable(fn, args).trace);
}

// g [6, 4], idx [5] (int64), src [5, 4], as proxies (no memory) on `device`.
std::vector<Tensor> proxies(const Device& device) {
  return {compiler::proxy_of({{6, 4}, kFloat, device}), compiler::proxy_of({{5}, kInt64, device}),
          compiler::proxy_of({{5, 4}, kFloat, device})};
}

Tensor zero_table(const Tensor& like) { return empty_like(like).fill_(0.0); }

TEST(FoldIndexAdd, FoldsTheZeroTableOnCudaValues) {
  const std::vector<Tensor> cuda = proxies(Device(kCUDA, 0));
  // Either order of the add's inputs; g an argument.
  for (int order = 0; order < 2; ++order) {
    const Trace t = folded(
        [&](const std::vector<Tensor>& in) {
          const Tensor rows = zero_table(in[0]).index_add(0, in[1], in[2], 0.5);
          return std::vector<Tensor>{order == 0 ? in[0] + rows : rows + in[0]};
        },
        cuda);
    EXPECT_EQ(count_ops(t, "add"), 0) << t.str();
    EXPECT_EQ(count_ops(t, "fill_"), 0) << t.str();
    EXPECT_EQ(count_ops(t, "empty"), 0) << t.str();
    ASSERT_EQ(count_ops(t, "index_add"), 1) << t.str();
    for (const auto& op : t.ops) {
      if (op.name() == "index_add") {
        EXPECT_EQ(op.inputs[0], t.arguments[0]) << t.str();
      }
    }
    // An argument is the caller's: the rows go into a copy of it.
    EXPECT_EQ(count_ops(t, "index_add_"), 0) << t.str();
  }
  // g made before the index_add by an op and read by nothing else: the rows go into g itself,
  // also through views of it.
  const std::vector<std::pair<std::string, std::function<Tensor(const Tensor&)>>> made{
      {"exp", [](const Tensor& x) { return x.exp(); }},
      {"a view of exp", [](const Tensor& x) {
         return x.exp().reshape({4, 6}).view({6, 4});
       }}};
  for (const auto& [what, make] : made) {
    const Trace t = folded(
        [&](const std::vector<Tensor>& in) {
          const Tensor g = make(in[0]);  // before the index_add
          return std::vector<Tensor>{g + zero_table(in[0]).index_add(0, in[1], in[2])};
        },
        cuda);
    EXPECT_EQ(count_ops(t, "add"), 0) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "index_add"), 0) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "index_add_"), 1) << what << "\n" << t.str();
  }
}

TEST(FoldIndexAdd, CopiesGWhenAnythingElseReadsItsMemory) {
  const std::vector<Tensor> cuda = proxies(Device(kCUDA, 0));
  auto copies = [&](const Body& fn, const std::string& what) {
    const Trace t = folded(fn, cuda);
    EXPECT_EQ(count_ops(t, "add"), 0) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "index_add"), 1) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "index_add_"), 0) << what << "\n" << t.str();
  };
  auto rows = [](const std::vector<Tensor>& in) {
    return zero_table(in[0]).index_add(0, in[1], in[2]);
  };
  copies(
      [&](const std::vector<Tensor>& in) {
        const Tensor g = in[0].exp();
        return std::vector<Tensor>{g + rows(in), g.sum()};
      },
      "g read again");
  copies(
      [&](const std::vector<Tensor>& in) {
        const Tensor g = in[0].exp();
        return std::vector<Tensor>{g + rows(in), g};
      },
      "g handed out");
  copies(
      [&](const std::vector<Tensor>& in) {
        const Tensor base = in[0].exp().reshape({4, 6});
        const Tensor g = base.view({6, 4});
        return std::vector<Tensor>{g + rows(in), base.sum()};
      },
      "the tensor g views read again");
  copies(
      [&](const std::vector<Tensor>& in) {
        const Tensor base = in[0].exp().reshape({4, 6});
        const Tensor g = base.view({6, 4});
        return std::vector<Tensor>{g + rows(in), base};
      },
      "the tensor g views handed out");
  copies(
      [&](const std::vector<Tensor>& in) {
        // A transposed product: the sum is dense row-major, g is not.
        const Tensor g = in[0].exp().t().matmul(ones({6, 6}, in[0].options())).t();
        return std::vector<Tensor>{g + rows(in)};
      },
      "g's layout not the sum's");
}

TEST(FoldIndexAdd, KeepsWhatItMustKeep) {
  auto kept = [](const Body& fn, const std::vector<Tensor>& args, const std::string& what) {
    const Trace t = folded(fn, args);
    EXPECT_EQ(count_ops(t, "add"), 1) << what << "\n" << t.str();
    EXPECT_EQ(count_ops(t, "fill_"), 1) << what << "\n" << t.str();
  };
  const std::vector<Tensor> cuda = proxies(Device(kCUDA, 0));
  manual_seed(3);
  const std::vector<Tensor> cpu{randn({6, 4}), tensor(std::vector<int64_t>{0, 5, 2, 0, 1}),
                                randn({5, 4})};
  const Body plain = [](const std::vector<Tensor>& in) {
    return std::vector<Tensor>{in[0] + zero_table(in[0]).index_add(0, in[1], in[2])};
  };
  kept(plain, cpu, "CPU values (compiled CPU code keeps eager's bits)");
  kept(
      [](const std::vector<Tensor>& in) {
        const Tensor z = zero_table(in[0]);
        return std::vector<Tensor>{in[0] + z.index_add(0, in[1], in[2]), z};
      },
      cuda, "the zero table handed out");
  kept(
      [](const std::vector<Tensor>& in) {
        const Tensor rows = zero_table(in[0]).index_add(0, in[1], in[2]);
        return std::vector<Tensor>{in[0] + rows, rows.exp()};
      },
      cuda, "the rows read twice");
  kept(
      [](const std::vector<Tensor>& in) {
        const Tensor rows = zero_table(in[0]).index_add(0, in[1], in[2]);
        return std::vector<Tensor>{in[0].exp() + rows};
      },
      cuda, "g made after the index_add");
  kept(
      [](const std::vector<Tensor>& in) {
        return std::vector<Tensor>{in[0].add(zero_table(in[0]).index_add(0, in[1], in[2]), 2.0)};
      },
      cuda, "alpha 2");
  kept(
      [](const std::vector<Tensor>& in) {
        const Tensor z = empty_like(in[0]).fill_(1.0);
        return std::vector<Tensor>{in[0] + z.index_add(0, in[1], in[2])};
      },
      cuda, "a table of ones");
}

// An index_add that no add folds: the rows go into its table in place where nothing else reads
// the table's memory, on any device, also through in-place ops (compiled DDP: the table's gradient
// all-reduced in place and waited for, then the ranks' rows added). Otherwise into a copy.
TEST(FoldIndexAdd, AddsIntoATableThatDiesThere) {
  // Each case: what it is, the program, and whether the rows go into the table in place.
  const std::vector<std::tuple<std::string, Body, int>> cases{
      {"g made by exp, then written in place",
       [](const std::vector<Tensor>& a) {
         Tensor g = a[0].exp();
         g.mul_(2.0);  // in place: g's memory is still the exp's
         return std::vector<Tensor>{g.index_add(0, a[1], a[2], 0.5)};
       },
       1},
      {"a view of exp",
       [](const std::vector<Tensor>& a) {
         return std::vector<Tensor>{a[0].exp().t().t().index_add(0, a[1], a[2])};
       },
       1},
      {"g an argument",
       [](const std::vector<Tensor>& a) {
         return std::vector<Tensor>{a[0].index_add(0, a[1], a[2])};
       },
       0},
      {"g read again",
       [](const std::vector<Tensor>& a) {
         Tensor g = a[0].exp();
         g.mul_(2.0);
         return std::vector<Tensor>{g.index_add(0, a[1], a[2]), g.sum()};
       },
       0},
      {"the memory read before the in-place op",
       [](const std::vector<Tensor>& a) {
         Tensor g = a[0].exp();
         const Tensor before = g.sum();  // the exp read before the in-place op
         g.mul_(2.0);
         return std::vector<Tensor>{g.index_add(0, a[1], a[2]), before};
       },
       0},
      {"g handed out",
       [](const std::vector<Tensor>& a) {
         Tensor g = a[0].exp();
         g.mul_(2.0);
         return std::vector<Tensor>{g.index_add(0, a[1], a[2]), g};
       },
       0},
      {"g's layout not the result's",
       [](const std::vector<Tensor>& a) {
         // A transposed table: the result is dense row-major, the table is not.
         const Tensor g = a[0].exp().t().matmul(ones({6, 6}, a[0].options())).t();
         return std::vector<Tensor>{g.index_add(0, a[1], a[2])};
       },
       0},
  };
  for (const Device& device : {Device(kCPU), Device(kCUDA, 0)}) {
    const std::vector<Tensor> in = proxies(device);
    const std::string on = device.is_cuda() ? " (CUDA)" : " (CPU)";
    for (const auto& [what, fn, in_place] : cases) {
      const Trace t = folded(fn, in);
      EXPECT_EQ(count_ops(t, "index_add") + count_ops(t, "index_add_"), 1) << what << on << "\n"
                                                                           << t.str();
      EXPECT_EQ(count_ops(t, "index_add_"), in_place) << what << on << "\n" << t.str();
    }
  }
  // Compiled on the CPU, the rows added in place: eager's values, call after call.
  manual_seed(5);
  const Tensor x = randn({6, 4}), src = randn({5, 4});
  const Tensor idx = tensor(std::vector<int64_t>{0, 5, 2, 0, 1});
  auto fn = [](const Tensor& a, const Tensor& i, const Tensor& rows) {
    Tensor g = a.exp();
    g.mul_(2.0);
    return g.index_add(0, i, rows, 0.5);
  };
  const Tensor want = fn(x, idx, src);
  auto f = compile(fn);
  for (int call = 0; call < 2; ++call) EXPECT_TRUE(equal(f(x, idx, src), want)) << call;
  const Trace& t = test::stage(f.traces(), "fold_index_add");
  EXPECT_EQ(count_ops(t, "index_add_"), 1) << t.str();
}

// A tied table's gradient on a GPU: the head's product and the lookup's rows, compiled (folded)
// against eager, in f32 (to rounding) and bf16 (eager rounds the rows' sum once more), with a
// matmul head (the head's gradient a view: the product's transpose transposed back) and with
// linear_cross_entropy (the models' head). Either way the rows go into the head's gradient in
// place.
TEST(GpuFoldIndexAdd, TiedTableGradientMatchesEager) {
  if (!cuda::is_available()) GTEST_SKIP() << "needs a GPU";
  const Device gpu(kCUDA, 0);
  for (const bool fused_head : {false, true}) {
    for (ScalarType dt : {kFloat, kBFloat16}) {
      SCOPED_TRACE(std::string(fused_head ? "linear_cross_entropy " : "matmul ") +
                   std::string(dtype_name(dt)));
      manual_seed(12);
      Tensor table = (randn({50, 16}) * 0.3).to(dt).to(gpu).requires_grad_();
      const Tensor idx = randint(0, 50, {4, 9}, kInt64).to(gpu);
      const Tensor targets = randint(0, 50, {36}, kInt64).to(gpu);
      const Tensor w = randn({16, 16}).to(dt).to(gpu);
      auto fn = [&](const Tensor& ids) {
        const Tensor h = embedding(table, ids).matmul(w).tanh();
        Tensor loss = fused_head ? linear_cross_entropy(h.reshape({36, 16}), table, targets)
                                 : h.matmul(table.t()).to(kFloat).square().mean();
        loss.backward();
        Tensor g = table.grad();
        table.mutable_grad() = Tensor();
        return std::vector<Tensor>{loss.detach(), g};
      };
      const std::vector<Tensor> want = fn(idx);
      auto f = compile([&](const Tensor& ids) { return fn(ids); });
      for (int call = 0; call < 3; ++call) {
        const std::vector<Tensor> got = f(idx);
        const double tol = dt == kFloat ? 1e-5 : 2e-2;
        EXPECT_TRUE(allclose(got[0].cpu(), want[0].cpu(), tol, tol));
        EXPECT_TRUE(allclose(got[1].to(kFloat).cpu(), want[1].to(kFloat).cpu(), tol, tol))
            << "call " << call;
      }
      // The lookup's rows go into the head's gradient itself, not into a zero-filled table nor
      // into a copy. No add of two tables is left.
      const Trace& t = test::stage(f.traces(), "fold_index_add");
      ASSERT_EQ(count_ops(t, "index_add_"), 1) << t.str();
      EXPECT_EQ(count_ops(t, "index_add"), 0) << t.str();
      for (const auto& op : t.ops) {
        if (op.name() != "index_add_") continue;
        for (const auto& maker : t.ops) {
          for (int v : maker.outputs) {
            if (v == op.inputs[0]) {
              EXPECT_EQ(maker.name(), fused_head ? "linear_cross_entropy" : "permute") << t.str();
            }
          }
        }
        for (const auto& reader : t.ops) {
          for (int v : reader.inputs) {
            if (v == op.outputs[0]) {
              EXPECT_NE(reader.name(), "add") << t.str();
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace kiln
