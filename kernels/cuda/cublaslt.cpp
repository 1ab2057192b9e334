// The cuBLASLt wrapper (kernels/cuda/cublaslt.h): per-device handle and workspace, the
// row-major -> column-major mapping of operands, and the per-shape plan cache.
//
// cuBLASLt is column-major. A contiguous row-major [m, n] output is the column-major [n, m]
// matrix D = out^T, so out = a @ b is computed as D = b^T @ a^T: cuBLASLt's first operand is
// kiln's b, its second kiln's a. A row-major view with unit column stride is, read
// column-major, the transpose (op N on the transposed shape); one with unit row stride is the
// matrix itself (op T).
//
// Autotuning (matmul_autotune()): a plan keeps the heuristic's candidates in its order; the
// first autotuned call of the plan outside graph capture times them all on the real operands
// (tune()) and remembers the fastest. Calls without autotune keep using the first candidate,
// so switching it off restores the heuristic's choice.
#include "kernels/cuda/cublaslt.h"

#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/choices.h"
#include "kernels/cuda/timing.h"
#include "tensor/deterministic.h"
#include "tensor/error.h"

#define KILN_CUBLAS_CHECK(expr)                                                                    \
  do {                                                                                             \
    const cublasStatus_t kiln_cublas_status_ = (expr);                                             \
    if (kiln_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                               \
      KILN_FAIL("[cublasLt] ", #expr, " failed: ", cublasLtGetStatusName(kiln_cublas_status_),     \
                ": ", cublasLtGetStatusString(kiln_cublas_status_), " (", __FILE__, ":", __LINE__, \
                ")");                                                                              \
    }                                                                                              \
  } while (0)

namespace kiln::cuda::internal {
namespace {

constexpr size_t kWorkspaceBytes = size_t{32} << 20;
constexpr int kMaxDevices = 64;
// Candidates asked of the heuristic; rounds and runs per round of each candidate's timing.
constexpr int kMaxCandidates = 8;
constexpr int kTimingRounds = 3, kTimedRuns = 2;

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

// The epilogue a plan is made for (Key::epilogue; its number is part of the disk cache's key).
enum Epilogue : uint8_t {
  kPlain = 0,
  kBias = 1,
  kBiasGradOfB = 2,  // sums of cuBLASLt's B (kiln's a) over k: CUBLASLT_EPILOGUE_BGRADB
  kBiasGradOfA = 3,  // sums of cuBLASLt's A (kiln's b) over k: CUBLASLT_EPILOGUE_BGRADA
  kRelu = 4,
  kReluBias = 5,
  kGelu = 6,  // cuBLASLt's GELU: the tanh approximation
  kGeluBias = 7,
  kGeluAux = 8,  // GELU that also writes its input to the aux matrix
  kGeluAuxBias = 9,
  kDGelu = 10,  // the product times gelu'(aux)
};

// cuBLASLt's epilogue of each Epilogue, in its order.
constexpr cublasLtEpilogue_t kCublasEpilogue[] = {
    CUBLASLT_EPILOGUE_DEFAULT,       CUBLASLT_EPILOGUE_BIAS,      CUBLASLT_EPILOGUE_BGRADB,
    CUBLASLT_EPILOGUE_BGRADA,        CUBLASLT_EPILOGUE_RELU,      CUBLASLT_EPILOGUE_RELU_BIAS,
    CUBLASLT_EPILOGUE_GELU,          CUBLASLT_EPILOGUE_GELU_BIAS, CUBLASLT_EPILOGUE_GELU_AUX,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS, CUBLASLT_EPILOGUE_DGELU,
};

bool has_bias_vector(uint8_t e) {
  return e == kBias || e == kReluBias || e == kGeluBias || e == kGeluAuxBias;
}
bool has_aux(uint8_t e) { return e == kGeluAux || e == kGeluAuxBias || e == kDGelu; }

struct Key {
  GemmType type;
  bool tf32;
  uint8_t epilogue;  // Epilogue
  bool has_c, separate_c;
  cublasOperation_t op_a, op_b;
  int64_t m, n, k, batch;
  int64_t lda, ldb, stride_a, stride_b;
  uint32_t align_a, align_b, align_c, align_d;
  int32_t sm_target;  // SMs the product is planned for; 0: all (matmul_sm_carveout())

  auto tie() const {
    return std::tie(type, tf32, epilogue, has_c, separate_c, op_a, op_b, m, n, k, batch, lda, ldb,
                    stride_a, stride_b, align_a, align_b, align_c, align_d, sm_target);
  }
  bool operator==(const Key& o) const { return tie() == o.tie(); }
  template <typename H>
  friend H AbslHashValue(H h, const Key& k) {
    return H::combine(std::move(h), k.tie());
  }
};

// Descriptors and the heuristic's candidates for one Key. No candidates when the heuristic had
// nothing: remembered too, so the fallback is not re-queried every call. `tuned` once the
// autotuner has chosen `best` among them.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's order, best guess first
  cublasLtMatmulAlgo_t best{};
  bool tuned = false;

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
  int multiprocessors = 0;
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
  if (key.sm_target > 0) {
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, &key.sm_target, sizeof(key.sm_target)));
  }
  if (key.epilogue != kPlain) {
    const cublasLtEpilogue_t epilogue = kCublasEpilogue[key.epilogue];
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof(epilogue)));
    // A bias vector in the operands' type; a bias gradient is written in the output's type
    // (cuBLASLt's default for it).
    if (has_bias_vector(key.epilogue)) {
      KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof(type)));
    }
    // The aux matrix: of the output's type (cuBLASLt's default), laid out as the output.
    if (has_aux(key.epilogue)) {
      const int64_t ld = key.n;
      KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
    }
  }
  // cuBLASLt's A is kiln's b ([n, k] after its op), its B is kiln's a ([k, m] after its op).
  const bool na = key.op_a == CUBLAS_OP_N, nb = key.op_b == CUBLAS_OP_N;
  plan->la =
      make_layout(type, na ? key.n : key.k, na ? key.k : key.n, key.lda, key.batch, key.stride_a);
  plan->lb =
      make_layout(type, nb ? key.k : key.m, nb ? key.m : key.k, key.ldb, key.batch, key.stride_b);
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
  std::array<cublasLtMatmulHeuristicResult_t, kMaxCandidates> results{};
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, plan->desc, plan->la, plan->lb, plan->lc,
                                            plan->lc, pref, kMaxCandidates, results.data(), &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  // A failing query (CUBLAS_STATUS_NOT_SUPPORTED, or INVALID_VALUE for an epilogue this type
  // lacks) means no algorithm for this problem, which the caller handles with its fallback.
  if (status == CUBLAS_STATUS_SUCCESS) {
    for (int i = 0; i < std::min(found, kMaxCandidates); ++i) {
      if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->candidates.push_back(results[i].algo);
    }
  }
  return plan;
}

// One cublasLtMatmul of a plan; alpha and beta point to doubles for f64, floats otherwise.
struct Launch {
  cublasLtHandle_t handle;
  void* workspace;
  cudaStream_t stream;
  const Plan* plan;
  const void* alpha;
  const void* beta;
  const void* a;  // cuBLASLt's A and B (kiln's b and a)
  const void* b;
  const void* c;

  cublasStatus_t operator()(const cublasLtMatmulAlgo_t& algo, void* d) const {
    return cublasLtMatmul(handle, plan->desc, alpha, a, plan->la, b, plan->lb, beta, c, plan->lc, d,
                          plan->lc, &algo, workspace, kWorkspaceBytes, stream);
  }
};

// Whether work queued on `stream` now would be captured into a CUDA graph (an error from the
// query, as for the legacy stream while another stream captures globally, counts as yes).
bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Scratch device memory for timing runs whose output must not land in the real output.
class Scratch {
 public:
  explicit Scratch(size_t bytes) {
    if (cudaMalloc(&p_, bytes) != cudaSuccess) {
      (void)cudaGetLastError();  // out of memory is not sticky: clear it and go without
      p_ = nullptr;
    }
  }
  ~Scratch() {
    if (p_ != nullptr) cudaFree(p_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

size_t element_bytes(GemmType t) {
  switch (t) {
    case GemmType::kF64:
      return 8;
    case GemmType::kF32:
      return 4;
    case GemmType::kF16:
    case GemmType::kBF16:
      return 2;
  }
  return 4;
}

// The key and the library version under which the disk cache keeps a shape's choice.
std::string key_text(const Key& k) {
  return absl::StrCat(static_cast<int>(k.type), " ", k.tf32, static_cast<int>(k.epilogue), k.has_c,
                      k.separate_c, " ", static_cast<int>(k.op_a), static_cast<int>(k.op_b), " ",
                      k.m, " ", k.n, " ", k.k, " ", k.batch, " ", k.lda, " ", k.ldb, " ",
                      k.stride_a, " ", k.stride_b, " ", k.align_a, " ", k.align_b, " ", k.align_c,
                      " ", k.align_d, " ", k.sm_target);
}
const std::string& library_text() {
  static const std::string text = absl::StrCat("cublasLt ", cublasLtGetVersion());
  return text;
}

// Chooses plan.best: the disk cache's choice for this shape on this device where it is one of
// the heuristic's candidates, else the candidates that launch are timed by best_times (timing.h)
// in kTimingRounds interleaved rounds of kTimedRuns runs, and the fastest is stored in the disk
// cache. Timing runs write `d`: the real output when the caller's final run overwrites it
// without reading it, else a scratch buffer (C == out: the output holds the addend). A candidate
// that fails to launch is dropped; with no scratch memory the heuristic's first choice is kept
// untimed.
void tune(Plan& plan, const Key& key, int device, const Launch& launch, void* out, bool c_is_out,
          size_t out_bytes) {
  AutotuneCounters& counters = autotune_counters();
  plan.tuned = true;
  plan.best = plan.candidates.front();
  counters.tuned_shapes.fetch_add(1, std::memory_order_relaxed);
  if (plan.candidates.size() < 2) return;
  const std::string text = key_text(key);
  if (const std::optional<std::string> cached =
          read_choice("cublaslt", device, library_text(), text);
      cached && cached->size() == sizeof(cublasLtMatmulAlgo_t)) {
    for (const cublasLtMatmulAlgo_t& algo : plan.candidates) {
      if (std::memcmp(&algo, cached->data(), sizeof(algo)) == 0) {
        plan.best = algo;
        return;
      }
    }
  }
  SetupCounters& setup = setup_counters();
  SetupTimer timer(setup.matmul_shapes, setup.matmul_ns);
  std::optional<Scratch> scratch;
  void* d = out;
  if (c_is_out) {
    scratch.emplace(out_bytes);
    d = scratch->get();
    if (d == nullptr) return;
  }
  std::vector<const cublasLtMatmulAlgo_t*> ok;
  for (const cublasLtMatmulAlgo_t& algo : plan.candidates) {
    if (launch(algo, d) == CUBLAS_STATUS_SUCCESS) ok.push_back(&algo);
  }
  if (ok.empty()) return;
  std::vector<std::function<void()>> runs;
  for (const cublasLtMatmulAlgo_t* algo : ok) runs.emplace_back([&, algo] { launch(*algo, d); });
  const std::vector<double> ms = best_times(runs, kTimingRounds, kTimedRuns);  // on launch.stream
  counters.candidates_timed.fetch_add(static_cast<int64_t>(ok.size()), std::memory_order_relaxed);
  // Another candidate replaces the heuristic's first choice only when it is faster by more
  // than kMargin: candidates within timing noise of each other keep the heuristic's order.
  constexpr double kMargin = 0.01;
  double best_ms = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < ok.size(); ++i) {
    const double t = ok[i] == &plan.candidates.front() ? ms[i] * (1.0 - kMargin) : ms[i];
    if (t < best_ms) {
      best_ms = t;
      plan.best = *ok[i];
    }
  }
  write_choice("cublaslt", device, library_text(), text,
               std::string(reinterpret_cast<const char*>(&plan.best), sizeof(plan.best)));
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
    KILN_CUDA_CHECK(
        cudaDeviceGetAttribute(&s.multiprocessors, cudaDevAttrMultiProcessorCount, device));
    s.ready = true;
  }

  const bool has_c = args.beta != 0.0 && args.c != nullptr;
  const bool bias_grad = args.bias_grad != nullptr;
  KILN_CHECK(!bias_grad || (args.batch == 1 && args.bias == nullptr && !has_c &&
                            args.activation == GemmActivation::kNone),
             "[cublasLt] the bias gradient epilogue takes one product without bias, C or "
             "activation");
  const bool with_bias = args.bias != nullptr;
  Key key{};
  key.type = args.type;
  key.tf32 = args.type == GemmType::kF32 && allow_tf32();
  switch (args.activation) {
    case GemmActivation::kNone:
      key.epilogue = bias_grad   ? (args.bias_grad_of == 0 ? kBiasGradOfB : kBiasGradOfA)
                     : with_bias ? kBias
                                 : kPlain;
      break;
    case GemmActivation::kRelu:
      key.epilogue = with_bias ? kReluBias : kRelu;
      break;
    case GemmActivation::kGeluTanh:
      key.epilogue = with_bias ? kGeluBias : kGelu;
      break;
    case GemmActivation::kGeluTanhAux:
      key.epilogue = with_bias ? kGeluAuxBias : kGeluAux;
      break;
    case GemmActivation::kGeluTanhGrad:
      key.epilogue = kDGelu;
      break;
  }
  if (has_aux(key.epilogue)) {
    KILN_CHECK(args.aux != nullptr && args.batch == 1 && !has_c && !bias_grad &&
                   (key.epilogue != kDGelu || !with_bias),
               "[cublasLt] the GELU aux epilogues take one product and an aux matrix, without C "
               "or a bias gradient (and DGELU without a bias)");
    // cuBLASLt's requirements of the aux matrix.
    if (n % 8 != 0 || reinterpret_cast<uintptr_t>(args.aux) % 16 != 0) return false;
  }
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
  const int carveout = matmul_sm_carveout();
  key.sm_target = carveout > 0 ? std::max(1, s.multiprocessors - carveout) : 0;

  auto it = s.plans.find(key);
  if (it == s.plans.end()) it = s.plans.emplace(key, make_plan(key, s.handle)).first;
  Plan& plan = *it->second;
  if (plan.candidates.empty()) return false;
  if (bias_grad || has_bias_vector(key.epilogue)) {
    const void* vector = bias_grad ? args.bias_grad : args.bias;
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &vector, sizeof(vector)));
  }
  if (has_aux(key.epilogue)) {
    KILN_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &args.aux, sizeof(args.aux)));
  }
  const double alpha64 = args.alpha, beta64 = has_c ? args.beta : 0.0;
  const float alpha32 = static_cast<float>(alpha64), beta32 = static_cast<float>(beta64);
  const bool f64 = args.type == GemmType::kF64;
  const Launch launch{s.handle,
                      s.workspace,
                      current_stream(),
                      &plan,
                      f64 ? static_cast<const void*>(&alpha64) : &alpha32,
                      f64 ? static_cast<const void*>(&beta64) : &beta32,
                      b.data,
                      a.data,
                      has_c ? args.c : out};

  const cublasLtMatmulAlgo_t* algo = &plan.candidates.front();
  // Deterministic algorithms keep the heuristic's first choice: a timed choice may differ from
  // run to run (tensor/deterministic.h).
  if (matmul_autotune() && !are_deterministic_algorithms_enabled()) {
    if (plan.tuned) {
      autotune_counters().cache_hits.fetch_add(1, std::memory_order_relaxed);
    } else if (is_capturing(launch.stream)) {
      // Timing needs the host to wait for the GPU, which a capture forbids: the heuristic's
      // choice goes into the graph and the shape is tuned at its first eager call.
      autotune_counters().skipped_in_capture.fetch_add(1, std::memory_order_relaxed);
    } else {
      const size_t out_bytes = static_cast<size_t>(args.batch * m * n) * element_bytes(args.type);
      tune(plan, key, device, launch, out, has_c && args.c == out, out_bytes);
    }
    if (plan.tuned) algo = &plan.best;
  }
  KILN_CUBLAS_CHECK(launch(*algo, out));
  sync_if_debug("cublasLtMatmul", __FILE__, __LINE__);
  return true;
}

void clear_plans() {
  for (int device = 0; device < kMaxDevices; ++device) {
    DeviceState& s = device_state(device);
    std::lock_guard<std::mutex> lock(s.mu);
    s.plans.clear();
  }
}

}  // namespace kiln::cuda::internal
