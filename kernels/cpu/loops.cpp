#include "kernels/cpu/loops.h"

namespace kiln::cpu {

Shape broadcast_byte_strides(const Tensor& t, IntArrayRef sizes) {
  const int64_t n = static_cast<int64_t>(sizes.size());
  const int64_t offset = n - t.dim();
  KILN_CHECK(offset >= 0, "[broadcast] cannot broadcast ", shape_str(t.sizes()), " to ",
             shape_str(sizes));
  Shape out(n, 0);
  const int64_t es = static_cast<int64_t>(t.element_size());
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t s = t.sizes()[d];
    KILN_CHECK(s == sizes[offset + d] || s == 1, "[broadcast] cannot broadcast ",
               shape_str(t.sizes()), " to ", shape_str(sizes));
    out[offset + d] = s == 1 ? 0 : t.strides()[d] * es;
  }
  return out;
}

}  // namespace kiln::cpu
