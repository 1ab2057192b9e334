// CUDA kernels of sort and topk (argsort is sort's indices), with the semantics of
// kernels/cpu/sort.cpp: stable (ties keep their input order, also when descending), NaN larger
// than every number, topk's ties broken by the lower position and its result always sorted.
//
// Each value becomes an order-preserving unsigned key (sort.cuh), the rows along `dim` are
// sorted as (key, column) pairs by CUB (one device-wide radix sort for a single row, the
// segmented sort for several), and a last kernel gathers the values at the sorted columns from
// the input itself, so values come out bit for bit (including -0.0 and NaN payloads). topk
// sorts whole rows and keeps the first k columns.
//
// Also here: sort_positions (declared in sort.cuh), the row sort that multinomial, randperm and
// index_put_ use.
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_sort.cuh>
#include <limits>

#include "kernels/cuda/index_util.cuh"
#include "kernels/cuda/sort.cuh"

#define KILN_GRID_STRIDE(i, n)                                                           \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

namespace kiln::cuda {
namespace internal {
namespace {

// columns[i] = i % size: the values that travel with the keys.
template <typename P>
__global__ void columns_kernel(P* columns, int64_t n, int64_t size) {
  KILN_GRID_STRIDE(i, n) { columns[i] = static_cast<P>(i % size); }
}

// offsets[r] = r * size for r in [0, rows]: the segment bounds of the row-major rows.
__global__ void row_offsets_kernel(int64_t* offsets, int64_t rows, int64_t size) {
  KILN_GRID_STRIDE(r, rows + 1) { offsets[r] = r * size; }
}

template <typename K, typename P>
Tensor sort_typed(const K* keys, int64_t rows, int64_t size, bool descending, Device device,
                  int key_bits) {
  const int64_t n = rows * size;
  const cudaStream_t stream = current_stream();
  Tensor columns = loops::empty_on({n}, dtype_of<P>(), device);
  Tensor sorted = loops::empty_on({n}, dtype_of<P>(), device);
  Tensor keys_out = device_bytes(n * static_cast<int64_t>(sizeof(K)), device);
  P* cin = static_cast<P*>(columns.data_ptr());
  P* cout = static_cast<P*>(sorted.data_ptr());
  K* kout = static_cast<K*>(keys_out.data_ptr());
  columns_kernel<P><<<loops::grid_for(n), loops::kThreads, 0, stream>>>(cin, n, size);
  KILN_CUDA_LAUNCH_CHECK("columns_kernel");
  size_t bytes = 0;
  if (rows == 1) {
    // One row: the device-wide radix sort (the segmented sorts give a segment one block).
    const int end_bit = key_bits > 0 ? key_bits : int(sizeof(K) * 8);
    auto run = [&](void* temp) {
      return descending ? cub::DeviceRadixSort::SortPairsDescending(temp, bytes, keys, kout, cin,
                                                                    cout, n, 0, end_bit, stream)
                        : cub::DeviceRadixSort::SortPairs(temp, bytes, keys, kout, cin, cout, n, 0,
                                                          end_bit, stream);
    };
    KILN_CUDA_CHECK(run(nullptr));
    Tensor temp = device_bytes(static_cast<int64_t>(bytes), device);
    KILN_CUDA_CHECK(run(temp.data_ptr()));
  } else {
    Tensor offsets = loops::empty_on({rows + 1}, kInt64, device);
    int64_t* off = static_cast<int64_t*>(offsets.data_ptr());
    row_offsets_kernel<<<loops::grid_for(rows + 1), loops::kThreads, 0, stream>>>(off, rows, size);
    KILN_CUDA_LAUNCH_CHECK("row_offsets_kernel");
    auto run = [&](void* temp) {
      return descending ? cub::DeviceSegmentedSort::StableSortPairsDescending(
                              temp, bytes, keys, kout, cin, cout, n, rows, off, off + 1, stream)
                        : cub::DeviceSegmentedSort::StableSortPairs(
                              temp, bytes, keys, kout, cin, cout, n, rows, off, off + 1, stream);
    };
    KILN_CUDA_CHECK(run(nullptr));
    Tensor temp = device_bytes(static_cast<int64_t>(bytes), device);
    KILN_CUDA_CHECK(run(temp.data_ptr()));
  }
  internal::sync_if_debug("cub sort", __FILE__, __LINE__);
  return sorted;
}

template <typename K>
Tensor sort_keys(const void* keys, int64_t rows, int64_t size, bool descending, Device device,
                 int key_bits) {
  const K* k = static_cast<const K*>(keys);
  if (size <= std::numeric_limits<int32_t>::max()) {
    return sort_typed<K, int32_t>(k, rows, size, descending, device, key_bits);
  }
  return sort_typed<K, int64_t>(k, rows, size, descending, device, key_bits);
}

}  // namespace

Tensor sort_positions(const void* keys, int key_bytes, int64_t rows, int64_t size, bool descending,
                      Device device, int key_bits) {
  KILN_CHECK(rows >= 0 && size >= 0, "[sort] internal: bad row geometry ", rows, " x ", size);
  KILN_CHECK(key_bits >= 0 && key_bits <= key_bytes * 8 && (key_bits == 0 || rows == 1),
             "[sort] internal: ", key_bits, " key bits for ", rows, " rows of ", key_bytes,
             "-byte keys");
  if (rows * size == 0) return loops::empty_on({0}, kInt32, device);
  switch (key_bytes) {
    case 1:
      return sort_keys<uint8_t>(keys, rows, size, descending, device, key_bits);
    case 2:
      return sort_keys<uint16_t>(keys, rows, size, descending, device, key_bits);
    case 4:
      return sort_keys<uint32_t>(keys, rows, size, descending, device, key_bits);
    case 8:
      return sort_keys<uint64_t>(keys, rows, size, descending, device, key_bits);
    default:
      KILN_FAIL("[sort] internal: unsupported key width ", key_bytes);
  }
}

}  // namespace internal

namespace {

using internal::KeyOf;
using internal::visit_bytes;
using loops::Geometry;

// The rows along dim d of an input and of the outputs: row r's first element sits at offset
// off[0] (input) and off[1] (outputs) of the geometry over the shape without d; the elements
// of a row are `src_stride` / `out_stride` apart.
struct Rows {
  Geometry<2> g;
  int64_t count = 1, size = 1, src_stride = 1, out_stride = 1;
};

Rows plan_rows(const Tensor& src, const Tensor& out, int64_t d, const char* op) {
  Rows r;
  if (src.dim() == 0) {  // one row of one element
    const Shape none[2] = {Shape{}, Shape{}};
    r.g = loops::make_geometry<2>(Shape{}, none, op);
    return r;
  }
  Shape sizes, src_strides, out_strides;
  for (int64_t k = 0; k < src.dim(); ++k) {
    if (k == d) continue;
    sizes.push_back(src.sizes()[k]);
    src_strides.push_back(src.strides()[k]);
    out_strides.push_back(out.strides()[k]);
  }
  const Shape strides[2] = {src_strides, out_strides};
  r.g = loops::make_geometry<2>(sizes, strides, op);
  r.count = numel_of(sizes);
  r.size = src.sizes()[d];
  r.src_stride = src.strides()[d];
  r.out_stride = out.strides()[d];
  return r;
}

// keys[r * size + j] = ordered_key(element j of row r).
template <typename T>
__global__ void keys_kernel(KeyOf<T>* keys, const T* src, int64_t n, int64_t size, Geometry<2> g,
                            int64_t src_stride) {
  KILN_GRID_STRIDE(i, n) {
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, i / size, off);
    keys[i] = internal::ordered_key(src[off[0] + (i % size) * src_stride]);
  }
}

// The first k sorted columns of each row: values (raw element copies) and int64 indices.
template <typename U, typename P>
__global__ void take_kernel(U* values, int64_t* indices, const U* src, const P* columns, int64_t n,
                            int64_t k, int64_t size, Geometry<2> g, int64_t src_stride,
                            int64_t out_stride) {
  KILN_GRID_STRIDE(i, n) {
    const int64_t r = i / k, j = i % k;
    int64_t off[2];
    loops::offsets<int64_t, 2>(g, r, off);
    const int64_t p = static_cast<int64_t>(columns[r * size + j]);
    values[off[1] + j * out_stride] = src[off[0] + p * src_stride];
    indices[off[1] + j * out_stride] = p;
  }
}

// Sorts the rows of `src` along d and writes the first k of each into values/indices.
void sort_rows_into(const Tensor& src, const Tensor& values, const Tensor& indices, int64_t d,
                    int64_t k, bool descending, const char* op) {
  DeviceGuard guard(values.device().index());
  const cudaStream_t stream = current_stream();
  const Rows r = plan_rows(src, values, d, op);
  const int64_t n = r.count * r.size;
  if (n == 0 || k == 0) return;
  visit_dtype(src.dtype(), [&]<typename T>(TypeTag<T>) {
    using K = KeyOf<T>;
    Tensor keys = internal::device_bytes(n * static_cast<int64_t>(sizeof(K)), src.device());
    keys_kernel<T><<<loops::grid_for(n), loops::kThreads, 0, stream>>>(
        static_cast<K*>(keys.data_ptr()), static_cast<const T*>(src.data_ptr()), n, r.size, r.g,
        r.src_stride);
    KILN_CUDA_LAUNCH_CHECK("keys_kernel");
    const Tensor columns = internal::sort_positions(keys.data_ptr(), sizeof(K), r.count, r.size,
                                                    descending, src.device());
    const int64_t m = r.count * k;
    visit_bytes(src.dtype(), [&]<typename U>(TypeTag<U>) {
      auto launch = [&]<typename P>(TypeTag<P>) {
        take_kernel<U, P><<<loops::grid_for(m), loops::kThreads, 0, stream>>>(
            static_cast<U*>(values.data_ptr()), static_cast<int64_t*>(indices.data_ptr()),
            static_cast<const U*>(src.data_ptr()), static_cast<const P*>(columns.data_ptr()), m, k,
            r.size, r.g, r.src_stride, r.out_stride);
        KILN_CUDA_LAUNCH_CHECK("take_kernel");
      };
      if (columns.dtype() == kInt32) {
        launch(TypeTag<int32_t>{});
      } else {
        launch(TypeTag<int64_t>{});
      }
    });
  });
}

// inputs: self; attrs: dim, descending, stable (sorting is always stable).
void sort_cuda(OpCall& c) {
  const Tensor& src = c.input(0);
  const int64_t d = src.dim() == 0 ? 0 : wrap_dim(c.attr<int64_t>(0), src.dim(), "sort");
  sort_rows_into(src, c.outputs[0], c.outputs[1], d, src.dim() == 0 ? 1 : src.sizes()[d],
                 c.attr<bool>(1), "sort");
}

// inputs: self; attrs: k, dim, largest, sorted (the result is always sorted).
void topk_cuda(OpCall& c) {
  const Tensor& src = c.input(0);
  const int64_t d = src.dim() == 0 ? 0 : wrap_dim(c.attr<int64_t>(1), src.dim(), "topk");
  sort_rows_into(src, c.outputs[0], c.outputs[1], d, c.attr<int64_t>(0), c.attr<bool>(2), "topk");
}

}  // namespace

KILN_REGISTER_KERNEL(sort, kCUDA, sort_cuda);
KILN_REGISTER_KERNEL(topk, kCUDA, topk_cuda);

}  // namespace kiln::cuda

#undef KILN_GRID_STRIDE
