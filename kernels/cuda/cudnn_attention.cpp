// cuDNN's fused attention through the backend graph API (kernels/cuda/cudnn_attention.h says
// what runs and how it is chosen). The graphs are the operation patterns cuDNN's fused-attention
// engines recognise (the ones NVIDIA's cudnn-frontend emits for SDPA), written here over the
// plain backend descriptors:
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
#include "kernels/cuda/cudnn_attention.h"

#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/check.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

// The operation graph's and execution plan's handle attributes are marked deprecated in recent
// cuDNN 9 headers (their replacement, the device-property descriptor, is newer than the cuDNN 9.x
// kiln supports); they are still the way every cuDNN 9 release takes a handle.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace kiln::cuda::cudnn {
namespace {

// "CUDNN_STATUS_...: <cuDNN's last error message>".
std::string status_text(cudnnStatus_t s) {
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  std::string text = cudnnGetErrorString(s);
  if (last[0] != '\0') absl::StrAppend(&text, ": ", last);
  return text;
}

// Graph and plan building throw BuildError, which plan_for() keeps as the plan's error (a call
// without a plan is refused by the support rules); errors while running throw kiln::Error.
struct BuildError {
  std::string what;
};

#define KILN_CUDNN_TRY(expr)                                                        \
  do {                                                                              \
    const cudnnStatus_t kiln_cudnn_status_ = (expr);                                \
    if (kiln_cudnn_status_ != CUDNN_STATUS_SUCCESS) {                               \
      throw BuildError{absl::StrCat(#expr, ": ", status_text(kiln_cudnn_status_))}; \
    }                                                                               \
  } while (0)

#define KILN_CUDNN_CHECK(op, expr)                                                                \
  do {                                                                                            \
    const cudnnStatus_t kiln_cudnn_status_ = (expr);                                              \
    KILN_CHECK(kiln_cudnn_status_ == CUDNN_STATUS_SUCCESS, "[", op, "] cuDNN: ", #expr,           \
               " failed: ", status_text(kiln_cudnn_status_), " (", __FILE__, ":", __LINE__, ")"); \
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

Dims dense(const Dims& d) {
  Dims s(d.size(), 1);
  for (int i = static_cast<int>(d.size()) - 2; i >= 0; --i) s[i] = s[i + 1] * d[i + 1];
  return s;
}

// An operation graph and every descriptor it references (kept alive with it).
struct Graph {
  std::vector<DescPtr> descriptors;  // everything the graph references, kept alive
  std::unique_ptr<Desc> graph;
};

// Builds one operation graph: tensors and operations in the order the patterns list them.
class GraphBuilder {
 public:
  DescPtr tensor(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type,
                 bool is_virtual, bool by_value = false) {
    auto t = std::make_shared<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t n = static_cast<int64_t>(dims.size());
    t->set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid)
        .set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), n)
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), n)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, int64_t{16})
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
    if (by_value) t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    t->finalize();
    keep_.push_back(t);
    return t;
  }
  DescPtr operand(int64_t uid, const Dims& dims, const Dims& strides, cudnnDataType_t type) {
    return tensor(uid, dims, strides, type, false);
  }
  DescPtr scalar(int64_t uid) {
    return tensor(uid, {1, 1, 1, 1}, {1, 1, 1, 1}, CUDNN_DATA_FLOAT, false, true);
  }
  // A fresh virtual tensor (f32 unless told), dense over dims unless strides are given.
  DescPtr virt(const Dims& dims, cudnnDataType_t type = CUDNN_DATA_FLOAT, Dims strides = {}) {
    return tensor(next_virtual_++, dims, strides.empty() ? dense(dims) : strides, type, true);
  }

  void matmul(const DescPtr& a, const DescPtr& b, const DescPtr& c) {
    auto mm = std::make_shared<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT).finalize();
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, *a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, *b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, *c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, *mm);
    op->finalize();
    keep_.push_back(mm);
    ops_.push_back(op);
  }

  // y = mode(x[, b[, t]]); GEN_INDEX takes an axis.
  void pointwise(cudnnPointwiseMode_t mode, const DescPtr& x, const DescPtr& b, const DescPtr& t,
                 const DescPtr& y, cudnnDataType_t compute = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto pw = std::make_shared<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, compute);
    if (axis >= 0) pw->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    pw->finalize();
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, *pw)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, *x);
    if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, *b);
    if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, *t);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, *y)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1.0f)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1.0f);
    op->finalize();
    keep_.push_back(pw);
    ops_.push_back(op);
  }
  // A fresh virtual output shaped like x (f32 unless told).
  DescPtr pw(cudnnPointwiseMode_t mode, const DescPtr& x, const Dims& dims,
             const DescPtr& b = nullptr, const DescPtr& t = nullptr,
             cudnnDataType_t out = CUDNN_DATA_FLOAT, cudnnDataType_t compute = CUDNN_DATA_FLOAT,
             int64_t axis = -1) {
    DescPtr y = virt(dims, out);
    pointwise(mode, x, b, t, y, compute, axis);
    return y;
  }

  void reduction(cudnnReduceTensorOp_t mode, const DescPtr& x, const DescPtr& y) {
    auto r = std::make_shared<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode)
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT)
        .finalize();
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, *x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, *y)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, *r);
    op->finalize();
    keep_.push_back(r);
    ops_.push_back(op);
  }

  void reshape(const DescPtr& x, const DescPtr& y) {
    auto op = std::make_shared<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, *x)
        .set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, *y);
    op->finalize();
    ops_.push_back(op);
  }

  // The top-left causal mask: keys j > i get the mask value (mask_value(); a fully masked row
  // cannot occur: key 0 is visible to every query).
  DescPtr causal_mask(const DescPtr& s, const Dims& dims, const DescPtr& mask_value) {
    DescPtr row = pw(CUDNN_POINTWISE_GEN_INDEX, s, dims, nullptr, nullptr, CUDNN_DATA_INT32,
                     CUDNN_DATA_FLOAT, 2);
    DescPtr col = pw(CUDNN_POINTWISE_GEN_INDEX, s, dims, nullptr, nullptr, CUDNN_DATA_INT32,
                     CUDNN_DATA_FLOAT, 3);
    DescPtr keep =
        pw(CUDNN_POINTWISE_CMP_GE, row, dims, col, nullptr, CUDNN_DATA_BOOLEAN, CUDNN_DATA_BOOLEAN);
    return pw(CUDNN_POINTWISE_BINARY_SELECT, s, dims, mask_value, keep);
  }

  // The finalized operation graph of the operations added, in their order.
  Graph finish(cudnnHandle_t handle) {
    Graph out;
    out.graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const DescPtr& op : ops_) ops.push_back(op->get());
    out.graph->set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
                   static_cast<int64_t>(ops.size()));
    out.graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle);
    out.graph->finalize();
    out.descriptors = keep_;
    out.descriptors.insert(out.descriptors.end(), ops_.begin(), ops_.end());
    return out;
  }

 private:
  int64_t next_virtual_ = kFirstVirtual;
  std::vector<DescPtr> ops_;
  std::vector<DescPtr> keep_;
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
  // Strides of q, k, v, o (and dO for the backward), 4 each.
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

Dims strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2), t.stride(3)}; }
// [.., X, Y] -> [.., Y, X] (sizes or strides).
Dims swap_last(Dims d) {
  std::swap(d[2], d[3]);
  return d;
}

// --- The graphs ----------------------------------------------------------------------------------

Graph forward_graph(cudnnHandle_t handle, const Key& key) {
  const Shape4& n = key.n;
  auto sub = [&](int i) {
    return Dims(key.strides.begin() + 4 * i, key.strides.begin() + 4 * i + 4);
  };
  GraphBuilder g;
  const Dims scores{n.b, n.h, n.t, n.s};
  const Dims rows{n.b, n.h, n.t, 1};
  DescPtr q = g.operand(kQ, {n.b, n.h, n.t, n.d}, sub(0), key.io);
  DescPtr kt = g.operand(kK, {n.b, n.hkv, n.d, n.s}, swap_last(sub(1)), key.io);
  DescPtr v = g.operand(kV, {n.b, n.hkv, n.s, n.d}, sub(2), key.io);
  DescPtr o = g.operand(kO, {n.b, n.h, n.t, n.d}, sub(3), key.io);
  DescPtr stats = g.operand(kStats, rows, dense(rows), CUDNN_DATA_FLOAT);
  DescPtr scale = g.scalar(kScale);

  DescPtr s = g.virt(scores);
  g.matmul(q, kt, s);
  s = g.pw(CUDNN_POINTWISE_MUL, s, scores, scale);
  if (key.causal) s = g.causal_mask(s, scores, g.scalar(kMaskValue));
  DescPtr m = g.virt(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s, m);
  DescPtr e = g.pw(CUDNN_POINTWISE_EXP, g.pw(CUDNN_POINTWISE_SUB, s, scores, m), scores);
  DescPtr z = g.virt(rows);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, z);
  g.pointwise(CUDNN_POINTWISE_ADD, m, g.pw(CUDNN_POINTWISE_LOG, z, rows), nullptr, stats);
  // The probabilities enter the second matmul in the io dtype (its A operand's type).
  DescPtr p = g.pw(CUDNN_POINTWISE_DIV, e, scores, z, nullptr, key.io);
  g.matmul(p, v, o);

  return g.finish(handle);
}

Graph backward_graph(cudnnHandle_t handle, const Key& key) {
  const Shape4& n = key.n;
  auto sub = [&](int i) {
    return Dims(key.strides.begin() + 4 * i, key.strides.begin() + 4 * i + 4);
  };
  GraphBuilder g;
  const Dims scores{n.b, n.h, n.t, n.s};
  const Dims scores_t{n.b, n.h, n.s, n.t};
  // P^T and dS^T read the [B, H, T, S] scores transposed.
  const Dims scores_t_strides{n.h * n.t * n.s, n.t * n.s, 1, n.s};
  const Dims rows{n.b, n.h, n.t, 1};
  const Dims qshape{n.b, n.h, n.t, n.d};
  const Dims kvshape{n.b, n.hkv, n.s, n.d};
  const Dims kv_full{n.b, n.h, n.s, n.d};
  DescPtr q = g.operand(kQ, qshape, sub(0), key.io);
  DescPtr kt = g.operand(kK, {n.b, n.hkv, n.d, n.s}, swap_last(sub(1)), key.io);
  DescPtr vt = g.operand(kV, {n.b, n.hkv, n.d, n.s}, swap_last(sub(2)), key.io);
  DescPtr o = g.operand(kO, qshape, sub(3), key.io);
  DescPtr dout = g.operand(kDO, qshape, sub(4), key.io);
  DescPtr stats = g.operand(kStats, rows, dense(rows), CUDNN_DATA_FLOAT);
  DescPtr dq = g.operand(kDQ, qshape, dense(qshape), key.io);
  DescPtr dk = g.operand(kDK, kvshape, dense(kvshape), key.io);
  DescPtr dv = g.operand(kDV, kvshape, dense(kvshape), key.io);
  DescPtr dq_acc = g.operand(kDQAcc, qshape, dense(qshape), CUDNN_DATA_FLOAT);
  DescPtr dsum = g.operand(kDsum, rows, dense(rows), CUDNN_DATA_FLOAT);
  DescPtr scale = g.scalar(kScale);

  if (!key.dsum_input) {  // Dsum = rowsum(dO * O) * 1, written by cuDNN
    DescPtr prod = g.pw(CUDNN_POINTWISE_MUL, dout, qshape, o);
    DescPtr red = g.virt(rows);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, red);
    g.pointwise(CUDNN_POINTWISE_MUL, red, g.scalar(kOne), nullptr, dsum);
  }
  // P = exp(scale * Q K^T - Stats), masked (after the subtraction, as cudnn-frontend orders it)
  DescPtr s = g.virt(scores);
  g.matmul(q, kt, s);
  s = g.pw(CUDNN_POINTWISE_MUL, s, scores, scale);
  s = g.pw(CUDNN_POINTWISE_SUB, s, scores, stats);
  if (key.causal) s = g.causal_mask(s, scores, g.scalar(kMaskValue));
  DescPtr p = g.pw(CUDNN_POINTWISE_EXP, s, scores);

  // dV = P^T @ dO (per query head, then summed over each kv group under GQA).
  DescPtr pt = g.virt(scores_t, key.io, scores_t_strides);
  g.reshape(p, pt);
  const bool gqa = n.h != n.hkv;
  if (!gqa) {
    g.matmul(pt, dout, dv);
  } else {
    DescPtr dv_full = g.virt(kv_full, key.io);
    g.matmul(pt, dout, dv_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_full, dv);
  }
  // dS = (dO @ V^T - Dsum) * P * scale
  DescPtr dp = g.virt(scores);
  g.matmul(dout, vt, dp);
  DescPtr ds = g.pw(CUDNN_POINTWISE_SUB, dp, scores, dsum);
  ds = g.pw(CUDNN_POINTWISE_MUL, ds, scores, p);
  ds = g.pw(CUDNN_POINTWISE_MUL, ds, scores, scale);
  // dK = dS^T @ Q
  DescPtr dst = g.virt(scores_t, key.io, scores_t_strides);
  g.reshape(ds, dst);
  if (!gqa) {
    g.matmul(dst, q, dk);
  } else {
    DescPtr dk_full = g.virt(kv_full, key.io);
    g.matmul(dst, q, dk_full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_full, dk);
  }
  // dQ = dS @ K, accumulated in f32 (cuDNN's dQ accumulator, a workspace tensor of kiln's).
  DescPtr k = g.virt({n.b, n.hkv, n.s, n.d}, key.io, sub(1));
  g.reshape(kt, k);
  g.matmul(ds, k, dq_acc);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_acc, nullptr, nullptr, dq);

  return g.finish(handle);
}

// --- Plans ---------------------------------------------------------------------------------------
struct Plan {
  Graph graph;
  std::unique_ptr<Desc> config;  // the engine configuration the plan was finalized with
  std::unique_ptr<Desc> plan;    // null: no plan (see error)
  int64_t workspace = 0;
  int64_t engine = -1;
  std::string error;
};

// The first engine configuration of the heuristics (mode A, then the fallback list) whose
// execution plan finalizes.
void make_plan(cudnnHandle_t handle, Plan& p) {
  std::string tried;
  for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
    Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
    heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, *p.graph.graph)
        .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode);
    try {
      heur.finalize();
    } catch (const BuildError& e) {
      absl::StrAppend(&tried, " heuristics ", static_cast<int>(mode), ": ", e.what, ";");
      continue;
    }
    int64_t count = 0;
    cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
    if (count <= 0) {
      absl::StrAppend(&tried, " heuristics ", static_cast<int>(mode), ": no engine;");
      continue;
    }
    std::vector<std::unique_ptr<Desc>> cfgs;
    std::vector<cudnnBackendDescriptor_t> raw;
    for (int64_t i = 0; i < count; ++i) {
      cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      raw.push_back(cfgs.back()->get());
    }
    int64_t got = 0;
    KILN_CUDNN_TRY(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                            CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got,
                                            raw.data()));
    for (int64_t i = 0; i < got; ++i) {
      try {
        auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
            .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i]);
        plan->finalize();
        int64_t ws = 0, n = 0;
        KILN_CUDNN_TRY(cudnnBackendGetAttribute(
            plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &ws));
        // The engine's global index, for logs.
        Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
        cudnnBackendDescriptor_t e = engine.get();
        int64_t index = -1;
        if (cudnnBackendGetAttribute(cfgs[i]->get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                     &e) == CUDNN_STATUS_SUCCESS) {
          cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                   &index);
        }
        p.config = std::move(cfgs[i]);
        p.plan = std::move(plan);
        p.workspace = ws;
        p.engine = index;
        return;
      } catch (const BuildError& e) {
        absl::StrAppend(&tried, " config ", i, ": ", e.what, ";");
      }
    }
  }
  p.error = absl::StrCat("no execution plan:", tried);
}

// --- Per-device state ----------------------------------------------------------------------------

struct Device {
  std::mutex mu;  // a handle is not for concurrent use; plans are tied to it
  cudnnHandle_t handle = nullptr;
  absl::flat_hash_map<Key, std::unique_ptr<Plan>> plans;
};
constexpr int kMaxDevices = 64;

Device& device_state(int index) {
  // Never destroyed: descriptors must not be released after the CUDA context at exit.
  static Device* const devices = new Device[kMaxDevices];
  KILN_CHECK(index >= 0 && index < kMaxDevices, "[cudnn] device index ", index, " out of range");
  return devices[index];
}

// The plan for key (built on first use, failures cached too). Call with d.mu held.
Plan& plan_for(Device& d, const Key& key) {
  auto it = d.plans.find(key);
  if (it != d.plans.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  try {
    DeviceGuard guard(key.device);  // plans are built for the handle's device
    if (d.handle == nullptr) KILN_CUDNN_TRY(cudnnCreate(&d.handle));
    p->graph = key.backward ? backward_graph(d.handle, key) : forward_graph(d.handle, key);
    make_plan(d.handle, *p);
  } catch (const BuildError& e) {
    p->error = e.what;
  }
  return *d.plans.emplace(key, std::move(p)).first->second;
}

// --- Support -------------------------------------------------------------------------------------
bool is_forward(const OpCall& c) {
  static const OpDef* const forward = &KILN_OP(flash_attention);
  return c.op == forward;
}

// Whether cuDNN reads (or writes) t in place: a contiguous last dim, the other strides multiples
// of 8 elements and a 16-byte aligned base (the graphs' tensors promise 16-byte alignment).
bool layout_ok(const Tensor& t) {
  if (t.stride(3) != 1 && t.size(3) > 1) return false;
  for (int i = 0; i < 3; ++i) {
    if (t.stride(i) % 8 != 0 && t.size(i) > 1) return false;
  }
  // impl()->data(), not data_ptr(): a proxy tensor (kiln::compile's tracer asks the support rules
  // too) has no memory, and its layout is all that matters then.
  return reinterpret_cast<uintptr_t>(t.impl()->data()) % 16 == 0;
}

int capability_major(int device) {
  static int major[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return 0;
  if (major[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      return 0;
    }
    major[device] = v;
  }
  return major[device];
}

// The output's strides as the meta rule lays it out (q's memory order), before it exists.
Dims out_strides(const Tensor& q) {
  const Shape s = dense_strides_like(q.sizes(), q.strides());
  return {s[0], s[1], s[2], s[3]};
}

// The static part of the rule (no graph built): the attributes, dtypes, head size and layouts.
bool static_supports(const OpCall& c) {
  if (!available()) return false;
  const bool fwd = is_forward(c);
  if (fwd && ((c.inputs.size() > 3 && c.input(3).defined()) ||
              (c.has_attr(4) && c.attr<double>(4) != 0.0))) {
    return false;
  }
  if (c.attr<int64_t>(2) != 0 || c.attr<double>(3) != 0.0) return false;  // window, softcap
  const Tensor& q = c.input(fwd ? 0 : 1);
  const Tensor& k = c.input(fwd ? 1 : 2);
  const Tensor& v = c.input(fwd ? 2 : 3);
  const int64_t d = q.size(3);
  if ((q.dtype() != kBFloat16 && q.dtype() != kHalf) || v.size(3) != d ||
      (d != 64 && d != 128 && d != 256)) {
    return false;
  }
  if (q.numel() == 0 || k.numel() == 0) return false;
  if (capability_major(q.device().index()) < 8) return false;
  if (!layout_ok(q) || !layout_ok(k) || !layout_ok(v)) return false;
  if (!fwd && (!layout_ok(c.input(0)) || !layout_ok(c.input(4)))) return false;
  return std::isfinite(c.attr<double>(0));
}

// The key of attention over q, k, v whose output (and, backward, dO) has the strides given.
Key make_key(bool backward, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& o,
             const Dims& dout, bool causal, double scale, bool dsum_input) {
  Key key;
  key.backward = backward;
  key.device = q.device().index();
  key.io = q.dtype() == kBFloat16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
  key.n = {q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  key.causal = causal;
  key.scale = static_cast<float>(scale);
  for (const Dims& s : {strides_of(q), strides_of(k), strides_of(v), o}) {
    key.strides.insert(key.strides.end(), s.begin(), s.end());
  }
  if (backward) {
    key.strides.insert(key.strides.end(), dout.begin(), dout.end());
    key.dsum_input = dsum_input;
  }
  return key;
}

// The key of the graph that runs call c: for the backward, Dsum is an input when the call has a
// dlse (kiln's Delta pass subtracts it) and computed by cuDNN when dlse is undefined (zeros).
Key key_of(const OpCall& c) {
  const bool fwd = is_forward(c);
  const Tensor& q = c.input(fwd ? 0 : 1);
  return make_key(!fwd, q, c.input(fwd ? 1 : 2), c.input(fwd ? 2 : 3),
                  fwd ? out_strides(q) : strides_of(c.input(4)),
                  fwd ? Dims{} : strides_of(c.input(0)), c.attr<bool>(1), c.attr<double>(0),
                  /*dsum_input=*/!fwd && c.input(6).defined());
}

// Whether the current stream is capturing a CUDA graph.
bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(current_stream(), &status) == cudaSuccess &&
         status != cudaStreamCaptureStatusNone;
}

// The plan that runs call c, or nullptr when cuDNN cannot run it. No plan is built while a CUDA
// graph is being captured (building may allocate and copy on the device): a shape first seen
// there goes to the hand kernels.
Plan* supported_plan(const OpCall& c) {
  if (!static_supports(c)) return nullptr;
  Device& d = device_state(c.input(0).device().index());
  const Key key = key_of(c);
  std::lock_guard<std::mutex> lock(d.mu);
  if (!d.plans.contains(key) && capturing()) return nullptr;
  Plan& p = plan_for(d, key);
  return p.plan ? &p : nullptr;
}

bool cudnn_supports(const OpCall& c) { return supported_plan(c) != nullptr; }

// --- Execution -----------------------------------------------------------------------------------
void execute(const char* op, Device& d, Plan& p, const std::vector<int64_t>& uids,
             std::vector<void*>& ptrs, const Tensor& like) {
  Tensor workspace;
  if (p.workspace > 0) {
    // From kiln's stream-ordered pool (no byte dtype: f32 words), aligned as every allocation.
    workspace = empty({(p.workspace + 3) / 4}, TensorOptions(kFloat).device(like.device()));
  }
  try {
    Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
    void* ws = workspace.defined() ? workspace.data_ptr() : nullptr;
    pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(),
             static_cast<int64_t>(uids.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, ptrs.data(),
             static_cast<int64_t>(ptrs.size()))
        .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, ws);
    pack.finalize();
    KILN_CUDNN_CHECK(op, cudnnSetStream(d.handle, current_stream()));
    KILN_CUDNN_CHECK(op, cudnnBackendExecute(d.handle, p.plan->get(), pack.get()));
  } catch (const BuildError& e) {
    KILN_FAIL("[", op, "] cuDNN variant pack: ", e.what);
  }
}

// Where cuDNN writes an output: the output itself when its layout is one cuDNN takes (`ok`), else
// a contiguous temporary that is copied into it afterwards (eager outputs have the meta rule's
// layout; a compiled program may place them in its arena differently).
Tensor write_target(const Tensor& out, bool ok) {
  return ok ? out : empty(out.sizes(), TensorOptions(out.dtype()).device(out.device()));
}
void copy_back(Tensor out, const Tensor& written) {
  if (written.data_ptr() != out.data_ptr()) out.copy_(written);
}

// What the causal mask puts in the scores of hidden keys: -inf from cuDNN 9.10 on, the lowest
// float before (what each version's engines expect; cudnn-frontend chooses the same way).
float mask_value() {
  return version() >= 91000 ? -std::numeric_limits<float>::infinity()
                            : std::numeric_limits<float>::lowest();
}

// Runs the plan cached for `key` (built now if new), which the support rule saw built.
void execute_plan(const char* op, Device& d, const Key& key, const std::vector<int64_t>& uids,
                  std::vector<void*>& ptrs, const Tensor& like) {
  std::lock_guard<std::mutex> lock(d.mu);
  Plan& p = plan_for(d, key);
  KILN_CHECK(p.plan != nullptr, "[", op, "] cuDNN built no plan for ", key.str(), ": ", p.error);
  execute(op, d, p, uids, ptrs, like);
}

void run_forward_cudnn(OpCall& c) {
  constexpr const char* kOp = "flash_attention";
  KILN_CHECK(static_supports(c), "[", kOp, "] cuDNN does not take this call (", key_of(c).str(),
             ")");
  const Tensor& q = c.input(0);
  const Tensor out = write_target(c.outputs[0], layout_ok(c.outputs[0]));
  const Tensor lse = write_target(c.outputs[1], c.outputs[1].is_contiguous());
  const Key key = make_key(false, q, c.input(1), c.input(2), strides_of(out), {}, c.attr<bool>(1),
                           c.attr<double>(0), true);
  DeviceGuard guard(q.device().index());
  Device& d = device_state(q.device().index());
  float scale = static_cast<float>(c.attr<double>(0));
  float masked = mask_value();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data_ptr(),   c.input(1).data_ptr(), c.input(2).data_ptr(),
                          out.data_ptr(), lse.data_ptr(),        &scale};
  if (c.attr<bool>(1)) {
    uids.push_back(kMaskValue);
    ptrs.push_back(&masked);
  }
  execute_plan(kOp, d, key, uids, ptrs, q);
  copy_back(c.outputs[0], out);
  copy_back(c.outputs[1], lse);
}

void run_backward_cudnn(OpCall& c) {
  constexpr const char* kOp = "flash_attention_backward";
  KILN_CHECK(static_supports(c), "[", kOp, "] cuDNN does not take this call (", key_of(c).str(),
             ")");
  const Tensor& dout = c.input(0);
  const Tensor& q = c.input(1);
  const Tensor& out = c.input(4);
  const Tensor& dlse = c.input(6);
  const Key key = key_of(c);
  DeviceGuard guard(q.device().index());
  Device& d = device_state(q.device().index());
  const TensorOptions f32 = TensorOptions(kFloat).device(q.device());
  // The graph's dQ, dK and dV are contiguous.
  const Tensor dq = write_target(c.outputs[0], c.outputs[0].is_contiguous());
  const Tensor dk = write_target(c.outputs[1], c.outputs[1].is_contiguous());
  const Tensor dv = write_target(c.outputs[2], c.outputs[2].is_contiguous());
  const Tensor dsum = empty({q.size(0), q.size(1), q.size(2)}, f32);
  const Tensor dq_acc = empty(q.sizes(), f32);
  // The dQ accumulator starts at zero (cudnn-frontend zeroes it before every run).
  if (dlse.defined()) {
    // Dsum = rowsum(dO * O) - dlse and the accumulator zeroed, in one pass.
    flash::delta_pass(dout, out, dlse, static_cast<float*>(dsum.data_ptr()),
                      static_cast<float*>(dq_acc.data_ptr()));
  } else {  // cuDNN writes Dsum = rowsum(dO * O)
    KILN_CUDA_CHECK(cudaMemsetAsync(dq_acc.data_ptr(), 0, dq_acc.nbytes(), current_stream()));
  }
  float scale = static_cast<float>(c.attr<double>(0));
  float masked = mask_value();
  float one = 1.0f;
  const Tensor lse = c.input(5).contiguous();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kDsum, kDQAcc, kScale};
  std::vector<void*> ptrs{q.data_ptr(),    c.input(2).data_ptr(), c.input(3).data_ptr(),
                          out.data_ptr(),  dout.data_ptr(),       lse.data_ptr(),
                          dq.data_ptr(),   dk.data_ptr(),         dv.data_ptr(),
                          dsum.data_ptr(), dq_acc.data_ptr(),     &scale};
  if (!key.dsum_input) {
    uids.push_back(kOne);
    ptrs.push_back(&one);
  }
  if (c.attr<bool>(1)) {
    uids.push_back(kMaskValue);
    ptrs.push_back(&masked);
  }
  execute_plan(kOp, d, key, uids, ptrs, q);
  copy_back(c.outputs[0], dq);
  copy_back(c.outputs[1], dk);
  copy_back(c.outputs[2], dv);
}

// --- Selection by measurement --------------------------------------------------------------------
enum class Choice : uint8_t { kCudnn, kHand };

struct Selections {
  std::mutex mu;
  absl::flat_hash_map<Key, Choice> choice;
  absl::flat_hash_map<std::string, Selection> last;  // per op name
};
Selections& selections() {
  static Selections s;
  return s;
}

// The hand kernel the dispatcher would run without cuDNN: the first other CUDA kernel of the op
// whose rule accepts the call.
const KernelDef* hand_kernel(const OpCall& c) {
  for (const KernelDef& k : c.op->kernels[static_cast<int>(DeviceType::CUDA)]) {
    if (k.name == "fastest" || k.name == "cudnn") continue;
    if (k.accepts(c)) return &k;
  }
  return nullptr;
}

const Choice* measured(const Key& key) {
  Selections& s = selections();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.choice.find(key);
  return it == s.choice.end() ? nullptr : &it->second;
}

// Runs a measured cuDNN winner, or a call not measured yet (both kinds of kernel can run it).
// Measured per key, so per backward variant: calls without dlse time cuDNN's own-Dsum graph.
bool fastest_supports(const OpCall& c) {
  if (!static_supports(c)) return false;
  if (const Choice* ch = measured(key_of(c))) return *ch == Choice::kCudnn;
  return supported_plan(c) != nullptr && hand_kernel(c) != nullptr;
}

// Milliseconds per run of fn over kRuns back-to-back runs on the current stream.
template <typename F>
double time_ms(F&& fn) {
  constexpr int kRuns = 2;
  cudaEvent_t start, stop;
  KILN_CUDA_CHECK(cudaEventCreate(&start));
  KILN_CUDA_CHECK(cudaEventCreate(&stop));
  KILN_CUDA_CHECK(cudaEventRecord(start, current_stream()));
  for (int i = 0; i < kRuns; ++i) fn();
  KILN_CUDA_CHECK(cudaEventRecord(stop, current_stream()));
  KILN_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.f;
  KILN_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / kRuns;
}

// The faster of two kernels, each's best time over interleaved rounds (after a warm-up run of
// each): a shape's first call comes at the start of a run, while the GPU's clocks still ramp up
// and other work may share it, so one timing of each, one after the other, picked the slower
// kernel in some runs (llama-160m's forward: 1.55 against 1.18 ms a step).
template <typename A, typename B>
std::pair<double, double> best_times(A&& a, B&& b) {
  constexpr int kRounds = 5;
  a();
  b();
  double ta = std::numeric_limits<double>::infinity(), tb = ta;
  for (int r = 0; r < kRounds; ++r) {
    ta = std::min(ta, time_ms(a));
    tb = std::min(tb, time_ms(b));
  }
  return {ta, tb};
}

void fastest(OpCall& c, KernelFn cudnn_fn) {
  const Key key = key_of(c);
  if (const Choice* ch = measured(key); ch != nullptr && *ch == Choice::kCudnn) {
    cudnn_fn(c);
    return;
  }
  const KernelDef* hand = hand_kernel(c);
  KILN_CHECK(hand != nullptr, "[", c.name(), "] no hand kernel to measure cuDNN against (",
             key.str(), ")");
  if (capturing()) {  // no timing inside a CUDA graph: the hand kernel, nothing remembered
    hand->fn(c);
    return;
  }
  DeviceGuard guard(c.input(0).device().index());
  // The op is pure: both kernels write the same outputs from the same inputs.
  const auto [cudnn_ms, hand_ms] = best_times([&] { cudnn_fn(c); }, [&] { hand->fn(c); });
  const bool cudnn_wins = cudnn_ms < hand_ms;
  if (cudnn_wins) cudnn_fn(c);  // the outputs come from the kernel later calls will run
  Selections& s = selections();
  std::lock_guard<std::mutex> lock(s.mu);
  s.choice[key] = cudnn_wins ? Choice::kCudnn : Choice::kHand;
  s.last[c.name()] = {cudnn_wins ? "cudnn" : hand->name, key.str(), cudnn_ms, hand_ms};
}

void fastest_forward(OpCall& c) { fastest(c, run_forward_cudnn); }
void fastest_backward(OpCall& c) { fastest(c, run_backward_cudnn); }

}  // namespace

// cuDNN 9.10.0 and 9.10.1 have known bugs in the bf16/f16 attention forward (cudnn-frontend
// refuses them too).
bool available() { return version() >= 90000 && version() != 91000 && version() != 91001; }

int64_t version() {
  static const int64_t v = static_cast<int64_t>(cudnnGetVersion());
  return v;
}

Selection last_selection(const std::string& op) {
  Selections& s = selections();
  std::lock_guard<std::mutex> lock(s.mu);
  auto it = s.last.find(op);
  return it == s.last.end() ? Selection{} : it->second;
}

void clear_selections() {
  Selections& s = selections();
  std::lock_guard<std::mutex> lock(s.mu);
  s.choice.clear();
  s.last.clear();
}

std::string describe_plans() {
  std::string text;
  for (int i = 0; i < kMaxDevices; ++i) {
    Device& d = device_state(i);
    std::lock_guard<std::mutex> lock(d.mu);
    for (const auto& [key, plan] : d.plans) {
      absl::StrAppend(&text, key.str(), ": ",
                      plan->plan ? absl::StrCat("engine ", plan->engine, ", workspace ",
                                                plan->workspace, " bytes")
                                 : plan->error,
                      "\n");
    }
  }
  return text;
}

std::string probe(const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale) {
  if (!available()) return "cuDNN 9 is not available";
  Device& d = device_state(q.device().index());
  std::lock_guard<std::mutex> lock(d.mu);
  const Dims o = out_strides(q), dout = dense({q.size(0), q.size(1), q.size(2), q.size(3)});
  std::string text;
  for (const auto& [backward, dsum_input] :
       {std::pair{false, true}, std::pair{true, true}, std::pair{true, false}}) {
    const Key key = make_key(backward, q, k, v, o, dout, causal, scale, dsum_input);
    const Plan& p = plan_for(d, key);
    absl::StrAppend(
        &text, key.str(), ": ",
        p.plan ? absl::StrCat("engine ", p.engine, ", workspace ", p.workspace, " bytes") : p.error,
        "\n");
  }
  return text;
}

KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "fastest", fastest_forward, fastest_supports, -1);
// cuDNN's backward accumulates dQ with atomics: with deterministic algorithms
// (tensor/deterministic.h) the backwards refuse, and the op's decomposition runs.
bool fastest_backward_supports(const OpCall& c) {
  return !are_deterministic_algorithms_enabled() && fastest_supports(c);
}
bool cudnn_backward_supports(const OpCall& c) {
  return !are_deterministic_algorithms_enabled() && cudnn_supports(c);
}

KILN_REGISTER_KERNEL_IF(flash_attention_backward, kCUDA, "fastest", fastest_backward,
                        fastest_backward_supports, -1);
KILN_REGISTER_KERNEL_IF(flash_attention, kCUDA, "cudnn", run_forward_cudnn, cudnn_supports, 2);
KILN_REGISTER_KERNEL_IF(flash_attention_backward, kCUDA, "cudnn", run_backward_cudnn,
                        cudnn_backward_supports, 2);

}  // namespace kiln::cuda::cudnn
