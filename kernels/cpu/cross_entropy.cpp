// CPU kernels of cross_entropy_fused, its backward and the two in one call
// (cross_entropy_fused_with_grad; tensor/ops/cross_entropy.cpp): the
// reference the CUDA kernels are tested against. Rows run in parallel; each row's logsumexp
// takes one pass with a running maximum and rescaled sum (the CUDA kernel's method), in the
// compute type (f32 for f16/bf16/f32, f64 for f64). The mean is summed in f64.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/fused_support.h"
#include "tensor/ops.h"
#include "tensor/parallel.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

void check_target(const std::string& op, int64_t t, int64_t v, int64_t ignore_index) {
  KILN_CHECK(t == ignore_index || (t >= 0 && t < v), "[", op, "] target ", t,
             " is out of bounds for ", v, " classes");
}

void cross_entropy_cpu(OpCall& c) {
  const Tensor logits = c.input(0).contiguous();
  const Tensor targets = c.input(1).contiguous();
  const int64_t ignore = c.attr<int64_t>(0);
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t* pt = targets.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) check_target(c.name(), pt[i], v, ignore);
  visit_floating(logits.dtype(), "cross_entropy_fused", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    const T* px = logits.data_ptr<T>();
    Acc* plse = c.outputs[1].data_ptr<Acc>();
    std::vector<double> row_loss(static_cast<size_t>(n), 0.0);
    internal::parallel_for(0, n, std::max<int64_t>(1, 32768 / v), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const T* row = px + i * v;
        Acc m = -std::numeric_limits<Acc>::infinity(), s = 0;
        for (int64_t j = 0; j < v; ++j) {
          const Acc x = static_cast<Acc>(row[j]);
          if (x > m) {
            s = s * std::exp(m - x) + Acc(1);
            m = x;
          } else if (x != -std::numeric_limits<Acc>::infinity()) {
            s += std::exp(x - m);
          }
        }
        const Acc lse = m + std::log(s);
        plse[i] = lse;
        if (pt[i] != ignore) row_loss[i] = static_cast<double>(lse - static_cast<Acc>(row[pt[i]]));
      }
    });
    double sum = 0;
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (pt[i] == ignore) continue;
      sum += row_loss[i];
      ++count;
    }
    *c.outputs[0].data_ptr<Acc>() = static_cast<Acc>(sum / static_cast<double>(count));
  });
}

void cross_entropy_backward_cpu(OpCall& c) {
  const Tensor logits = c.input(1).contiguous();
  const Tensor targets = c.input(2).contiguous();
  const Tensor lse = c.input(3).contiguous();
  const int64_t ignore = c.attr<int64_t>(0);
  const int64_t n = logits.size(0), v = logits.size(1);
  const int64_t* pt = targets.data_ptr<int64_t>();
  int64_t count = 0;
  for (int64_t i = 0; i < n; ++i) {
    check_target(c.name(), pt[i], v, ignore);
    count += pt[i] != ignore;
  }
  const double g = c.input(0).item<double>();
  visit_floating(logits.dtype(), "cross_entropy_fused_backward", [&]<typename T>(TypeTag<T>) {
    using Acc = opmath_t<T>;
    const T* px = logits.data_ptr<T>();
    const Acc* plse = lse.data_ptr<Acc>();
    T* pd = c.outputs[0].data_ptr<T>();
    const Acc scale = static_cast<Acc>(g / static_cast<double>(count));
    internal::parallel_for(0, n, std::max<int64_t>(1, 32768 / v), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        T* out = pd + i * v;
        if (pt[i] == ignore) {
          for (int64_t j = 0; j < v; ++j) out[j] = T(Acc(0));
          continue;
        }
        const T* row = px + i * v;
        for (int64_t j = 0; j < v; ++j) {
          const Acc p = std::exp(static_cast<Acc>(row[j]) - plse[i]);
          out[j] = T((p - (j == pt[i] ? Acc(1) : Acc(0))) * scale);
        }
      }
    });
  });
}

// cross_entropy_fused_with_grad: the two kernels above, one after the other.
void cross_entropy_with_grad_cpu(OpCall& c) {
  cross_entropy_with_grad_in_two(c, cross_entropy_cpu, cross_entropy_backward_cpu);
}

}  // namespace

KILN_REGISTER_KERNEL_IF(cross_entropy_fused, kCPU, "fused", cross_entropy_cpu,
                        cross_entropy_supported);
KILN_REGISTER_KERNEL(cross_entropy_fused_backward, kCPU, cross_entropy_backward_cpu);
KILN_REGISTER_KERNEL(cross_entropy_fused_with_grad, kCPU, cross_entropy_with_grad_cpu);

}  // namespace kiln::cpu
