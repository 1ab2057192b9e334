// CUDA kernel for cat (CPU: kernels/cpu/join.cpp): each input is converted to the result dtype
// (if needed) and made contiguous on the GPU, then copied into its column band of the
// contiguous output with one strided device-to-device copy (cudaMemcpy2DAsync: `outer` rows of
// the input's bytes per outer index, at the output's row pitch).
#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

void cat_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), "cat");
  int64_t outer = 1;
  for (int64_t k = 0; k < d; ++k) outer *= out.sizes()[k];
  const int64_t es = static_cast<int64_t>(out.element_size());
  const int64_t out_row = out.numel() / outer * es;  // bytes per outer index in the output
  char* o = static_cast<char*>(out.data_ptr());
  int64_t offset = 0;  // bytes into an output row where the next input starts
  for (const Tensor& in : c.inputs) {
    if (in.numel() == 0) continue;  // also skips legacy [0] tensors
    KILN_CHECK(in.is_cuda(), "[cat] expected all tensors on ", out.device().str(), ", got one on ",
               in.device().str());
    const Tensor src = loops::as_dtype(in, out.dtype()).contiguous();
    const int64_t chunk = src.numel() / outer * es;  // bytes per outer index in this input
    KILN_CUDA_CHECK(cudaMemcpy2DAsync(o + offset, static_cast<size_t>(out_row), src.data_ptr(),
                                      static_cast<size_t>(chunk), static_cast<size_t>(chunk),
                                      static_cast<size_t>(outer), cudaMemcpyDeviceToDevice,
                                      current_stream()));
    internal::sync_if_debug("cudaMemcpy2DAsync (cat)", __FILE__, __LINE__);
    offset += chunk;
  }
}

}  // namespace

KILN_REGISTER_KERNEL(cat, kCUDA, cat_cuda);

}  // namespace kiln::cuda
