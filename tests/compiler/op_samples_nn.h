// Sample calls of the registry's indexing, sorting, random, factory, fused and optimizer ops for
// tests/compiler/registry_test.cpp (op_samples.h says what a sample is and holds the others).
#pragma once

#include "dist/collective_ops.h"
#include "op_samples.h"

namespace kiln::compiler_test {

// Indexing, joining and sorting.
inline std::vector<OpSample> index_samples() {
  using namespace samples;
  namespace I = indexing;
  auto two = [](std::tuple<Tensor, Tensor> t) { return Tensors{std::get<0>(t), std::get<1>(t)}; };
  return {
      one(
          "index",
          [](const Tensors& x) {
            return x[0].index({I::Slice(), x[1]});
          },
          [] {
            return Tensors{nc(4, 3), ints(3, {2, 5})};
          }),
      one(
          "index_put_",
          [](const Tensors& x) {
            Tensor y = x[0].clone();
            y.index_put_({x[1]}, x[2]);
            return y;
          },
          [] {
            return Tensors{f32({4, 3}), randperm(4).narrow(0, 0, 2), f32({3})};
          }),
      one(
          "index_select", [](const Tensors& x) { return x[0].index_select(0, x[1]); },
          [] {
            return Tensors{nc(4, 3), ints(4, {5})};
          }),
      one(
          "gather", [](const Tensors& x) { return x[0].gather(1, x[1]); },
          [] {
            return Tensors{nc(4, 3), ints(3, {4, 2})};
          }),
      one(
          "scatter", [](const Tensors& x) { return x[0].scatter(1, x[1], x[2]); },
          [] {
            return Tensors{nc(4, 3), distinct_cols(4, 3, 2), f32({4, 2})};
          }),
      one(
          "scatter_", [](const Tensors& x) { return x[0].clone().scatter_(1, x[1], x[2]); },
          [] {
            return Tensors{f32({4, 3}), distinct_cols(4, 3, 2), f32({4, 2})};
          }),
      one(
          "scatter_value", [](const Tensors& x) { return x[0].scatter(1, x[1], 2.5); },
          [] {
            return Tensors{nc(4, 3), distinct_cols(4, 3, 2)};
          }),
      one(
          "scatter_value_", [](const Tensors& x) { return x[0].clone().scatter_(1, x[1], -1.0); },
          [] {
            return Tensors{f32({4, 3}), distinct_cols(4, 3, 2)};
          }),
      one(
          "scatter_add", [](const Tensors& x) { return x[0].scatter_add(0, x[1], x[2]); },
          [] {
            return Tensors{nc(4, 3), ints(4, {5, 3}), f32({5, 3})};
          }),
      one(
          "scatter_add_", [](const Tensors& x) { return x[0].clone().scatter_add_(1, x[1], x[2]); },
          [] {
            return Tensors{f32({4, 3}), ints(3, {4, 5}), f32({4, 5})};
          }),
      one(
          "index_add", [](const Tensors& x) { return x[0].index_add(0, x[1], x[2], 0.5); },
          [] {
            return Tensors{nc(4, 3), ints(4, {5}), f32({5, 3})};
          }),
      one(
          "index_add_", [](const Tensors& x) { return x[0].clone().index_add_(1, x[1], x[2]); },
          [] {
            return Tensors{f32({4, 3}), ints(3, {2}), nc(4, 2)};
          }),
      one(
          "masked_fill", [](const Tensors& x) { return x[0].masked_fill(x[1], 0.5); },
          [] {
            return Tensors{nc(4, 3), mask({3})};
          }),
      one(
          "masked_fill_", [](const Tensors& x) { return x[0].clone().masked_fill_(x[1], -2.0); },
          [] {
            return Tensors{f32({4, 3}), mask({4, 1})};
          }),
      one(
          "embedding", [](const Tensors& x) { return embedding(x[0], x[1]); },
          [] {
            return Tensors{f32({6, 4}), ints(6, {2, 3})};
          }),
      one(
          "triu", [](const Tensors& x) { return x[0].triu(1); }, [] { return Tensors{nc(4, 4)}; }),
      one(
          "tril", [](const Tensors& x) { return x[0].tril(-1); },
          [] {
            return Tensors{f32({2, 4, 3})};
          }),
      one(
          "cat",
          [](const Tensors& x) {
            return cat({x[0], x[1], x[2]}, 1);
          },
          [] {
            return Tensors{nc(4, 3), f32({4, 1}), f32({4, 2})};
          }),
      one(
          "stack",
          [](const Tensors& x) {
            return stack({x[0], x[1]}, 0);
          },
          [] {
            return Tensors{nc(4, 3), f32({4, 3})};
          }),
      {"sort", [two](const Tensors& x) { return two(x[0].sort(1, true)); },
       [] { return Tensors{nc(4, 5)}; }},
      {"topk", [two](const Tensors& x) { return two(x[0].topk(2, 0)); },
       [] { return Tensors{nc(4, 3)}; }},
      one(
          "one_hot", [](const Tensors& x) { return one_hot(x[0], 5); },
          [] {
            return Tensors{ints(5, {2, 3})};
          }),
  };
}

// Random ops (every run starts from one manual_seed) and factories.
inline std::vector<OpSample> random_samples() {
  using namespace samples;
  auto random = [](OpSample s) {
    s.random = true;
    return s;
  };
  auto fill = [random](std::string name, std::function<void(Tensor&)> draw) {
    return random(one(
        std::move(name),
        [draw](const Tensors& x) {
          Tensor y = x[0].clone();
          draw(y);
          return y * x[0];
        },
        [] {
          return Tensors{f32({4, 3})};
        }));
  };
  return {
      fill("uniform_", [](Tensor& y) { y.uniform_(-1.0, 1.0); }),
      fill("normal_", [](Tensor& y) { y.normal_(0.5, 2.0); }),
      fill("bernoulli_", [](Tensor& y) { y.bernoulli_(0.3); }),
      random(one(
          "random_",
          [](const Tensors& x) {
            return randint(-3, 9, {4, 3}) + x[0];
          },
          [] { return Tensors{ints(2, {3})}; })),
      random(one(
          "rand_like", [](const Tensors& x) { return rand_like(x[0]) + randn_like(x[0]); },
          [] { return Tensors{nc(4, 3)}; }, false)),
      random(one(
          "dropout", [](const Tensors& x) { return dropout(x[0], 0.5, true); },
          [] {
            return Tensors{f32({4, 8})};
          })),
      random({"multinomial",
              [](const Tensors& x) {
                return Tensors{x[0].multinomial(3), x[0].multinomial(6, true)};
              },
              [] {
                return Tensors{pos({2, 5})};
              }}),
      random(one(
          "randperm", [](const Tensors& x) { return randperm(7) + x[0]; },
          [] { return Tensors{ints(2, {1})}; })),
      one(
          "arange", [](const Tensors& x) { return arange(0.0, 3.0, 0.5) * x[0]; },
          [] { return Tensors{f32({6})}; }),
      one(
          "eye", [](const Tensors& x) { return eye(3, 4) + x[0]; },
          [] { return Tensors{f32({4})}; }),
  };
}

// The fused ops (forward and, through their backward rules, their fused backward ops).
inline std::vector<OpSample> fused_samples() {
  using namespace samples;
  namespace F = nn::functional;
  auto two = [](std::tuple<Tensor, Tensor> t) { return Tensors{std::get<0>(t), std::get<1>(t)}; };
  auto rope = [] {
    auto [cos, sin] = F::rope_cache(4, 8);
    return Tensors{cos, sin};
  };
  return {
      one(
          "rms_norm", [](const Tensors& x) { return rms_norm(x[0], x[1], 1e-6); },
          [] {
            return Tensors{f32({2, 3, 8}), pos({8})};
          }),
      one(
          "rms_norm_no_weight",
          [](const Tensors& x) {
            return F::rms_norm(x[0], {3, 8});
          },
          // Without a weight no kernel takes it: the decomposition runs.
          [] {
            return Tensors{f32({2, 3, 8})};
          }),
      one(
          "layer_norm", [](const Tensors& x) { return layer_norm(x[0], x[1], x[2], 1e-5); },
          [] {
            return Tensors{nc(4, 8), pos({8}), f32({8})};
          }),
      one(
          "rotary_emb", [](const Tensors& x) { return rotary_emb(x[0], x[1], x[2]); },
          [rope] {
            Tensors in = rope();
            in.insert(in.begin(), f32({1, 4, 2, 8}).transpose(1, 2));  // [B, H, T, D], strided
            return in;
          }),
      {"rotary_emb_qk",
       [two](const Tensors& x) { return two(rotary_emb_qk(x[0], x[1], x[2], x[3])); },
       [rope] {
         Tensors in = rope();
         in.insert(in.begin(), {f32({1, 2, 4, 8}), f32({1, 1, 4, 8})});
         return in;
       }},
      {"split_qkv_rotary",
       [](const Tensors& x) {
         auto [q, k, v] = split_qkv_rotary(x[0], x[1], x[2], 2, 1);
         return Tensors{q, k, v};
       },
       [rope] {
         Tensors in = rope();
         in.insert(in.begin(), f32({1, 4, 4 * 8}));  // [B, T, (H + 2G) D], H = 2, G = 1
         return in;
       }},
      one(
          "merge_qkv_rotary",
          [](const Tensors& x) { return merge_qkv_rotary(x[0], x[1], x[2], x[3], x[4]); },
          [rope] {
            Tensors in = rope();
            in.insert(in.begin(), {f32({1, 2, 4, 8}), f32({1, 1, 4, 8}), f32({1, 1, 4, 8})});
            return in;
          }),
      // An attention block over one qkv projection, its backward by hand: the fuse_qkv_rotary
      // pass's rotary_qkv_ and flash_attention_backward_qkv (flash_attention_backward has no
      // derivative, hence no gradients).
      {"qkv_attention_fused",
       [](const Tensors& x) {
         static const OpDef& bwd = KILN_OP(flash_attention_backward);
         auto [q, k, v] = split_qkv_rotary(x[0].matmul(x[1]), x[2], x[3], 2, 1);
         auto [o, lse] = flash_attention(q, k, v, 0.3, true);
         const TensorVec d =
             call_op(bwd, {x[4], q, k, v, o, lse, Tensor()}, {0.3, true, int64_t{0}, 0.0});
         return Tensors{o, merge_qkv_rotary(d[0], d[1], d[2], x[2], x[3])};
       },
       [rope] {
         Tensors in = rope();
         in.insert(in.begin(), {f32({1, 4, 6}), f32({6, 4 * 8})});  // x, w: qkv [1, 4, 32]
         in.push_back(f32({1, 2, 4, 8}));                           // dout
         return in;
       },
       /*grad=*/false},
      one(
          "swiglu", [](const Tensors& x) { return swiglu(x[0], x[1]); },
          [] {
            return Tensors{nc(4, 6), f32({4, 6})};
          }),
      one(
          "geglu_tanh", [](const Tensors& x) { return geglu_tanh(x[0], x[1]); },
          [] {
            return Tensors{f32({2, 1, 6}), f32({2, 1, 6})};
          }),
      // The recurrent cells (tensor/ops/rnn.cpp): gates as a strided view; a whole LSTM/GRU step.
      {"lstm_cell_fused", [two](const Tensors& x) { return two(lstm_cell_fused(x[0].t(), x[1])); },
       [] {
         return Tensors{f32({12, 2}), f32({2, 3})};
       }},
      one(
          "gru_cell_fused", [](const Tensors& x) { return gru_cell_fused(x[0], x[1], x[2]); },
          [] {
            return Tensors{f32({2, 9}), nc(2, 9), f32({2, 3})};
          }),
      {"split_with_sizes_copy",
       [](const Tensors& x) {
         const std::vector<Tensor> parts = split_with_sizes_copy(x[0], {1, 2}, 1);
         return Tensors(parts.begin(), parts.end());
       },
       [] { return Tensors{nc(4, 3)}; }},
      {"unbind_copy",
       [](const Tensors& x) {
         const std::vector<Tensor> parts = unbind_copy(x[0], 1);
         return Tensors(parts.begin(), parts.end());
       },
       [] { return Tensors{nc(4, 3)}; }},
      {"lstm_step",
       [two](const Tensors& x) { return two(lstm_cell_fused(addmm(x[0], x[1], x[2].t()), x[3])); },
       [] {
         return Tensors{f32({2, 8}), f32({2, 2}), f32({8, 2}), f32({2, 2})};
       }},
      one(
          "cross_entropy_fused", [](const Tensors& x) { return cross_entropy_fused(x[0], x[1]); },
          [] {
            return Tensors{f32({5, 7}), ints(7, {5})};
          }),
      // Ignored targets.
      one(
          "cross_entropy_ignore_index",
          [](const Tensors& x) {
            return cross_entropy_fused(x[0], where(x[1].eq(0), full({5}, -100, kInt64), x[1]));
          },
          [] {
            return Tensors{f32({5, 7}), ints(7, {5})};
          }),
      // The LM head and its loss in one op (chunked; the gradients come from the forward).
      one(
          "linear_cross_entropy",
          [](const Tensors& x) {
            return linear_cross_entropy(x[0], x[1],
                                        where(x[2].eq(0), full({6}, -100, kInt64), x[2]));
          },
          [] {
            return Tensors{f32({6, 4}), f32({7, 4}), ints(7, {6})};
          }),
      // The loss and its gradient in one call (linear_cross_entropy's chunks on a GPU). No
      // gradients: the op returns its own.
      {"cross_entropy_fused_with_grad",
       [](const Tensors& x) {
         const auto [loss, lse, dlogits] = cross_entropy_fused_with_grad(
             x[0], where(x[1].eq(0), full({5}, -100, kInt64), x[1]), x[2]);
         return Tensors{loss, lse, dlogits};
       },
       [] {
         return Tensors{f32({5, 7}), ints(7, {5}), full({}, 0.5, kFloat)};
       },
       false},
      // A class weight, smoothing and the sum: no kernel takes it, the decomposition runs.
      one(
          "cross_entropy_weighted",
          [](const Tensors& x) {
            return cross_entropy_fused(x[0], where(x[1].eq(0), full({5}, -100, kInt64), x[1]), x[2],
                                       -100, "sum", 0.1);
          },
          [] {
            return Tensors{f32({5, 7}), ints(7, {5}), pos({7})};
          }),
      // f64 for the CPU's reference kernel; grouped-query heads and a causal mask.
      {"flash_attention",
       [two](const Tensors& x) { return two(flash_attention(x[0], x[1], x[2], 0.3, true)); },
       [] {
         return Tensors{f64({1, 2, 4, 8}), f64({1, 1, 5, 8}), f64({1, 1, 5, 8})};
       }},
      // out alone: lse's gradient is absent, so the traced backward's dlse is undefined (`_`).
      one(
          "flash_attention_out_only",
          [](const Tensors& x) { return std::get<0>(flash_attention(x[0], x[1], x[2], 0.4)); },
          [] {
            return Tensors{f64({1, 2, 4, 8}), f64({1, 2, 5, 8}), f64({1, 2, 5, 8})};
          }),
      // f32: runs the decomposition; a bool mask.
      one(
          "scaled_dot_product_attention",
          [](const Tensors& x) { return F::scaled_dot_product_attention(x[0], x[1], x[2], x[3]); },
          [] {
            return Tensors{f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), f32({1, 2, 4, 8}), mask({4, 4})};
          }),
  };
}

// The optimizer updates, called as optim::Adam / SGD's step() calls them, on clones of the
// parameters and state (registry_test.cpp runs the optimizers themselves too).
inline std::vector<OpSample> optim_samples() {
  using namespace samples;
  auto state = [] {
    // param, grad, exp_avg (momentum buffer), exp_avg_sq, step count, lr, max_exp_avg_sq
    return Tensors{f32({4, 3}), f32({4, 3}),         f32({4, 3}),
                   pos({4, 3}), full({}, 2, kInt64), full({}, 0.01, kDouble),
                   pos({4, 3})};
  };
  return {
      {"adam_update_",
       [](const Tensors& x) {
         NoGradGuard no_grad;
         // vmax from its own input: two clones of one tensor would be merged by CSE
         // (DISABLED_CseMergesClonesWrittenInPlace).
         Tensor p = x[0].clone(), m = x[2].clone(), v = x[3].clone(), vmax = x[6].clone();
         Tensor step = x[4].clone();
         increment_({step});
         adam_update_({p}, {x[1]}, {m}, {v}, {vmax}, {step}, x[5], 0.9, 0.999, 0.01, 1e-8, true,
                      true);
         return Tensors{p, m, v, vmax, step};
       },
       state, false},
      {"sgd_update_",
       [](const Tensors& x) {
         NoGradGuard no_grad;
         Tensor p = x[0].clone(), q = x[1].clone(), buf = x[2].clone(), fresh = zeros({4, 3});
         sgd_update_({p, q}, {x[1], x[3]}, {buf, fresh}, {0, 1}, x[5], 0.9, 0.0, 0.01, true);
         return Tensors{p, q, buf, fresh};
       },
       state, false},
  };
}

// A process group of one rank, in this process: the collectives are the identity (the tensor
// variants of all-gather and reduce-scatter copy their input into their output).
class SoloGroup final : public dist::ProcessGroup {
 public:
  SoloGroup() : ProcessGroup(0, 1) {}
  std::string backend_name() const override { return "solo"; }
  std::shared_ptr<dist::Work> all_reduce(Tensor&, dist::ReduceOp) override { return done(); }
  std::shared_ptr<dist::Work> broadcast(Tensor&, int) override { return done(); }
  std::shared_ptr<dist::Work> all_gather_into_tensor(Tensor& out, const Tensor& in) override {
    out.copy_(in);
    return done();
  }
  std::shared_ptr<dist::Work> all_gather(std::vector<Tensor>&, const Tensor&) override {
    return done();
  }
  std::shared_ptr<dist::Work> reduce_scatter_tensor(Tensor& out, const Tensor& in,
                                                    dist::ReduceOp) override {
    out.copy_(in);
    return done();
  }
  std::shared_ptr<dist::Work> reduce_scatter(Tensor&, const std::vector<Tensor>&,
                                             dist::ReduceOp) override {
    return done();
  }
  std::shared_ptr<dist::Work> barrier() override { return done(); }
  std::shared_ptr<dist::Work> send(const Tensor&, int, int) override { return done(); }
  std::shared_ptr<dist::Work> recv(Tensor&, int, int) override { return done(); }

 private:
  static std::shared_ptr<dist::Work> done() {
    auto w = std::make_shared<dist::Work>("solo");
    w->finish();
    return w;
  }
};

// The collectives as ops (dist/collective_ops.h), on a group of one rank: recorded, replayed.
inline std::vector<OpSample> dist_samples() {
  using namespace samples;
  static const auto group = std::make_shared<SoloGroup>();
  auto input = [] { return Tensors{f32({4, 3})}; };
  std::vector<OpSample> out;
  out.push_back(one(
      "dist_all_reduce_broadcast_wait",
      [](const Tensors& x) {
        Tensor y = x[0] * 2.0;
        dist::all_reduce_op(group, y, dist::ReduceOp::kAvg)->wait();
        dist::all_reduce_op(group, y, dist::ReduceOp::kSum, /*beside_compute=*/true)->wait();
        dist::broadcast_op(group, y, 0)->wait();
        return y + 1.0;
      },
      input, /*grad=*/false));
  out.push_back(one(
      "dist_all_gather_reduce_scatter_wait",  // FSDP's (dist/fsdp.cpp)
      [](const Tensors& x) {
        Tensor y = (x[0] * 2.0).reshape({12});
        Tensor gathered = zeros({12});
        dist::all_gather_op(group, gathered, y)->wait();
        Tensor reduced = zeros({12});
        dist::reduce_scatter_op(group, reduced, gathered, dist::ReduceOp::kAvg)->wait();
        return reduced.view({4, 3}) + 1.0;
      },
      input, /*grad=*/false));
  out.push_back(one(
      "dist_coalesced_gather_reduce_scatter_wait",  // FSDP's at more than one rank
      [](const Tensors& x) {
        Tensor y = (x[0] * 2.0).reshape({12});
        Tensor gathered = zeros({14});
        dist::all_gather_coalesced_op(group, gathered, y, {{0, 5, 9}, {5, 7, 0}})->wait();
        Tensor reduced = zeros({12});
        std::vector<Tensor> grads{gathered.narrow(0, 0, 7) * 3.0, gathered.narrow(0, 9, 5) - 1.0};
        dist::reduce_scatter_coalesced_op(group, reduced, grads, {5, 0}, dist::ReduceOp::kAvg)
            ->wait();
        return reduced.view({4, 3}) + 1.0;
      },
      input, /*grad=*/false));
  return out;
}

inline std::vector<OpSample> all_samples() {
  std::vector<OpSample> all;
  for (auto family : {elementwise_samples, reduction_samples, view_samples, index_samples,
                      random_samples, fused_samples, optim_samples, dist_samples}) {
    for (OpSample& s : family()) all.push_back(std::move(s));
  }
  return all;
}

}  // namespace kiln::compiler_test
