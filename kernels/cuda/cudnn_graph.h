// kiln::cuda::cudnn::internal: the operation graphs of cuDNN's fused attention, written over the
// plain backend descriptors, and their execution plans (kernels/cuda/cudnn_graph.cpp). Running
// them, and choosing between them and the hand kernels, is kernels/cuda/cudnn_attention.cpp's.
//
// The graphs are the operation patterns cuDNN's fused-attention engines recognise (the ones
// NVIDIA's cudnn-frontend emits for SDPA):
//
//   forward:  S = Q @ K^T (f32) -> * scale -> [causal: select(row >= col, S, -inf)]
//             -> M = max_j -> E = exp(S - M) -> Z = sum_j E -> Stats = M + log Z
//             -> P = E / Z (io dtype) -> O = P @ V
//   backward: Dsum = rowsum(dO * O) computed by cuDNN (cuDNN's usual graph: calls without dlse),
//             or an input (kiln's rowsum(dO * O) - dlse from the Delta pass: calls with dlse)
//             P = exp([causal mask](scale * Q @ K^T - Stats))
//             dV = P^T @ dO ; dP = dO @ V^T ; dS = (dP - Dsum) * P * scale
//             dK = dS^T @ Q ; dQacc (f32) = dS @ K -> dQ = identity(dQacc)
//             (GQA: dK and dV come out per query head and are summed over each kv group)
//
// K and V enter the graph transposed (K^T [B, H_kv, D, S] is K with its last two dims' sizes and
// strides swapped): cuDNN's matmul takes [.., M, K] @ [.., K, N]. Pass-by-value scalars (scale,
// the mask value, 1) are [1, 1, 1, 1] tensors whose variant-pack pointer is host memory.
#pragma once

#include <cudnn.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensor/tensor.h"

namespace kiln::cuda::cudnn::internal {

// "CUDNN_STATUS_...: <cuDNN's last error message>".
std::string status_text(cudnnStatus_t s);

// Graph and plan building throw BuildError, which the plan cache keeps as the plan's error (a
// call without a plan is refused by the support rules); errors while running throw kiln::Error.
struct BuildError {
  std::string what;
};

#define KILN_CUDNN_TRY(expr)                                                             \
  do {                                                                                   \
    const cudnnStatus_t kiln_cudnn_status_ = (expr);                                     \
    if (kiln_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                                    \
      throw ::kiln::cuda::cudnn::internal::BuildError{absl::StrCat(                      \
          #expr, ": ", ::kiln::cuda::cudnn::internal::status_text(kiln_cudnn_status_))}; \
    }                                                                                    \
  } while (0)

#define KILN_CUDNN_CHECK(op, expr)                                                                \
  do {                                                                                            \
    const cudnnStatus_t kiln_cudnn_status_ = (expr);                                              \
    KILN_CHECK(kiln_cudnn_status_ == CUDNN_STATUS_SUCCESS, "[", op, "] cuDNN: ", #expr,           \
               " failed: ", ::kiln::cuda::cudnn::internal::status_text(kiln_cudnn_status_), " (", \
               __FILE__, ":", __LINE__, ")");                                                     \
  } while (0)

// --- Descriptors ---------------------------------------------------------------------------------

// An owned backend descriptor.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    KILN_CUDNN_TRY(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  template <typename T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
            int64_t count) {
    KILN_CUDNN_TRY(cudnnBackendSetAttribute(d_, name, type, count, values));
    return *this;
  }
  template <typename T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, T value) {
    return set(name, type, &value, 1);
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, const Desc& other) {
    cudnnBackendDescriptor_t o = other.get();
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &o, 1);
  }
  void finalize() { KILN_CUDNN_TRY(cudnnBackendFinalize(d_)); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};
using DescPtr = std::shared_ptr<Desc>;

// Tensor ids of the operands the variant pack names; virtual tensors count up from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kDsum,
  kDQAcc,
  kScale = 20,
  kMaskValue,
  kOne,
  kFirstVirtual = 100,
};

using Dims = std::vector<int64_t>;

inline Dims dense(const Dims& d) {
  Dims s(d.size(), 1);
  for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * d[i + 1];
  return s;
}

// An operation graph and every descriptor it references (kept alive with it).
struct Graph {
  std::vector<DescPtr> descriptors;  // everything the graph references, kept alive
  std::unique_ptr<Desc> graph;
};

// --- Shapes and keys -----------------------------------------------------------------------------

// What a graph depends on: one plan per distinct value.
struct Shape4 {
  int64_t b, h, hkv, t, s, d;
};
struct Key {
  bool backward = false;
  int device = 0;
  cudnnDataType_t io = CUDNN_DATA_BFLOAT16;
  Shape4 n{};
  bool causal = false;
  float scale = 0.f;
  // Strides of q, k, v, o (and dO, dQ, dK, dV for the backward), 4 each.
  std::vector<int64_t> strides;
  // Backward only: whether Dsum is an input (true) or computed by cuDNN (false).
  bool dsum_input = true;

  template <typename H>
  friend H AbslHashValue(H h, const Key& k) {
    uint32_t scale_bits;
    std::memcpy(&scale_bits, &k.scale, sizeof(scale_bits));
    return H::combine(std::move(h), k.backward, k.device, static_cast<int>(k.io), k.n.b, k.n.h,
                      k.n.hkv, k.n.t, k.n.s, k.n.d, k.causal, scale_bits, k.strides, k.dsum_input);
  }
  friend bool operator==(const Key& a, const Key& b) {
    return a.backward == b.backward && a.device == b.device && a.io == b.io && a.n.b == b.n.b &&
           a.n.h == b.n.h && a.n.hkv == b.n.hkv && a.n.t == b.n.t && a.n.s == b.n.s &&
           a.n.d == b.n.d && a.causal == b.causal &&
           std::memcmp(&a.scale, &b.scale, sizeof(float)) == 0 && a.strides == b.strides &&
           a.dsum_input == b.dsum_input;
  }
  std::string str() const {
    return absl::StrCat(backward ? "bwd" : "fwd", " cuda:", device,
                        io == CUDNN_DATA_BFLOAT16 ? " bf16" : " f16", " B", n.b, " H", n.h, "/",
                        n.hkv, " T", n.t, " S", n.s, " D", n.d, causal ? " causal" : "", " scale ",
                        scale, " strides [", absl::StrJoin(strides, ","), "]",
                        backward ? (dsum_input ? " dsum=input" : " dsum=cudnn") : "");
  }
};

inline Dims strides_of(const Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}
// [.., X, Y] -> [.., Y, X] (sizes or strides).
inline Dims swap_last(Dims d) {
  std::swap(d[2], d[3]);
  return d;
}

// The operation graphs of the forward and the backward for `key` (the patterns above).
Graph forward_graph(cudnnHandle_t handle, const Key& key);
Graph backward_graph(cudnnHandle_t handle, const Key& key);

// --- Plans ---------------------------------------------------------------------------------------
// An engine configuration and the execution plan finalized with it.
struct Engine {
  std::unique_ptr<Desc> config;
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
  int64_t index = -1;  // cuDNN's global engine index
  std::string knobs;   // the configuration's knob choices, "type=value ..." (for logs)
  // The engine and its knobs, "8 [2=1 5=0]": what the disk cache keeps of a timed choice.
  std::string choice() const { return absl::StrCat(index, " [", knobs, "]"); }
  std::string str() const {
    return absl::StrCat("engine ", index, knobs.empty() ? "" : " [", knobs,
                        knobs.empty() ? "" : "]", ", workspace ", workspace, " bytes");
  }
};

// The candidate engines of one graph. The heuristics' first runs until the candidates have been
// timed on a call (cudnn_attention.cpp's "fastest" kernel): then the fastest.
struct Plan {
  Graph graph;
  std::vector<Engine> engines;  // empty: no plan (see error)
  size_t active = 0;            // the engine that runs
  bool tuned = false;           // the engines were timed and the fastest made active
  std::string error;
  bool ok() const { return !engines.empty(); }
  const Engine& engine() const { return engines[active]; }
};

// Candidates per graph: each finalized plan of cuDNN's runtime-compiled attention engines costs
// its compilation once, and the heuristics' first few hold the fastest.
constexpr size_t kMaxEngines = 4;

// The engine configurations of the heuristics (mode A, else the fallback list) whose execution
// plans finalize, up to kMaxEngines in the heuristics' order; p.error says why when none does.
// With `only` (an Engine::choice()), just the configuration it names, when the heuristics list it.
void make_plan(cudnnHandle_t handle, Plan& p, const std::string* only = nullptr);

// An engine's execution plan in cuDNN's serialized form (its JSON representation), "" where
// cuDNN gives none.
std::string plan_json(const Engine& e);
// The engine `choice` (an Engine::choice()) whose plan cuDNN restores from `json` (plan_json's,
// made by the same cuDNN on the same kind of device for the same graph) without building the
// graph or asking the heuristics; throws BuildError where cuDNN does not take it.
Engine engine_from_json(cudnnHandle_t handle, const std::string& choice, const std::string& json);

}  // namespace kiln::cuda::cudnn::internal
