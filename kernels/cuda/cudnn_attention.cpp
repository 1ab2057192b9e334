// cuDNN's fused attention: running the plans of kernels/cuda/cudnn_graph.h, the support rules,
// and the measured choice between cuDNN and the hand kernels (kernels/cuda/cudnn_attention.h says
// what runs and how it is chosen).
#include "kernels/cuda/cudnn_attention.h"

#include <cudnn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/choices.h"
#include "kernels/cuda/cudnn_graph.h"
#include "kernels/cuda/timing.h"
#include "kernels/fused_support.h"
#include "tensor/deterministic.h"
#include "tensor/ops.h"
#include "tensor/ops/rotary.h"
#include "tensor/registry.h"

// The operation graph's and execution plan's handle attributes are marked deprecated in recent
// cuDNN 9 headers (their replacement, the device-property descriptor, is newer than the cuDNN 9.x
// kiln supports); they are still the way every cuDNN 9 release takes a handle.
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

namespace kiln::cuda::cudnn {
namespace {

using namespace internal;  // NOLINT(build/namespaces): the graphs' one user

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

// What the disk cache keeps a key's engine under (kernels/cuda/choices.h): the key without its
// device index, with the scale's bits.
std::string disk_text(Key key) {
  uint32_t scale_bits = 0;
  std::memcpy(&scale_bits, &key.scale, sizeof(scale_bits));
  key.device = 0;
  return absl::StrCat(key.str(), " scale bits ", scale_bits);
}
const std::string& library_text() {
  static const std::string text = absl::StrCat("cuDNN ", cudnnGetVersion());
  return text;
}
constexpr char kEngineChoice[] = "cudnn-attention-engine";

// The plan for key (built on first use, failures cached too). Call with d.mu held. Where the
// disk cache holds the engine timed fastest for the key by an earlier run (tune_engines), its
// plan is restored from the JSON stored beside it, else only that engine's plan is finalized
// (each costs cuDNN a compilation).
Plan& plan_for(Device& d, const Key& key) {
  auto it = d.plans.find(key);
  if (it != d.plans.end()) return *it->second;
  auto p = std::make_unique<Plan>();
  cuda::internal::SetupCounters& setup = cuda::internal::setup_counters();
  cuda::internal::SetupTimer timer(setup.attention_plans, setup.attention_plan_ns);
  try {
    DeviceGuard guard(key.device);  // plans are built for the handle's device
    if (d.handle == nullptr) KILN_CUDNN_TRY(cudnnCreate(&d.handle));
    // The cache's payload: the engine's choice, a newline, and its plan's JSON (or nothing).
    const std::optional<std::string> cached =
        cuda::internal::read_choice(kEngineChoice, key.device, library_text(), disk_text(key));
    const size_t newline = cached ? cached->find('\n') : std::string::npos;
    const std::string choice = cached ? cached->substr(0, newline) : "";
    if (newline != std::string::npos && newline + 1 < cached->size()) {
      try {
        p->engines.push_back(engine_from_json(d.handle, choice, cached->substr(newline + 1)));
        p->tuned = true;
      } catch (const BuildError&) {  // built below
      }
    }
    if (!p->ok()) {
      p->graph = key.backward ? backward_graph(d.handle, key) : forward_graph(d.handle, key);
    }
    if (!p->ok() && cached) {
      make_plan(d.handle, *p, &choice);
      p->tuned = p->ok();
    }
    if (!p->ok()) {  // not cached, or the heuristics no longer offer it
      p->error.clear();
      make_plan(d.handle, *p);
    }
  } catch (const BuildError& e) {
    p->error = e.what;
  }
  return *d.plans.emplace(key, std::move(p)).first->second;
}

// A plan's engines for logs, the active one marked when there are several.
std::string plan_text(const Plan& p) {
  if (!p.ok()) return p.error;
  if (p.engines.size() == 1) return p.engine().str();
  std::string text = absl::StrCat(p.engines.size(), " engines", p.tuned ? ", timed" : "", ":");
  for (size_t i = 0; i < p.engines.size(); ++i) {
    absl::StrAppend(&text, i == p.active ? " *" : " ", p.engines[i].str(), ";");
  }
  return text;
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

// Whether the call's keys are masked causally: its causal flag, or a sliding window (which
// implies causal, tensor/ops/attention.cpp).
bool causal_of(const OpCall& c) { return c.attr<bool>(1) || c.attr<int64_t>(2) > 0; }

// The static part of the rule (no graph built): the attributes, dtypes, head size and layouts. A
// sliding window at least as long as the queries hides no key that the causal mask shows (key j
// is visible from query i < T when j > i - window, true for every j >= 0): it runs as causal
// attention without a window (Mistral's 4096 at T <= 4096).
bool static_supports(const OpCall& c) {
  if (!available()) return false;
  const bool fwd = is_forward(c);
  if (fwd && ((c.inputs.size() > 3 && c.input(3).defined()) ||
              (c.has_attr(4) && c.attr<double>(4) != 0.0))) {
    return false;
  }
  const Tensor& q = c.input(fwd ? 0 : 1);
  const int64_t window = c.attr<int64_t>(2);
  if ((window != 0 && window < q.size(2)) || c.attr<double>(3) != 0.0) return false;  // softcap
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

// The key of attention over q, k, v whose output (and, backward, dO) has the strides given; the
// backward's dQ, dK and dV have `grads` (three strides in a row), or are contiguous.
Key make_key(bool backward, const Tensor& q, const Tensor& k, const Tensor& v, const Dims& o,
             const Dims& dout, bool causal, double scale, bool dsum_input,
             const std::vector<int64_t>& grads = {}) {
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
    if (grads.empty()) {
      for (const Tensor* t : {&q, &k, &k}) {
        const Dims d = dense({t->size(0), t->size(1), t->size(2), t->size(3)});
        key.strides.insert(key.strides.end(), d.begin(), d.end());
      }
    } else {
      key.strides.insert(key.strides.end(), grads.begin(), grads.end());
    }
    key.dsum_input = dsum_input;
  }
  return key;
}

// The key of the graph that runs call c: for the backward, Dsum is an input when the call has a
// dlse (kiln's Delta pass subtracts it) and computed by cuDNN when dlse is undefined (zeros), and
// dQ, dK, dV are contiguous (what the measured choice between cuDNN and the hand kernels is kept
// under; run_backward_cudnn writes other layouts cuDNN takes in place).
Key key_of(const OpCall& c) {
  const bool fwd = is_forward(c);
  const Tensor& q = c.input(fwd ? 0 : 1);
  return make_key(!fwd, q, c.input(fwd ? 1 : 2), c.input(fwd ? 2 : 3),
                  fwd ? out_strides(q) : strides_of(c.input(4)),
                  fwd ? Dims{} : strides_of(c.input(0)), causal_of(c), c.attr<double>(0),
                  /*dsum_input=*/!fwd && c.input(6).defined());
}

// The key of backward call c writing its outputs (dQ, dK, dV) with their own strides.
Key key_with_outputs(const OpCall& c) {
  std::vector<int64_t> grads;
  for (const Tensor& t : c.outputs) {
    const Dims s = strides_of(t);
    grads.insert(grads.end(), s.begin(), s.end());
  }
  return make_key(true, c.input(1), c.input(2), c.input(3), strides_of(c.input(4)),
                  strides_of(c.input(0)), causal_of(c), c.attr<double>(0), c.input(6).defined(),
                  grads);
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
  return p.ok() ? &p : nullptr;
}

bool cudnn_supports(const OpCall& c) { return supported_plan(c) != nullptr; }

// --- Execution -----------------------------------------------------------------------------------
void execute(const char* op, Device& d, Plan& p, const std::vector<int64_t>& uids,
             std::vector<void*>& ptrs, const Tensor& like) {
  const Engine& engine = p.engine();
  Tensor workspace;
  if (engine.workspace > 0) {
    // From kiln's stream-ordered pool (no byte dtype: f32 words), aligned as every allocation.
    workspace = empty({(engine.workspace + 3) / 4}, TensorOptions(kFloat).device(like.device()));
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
    KILN_CUDNN_CHECK(op, cudnnBackendExecute(d.handle, engine.plan->get(), pack.get()));
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
  KILN_CHECK(p.ok(), "[", op, "] cuDNN built no plan for ", key.str(), ": ", p.error);
  execute(op, d, p, uids, ptrs, like);
}

void run_forward_cudnn(OpCall& c) {
  constexpr const char* kOp = "flash_attention";
  KILN_CHECK(static_supports(c), "[", kOp, "] cuDNN does not take this call (", key_of(c).str(),
             ")");
  const Tensor& q = c.input(0);
  const Tensor out = write_target(c.outputs[0], layout_ok(c.outputs[0]));
  const Tensor lse = write_target(c.outputs[1], c.outputs[1].is_contiguous());
  const Key key = make_key(false, q, c.input(1), c.input(2), strides_of(out), {}, causal_of(c),
                           c.attr<double>(0), true);
  DeviceGuard guard(q.device().index());
  Device& d = device_state(q.device().index());
  float scale = static_cast<float>(c.attr<double>(0));
  float masked = mask_value();
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data_ptr(),   c.input(1).data_ptr(), c.input(2).data_ptr(),
                          out.data_ptr(), lse.data_ptr(),        &scale};
  if (causal_of(c)) {
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
  DeviceGuard guard(q.device().index());
  Device& d = device_state(q.device().index());
  const TensorOptions f32 = TensorOptions(kFloat).device(q.device());
  // dQ, dK and dV are written in place where cuDNN takes their layout and a plan for it exists or
  // may be built now (not inside a CUDA graph capture), else contiguous and copied.
  const Key contiguous = key_of(c);
  const Key strided = key_with_outputs(c);
  bool in_place = strided == contiguous;
  if (!in_place && layout_ok(c.outputs[0]) && layout_ok(c.outputs[1]) && layout_ok(c.outputs[2])) {
    std::lock_guard<std::mutex> lock(d.mu);
    in_place = (d.plans.contains(strided) || !capturing()) && plan_for(d, strided).ok();
  }
  const Key key = in_place ? strided : contiguous;
  const Tensor dq = write_target(c.outputs[0], in_place);
  const Tensor dk = write_target(c.outputs[1], in_place);
  const Tensor dv = write_target(c.outputs[2], in_place);
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
  if (causal_of(c)) {
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

// Rounds and back-to-back runs per round of a timing (best_times, timing.h).
constexpr int kTimingRounds = 5, kTimingRuns = 2;

// cuDNN's candidate engines for `key` (the heuristics' first few, cudnn_graph.h), each timed on
// call c by best_times, the fastest made active for this and later calls; once
// per key. cuDNN's heuristics do not always rank its own engines right: on llama-160m's forward
// (H100, cuDNN 9.14) the first was a 64x256 tile where torch's cuDNN 9.19 ran a 64x128 one
// (benchmarks/RESULTS.md, session 25). Returns each engine and its milliseconds ("" when there
// was nothing to choose).
std::string tune_engines(OpCall& c, const Key& key, KernelFn cudnn_fn) {
  Device& d = device_state(c.input(0).device().index());
  Plan* p = nullptr;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    p = &plan_for(d, key);
    if (p->tuned || p->engines.size() < 2) {
      p->tuned = true;
      return "";
    }
  }
  const size_t n = p->engines.size();
  std::vector<std::function<void()>> engines;
  for (size_t i = 0; i < n; ++i) {
    engines.emplace_back([&, i] {
      {
        std::lock_guard<std::mutex> lock(d.mu);
        p->active = i;
      }
      cudnn_fn(c);
    });
  }
  const std::vector<double> ms = best_times(engines, kTimingRounds, kTimingRuns);
  const size_t best = static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
  std::string text, choice;
  {
    std::lock_guard<std::mutex> lock(d.mu);
    choice = absl::StrCat(p->engines[best].choice(), "\n", plan_json(p->engines[best]));
    p->active = best;
    p->tuned = true;
    for (size_t i = 0; i < n; ++i) {
      absl::StrAppend(&text, text.empty() ? "" : "; ", i == best ? "*" : "", p->engines[i].str(),
                      ": ", absl::SixDigits(ms[i]), " ms");
    }
  }
  cuda::internal::write_choice(kEngineChoice, key.device, library_text(), disk_text(key), choice);
  return text;
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
  cuda::internal::SetupCounters& setup = cuda::internal::setup_counters();
  cuda::internal::SetupTimer timer(setup.attention_shapes, setup.attention_timing_ns);
  // The op is pure: every kernel writes the same outputs from the same inputs.
  std::string engines = tune_engines(c, key, cudnn_fn);
  const std::vector<double> ms =
      best_times({[&] { cudnn_fn(c); }, [&] { hand->fn(c); }}, kTimingRounds, kTimingRuns);
  const double cudnn_ms = ms[0], hand_ms = ms[1];
  const bool cudnn_wins = cudnn_ms < hand_ms;
  if (cudnn_wins) cudnn_fn(c);  // the outputs come from the kernel later calls will run
  Selections& s = selections();
  std::lock_guard<std::mutex> lock(s.mu);
  s.choice[key] = cudnn_wins ? Choice::kCudnn : Choice::kHand;
  s.last[c.name()] = {cudnn_wins ? "cudnn" : hand->name, key.str(), cudnn_ms, hand_ms,
                      std::move(engines)};
}

void fastest_forward(OpCall& c) { fastest(c, run_forward_cudnn); }
void fastest_backward(OpCall& c) { fastest(c, run_backward_cudnn); }

// --- flash_attention_backward_qkv ----------------------------------------------------------------
// The backward of attention over the heads of one qkv projection, merged into dqkv [B, T,
// (H + 2 H_kv) D] (tensor/ops/attention.cpp): cuDNN writes dq, dk and dv into their places in
// dqkv (each a [B, heads, T, D] view with rows of (H + 2 H_kv) D elements) and rotary_qkv_'s kernel
// rotates dq and dk back where they are, so dv is never copied.
//   - "fastest" takes the calls whose flash_attention_backward the dispatcher runs on cuDNN (its
//     "cudnn" kernel, or "fastest" once that measured cuDNN faster for the shape) or has not
//     measured yet. A first call runs in parts (kernels/fused_support.h), which measures; where
//     cuDNN won, the views' plan is built and its engines timed at once, and the call's result
//     comes from it, so that a CUDA graph captured after one run finds the plan built.
//   - "cudnn", after "in_parts" (kernels/cuda/flash_attention.cu), takes every call cuDNN can
//     run: for tests and the lab.
// Inside a capture nothing is built or timed: a call that finds no plan for the views has cuDNN
// write contiguous gradients that are copied into them.

// The dispatcher's kernel for flash_attention_backward's call b, and whether it runs cuDNN.
const KernelDef* backward_kernel(const OpCall& b) {
  return b.op->select_kernel(DeviceType::CUDA, b);
}
bool cudnn_runs_backward(const OpCall& b) {
  const KernelDef* k = backward_kernel(b);
  if (k == nullptr) return false;
  if (k->name == "cudnn") return true;
  const Choice* ch = k->name == "fastest" ? measured(key_of(b)) : nullptr;
  return ch != nullptr && *ch == Choice::kCudnn;
}

bool backward_qkv_fastest_supports(const OpCall& c) {
  if (!rotary_table_supported(c.input(7), c.input(1))) return false;
  const KernelDef* k = backward_kernel(attention_backward_part(c));
  return k != nullptr && (k->name == "cudnn" || k->name == "fastest");
}
// Whether cuDNN can run the call at all (whichever is faster).
bool backward_qkv_cudnn_supports(const OpCall& c) {
  return rotary_table_supported(c.input(7), c.input(1)) &&
         !are_deterministic_algorithms_enabled() && cudnn_supports(attention_backward_part(c));
}

void backward_qkv_cudnn(OpCall& c) {
  const Tensor& dqkv = c.outputs[0];
  const int64_t h = c.input(1).size(1), g = c.input(2).size(1), n = h + 2 * g;
  OpCall b = attention_backward_part(c);
  if (!cudnn_runs_backward(b)) {  // not measured yet, or the hand kernel
    attention_backward_qkv_in_parts(c);
    if (capturing() || !cudnn_runs_backward(b)) return;
  }
  b.outputs = {::kiln::internal::qkv_heads(dqkv, 0, h, n),
               ::kiln::internal::qkv_heads(dqkv, h, g, n),
               ::kiln::internal::qkv_heads(dqkv, h + g, g, n)};
  DeviceGuard guard(dqkv.device().index());
  // The views' plan is built and its engines timed once; run_backward_cudnn writes the views in
  // place, or (in a capture that finds no plan) through contiguous copies.
  if (!capturing()) (void)tune_engines(b, key_with_outputs(b), run_backward_cudnn);
  run_backward_cudnn(b);
  static const OpDef& rotate = KILN_OP(rotary_qkv_);
  OpCall r;
  r.op = &rotate;
  r.inputs = {dqkv, c.input(7), c.input(8)};
  r.attrs = {c.attrs[4], h, g};
  r.outputs = {dqkv};
  const KernelDef* k = rotate.select_kernel(DeviceType::CUDA, r);
  KILN_CHECK(k != nullptr, "[flash_attention_backward_qkv] no CUDA kernel of rotary_qkv_ takes ",
             shape_str(dqkv.sizes()), " with tables of ", dtype_name(c.input(7).dtype()));
  k->fn(r);
}

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

void clear_plans() {
  clear_selections();
  for (int i = 0; i < kMaxDevices; ++i) {
    Device& d = device_state(i);
    std::lock_guard<std::mutex> lock(d.mu);
    d.plans.clear();
  }
}

std::string describe_plans() {
  std::string text;
  for (int i = 0; i < kMaxDevices; ++i) {
    Device& d = device_state(i);
    std::lock_guard<std::mutex> lock(d.mu);
    for (const auto& [key, plan] : d.plans) {
      absl::StrAppend(&text, key.str(), ": ", plan_text(*plan), "\n");
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
    absl::StrAppend(&text, key.str(), ": ", plan_text(p), "\n");
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
KILN_REGISTER_KERNEL_IF(flash_attention_backward_qkv, kCUDA, "fastest", backward_qkv_cudnn,
                        backward_qkv_fastest_supports, -1);
KILN_REGISTER_KERNEL_IF(flash_attention_backward_qkv, kCUDA, "cudnn", backward_qkv_cudnn,
                        backward_qkv_cudnn_supports, 2);

}  // namespace kiln::cuda::cudnn
