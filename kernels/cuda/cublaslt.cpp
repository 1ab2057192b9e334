// The cuBLASLt wrapper (kernels/cuda/cublaslt.h): per-device handle and workspace, the
// row-major -> column-major mapping of operands, and the per-shape plan cache.
//
// cuBLASLt is column-major. A contiguous row-major [m, n] output is the column-major [n, m]
// matrix D = out^T, so out = a @ b is computed as D = b^T @ a^T: cuBLASLt's first operand is
// kiln's b, its second kiln's a. A row-major view with unit column stride is, read
// column-major, the transpose (op N on the transposed shape); one with unit row stride is the
// matrix itself (op T).
#include "kernels/cuda/cublaslt.h"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <limits>
#include <mutex>
#include <optional>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "kernels/cuda/check.h"
#include "tensor/error.h"

#define KILN_CUBLAS_CHECK(expr)                                                          \
  do {                                                                                   \
    const cublasStatus_t kiln_cublas_status_ = (expr);                                   \
    if (kiln_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                     \
      KILN_FAIL("[cublasLt] ", #expr, " failed: ", cublasLtGetStatusName(kiln_cublas_status_), \
                ": ", cublasLtGetStatusString(kiln_cublas_status_), " (", __FILE__, ":",      \
                __LINE__, ")");                                                          \
    }                                                                                    \
  } while (0)

namespace kiln::cuda::internal {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kMaxDevices = 64;

// One operand as cuBLASLt sees it.
struct Operand {
  cublasOperation_t op = CUBLAS_OP_N;
  int64_t rows = 0, cols = 0, ld = 1;  // the stored column-major matrix
};

// The column-major reading of row-major `m` ([rows, cols]) as cuBLASLt's operand of shape
// [cols, rows] after its op, or nothing when neither dim has unit stride.
std::optional<Operand> as_column_major(const Matrix& m) {
  const int64_t rows = m.rows, cols = m.cols;
  // Unit column stride: memory is the column-major [cols, rows] matrix, leading dim row_stride.
  if (m.col_stride == 1 || cols <= 1) {
    const int64_t ld = rows <= 1 ? std::max<int64_t>(cols, 1) : m.row_stride;
    if (ld >= std::max<int64_t>(cols, 1)) return Operand{CUBLAS_OP_N, cols, rows, ld};
  }
  // Unit row stride: memory is the column-major [rows, cols] matrix, read transposed.
  if (m.row_stride == 1 || rows <= 1) {
    const int64_t ld = cols <= 1 ? std::max<int64_t>(rows, 1) : m.col_stride;
    if (ld >= std::max<int64_t>(rows, 1)) return Operand{CUBLAS_OP_T, rows, cols, ld};
  }
  return std::nullopt;
}

// The largest power of two (up to 256) dividing the address: cuBLASLt assumes 256 unless told.
uint32_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  if (v == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(v & (~v + 1), 256));
}

struct Key {
  GemmType type;
  bool tf32, has_bias, has_c, separate_c;
  cublasOperation_t op_a, op_b;
  int64_t m, n, k, batch;
  int64_t lda, ldb, stride_a, stride_b;
  uint32_t align_a, align_b, align_c, align_d;

  auto tie() const {
    return std::tie(type, tf32, has_bias, has_c, separate_c, op_a, op_b, m, n, k, batch, lda, ldb,
                    stride_a, stride_b, align_a, align_b, align_c, align_d);
  }
  bool operator==(const Key& o) const { return tie() == o.tie(); }
  template <typename H>
  friend H AbslHashValue(H h, const Key& k) {
    return H::combine(std::move(h), k.tie());
  }
};

// Descriptors and the chosen algorithm for one Key. `found` is false when the heuristic had
// nothing: remembered too, so the fallback is not re-queried every call.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;

  ~Plan() {
    if (lc != nullptr) cublasLtMatrixLayoutDestroy(lc);
    if (lb != nullptr) cublasLtMatrixLayoutDestroy(lb);
    if (la != nullptr) cublasLtMatrixLayoutDestroy(la);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

struct DeviceState {
  std::mutex mu;  // guards everything below, and a plan's descriptors while a call uses them
  bool ready = false;
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  absl::flat_hash_map<Key, std::unique_ptr<Plan>, absl::Hash<Key>> plans;
};

// Never destroyed: a handle outliving the CUDA runtime at exit must not be released then.
DeviceState& device_state(int device) {
  static std::array<DeviceState, kMaxDevices>* states = new std::array<DeviceState, kMaxDevices>();
  KILN_CHECK(device >= 0 && device < kMaxDevices, "[cublasLt] device index ", device,
             " out of range");
  return (*states)[device];
}

cudaDataType_t data_type(GemmType t) {
  switch (t) {
    case GemmType::kF32:
      return CUDA_R_32F;
    case GemmType::kF64:
      return CUDA_R_64F;
    case GemmType::kF16:
      return CUDA_R_16F;
    case GemmType::kBF16:
      return CUDA_R_16BF;
  }
  return CUDA_R_32F;
}

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t l = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                               static_cast<uint64_t>(cols), ld));
  if (batch > 1) {
    const int32_t count = static_cast<int32_t>(batch);
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                       &count, sizeof(count)));
    KILN_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride, sizeof(batch_stride)));
  }
  return l;
}

std::unique_ptr<Plan> make_plan(const Key& key, cublasLtHandle_t handle) {
  auto plan = std::make_unique<Plan>();
  const cudaDataType_t type = data_type(key.type);
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t scale = CUDA_R_32F;
  if (key.type == GemmType::kF64) {
    compute = CUBLAS_COMPUTE_64F;
    scale = CUDA_R_64F;
  } else if (key.type == GemmType::kF32 && key.tf32) {
    compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  }
  KILN_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->desc, compute, scale));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                   &key.op_a, sizeof(key.op_a)));
  KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                   &key.op_b, sizeof(key.op_b)));
  if (key.has_bias) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof(epilogue)));
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
  }
  // cuBLASLt's A is kiln's b ([n, k] after its op), its B is kiln's a ([k, m] after its op).
  const bool na = key.op_a == CUBLAS_OP_N, nb = key.op_b == CUBLAS_OP_N;
  plan->la = make_layout(type, na ? key.n : key.k, na ? key.k : key.n, key.lda, key.batch,
                         key.stride_a);
  plan->lb = make_layout(type, nb ? key.k : key.m, nb ? key.m : key.k, key.ldb, key.batch,
                         key.stride_b);
  plan->lc = make_layout(type, key.n, key.m, key.n, key.batch, key.m * key.n);

  cublasLtMatmulPreference_t pref = nullptr;
  KILN_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>, 4> aligns = {{
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_d},
  }};
  for (const auto& [attr, value] : aligns) {
    if (status == CUBLAS_STATUS_SUCCESS) {
      status = cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof(value));
    }
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->la, plan->lb, plan->lc,
                                            plan->lc, pref, 1, &result, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // A failing query (CUBLAS_STATUS_NOT_SUPPORTED, or INVALID_VALUE for an epilogue this type
  // lacks) means no algorithm for this problem, which the caller handles with its fallback.
  plan->found = status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (plan->found) plan->algo = result.algo;
  return plan;
}

}  // namespace

bool gemm(void* out, const Matrix& a, const Matrix& b, const GemmArgs& args) {
  const int64_t m = a.rows, k = a.cols, n = b.cols;
  KILN_CHECK(b.rows == k, "[cublasLt] inner dimensions differ: ", k, " and ", b.rows);
  if (m == 0 || n == 0) return true;
  if (k == 0) return false;  // no product to run: the caller writes beta * C (+ bias)
  const std::optional<Operand> oa = as_column_major(b);  // cuBLASLt's A
  const std::optional<Operand> ob = as_column_major(a);  // cuBLASLt's B
  if (!oa || !ob) return false;
  const int64_t limit = std::numeric_limits<int32_t>::max();
  if (args.batch > limit) return false;

  int device = 0;
  KILN_CUDA_CHECK(cudaGetDevice(&device));
  DeviceState& s = device_state(device);
  std::lock_guard<std::mutex> lock(s.mu);
  if (!s.ready) {
    KILN_CUBLAS_CHECK(cublasLtCreate(&s.handle));
    KILN_CUDA_CHECK(cudaMalloc(&s.workspace, kWorkspaceBytes));
    s.ready = true;
  }

  const bool has_c = args.beta != 0.0 && args.c != nullptr;
  Key key{};
  key.type = args.type;
  key.tf32 = args.type == GemmType::kF32 && allow_tf32();
  key.has_bias = args.bias != nullptr;
  key.has_c = has_c;
  key.separate_c = has_c && args.c != out;
  key.op_a = oa->op;
  key.op_b = ob->op;
  key.m = m;
  key.n = n;
  key.k = k;
  key.batch = args.batch;
  key.lda = oa->ld;
  key.ldb = ob->ld;
  key.stride_a = args.batch > 1 ? b.batch_stride : 0;
  key.stride_b = args.batch > 1 ? a.batch_stride : 0;
  key.align_a = alignment_of(b.data);
  key.align_b = alignment_of(a.data);
  key.align_c = has_c ? alignment_of(args.c) : 256;
  key.align_d = alignment_of(out);

  auto it = s.plans.find(key);
  if (it == s.plans.end()) it = s.plans.emplace(key, make_plan(key, s.handle)).first;
  Plan& plan = *it->second;
  if (!plan.found) return false;
  if (key.has_bias) {
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &args.bias, sizeof(args.bias)));
  }
  const void* c = has_c ? args.c : out;
  if (args.type == GemmType::kF64) {
    const double alpha = args.alpha, beta = has_c ? args.beta : 0.0;
    KILN_CUBLAS_CHECK(cublasLtMatmul(s.handle, plan.desc, &alpha, b.data, plan.la, a.data,
                                     plan.lb, &beta, c, plan.lc, out, plan.lc, &plan.algo,
                                     s.workspace, kWorkspaceBytes, current_stream()));
  } else {
    const float alpha = static_cast<float>(args.alpha);
    const float beta = has_c ? static_cast<float>(args.beta) : 0.0f;
    KILN_CUBLAS_CHECK(cublasLtMatmul(s.handle, plan.desc, &alpha, b.data, plan.la, a.data,
                                     plan.lb, &beta, c, plan.lc, out, plan.lc, &plan.algo,
                                     s.workspace, kWorkspaceBytes, current_stream()));
  }
  sync_if_debug("cublasLtMatmul", __FILE__, __LINE__);
  return true;
}

}  // namespace kiln::cuda::internal
