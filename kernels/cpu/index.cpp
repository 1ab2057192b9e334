// CPU kernels for the indexing ops (see tensor/ops/index.cpp for their rules).
//
// Most of them move whole elements without looking at their values, so they dispatch on the
// element size only (1, 2, 4 or 8 bytes) and work on any strides. Every index read is checked
// against its dim before memory is touched: a bad index raises kiln::Error, never a wild read.
// Position lists (`offsets_of`) turn strided sub-shapes into flat element offsets once, so
// inner loops are plain array walks.
#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#include "kernels/cpu/loops.h"
#include "tensor/ops.h"
#include "tensor/registry.h"

namespace kiln::cpu {
namespace {

using Offsets = std::vector<int64_t>;

// Element offsets (row-major over `sizes`) of a layout with `strides`.
Offsets offsets_of(IntArrayRef sizes, IntArrayRef strides) {
  const int64_t n = numel_of(sizes);
  Offsets out(static_cast<size_t>(n));
  if (n == 0) return out;
  const int64_t nd = static_cast<int64_t>(sizes.size());
  Shape idx(nd, 0);
  int64_t off = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = off;
    for (int64_t d = nd - 1; d >= 0; --d) {
      if (++idx[d] < sizes[d]) {
        off += strides[d];
        break;
      }
      off -= (sizes[d] - 1) * strides[d];
      idx[d] = 0;
    }
  }
  return out;
}

// Element strides of `t` read as broadcast to `sizes` (0 along broadcast dims).
Shape expand_strides(const Tensor& t, IntArrayRef sizes) {
  Shape out(sizes.size(), 0);
  const size_t lead = sizes.size() - static_cast<size_t>(t.dim());
  for (int64_t d = 0; d < t.dim(); ++d) {
    out[lead + d] = t.sizes()[d] == 1 ? 0 : t.strides()[d];
  }
  return out;
}

// Sizes and strides with a 0-d tensor read as shape [1] (gather/scatter treat it so).
struct Layout {
  Shape sizes, strides;
};
Layout layout_1d(const Tensor& t) {
  if (t.dim() == 0) return {Shape{1}, Shape{1}};
  return {to_shape(t.sizes()), to_shape(t.strides())};
}

// Calls f(TypeTag<U>) with an unsigned integer type as wide as one element of `dtype`.
template <typename F>
void visit_bytes(ScalarType dtype, F&& f) {
  switch (element_size(dtype)) {
    case 1:
      return f(TypeTag<uint8_t>{});
    case 2:
      return f(TypeTag<uint16_t>{});
    case 4:
      return f(TypeTag<uint32_t>{});
    case 8:
      return f(TypeTag<uint64_t>{});
    default:
      KILN_FAIL("[index] unsupported element size ", element_size(dtype));
  }
}

template <typename F>
void visit_index(ScalarType dtype, F&& f) {
  if (dtype == kInt32) return f(TypeTag<int32_t>{});
  return f(TypeTag<int64_t>{});
}

// Reads index value `v` for a dim of `size`; wraps negatives when `allow_negative`.
inline int64_t checked_index(int64_t v, int64_t size, bool allow_negative, const char* op,
                             int64_t dim) {
  const int64_t lo = allow_negative ? -size : 0;
  KILN_CHECK(v >= lo && v < size, "[", op, "] index ", v, " is out of bounds for dimension ", dim,
             " with size ", size);
  return v < 0 ? v + size : v;
}

// Element offsets (times `stride`) of the values of `idx` read as broadcast to `sizes`.
Offsets index_offsets(const Tensor& idx, IntArrayRef sizes, int64_t dim_size, int64_t stride,
                      bool allow_negative, const char* op, int64_t dim) {
  Offsets pos = offsets_of(sizes, expand_strides(idx, sizes));
  visit_index(idx.dtype(), [&]<typename I>(TypeTag<I>) {
    const I* p = idx.data_ptr<I>();
    for (int64_t& o : pos) {
      o = checked_index(static_cast<int64_t>(p[o]), dim_size, allow_negative, op, dim) * stride;
    }
  });
  return pos;
}

// out (contiguous, [pre, mid, post]) = src at pre[i] + mid[j] + post[k]. Rows go to threads.
void gather_rows(const Tensor& out, const Tensor& src, const Offsets& pre, const Offsets& mid,
                 const Offsets& post) {
  const int64_t nmid = static_cast<int64_t>(mid.size());
  const int64_t npost = static_cast<int64_t>(post.size());
  const int64_t rows = static_cast<int64_t>(pre.size()) * nmid;
  if (rows == 0 || npost == 0) return;
  bool dense = true;
  for (int64_t k = 0; k < npost && dense; ++k) dense = post[k] == k;
  visit_bytes(src.dtype(), [&]<typename U>(TypeTag<U>) {
    const U* s = static_cast<const U*>(src.data_ptr());
    U* o = static_cast<U*>(out.data_ptr());
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / npost);
    internal::parallel_for(0, rows, grain, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const U* from = s + pre[r / nmid] + mid[r % nmid];
        U* to = o + r * npost;
        if (dense) {
          std::memcpy(to, from, static_cast<size_t>(npost) * sizeof(U));
        } else {
          for (int64_t k = 0; k < npost; ++k) to[k] = from[post[k]];
        }
      }
    });
  });
}

// dst = src (same dtype and shape, any strides).
void copy_same(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  visit_bytes(dst.dtype(), [&]<typename U>(TypeTag<U>) {
    elementwise_typed<U, U>(
        dst, [](U v) { return v; }, src);
  });
}

// a + alpha * b in T's compute type (bool: a or (alpha and b), as PyTorch's bool add).
template <typename T>
T add_values(T a, T b, opmath_t<T> alpha = opmath_t<T>(1)) {
  if constexpr (std::is_same_v<T, bool>) {
    return a || (alpha && b);
  } else {
    using M = opmath_t<T>;
    return T(static_cast<M>(a) + alpha * static_cast<M>(b));
  }
}

// --- index, index_put_ -----------------------------------------------------------------------

// Where self[dims = index tensors] reads from: the result is [pre][b][post] (pre empty when the
// indexed dims are not adjacent), and element (i, j, k) of it is self at pre[i] + mid[j] +
// post[k]. `result_strides` of another tensor laid out like the result give its own offsets.
struct AdvancedPlan {
  Shape b, pre_sizes, post_sizes;
  Offsets pre, mid, post;
  // Splits strides given for the result shape into its pre, b and post offsets.
  std::array<Offsets, 3> split(IntArrayRef result_strides) const {
    const size_t np = pre_sizes.size(), nb = b.size();
    return {offsets_of(pre_sizes, result_strides.subspan(0, np)),
            offsets_of(b, result_strides.subspan(np, nb)),
            offsets_of(post_sizes, result_strides.subspan(np + nb))};
  }
};

AdvancedPlan plan_advanced(const Tensor& self, const Shape& dims, TensorList idx, const char* op) {
  AdvancedPlan p;
  for (size_t k = 0; k < idx.size(); ++k) {
    p.b = k == 0 ? to_shape(idx[k].sizes()) : broadcast_shapes(p.b, idx[k].sizes(), op);
  }
  const int64_t k = static_cast<int64_t>(dims.size());
  const bool adjacent = dims.back() - dims.front() == k - 1;
  Shape pre_strides, post_strides;
  for (int64_t d = 0; d < self.dim(); ++d) {
    if (std::find(dims.begin(), dims.end(), d) != dims.end()) continue;
    const bool before = adjacent && d < dims.front();
    (before ? p.pre_sizes : p.post_sizes).push_back(self.sizes()[d]);
    (before ? pre_strides : post_strides).push_back(self.strides()[d]);
  }
  p.pre = offsets_of(p.pre_sizes, pre_strides);
  p.post = offsets_of(p.post_sizes, post_strides);
  p.mid.assign(static_cast<size_t>(numel_of(p.b)), 0);
  for (int64_t j = 0; j < k; ++j) {
    const Offsets o = index_offsets(idx[j], p.b, self.sizes()[dims[j]], self.strides()[dims[j]],
                                    /*allow_negative=*/true, op, dims[j]);
    for (size_t m = 0; m < o.size(); ++m) p.mid[m] += o[m];
  }
  return p;
}

void index_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  const TensorList idx = absl::MakeConstSpan(c.inputs).subspan(1);
  const AdvancedPlan p = plan_advanced(self, c.attr<Shape>(0), idx, "index");
  gather_rows(c.outputs[0], self, p.pre, p.mid, p.post);
}

void index_put_cpu(OpCall& c) {
  const Tensor& self = c.outputs[0];
  const Tensor& values = c.input(1);
  const TensorList idx = absl::MakeConstSpan(c.inputs).subspan(2);
  const bool accumulate = c.attr<bool>(1);
  const AdvancedPlan p = plan_advanced(self, c.attr<Shape>(0), idx, "index_put_");
  Shape result = p.pre_sizes;
  result.insert(result.end(), p.b.begin(), p.b.end());
  result.insert(result.end(), p.post_sizes.begin(), p.post_sizes.end());
  if (numel_of(result) == 0) return;
  const std::array<Offsets, 3> vo = p.split(expand_strides(values, result));
  const Offsets &vpre = vo[0], &vmid = vo[1], &vpost = vo[2];
  // Serial, so that repeated indices resolve in order (the last write wins, or all add up).
  visit_dtype(self.dtype(), [&]<typename T>(TypeTag<T>) {
    T* s = self.data_ptr<T>();
    const T* v = values.data_ptr<T>();
    for (size_t i = 0; i < p.pre.size(); ++i) {
      for (size_t j = 0; j < p.mid.size(); ++j) {
        T* to = s + p.pre[i] + p.mid[j];
        const T* from = v + vpre[i] + vmid[j];
        for (size_t k = 0; k < p.post.size(); ++k) {
          to[p.post[k]] = accumulate ? add_values(to[p.post[k]], from[vpost[k]]) : from[vpost[k]];
        }
      }
    }
  });
}

void nonzero_cpu(OpCall& c) {
  const Tensor t = c.input(0).contiguous();
  const int64_t n = t.numel(), nd = t.dim();
  std::vector<int64_t> hits;
  visit_dtype(t.dtype(), [&]<typename T>(TypeTag<T>) {
    const T* p = n > 0 ? t.data_ptr<T>() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      if (static_cast<opmath_t<T>>(p[i]) != opmath_t<T>(0)) hits.push_back(i);
    }
  });
  Tensor out = empty({static_cast<int64_t>(hits.size()), nd}, TensorOptions(kInt64));
  int64_t* o = out.numel() > 0 ? out.data_ptr<int64_t>() : nullptr;
  for (size_t h = 0; h < hits.size(); ++h) {
    int64_t rem = hits[h];
    for (int64_t d = nd - 1; d >= 0; --d) {
      o[h * nd + d] = rem % t.sizes()[d];
      rem /= t.sizes()[d];
    }
  }
  c.outputs.assign({out});
}

// --- index_select, embedding, gather ----------------------------------------------------------

void index_select_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const Tensor& out = c.outputs[0];
  if (self.dim() == 0) {
    index_offsets(idx.reshape({-1}), {1}, 1, 0, false, "index_select", 0);
    gather_rows(out, self, {0}, {0}, {0});
    return;
  }
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), "index_select");
  const IntArrayRef sz = self.sizes(), st = self.strides();
  const Offsets pre = offsets_of(sz.subspan(0, d), st.subspan(0, d));
  const Offsets post = offsets_of(sz.subspan(d + 1), st.subspan(d + 1));
  const Offsets mid = index_offsets(idx.reshape({-1}), {idx.numel()}, sz[d], st[d],
                                    /*allow_negative=*/false, "index_select", d);
  gather_rows(out, self, pre, mid, post);
}

void embedding_cpu(OpCall& c) {
  const Tensor& weight = c.input(0);
  const Tensor& idx = c.input(1);
  const Offsets mid = index_offsets(idx, idx.sizes(), weight.sizes()[0], weight.strides()[0],
                                    /*allow_negative=*/false, "embedding", 0);
  gather_rows(c.outputs[0], weight, {0}, mid,
              offsets_of({weight.sizes()[1]}, {weight.strides()[1]}));
}

// Rows along `dim` of the index tensor's shape: the offsets where each row starts in the index,
// in self (or the target) and in a third tensor laid out like the index (out or src).
struct Rows {
  Offsets idx, self, other;
  int64_t len, idx_stride, self_stride, other_stride, self_size;
};

Rows plan_rows(const Tensor& idx, const Layout& self, const Layout& other, int64_t d) {
  const Layout il = layout_1d(idx);
  Shape row_sizes = il.sizes;
  row_sizes[d] = 1;
  return {offsets_of(row_sizes, il.strides),
          offsets_of(row_sizes, self.strides),
          offsets_of(row_sizes, other.strides),
          il.sizes[d],
          il.strides[d],
          self.strides[d],
          other.strides[d],
          self.sizes[d]};
}

void gather_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& idx = c.input(1);
  const Tensor& out = c.outputs[0];
  if (idx.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), self.dim(), "gather");
  const Rows r = plan_rows(idx, layout_1d(self), layout_1d(out), d);
  const int64_t* ip = idx.data_ptr<int64_t>();
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    const U* s = static_cast<const U*>(self.data_ptr());
    U* o = static_cast<U*>(out.data_ptr());
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / std::max<int64_t>(r.len, 1));
    internal::parallel_for(0, static_cast<int64_t>(r.idx.size()), grain, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        for (int64_t j = 0; j < r.len; ++j) {
          const int64_t v =
              checked_index(ip[r.idx[row] + j * r.idx_stride], r.self_size, false, "gather", d);
          o[r.other[row] + j * r.other_stride] = s[r.self[row] + v * r.self_stride];
        }
      }
    });
  });
}

// --- scatter, scatter_add, index_add ----------------------------------------------------------

enum class ScatterMode { kSrc, kValue, kAdd };

// Rows along dim are independent (they differ in another coordinate, so they write disjoint
// elements): they go to threads, and within a row repeated indices resolve in order.
template <ScatterMode kMode, bool kInplace>
void scatter_cpu(OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& out = c.outputs[0];
  const Tensor& idx = c.input(1);
  if constexpr (!kInplace) copy_same(out, c.input(0));
  if (idx.numel() == 0) return;
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), op);
  const Tensor src = kMode == ScatterMode::kValue ? idx : c.input(2);
  const Rows r = plan_rows(idx, layout_1d(out), layout_1d(src), d);
  const int64_t* ip = idx.data_ptr<int64_t>();
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    T* o = out.data_ptr<T>();
    const T value = kMode == ScatterMode::kValue ? c.attr<Scalar>(1).to<T>() : T();
    const T* s = kMode == ScatterMode::kValue ? nullptr : src.data_ptr<T>();
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / std::max<int64_t>(r.len, 1));
    internal::parallel_for(0, static_cast<int64_t>(r.idx.size()), grain, [&](int64_t b, int64_t e) {
      for (int64_t row = b; row < e; ++row) {
        for (int64_t j = 0; j < r.len; ++j) {
          const int64_t v =
              checked_index(ip[r.idx[row] + j * r.idx_stride], r.self_size, false, op, d);
          T& to = o[r.self[row] + v * r.self_stride];
          if constexpr (kMode == ScatterMode::kValue) {
            to = value;
          } else if constexpr (kMode == ScatterMode::kSrc) {
            to = s[r.other[row] + j * r.other_stride];
          } else {
            to = add_values(to, s[r.other[row] + j * r.other_stride]);
          }
        }
      }
    });
  });
}

template <bool kInplace>
void index_add_cpu(OpCall& c) {
  const char* op = c.name().c_str();
  const Tensor& out = c.outputs[0];
  const Tensor idx = c.input(1).reshape({-1});
  const Tensor& src = c.input(2);
  if constexpr (!kInplace) copy_same(out, c.input(0));
  const int64_t d = wrap_dim(c.attr<int64_t>(0), out.dim(), op);
  const Layout ol = layout_1d(out), sl = layout_1d(src);
  const IntArrayRef osz = ol.sizes;
  // The slice of self (or source) at one index along d, as pre x post positions.
  const Offsets opre = offsets_of(osz.subspan(0, d), IntArrayRef(ol.strides).subspan(0, d));
  const Offsets opost = offsets_of(osz.subspan(d + 1), IntArrayRef(ol.strides).subspan(d + 1));
  const Offsets spre = offsets_of(osz.subspan(0, d), IntArrayRef(sl.strides).subspan(0, d));
  const Offsets spost = offsets_of(osz.subspan(d + 1), IntArrayRef(sl.strides).subspan(d + 1));
  const Offsets targets = index_offsets(idx, {idx.numel()}, osz[d], ol.strides[d], false, op, d);
  const int64_t npost = static_cast<int64_t>(opost.size());
  const int64_t slice = static_cast<int64_t>(opre.size()) * npost;
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    using M = opmath_t<T>;
    T* o = out.data_ptr<T>();
    const T* s = src.numel() > 0 ? src.data_ptr<T>() : nullptr;
    const M alpha = c.attr<Scalar>(1).to<M>();
    // Threads split the slice positions; each walks every index in order (so repeated indices
    // accumulate without races).
    const int64_t grain =
        std::max<int64_t>(1, internal::kGrainSize / std::max<int64_t>(idx.numel(), 1));
    internal::parallel_for(0, slice, grain, [&](int64_t b, int64_t e) {
      for (size_t i = 0; i < targets.size(); ++i) {
        const int64_t src_off = static_cast<int64_t>(i) * sl.strides[d];
        for (int64_t p = b; p < e; ++p) {
          const int64_t pre = p / npost, post = p % npost;
          T& to = o[opre[pre] + targets[i] + opost[post]];
          to = add_values(to, s[spre[pre] + src_off + spost[post]], alpha);
        }
      }
    });
  });
}

// --- masks ----------------------------------------------------------------------------------

void masked_fill_cpu(OpCall& c) {
  const Tensor& out = c.outputs[0];
  visit_dtype(out.dtype(), [&]<typename T>(TypeTag<T>) {
    const T value = c.attr<Scalar>(0).to<T>();
    elementwise_typed<T, T, bool>(
        out, [value](T x, bool m) { return m ? value : x; }, c.input(0), c.input(1));
  });
}

void masked_select_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& mask = c.input(1);
  const Shape shape = broadcast_shapes(self.sizes(), mask.sizes(), "masked_select");
  const std::array<char*, 2> base{static_cast<char*>(self.data_ptr()),
                                  static_cast<char*>(mask.data_ptr())};
  const std::array<Shape, 2> strides{broadcast_byte_strides(self, shape),
                                     broadcast_byte_strides(mask, shape)};
  int64_t n = 0;
  for_each_run<2>(
      shape, base, strides,
      [&](std::array<char*, 2> p, std::array<int64_t, 2> s, int64_t count) {
        for (int64_t i = 0; i < count; ++i) n += *(p[1] + i * s[1]) != 0;
      },
      /*parallel=*/false);
  Tensor out = empty({n}, TensorOptions(self.dtype()));
  if (n > 0) {
    visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
      U* o = static_cast<U*>(out.data_ptr());
      for_each_run<2>(
          shape, base, strides,
          [&](std::array<char*, 2> p, std::array<int64_t, 2> s, int64_t count) {
            for (int64_t i = 0; i < count; ++i) {
              if (*(p[1] + i * s[1]) != 0) {
                *o++ = *reinterpret_cast<const U*>(p[0] + i * s[0]);
              }
            }
          },
          /*parallel=*/false);
    });
  }
  c.outputs.assign({out});
}

// --- triu, tril, one_hot ----------------------------------------------------------------------

template <bool kUpper>
void triangle_cpu(OpCall& c) {
  const Tensor& self = c.input(0);
  const Tensor& out = c.outputs[0];
  const int64_t diag = c.attr<int64_t>(0);
  const int64_t nd = self.dim();
  const int64_t rows = self.sizes()[nd - 2], cols = self.sizes()[nd - 1];
  const int64_t rs = self.strides()[nd - 2], cs = self.strides()[nd - 1];
  const Offsets batch =
      offsets_of(self.sizes().subspan(0, nd - 2), self.strides().subspan(0, nd - 2));
  if (out.numel() == 0) return;
  visit_bytes(self.dtype(), [&]<typename U>(TypeTag<U>) {
    const U* s = static_cast<const U*>(self.data_ptr());
    U* o = static_cast<U*>(out.data_ptr());
    const int64_t grain = std::max<int64_t>(1, internal::kGrainSize / cols);
    internal::parallel_for(0, static_cast<int64_t>(batch.size()) * rows, grain,
                           [&](int64_t b, int64_t e) {
                             for (int64_t r = b; r < e; ++r) {
                               const int64_t i = r % rows;
                               const U* from = s + batch[r / rows] + i * rs;
                               U* to = o + r * cols;
                               for (int64_t j = 0; j < cols; ++j) {
                                 const bool keep = kUpper ? j - i >= diag : j - i <= diag;
                                 // Zero bits are zero in every dtype (0, 0.0, false).
                                 to[j] = keep ? from[j * cs] : U(0);
                               }
                             }
                           });
  });
}

void one_hot_cpu(OpCall& c) {
  const Tensor idx = c.input(0).contiguous();
  const Tensor& out = c.outputs[0];
  const int64_t n = c.attr<int64_t>(0);
  if (out.numel() > 0) std::memset(out.data_ptr(), 0, out.nbytes());
  if (idx.numel() == 0) return;
  const int64_t* ip = idx.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i) {
    KILN_CHECK(ip[i] >= 0, "[one_hot] class values must be non-negative, got ", ip[i]);
    KILN_CHECK(ip[i] < n, "[one_hot] class values must be smaller than num_classes (", n, "), got ",
               ip[i]);
    o[i * n + ip[i]] = 1;
  }
}

}  // namespace

KILN_REGISTER_KERNEL(index, kCPU, index_cpu);
KILN_REGISTER_KERNEL(index_put_, kCPU, index_put_cpu);
KILN_REGISTER_KERNEL(nonzero, kCPU, nonzero_cpu);
KILN_REGISTER_KERNEL(index_select, kCPU, index_select_cpu);
KILN_REGISTER_KERNEL(embedding, kCPU, embedding_cpu);
KILN_REGISTER_KERNEL(gather, kCPU, gather_cpu);
KILN_REGISTER_KERNEL(scatter, kCPU, (scatter_cpu<ScatterMode::kSrc, false>));
KILN_REGISTER_KERNEL(scatter_, kCPU, (scatter_cpu<ScatterMode::kSrc, true>));
KILN_REGISTER_KERNEL(scatter_value, kCPU, (scatter_cpu<ScatterMode::kValue, false>));
KILN_REGISTER_KERNEL(scatter_value_, kCPU, (scatter_cpu<ScatterMode::kValue, true>));
KILN_REGISTER_KERNEL(scatter_add, kCPU, (scatter_cpu<ScatterMode::kAdd, false>));
KILN_REGISTER_KERNEL(scatter_add_, kCPU, (scatter_cpu<ScatterMode::kAdd, true>));
KILN_REGISTER_KERNEL(index_add, kCPU, index_add_cpu<false>);
KILN_REGISTER_KERNEL(index_add_, kCPU, index_add_cpu<true>);
KILN_REGISTER_KERNEL(masked_fill, kCPU, masked_fill_cpu);
KILN_REGISTER_KERNEL(masked_fill_, kCPU, masked_fill_cpu);
KILN_REGISTER_KERNEL(masked_select, kCPU, masked_select_cpu);
KILN_REGISTER_KERNEL(triu, kCPU, triangle_cpu<true>);
KILN_REGISTER_KERNEL(tril, kCPU, triangle_cpu<false>);
KILN_REGISTER_KERNEL(one_hot, kCPU, one_hot_cpu);

}  // namespace kiln::cpu
