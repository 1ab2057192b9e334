// CPU kernel for cat: each input is converted to the result dtype (if needed), made contiguous,
// and copied as blocks of rows into the contiguous output, rows split across threads.
#include <cstring>

#include "kernels/cpu/loops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

void cat_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), "cat");
  int64_t outer = 1;
  for (int64_t k = 0; k < d; ++k) outer *= out.sizes()[k];
  const int64_t es = static_cast<int64_t>(out.element_size());
  const int64_t out_row = out.numel() / outer * es;  // bytes per outer index in the output
  char* o = static_cast<char*>(out.data_ptr());
  int64_t offset = 0;  // bytes into an output row where the next input starts
  for (const Tensor& in : c.inputs) {
    if (in.numel() == 0) continue;  // also skips legacy [0] tensors
    const Tensor src = as_dtype(in, out.dtype()).contiguous();
    const int64_t chunk = src.numel() / outer * es;  // bytes per outer index in this input
    const char* s = static_cast<const char*>(src.data_ptr());
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize * 4 / chunk);
    internal::parallel_for(0, outer, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        std::memcpy(o + r * out_row + offset, s + r * chunk, static_cast<size_t>(chunk));
      }
    });
    offset += chunk;
  }
}

}  // namespace

KILN_REGISTER_KERNEL(cat, kCPU, cat_cpu);

}  // namespace kiln::cpu
