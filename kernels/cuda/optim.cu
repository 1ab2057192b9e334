// The CUDA kernel of adam_update_ (tensor/ops/optim.cpp): every parameter of a call in a few
// launches of a multi-tensor kernel (the launcher multi_tensor_adam, kernels/cuda/optim.h).
//
// A launch carries a table of up to kMaxTensors parameters in its kernel arguments (the
// multi-tensor tables of kernels/cuda/multi_tensor.cuh). Each parameter is cut into chunks of
// kChunk elements, one block per chunk. Within a chunk each thread
// moves 16 / sizeof(state) elements per access when the pointers allow it: 4 with f32 state
// (16-byte loads of the state, 8- or 16-byte loads of the parameter and grad), 8 with 16-bit
// state (state_in_param_dtype: 16-byte loads of everything).
//
// The arithmetic is the CPU kernel's (kernels/cpu/optim.cpp), operation by operation, with
// explicitly rounded intrinsics so that nvcc does not contract a*b+c into an FMA: the GPU
// gives the CPU optimizer's bits for f32 parameters, and for bf16/f16 parameters the same
// f32 update rounded once into the parameter. 16-bit moments are read as f32 and rounded once
// when stored; the amsgrad maximum is taken in f32 (stored v_max against the unrounded new v)
// and feeds the denominator unrounded, as the CPU kernel on f32 copies does.
//
// With a gradient factor (adam_update_'s optional input) each gradient is T(g * s), rounded to
// the grad's dtype as foreach_mul_ rounds it: the factor s is read once by every thread, from
// device memory for a GPU factor (no host sync) or from the kernel arguments for a CPU one, and
// the grads are not written. The strided path (f32 copies) takes grads multiplied beforehand,
// with the same rounding.
//
// The registered kernel takes f32, bf16 and f16 parameters (f64 runs the decomposition): the
// contiguous ones in place, the others (strided views) through contiguous f32 copies that are
// stored back afterwards, so that every call gets the CPU's arithmetic.
//
// The lr and step counts: host scalars (0-d CPU tensors) are read when the kernel is launched and
// the per-tensor scalars derived on the host (AdamUpdateCall::step_scalars). Device scalars (the
// lr and counts on the parameters' device, as Adam and AdamW keep them for GPU parameters) are
// read when the kernel runs, so that a CUDA graph of the update replays with their current
// values: the first thread of each block derives its tensor's scalars in f64 from them, with the
// host's operations in the host's order, each rounded (no FMA), then rounds them to f32 as the
// host does. The only operation that is not IEEE-exact on both sides is pow(beta, t): glibc's is
// within 0.52 ulp, CUDA's within 2 ulp (of f64). The f32 scalars differ only when the f64 values
// straddle an f32 rounding boundary, about one chance in 2^28 per scalar and step; the GPU
// tests check the device path against the CPU kernel bit for bit.
//
// increment_ on a GPU: one kernel adds 1 to a list of 0-d int64 tensors (the step counts of an
// update call), their addresses in its arguments.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels/cuda/check.h"
#include "kernels/cuda/loops.cuh"
#include "kernels/cuda/multi_tensor.cuh"
#include "kernels/cuda/optim.h"
#include "tensor/error.h"
#include "tensor/ops.h"
#include "tensor/ops/optim.h"
#include "tensor/registry.h"

namespace kiln::cuda::internal {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kChunk = kThreads * 4 * 8;  // 8192 elements per block
constexpr int kMaxTensors = 36;

// Elements per vectorised access: 16 bytes of state.
template <typename S>
constexpr int kVecOf = 16 / static_cast<int>(sizeof(S));

struct Entry {
  void* param;
  const void* grad;
  void* m;
  void* v;
  void* vmax;
  int64_t numel;
  float neg_step;
  float bc2_sqrt;
  const int64_t* step;  // the device step count (AdamHyper::lr set), else null
  int64_t vectorised;   // 1 when every pointer allows kVecOf<S>-element accesses
};

using Table = multi_tensor::Table<Entry, kMaxTensors>;
static_assert(sizeof(Table) + sizeof(AdamHyper) < multi_tensor::kMaxArgBytes,
              "kernel arguments are limited to 4 KiB");

using multi_tensor::Pack;

// A tensor's scalars of one step: from the host, or derived on the device.
struct StepScalars {
  float decay;  // 1 - lr * weight_decay
  float neg_step;
  float bc2_sqrt;
};

// AdamUpdateCall::step_scalars and the host's rounding to f32, on the device: lr / (1 - beta1^t),
// sqrt(1 - beta2^t) and 1 - lr * weight_decay in f64, each operation rounded (no contraction),
// pow CUDA's (see the banner).
__device__ __forceinline__ StepScalars device_step_scalars(const AdamHyper& h, int64_t step) {
  const double lr = *h.lr;
  const double t = __ll2double_rn(step);
  const double bc1 = __dsub_rn(1.0, ::pow(h.beta1, t));
  const double bc2 = __dsub_rn(1.0, ::pow(h.beta2, t));
  return {__double2float_rn(__dsub_rn(1.0, __dmul_rn(lr, h.weight_decay))),
          __double2float_rn(-__ddiv_rn(lr, bc1)), __double2float_rn(__dsqrt_rn(bc2))};
}

template <bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
__device__ __forceinline__ float adam_element(float pv, float g, float& m, float& v, float* vmax,
                                              const AdamHyper& h, const StepScalars& k) {
  const float neg_step = k.neg_step, bc2_sqrt = k.bc2_sqrt;
  if constexpr (kDecay) pv = __fmul_rn(pv, k.decay);
  if constexpr (kL2) g = __fadd_rn(g, __fmul_rn(h.wd, pv));
  const float diff = __fsub_rn(g, m);
  float mi;
  if constexpr (kLerpFromStart) {
    mi = __fadd_rn(m, __fmul_rn(h.w1, diff));
  } else {
    mi = __fsub_rn(g, __fmul_rn(diff, __fsub_rn(1.0f, h.w1)));
  }
  m = mi;
  float vi = __fmul_rn(v, h.b2);
  vi = __fadd_rn(vi, __fmul_rn(h.w2, __fmul_rn(g, g)));
  v = vi;
  if constexpr (kAmsgrad) {
    const float mx = *vmax;
    vi = (mx > vi || mx != mx) ? mx : vi;  // maximum, propagating nan
    *vmax = vi;
  }
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), h.eps);
  return __fadd_rn(pv, __fmul_rn(neg_step, __fdiv_rn(mi, denom)));
}

// The gradient factor as f32 (1 without one): read from device memory for a GPU factor.
__device__ __forceinline__ float factor_of(const AdamHyper& h) {
  if (!h.scaled || h.grad_factor == nullptr) return h.host_grad_factor;
  switch (h.grad_factor_dtype) {
    case ScalarType::Double:
      return loops::convert<float>(*static_cast<const double*>(h.grad_factor));
    case ScalarType::BFloat16:
      return loops::convert<float>(*static_cast<const BFloat16*>(h.grad_factor));
    case ScalarType::Half:
      return loops::convert<float>(*static_cast<const Half*>(h.grad_factor));
    default:
      return *static_cast<const float*>(h.grad_factor);
  }
}

// A gradient as the update reads it: with a factor s, foreach_mul_'s product T(g * s).
template <typename T>
__device__ __forceinline__ float read_grad(T g, const AdamHyper& h, float s) {
  const float gf = loops::convert<float>(g);
  return h.scaled ? loops::convert<float>(loops::convert<T>(__fmul_rn(gf, s))) : gf;
}

// One element through adam_element, state of type S read as f32 and rounded when stored.
template <typename T, typename S, bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
__device__ __forceinline__ void adam_scalar(T* p, const T* g, S* m, S* v, S* vmax, int64_t k,
                                            const AdamHyper& h, float s, const StepScalars& ks) {
  float mf = loops::convert<float>(m[k]);
  float vf = loops::convert<float>(v[k]);
  float xf = 0.0f;
  if constexpr (kAmsgrad) xf = loops::convert<float>(vmax[k]);
  p[k] = loops::convert<T>(adam_element<kDecay, kL2, kAmsgrad, kLerpFromStart>(
      loops::convert<float>(p[k]), read_grad(g[k], h, s), mf, vf, &xf, h, ks));
  m[k] = loops::convert<S>(mf);
  v[k] = loops::convert<S>(vf);
  if constexpr (kAmsgrad) vmax[k] = loops::convert<S>(xf);
}

template <typename T, typename S, bool kDecay, bool kL2, bool kAmsgrad, bool kLerpFromStart>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(const __grid_constant__ Table table, const AdamHyper h) {
  constexpr int kVec = kVecOf<S>;
  static_assert(kChunk % kVec == 0, "a chunk holds whole vectors");
  const int64_t block = blockIdx.x;
  const int i = multi_tensor::entry_of(table, block);
  const Entry& e = table.t[i];
  const int64_t begin = (block - table.block_start[i]) * kChunk;
  const int64_t end = min(begin + kChunk, e.numel);
  T* p = static_cast<T*>(e.param);
  const T* g = static_cast<const T*>(e.grad);
  S* m = static_cast<S*>(e.m);
  S* v = static_cast<S*>(e.v);
  S* vmax = static_cast<S*>(e.vmax);
  const float s = factor_of(h);
  StepScalars ks{h.decay, e.neg_step, e.bc2_sqrt};
  if (h.lr != nullptr) {  // device scalars: uniform across the block
    __shared__ StepScalars shared;
    if (threadIdx.x == 0) shared = device_step_scalars(h, *e.step);
    __syncthreads();
    ks = shared;
  }
  if (e.vectorised) {
    // One pack of kVec elements of p, g, m, v (and vmax) updated in registers.
    auto update = [&](Pack<T, kVec>& pp, const Pack<T, kVec>& gp, Pack<S, kVec>& mp,
                      Pack<S, kVec>& vp, Pack<S, kVec>& xp) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float mf = loops::convert<float>(mp.v[k]);
        float vf = loops::convert<float>(vp.v[k]);
        float xf = 0.0f;
        if constexpr (kAmsgrad) xf = loops::convert<float>(xp.v[k]);
        const float r = adam_element<kDecay, kL2, kAmsgrad, kLerpFromStart>(
            loops::convert<float>(pp.v[k]), read_grad(gp.v[k], h, s), mf, vf, &xf, h, ks);
        pp.v[k] = loops::convert<T>(r);
        mp.v[k] = loops::convert<S>(mf);
        vp.v[k] = loops::convert<S>(vf);
        if constexpr (kAmsgrad) xp.v[k] = loops::convert<S>(xf);
      }
    };
    auto load = [](const auto* base, int64_t j) {
      return *reinterpret_cast<
          const Pack<std::remove_cv_t<std::remove_pointer_t<decltype(base)>>, kVec>*>(base + j);
    };
    auto store = [](auto* base, int64_t j, const auto& pack) {
      *reinterpret_cast<std::remove_cvref_t<decltype(pack)>*>(base + j) = pack;
    };
    constexpr int64_t kStride = int64_t{kThreads} * kVec;
    int64_t j = begin + threadIdx.x * kVec;
    // Two packs a thread at once while both are whole: all their loads are in flight before
    // either is computed (f32 moments over llama-3.2-1b's parameters on an H100: 97% of copy
    // bandwidth, against 92% one pack at a time; benchmarks/RESULTS.md, session 30).
    for (; j + kStride + kVec <= end; j += 2 * kStride) {
      Pack<T, kVec> p0 = load(p, j), p1 = load(p, j + kStride);
      const Pack<T, kVec> g0 = load(g, j), g1 = load(g, j + kStride);
      Pack<S, kVec> m0 = load(m, j), m1 = load(m, j + kStride);
      Pack<S, kVec> v0 = load(v, j), v1 = load(v, j + kStride);
      Pack<S, kVec> x0, x1;
      if constexpr (kAmsgrad) {
        x0 = load(vmax, j);
        x1 = load(vmax, j + kStride);
      }
      update(p0, g0, m0, v0, x0);
      update(p1, g1, m1, v1, x1);
      store(p, j, p0);
      store(p, j + kStride, p1);
      store(m, j, m0);
      store(m, j + kStride, m1);
      store(v, j, v0);
      store(v, j + kStride, v1);
      if constexpr (kAmsgrad) {
        store(vmax, j, x0);
        store(vmax, j + kStride, x1);
      }
    }
    for (; j < end; j += kStride) {
      if (j + kVec <= end) {
        Pack<T, kVec> pp = load(p, j);
        Pack<S, kVec> mp = load(m, j), vp = load(v, j), xp;
        if constexpr (kAmsgrad) xp = load(vmax, j);
        update(pp, load(g, j), mp, vp, xp);
        store(p, j, pp);
        store(m, j, mp);
        store(v, j, vp);
        if constexpr (kAmsgrad) store(vmax, j, xp);
      } else {
        for (int64_t k = j; k < end; ++k) {
          adam_scalar<T, S, kDecay, kL2, kAmsgrad, kLerpFromStart>(p, g, m, v, vmax, k, h, s, ks);
        }
      }
    }
  } else {
    for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) {
      adam_scalar<T, S, kDecay, kL2, kAmsgrad, kLerpFromStart>(p, g, m, v, vmax, k, h, s, ks);
    }
  }
}

// Launches adam_kernel<T, S, flags...> for the runtime flags.
template <typename T, typename S, bool... kFlags, typename... Rest>
void launch(const Table& table, const AdamHyper& h, cudaStream_t stream, bool flag, Rest... rest) {
  if constexpr (sizeof...(Rest) == 0) {
    const unsigned grid = table.grid();
    if (flag) {
      adam_kernel<T, S, kFlags..., true><<<grid, kThreads, 0, stream>>>(table, h);
    } else {
      adam_kernel<T, S, kFlags..., false><<<grid, kThreads, 0, stream>>>(table, h);
    }
    KILN_CUDA_LAUNCH_CHECK("adam_kernel");
  } else {
    flag ? launch<T, S, kFlags..., true>(table, h, stream, rest...)
         : launch<T, S, kFlags..., false>(table, h, stream, rest...);
  }
}

}  // namespace

void multi_tensor_adam(ScalarType param_dtype, ScalarType state_dtype, int device,
                       const std::vector<AdamTensor>& tensors, const AdamHyper& h) {
  KILN_CHECK(param_dtype == kFloat || param_dtype == kBFloat16 || param_dtype == kHalf,
             "[adam] the multi-tensor CUDA kernel takes f32, bf16 or f16 parameters, got ",
             dtype_name(param_dtype));
  KILN_CHECK(state_dtype == kFloat || state_dtype == param_dtype,
             "[adam] the multi-tensor CUDA kernel keeps the state in f32 or in the parameters' "
             "dtype (",
             dtype_name(param_dtype), "), got ", dtype_name(state_dtype));
  for (const AdamTensor& a : tensors) {
    KILN_CHECK(a.numel == 0 || (h.lr == nullptr) == (a.step == nullptr),
               "[adam] the step counts are on the device exactly when the lr is");
  }
  DeviceGuard guard(device);
  const cudaStream_t stream = current_stream();
  const bool decay = h.decoupled && h.wd != 0;
  const bool l2 = !h.decoupled && h.wd != 0;
  const bool from_start = std::abs(h.w1) < 0.5f;
  const size_t elem = element_size(param_dtype);
  const size_t state_elem = element_size(state_dtype);
  const size_t vec = 16 / state_elem;  // kVecOf<S>
  auto tables = multi_tensor::table_filler<Table>([&](const Table& table, int64_t) {
    visit_dtype(param_dtype, [&]<typename T>(TypeTag<T>) {
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, BFloat16> ||
                    std::is_same_v<T, Half>) {
        if (state_dtype == kFloat) {
          launch<T, float>(table, h, stream, decay, l2, h.amsgrad, from_start);
        } else if constexpr (!std::is_same_v<T, float>) {
          launch<T, T>(table, h, stream, decay, l2, h.amsgrad, from_start);
        }
      }
    });
  });
  for (const AdamTensor& a : tensors) {
    if (a.numel == 0) continue;
    Entry e{};
    e.param = a.param;
    e.grad = a.grad;
    e.m = a.exp_avg;
    e.v = a.exp_avg_sq;
    e.vmax = a.max_exp_avg_sq;
    e.numel = a.numel;
    e.neg_step = a.neg_step_size;
    e.bc2_sqrt = a.bc2_sqrt;
    e.step = a.step;
    const size_t state_bytes = state_elem * vec;  // 16
    const bool vectorised =
        multi_tensor::aligned(a.param, elem * vec) && multi_tensor::aligned(a.grad, elem * vec) &&
        multi_tensor::aligned(a.exp_avg, state_bytes) &&
        multi_tensor::aligned(a.exp_avg_sq, state_bytes) &&
        (a.max_exp_avg_sq == nullptr || multi_tensor::aligned(a.max_exp_avg_sq, state_bytes));
    e.vectorised = vectorised ? 1 : 0;
    tables.add(e, multi_tensor::chunks(a.numel, kChunk));
  }
  tables.flush();
}

namespace {

// The call's scalars shared by all its parameters, as the kernel takes them (the CPU kernel's),
// its gradient factor (a GPU one by address, a CPU one by value) and, for device scalars, the
// lr's address and the f64 hyper-parameters the device derivation takes.
AdamHyper adam_hyper(const kiln::internal::AdamUpdateCall& a) {
  AdamHyper h{a.device_scalars ? 1.0f : static_cast<float>(1 - a.lr * a.weight_decay),
              static_cast<float>(a.weight_decay),
              static_cast<float>(1 - a.beta1),
              static_cast<float>(a.beta2),
              static_cast<float>(1 - a.beta2),
              static_cast<float>(a.eps),
              a.decoupled_weight_decay,
              a.amsgrad};
  if (a.device_scalars) {
    h.lr = a.lr_tensor.data_ptr<double>();
    h.beta1 = a.beta1;
    h.beta2 = a.beta2;
    h.weight_decay = a.weight_decay;
  }
  const Tensor& f = a.grad_factor;
  if (!f.defined()) return h;
  h.scaled = true;
  if (loops::is_host_scalar(f)) {
    h.host_grad_factor = loops::read_host_scalar<float>(f);
  } else {
    h.grad_factor = f.data_ptr();
    h.grad_factor_dtype = f.dtype();
  }
  return h;
}

// The kernel computes in f32: f32, bf16 and f16 parameters (a call holds one dtype).
bool adam_update_cuda_supports(const OpCall& c) {
  return kiln::internal::optim_compute_dtype(c) == kFloat;
}

void adam_update_cuda(OpCall& c) {
  const kiln::internal::AdamUpdateCall a(c, kiln::internal::OptimDecode::kHostValues);
  if (a.params.empty()) return;
  const ScalarType param_dtype = a.params[0].dtype();
  const ScalarType state_dtype = a.exp_avgs[0].dtype();
  const int device = a.params[0].device().index();
  std::vector<AdamTensor> direct;  // contiguous: updated in place
  std::vector<AdamTensor> copied;  // strided: contiguous f32 copies, stored back afterwards
  std::vector<Tensor> alive;       // grads made contiguous, alive until their launch is queued
  std::vector<std::pair<Tensor, Tensor>> stores;  // (target, f32 copy)
  for (size_t i = 0; i < a.params.size(); ++i) {
    float neg_step = 0, bc2_sqrt = 0;
    const int64_t* step = nullptr;
    if (a.device_scalars) {
      step = a.state_steps[i].data_ptr<int64_t>();
    } else {
      const kiln::internal::AdamStepScalars k = a.step_scalars(i);
      neg_step = static_cast<float>(-k.step_size);
      bc2_sqrt = static_cast<float>(k.bc2_sqrt);
    }
    const Tensor& p = a.params[i];
    const Tensor* vmax = a.amsgrad ? &a.max_exp_avg_sqs[i] : nullptr;
    if (p.is_contiguous() && a.exp_avgs[i].is_contiguous() && a.exp_avg_sqs[i].is_contiguous() &&
        (vmax == nullptr || vmax->is_contiguous())) {
      const Tensor g = a.grads[i].contiguous();
      alive.push_back(g);
      direct.push_back({p.data_ptr(), g.data_ptr(), a.exp_avgs[i].data_ptr(),
                        a.exp_avg_sqs[i].data_ptr(), vmax != nullptr ? vmax->data_ptr() : nullptr,
                        p.numel(), neg_step, bc2_sqrt, step});
      continue;
    }
    auto f32 = [&](const Tensor& t) {
      Tensor copy = t.to(t.device(), kFloat, /*non_blocking=*/false, /*copy=*/true).contiguous();
      stores.emplace_back(t, copy);
      return copy.data_ptr();
    };
    // The factor applied here, as the kernel applies it (rounded to the grad's dtype): the f32
    // launch below runs without it.
    Tensor g = a.grads[i];
    if (a.grad_factor.defined()) g = g.mul(a.grad_factor.to(kFloat)).to(g.dtype());
    g = g.to(kFloat).contiguous();
    alive.push_back(g);
    void* pp = f32(p);
    void* mp = f32(a.exp_avgs[i]);
    void* vp = f32(a.exp_avg_sqs[i]);
    void* xp = vmax != nullptr ? f32(*vmax) : nullptr;
    copied.push_back({pp, g.data_ptr(), mp, vp, xp, p.numel(), neg_step, bc2_sqrt, step});
  }
  const AdamHyper h = adam_hyper(a);
  multi_tensor_adam(param_dtype, state_dtype, device, direct, h);
  AdamHyper unscaled = h;
  unscaled.scaled = false;
  multi_tensor_adam(kFloat, kFloat, device, copied, unscaled);
  for (auto& [target, copy] : stores) target.copy_(copy);
}

// --- increment_ ---------------------------------------------------------------------------------

// The counts of one launch: their addresses in the kernel's arguments.
constexpr int kMaxCounts = 480;
struct CountTable {
  int64_t* count[kMaxCounts];
  int n;
};
static_assert(sizeof(CountTable) < multi_tensor::kMaxArgBytes, "kernel arguments are limited");

__global__ void increment_kernel(const __grid_constant__ CountTable table) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < table.n) ++*table.count[i];
}

void increment_cuda(OpCall& c) {
  if (c.outputs.empty()) return;
  DeviceGuard guard(c.outputs[0].device().index());
  const cudaStream_t stream = current_stream();
  CountTable table{};
  auto flush = [&] {
    if (table.n == 0) return;
    increment_kernel<<<(table.n + 127) / 128, 128, 0, stream>>>(table);
    KILN_CUDA_LAUNCH_CHECK("increment_kernel");
    table = CountTable{};
  };
  for (const Tensor& t : c.outputs) {
    if (table.n == kMaxCounts) flush();
    table.count[table.n++] = t.data_ptr<int64_t>();
  }
  flush();
}

}  // namespace

KILN_REGISTER_KERNEL_IF(adam_update_, kCUDA, "multi_tensor", adam_update_cuda,
                        adam_update_cuda_supports);
KILN_REGISTER_KERNEL(increment_, kCUDA, increment_cuda);

}  // namespace kiln::cuda::internal
