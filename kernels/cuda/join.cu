// CUDA kernel for cat (CPU: kernels/cpu/join.cpp): each input is converted to the result dtype
// (if needed) and made contiguous on the GPU, then copied into its column band of the
// contiguous output: a large input with one strided device-to-device copy (cudaMemcpy2DAsync:
// `outer` rows of the input's bytes per outer index, at the output's row pitch), the small ones
// (up to kSmallBytes each) together, one block per input, in one launch per table of
// kMaxSmall (small_copy_kernel): stack(foreach_norm(grads)) of a model's 100-odd gradients is one
// launch, not 100 copies.
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "kernels/cuda/loops.cuh"

namespace kiln::cuda {
namespace {

constexpr int64_t kSmallBytes = 64 * 1024;
constexpr int kMaxSmall = 96;
constexpr int kSmallThreads = 256;

// One small input: `rows` rows of `row_bytes` bytes, contiguous at src, going to dst at the
// output's row pitch; width: the widest access (1 to 16 bytes) that divides the pointers, the
// row size and the pitch.
struct SmallCopy {
  const char* src;
  char* dst;
  int64_t row_bytes;
  int64_t rows;
  int width;
};
struct SmallCopies {
  SmallCopy t[kMaxSmall];
  int count;
};
static_assert(sizeof(SmallCopies) + sizeof(int64_t) < 4000,
              "kernel arguments are limited to 4 KiB");

template <typename W>
__device__ __forceinline__ void copy_rows(const SmallCopy& e, int64_t pitch) {
  const int64_t per_row = e.row_bytes / static_cast<int64_t>(sizeof(W));
  const int64_t total = per_row * e.rows;
  const W* src = reinterpret_cast<const W*>(e.src);
  for (int64_t k = threadIdx.x; k < total; k += blockDim.x) {
    const int64_t r = k / per_row;
    reinterpret_cast<W*>(e.dst + r * pitch)[k - r * per_row] = src[k];
  }
}

__global__ void __launch_bounds__(kSmallThreads)
    small_copy_kernel(const __grid_constant__ SmallCopies table, int64_t pitch) {
  const SmallCopy& e = table.t[blockIdx.x];
  switch (e.width) {
    case 16:
      copy_rows<uint4>(e, pitch);
      break;
    case 8:
      copy_rows<uint2>(e, pitch);
      break;
    case 4:
      copy_rows<uint32_t>(e, pitch);
      break;
    case 2:
      copy_rows<uint16_t>(e, pitch);
      break;
    default:
      copy_rows<uint8_t>(e, pitch);
  }
}

// The widest of 16, 8, 4, 2, 1 bytes that divides every value.
int access_width(std::initializer_list<uint64_t> values) {
  uint64_t all = 0;
  for (uint64_t v : values) all |= v;
  for (int w = 16; w > 1; w /= 2) {
    if (all % static_cast<uint64_t>(w) == 0) return w;
  }
  return 1;
}

void cat_cuda(OpCall& c) {
  const Tensor& out = c.outputs[0];
  if (out.numel() == 0) return;
  DeviceGuard guard(out.device().index());
  const cudaStream_t stream = current_stream();
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), "cat");
  int64_t outer = 1;
  for (int64_t k = 0; k < d; ++k) outer *= out.sizes()[k];
  const int64_t es = static_cast<int64_t>(out.element_size());
  const int64_t out_row = out.numel() / outer * es;  // bytes per outer index in the output
  char* o = static_cast<char*>(out.data_ptr());
  int64_t offset = 0;         // bytes into an output row where the next input starts
  std::vector<Tensor> alive;  // the small inputs' sources, alive until their launch is queued
  SmallCopies small{};
  auto flush = [&] {
    if (small.count == 0) return;
    small_copy_kernel<<<static_cast<unsigned>(small.count), kSmallThreads, 0, stream>>>(small,
                                                                                        out_row);
    KILN_CUDA_LAUNCH_CHECK("small_copy_kernel");
    small = SmallCopies{};
    alive.clear();
  };
  for (const Tensor& in : c.inputs) {
    if (in.numel() == 0) continue;  // also skips legacy [0] tensors
    KILN_CHECK(in.is_cuda(), "[cat] expected all tensors on ", out.device().str(), ", got one on ",
               in.device().str());
    const Tensor src = loops::as_dtype(in, out.dtype()).contiguous();
    const int64_t chunk = src.numel() / outer * es;  // bytes per outer index in this input
    if (chunk * outer <= kSmallBytes) {
      if (small.count == kMaxSmall) flush();
      const char* from = static_cast<const char*>(src.data_ptr());
      char* to = o + offset;
      small.t[small.count++] = {
          from, to, chunk, outer,
          access_width({reinterpret_cast<uintptr_t>(from), reinterpret_cast<uintptr_t>(to),
                        static_cast<uint64_t>(chunk), static_cast<uint64_t>(out_row)})};
      alive.push_back(src);
    } else {
      KILN_CUDA_CHECK(cudaMemcpy2DAsync(o + offset, static_cast<size_t>(out_row), src.data_ptr(),
                                        static_cast<size_t>(chunk), static_cast<size_t>(chunk),
                                        static_cast<size_t>(outer), cudaMemcpyDeviceToDevice,
                                        stream));
      internal::sync_if_debug("cudaMemcpy2DAsync (cat)", __FILE__, __LINE__);
    }
    offset += chunk;
  }
  flush();
}

}  // namespace

KILN_REGISTER_KERNEL(cat, kCUDA, cat_cuda);

}  // namespace kiln::cuda
