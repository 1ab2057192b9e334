// PackedSequence and pack_padded_sequence / pad_packed_sequence / pad_sequence / pack_sequence
// (nn/utils/rnn.h): the layout against one written by hand, the round trip in both batch orders,
// gradients through packing; and RNN / LSTM / GRU forward_with_packed_input against running each
// sequence on its own, unpadded (outputs, h_n, c_n, initial states in the caller's order).
#include <gtest/gtest.h>
#include <kiln/kiln.h>

#include <tuple>
#include <vector>

#include "autograd/grad_test_util.h"
#include "kernels/cuda.h"
#include "test_util.h"

namespace kiln {
namespace {

namespace rnn = nn::utils::rnn;
using gradtest::check_grad;
using gradtest::variable_list;

std::vector<int64_t> ints(const Tensor& t) { return t.to_vector<int64_t>(); }

TEST(PackedSequenceTest, LayoutAndRoundTrip) {
  manual_seed(1);
  const Tensor x = randn({5, 3, 2});  // [T, B, *], lengths 5, 3, 2
  const rnn::PackedSequence p = rnn::pack_padded_sequence(x, tensor({5, 3, 2}, kInt64));
  EXPECT_EQ(ints(p.batch_sizes()), (std::vector<int64_t>{3, 3, 2, 1, 1}));
  EXPECT_FALSE(p.sorted_indices().defined());
  // Step by step, the running sequences in batch order.
  const Tensor want =
      cat({x[0], x[1], x[2].narrow(0, 0, 2), x[3].narrow(0, 0, 1), x[4].narrow(0, 0, 1)});
  EXPECT_TRUE(equal(p.data(), want));
  auto [padded, lengths] = rnn::pad_packed_sequence(p, /*batch_first=*/false, -1.0, 6);
  EXPECT_EQ(padded.sizes(), Shape({6, 3, 2}));
  EXPECT_EQ(ints(lengths), (std::vector<int64_t>{5, 3, 2}));
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t len = std::vector<int64_t>{5, 3, 2}[b];
    EXPECT_TRUE(equal(padded.select(1, b).narrow(0, 0, len), x.select(1, b).narrow(0, 0, len)));
    EXPECT_TRUE(equal(padded.select(1, b).narrow(0, len, 6 - len), full({6 - len, 2}, -1.0)));
  }
}

TEST(PackedSequenceTest, UnsortedBatchesAndBatchFirst) {
  manual_seed(2);
  const Tensor x = randn({3, 4, 2});  // [B, T, *] with lengths 2, 4, 3
  const std::vector<int64_t> lens{2, 4, 3};
  const rnn::PackedSequence p = rnn::pack_padded_sequence(x, lens, /*batch_first=*/true, false);
  EXPECT_EQ(ints(p.sorted_indices()), (std::vector<int64_t>{1, 2, 0}));
  EXPECT_EQ(ints(p.unsorted_indices()), (std::vector<int64_t>{2, 0, 1}));
  EXPECT_EQ(ints(p.batch_sizes()), (std::vector<int64_t>{3, 3, 2, 1}));
  EXPECT_TRUE(equal(p.data().narrow(0, 0, 3), stack({x[1][0], x[2][0], x[0][0]})));
  auto [padded, lengths] = rnn::pad_packed_sequence(p, /*batch_first=*/true);
  EXPECT_EQ(ints(lengths), lens);
  EXPECT_EQ(padded.sizes(), Shape({3, 4, 2}));
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_TRUE(equal(padded[b].narrow(0, 0, lens[b]), x[b].narrow(0, 0, lens[b])));
    EXPECT_TRUE(equal(padded[b].narrow(0, lens[b], 4 - lens[b]), zeros({4 - lens[b], 2})));
  }
  // pad_sequence / pack_sequence from the unpadded pieces.
  const std::vector<Tensor> seqs{x[0].narrow(0, 0, 2), x[1], x[2].narrow(0, 0, 3)};
  EXPECT_TRUE(equal(rnn::pad_sequence(seqs, /*batch_first=*/true), padded));
  EXPECT_EQ(rnn::pad_sequence(seqs, false, 7.0).sizes(), Shape({4, 3, 2}));
  EXPECT_EQ(rnn::pad_sequence(seqs, false, 7.0)[3][0][1].item<float>(), 7.0f);
  const rnn::PackedSequence q = rnn::pack_sequence(seqs, /*enforce_sorted=*/false);
  EXPECT_TRUE(equal(q.data(), p.data()));
  EXPECT_TRUE(equal(q.batch_sizes(), p.batch_sizes()));
}

TEST(PackedSequenceTest, GradientsFlowThroughPacking) {
  manual_seed(3);
  EXPECT_TRUE(check_grad({"index_select"},
                         [](const variable_list& in) {
                           const auto p = rnn::pack_padded_sequence(in[0], {2, 3, 1}, false, false);
                           return std::get<0>(rnn::pad_packed_sequence(p, false, 0.0, 4)) * 3.0;
                         },
                         {gradtest::leaf({3, 3, 2})}));
}

// Each sequence alone (unbatched, unpadded) through the same layer: the reference for packing.
template <typename Run>
void check_against_single_sequences(const Tensor& x, const std::vector<int64_t>& lens,
                                    const rnn::PackedSequence& out_packed, const Tensor& h_n,
                                    const Tensor& c_n, Run run_one) {
  auto [out, out_lens] = rnn::pad_packed_sequence(out_packed);
  EXPECT_EQ(ints(out_lens), lens);
  for (size_t b = 0; b < lens.size(); ++b) {
    SCOPED_TRACE("sequence " + std::to_string(b));
    auto [o, h, c] = run_one(static_cast<int64_t>(b), x.select(1, b).narrow(0, 0, lens[b]));
    EXPECT_TRUE(allclose(out.select(1, b).narrow(0, 0, lens[b]), o, 1e-5, 1e-6));
    EXPECT_TRUE(allclose(h_n.select(1, b), h, 1e-5, 1e-6));
    if (c.defined()) {
      EXPECT_TRUE(allclose(c_n.select(1, b), c, 1e-5, 1e-6));
    }
  }
}

TEST(PackedSequenceTest, LayersRunEachSequenceOverItsOwnSteps) {
  manual_seed(4);
  const std::vector<int64_t> lens{3, 6, 1, 4};
  const Tensor x = randn({6, 4, 3});
  const auto packed = rnn::pack_padded_sequence(x, lens, false, /*enforce_sorted=*/false);
  {
    nn::LSTM lstm(nn::LSTMOptions(3, 5).num_layers(2).bidirectional(true));
    const Tensor h0 = randn({4, 4, 5}), c0 = randn({4, 4, 5});
    auto [out, hc] = lstm->forward_with_packed_input(packed, std::make_tuple(h0, c0));
    check_against_single_sequences(
        x, lens, out, std::get<0>(hc), std::get<1>(hc), [&](int64_t b, const Tensor& xb) {
          auto [o, s] = lstm(xb, std::make_tuple(h0.select(1, b), c0.select(1, b)));
          return std::make_tuple(o, std::get<0>(s), std::get<1>(s));
        });
  }
  {
    nn::LSTM lstm(nn::LSTMOptions(3, 5).proj_size(2).batch_first(true));  // batch_first: unused
    auto [out, hc] = lstm->forward_with_packed_input(packed);
    check_against_single_sequences(x, lens, out, std::get<0>(hc), std::get<1>(hc),
                                   [&](int64_t, const Tensor& xb) {
                                     auto [o, s] = lstm(xb);
                                     return std::make_tuple(o, std::get<0>(s), std::get<1>(s));
                                   });
  }
  {
    nn::GRU gru(nn::GRUOptions(3, 5).bidirectional(true));
    const Tensor h0 = randn({2, 4, 5});
    auto [out, h] = gru->forward_with_packed_input(packed, h0);
    check_against_single_sequences(x, lens, out, h, Tensor(), [&](int64_t b, const Tensor& xb) {
      auto [o, hb] = gru(xb, h0.select(1, b));
      return std::make_tuple(o, hb, Tensor());
    });
  }
  {
    nn::RNN rnn_layer(nn::RNNOptions(3, 5).num_layers(2).nonlinearity(kiln::kReLU));
    auto [out, h] = rnn_layer->forward_with_packed_input(packed);
    check_against_single_sequences(x, lens, out, h, Tensor(), [&](int64_t, const Tensor& xb) {
      auto [o, hb] = rnn_layer(xb);
      return std::make_tuple(o, hb, Tensor());
    });
  }
}

TEST(PackedSequenceTest, LayerGradcheck) {
  manual_seed(5);
  nn::LSTM lstm(nn::LSTMOptions(2, 3).bidirectional(true));
  lstm->to(kDouble);
  variable_list inputs{gradtest::leaf({4, 3, 2})};
  for (const Tensor& p : lstm->parameters()) inputs.push_back(p);
  EXPECT_TRUE(check_grad(
      {"lstm_cell_fused", "where"},
      [&](const variable_list& in) {
        const auto p = rnn::pack_padded_sequence(in[0], {2, 4, 1}, false, false);
        auto [out, hc] = lstm->forward_with_packed_input(p);
        return cat({out.data().flatten(), std::get<0>(hc).flatten(), std::get<1>(hc).flatten()});
      },
      inputs));
}

// A packed LSTM on the GPU (skips without one) gives the CPU's outputs and states.
TEST(GpuPackedSequence, CudaMatchesCpu) {
  if (!cuda::is_available()) GTEST_SKIP() << "no CUDA device: " << cuda::unavailable_reason();
  manual_seed(6);
  const Tensor x = randn({5, 3, 2});
  const std::vector<int64_t> lens{2, 5, 3};
  nn::LSTM lstm(nn::LSTMOptions(2, 4).bidirectional(true));
  auto gpu = std::dynamic_pointer_cast<nn::LSTMImpl>(lstm->clone(Device(kCUDA)));
  ASSERT_NE(gpu, nullptr);
  auto [out, hc] =
      lstm->forward_with_packed_input(rnn::pack_padded_sequence(x, lens, false, false));
  auto [out_gpu, hc_gpu] =
      gpu->forward_with_packed_input(rnn::pack_padded_sequence(x.cuda(), lens, false, false));
  EXPECT_TRUE(out_gpu.is_cuda());
  EXPECT_TRUE(allclose(out_gpu.data().cpu(), out.data(), 1e-5, 1e-6));
  EXPECT_TRUE(allclose(std::get<0>(hc_gpu).cpu(), std::get<0>(hc), 1e-5, 1e-6));
  EXPECT_TRUE(allclose(std::get<1>(hc_gpu).cpu(), std::get<1>(hc), 1e-5, 1e-6));
}

TEST(PackedSequenceTest, Misuse) {
  const Tensor x = randn({4, 3, 2});
  EXPECT_KILN_ERROR(rnn::pack_padded_sequence(x, {2, 4, 1}),
                    "[pack_padded_sequence] lengths [2, 4, 1] must be sorted in decreasing order");
  EXPECT_KILN_ERROR(rnn::pack_padded_sequence(x, {4, 0, 0}, false, false),
                    "lengths [4, 0, 0] must lie within [1, 4]");
  EXPECT_KILN_ERROR(rnn::pack_padded_sequence(x, {5, 1, 1}), "must lie within [1, 4]");
  EXPECT_KILN_ERROR(rnn::pack_padded_sequence(x, {4, 1}), "2 lengths for a batch of 3");
  EXPECT_KILN_ERROR(rnn::pack_padded_sequence(x, tensor({4.0f, 2.0f, 1.0f})),
                    "lengths must be an int64 CPU tensor, got float32");
  const auto p = rnn::pack_padded_sequence(x, {4, 2, 1});
  EXPECT_KILN_ERROR(
      rnn::pad_packed_sequence(p, false, 0.0, 3),
      "[pad_packed_sequence] total_length 3 is shorter than the longest sequence (4)");
  EXPECT_KILN_ERROR(rnn::pad_sequence({randn({2, 3}), randn({2, 4})}),
                    "[pad_sequence] sequence 1 has shape [2, 4], sequence 0 has [2, 3]");
  nn::GRU gru(2, 3);
  EXPECT_KILN_ERROR(gru->forward_with_packed_input(p, randn({1, 2, 3})),
                    "[GRU] expected hx of shape [1, 3, 3]");
}

}  // namespace
}  // namespace kiln
