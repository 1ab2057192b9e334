// The operation graphs of cuDNN's fused attention and their execution plans
// (kernels/cuda/cudnn_graph.h says what they compute).
#include "kernels/cuda/cudnn_graph.h"

#include <algorithm>
#include <cmath>
#include <limits>

// The operation graph's and execution plan's handle attributes are marked deprecated in recent
// cuDNN 9 headers (their replacement, the device-property descriptor, is newer than the cuDNN 9.x
// kiln supports); they are still the way every cuDNN 9 release takes a handle.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace kiln::cuda::cudnn::internal {

std::string status_text(cudnnStatus_t s) {
  char last[512] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  std::string text = cudnnGetErrorString(s);
  if (last[0] != '\0') absl::StrAppend(&text, ": ", last);
  return text;
}

// Graph and plan building throw BuildError, which plan_for() keeps as the plan's error (a call

namespace {

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

}  // namespace

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
  DescPtr dq = g.operand(kDQ, qshape, sub(5), key.io);
  DescPtr dk = g.operand(kDK, kvshape, sub(6), key.io);
  DescPtr dv = g.operand(kDV, kvshape, sub(7), key.io);
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

namespace {

// The descriptors of `type` that attribute `name` of `from` holds, at most `max` of them (cuDNN
// reads an array of descriptors into ones the caller made). Throws BuildError when cuDNN refuses.
std::vector<std::unique_ptr<Desc>> read_descs(const Desc& from, cudnnBackendAttributeName_t name,
                                              cudnnBackendDescriptorType_t type, int64_t max) {
  std::vector<std::unique_ptr<Desc>> descs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < max; ++i) {
    descs.push_back(std::make_unique<Desc>(type));
    raw.push_back(descs.back()->get());
  }
  int64_t got = 0;
  KILN_CUDNN_TRY(cudnnBackendGetAttribute(from.get(), name, CUDNN_TYPE_BACKEND_DESCRIPTOR, max,
                                          &got, raw.data()));
  descs.resize(static_cast<size_t>(std::clamp<int64_t>(got, 0, max)));
  return descs;
}

// "type=value ..." of an engine configuration's knob choices.
std::string knobs_of(const Desc& config) {
  constexpr int kMaxKnobs = 16;
  std::vector<std::unique_ptr<Desc>> choices;
  try {
    choices = read_descs(config, CUDNN_ATTR_ENGINECFG_KNOB_CHOICES,
                         CUDNN_BACKEND_KNOB_CHOICE_DESCRIPTOR, kMaxKnobs);
  } catch (const BuildError&) {
    return "";
  }
  std::string text;
  for (const auto& choice : choices) {
    cudnnBackendKnobType_t type{};
    int64_t value = 0, got = 0;
    if (cudnnBackendGetAttribute(choice->get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_TYPE,
                                 CUDNN_TYPE_KNOB_TYPE, 1, &got, &type) != CUDNN_STATUS_SUCCESS ||
        cudnnBackendGetAttribute(choice->get(), CUDNN_ATTR_KNOB_CHOICE_KNOB_VALUE, CUDNN_TYPE_INT64,
                                 1, &got, &value) != CUDNN_STATUS_SUCCESS) {
      continue;
    }
    absl::StrAppend(&text, text.empty() ? "" : " ", static_cast<int>(type), "=", value);
  }
  return text;
}

}  // namespace

void make_plan(cudnnHandle_t handle, Plan& p, const std::string* only) {
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
    std::vector<std::unique_ptr<Desc>> cfgs =
        read_descs(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, count);
    for (size_t i = 0; i < cfgs.size() && p.engines.size() < kMaxEngines; ++i) {
      try {
        Engine e;
        int64_t n = 0;
        Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
        cudnnBackendDescriptor_t ed = engine.get();
        if (cudnnBackendGetAttribute(cfgs[i]->get(), CUDNN_ATTR_ENGINECFG_ENGINE,
                                     CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n,
                                     &ed) == CUDNN_STATUS_SUCCESS) {
          cudnnBackendGetAttribute(ed, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n,
                                   &e.index);
        }
        e.knobs = knobs_of(*cfgs[i]);
        if (only != nullptr && e.choice() != *only) continue;
        auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
            .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, *cfgs[i]);
        plan->finalize();
        KILN_CUDNN_TRY(cudnnBackendGetAttribute(plan->get(),
                                                CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                                CUDNN_TYPE_INT64, 1, &n, &e.workspace));
        e.config = std::move(cfgs[i]);
        e.plan = std::move(plan);
        p.engines.push_back(std::move(e));
      } catch (const BuildError& e) {
        absl::StrAppend(&tried, " config ", i, ": ", e.what, ";");
      }
    }
    if (p.ok()) return;
  }
  p.error = only != nullptr ? absl::StrCat("no engine configuration ", *only)
                            : absl::StrCat("no execution plan:", tried);
}

std::string plan_json(const Engine& e) {
  if (e.plan == nullptr) return "";
  int64_t count = 0;
  if (cudnnBackendGetAttribute(e.plan->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
                               CUDNN_TYPE_CHAR, 0, &count, nullptr) != CUDNN_STATUS_SUCCESS ||
      count <= 0) {
    return "";
  }
  std::string json(static_cast<size_t>(count), '\0');
  if (cudnnBackendGetAttribute(e.plan->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
                               CUDNN_TYPE_CHAR, count, &count,
                               json.data()) != CUDNN_STATUS_SUCCESS) {
    return "";
  }
  json.resize(std::min(json.size(), static_cast<size_t>(std::max<int64_t>(count, 0))));
  while (!json.empty() && json.back() == '\0') json.pop_back();
  return json;
}

Engine engine_from_json(cudnnHandle_t handle, const std::string& choice, const std::string& json) {
  Engine e;
  // choice: "<index> [<knobs>]"
  const size_t open = choice.find(" ["), close = choice.rfind(']');
  if (open == std::string::npos || close == std::string::npos || close < open) {
    throw BuildError{absl::StrCat("not an engine choice: ", choice)};
  }
  try {
    e.index = std::stoll(choice.substr(0, open));
  } catch (const std::exception&) {
    throw BuildError{absl::StrCat("not an engine choice: ", choice)};
  }
  e.knobs = choice.substr(open + 2, close - open - 2);
  auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle)
      .set(CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR, json.data(),
           static_cast<int64_t>(json.size()));
  plan->finalize();
  int64_t n = 0;
  KILN_CUDNN_TRY(cudnnBackendGetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                          CUDNN_TYPE_INT64, 1, &n, &e.workspace));
  e.plan = std::move(plan);
  return e;
}

}  // namespace kiln::cuda::cudnn::internal
