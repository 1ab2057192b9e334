// fused_cuda's code generator (compiler/fused_cuda_codegen.h): the kernels' source, from the
// planned operands and the members' expressions.
#include <algorithm>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {

// Offsets: an operand of the domain's rank reads element c of its own through its strides.
std::string Generator::offset(const FusedKernel::Operand& o, bool dense) const {
  if (o.sizes.empty()) return "0";
  if (dense) return "i";
  const size_t rank = k_.sizes.size();
  std::string s;
  for (size_t d = 0; d < rank; ++d) {
    if (k_.sizes[d] == 1) continue;  // its coordinate is always 0
    s += (s.empty() ? "" : " + ") + absl::StrCat("(i64)c", d, " * p.v[", o.slot + 1 + d, "]");
  }
  return s.empty() ? "0" : s;
}

// The coordinates c<d> of element i in the domain (dims of size 1 have none): below 2^31
// elements in 32 bits, where dividing by a constant is a multiply-high, not a 64-bit division
// sequence (offsets stay 64-bit).
std::string Generator::coordinates() const {
  std::ostringstream os;
  const bool narrow = numel_of(k_.sizes) < (int64_t{1} << 31);
  const std::string type = narrow ? "u32" : "i64", suffix = narrow ? "u" : "LL";
  os << "    " << type << " r = (" << type << ")i;\n";
  for (size_t d = k_.sizes.size(); d-- > 0;) {
    if (k_.sizes[d] == 1) continue;
    if (d == 0) {
      os << "    const " << type << " c0 = r;\n";
    } else {
      os << "    const " << type << " c" << d << " = r % " << k_.sizes[d] << suffix << ";\n";
      os << "    r /= " << k_.sizes[d] << suffix << ";\n";
    }
  }
  return os.str();
}

// The body of the element loop (dense: every operand indexed by i; vector: element e of the
// packs vx<j> and vy<j> for the operands of the domain's shape, whose loads and stores the
// vector entry writes around it).
std::string Generator::body(bool dense, bool vector, bool tiled, bool packs) const {
  std::ostringstream os;
  const size_t rank = k_.sizes.size();
  if (tiled) {
    os << tiled_coordinates();
  } else if (!dense) {
    os << coordinates();
  }
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (o.host_scalar) continue;
    if (vector && !o.sizes.empty()) {
      os << "    const " << ctype(o.dtype) << " x" << j << " = vx" << j << ".v[e];\n";
      continue;
    }
    if (tiled && k_.tiled[j]) {
      os << "    const " << ctype(o.dtype) << " x" << j
         << (packs ? absl::StrCat(" = tv", j, ".v[e];\n") : absl::StrCat(" = kt", j, "[tx][q];\n"));
      continue;
    }
    if (packs && o.sizes.back() == k_.sizes.back()) {
      os << "    const " << ctype(o.dtype) << " x" << j << " = vp" << j << ".v[e];\n";
      continue;
    }
    os << "    const " << ctype(o.dtype) << " x" << j << " = in" << j << "[" << offset(o, dense)
       << "];\n";
  }
  for (size_t i = 0; i < members_.size(); ++i) {
    os << "    // " << lines_[i] << "\n    " << member_decl(i) << "\n";
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.outputs[j];
    // An output smaller than the domain is written by the threads at coordinate 0 of the
    // dims it broadcasts along.
    std::string guard;
    if (!dense) {
      const size_t lead = rank - o.sizes.size();
      for (size_t d = 0; d < rank; ++d) {
        if (k_.sizes[d] == 1) continue;
        if (d < lead || o.sizes[d - lead] == 1) {
          guard += (guard.empty() ? "" : " && ") + absl::StrCat("c", d, " == 0");
        }
      }
    }
    if (vector || packs) {
      os << "    vy" << j << ".v[e] = " << var(o.value) << ";\n";
      continue;
    }
    os << "    " << (guard.empty() ? "" : "if (" + guard + ") ") << "out" << j << "["
       << offset(o, dense) << "] = " << var(o.value) << ";\n";
  }
  return os.str();
}

std::string Generator::member_decl(size_t i) const {
  const int v = members_[i]->outputs[0];
  const ScalarType out = spec(v).dtype;
  const bool fence = (out == kFloat || out == kDouble) && !fast_.contains(v);
  return "const " + ctype(out) + " y" + std::to_string(i) + " = " +
         (fence ? "kopaque(" + exprs_[i] + ", kzero)" : exprs_[i]) + ";";
}

std::string Generator::member_line(const BoundOp& op) const {
  std::string line = var(op.outputs[0]) + " = " + op.name() + "(";
  for (size_t j = 0; j < op.inputs.size(); ++j) line += (j ? ", " : "") + var(op.inputs[j]);
  if (!op.attrs.empty()) {
    line += "; ";
    for (size_t j = 0; j < op.attrs.size(); ++j) {
      // Constants are parameters: the listing names their kind, not their value, so that
      // regions differing only in them share a kernel.
      const bool scalar = std::holds_alternative<Scalar>(op.attrs[j]);
      line += (j ? ", " : "") + (scalar ? std::string("<scalar>") : attr_str(op.attrs[j]));
    }
  }
  return line + ")  " + spec_str(spec(op.outputs[0]));
}

std::string Generator::operand_decls() const {
  std::ostringstream os;
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (o.host_scalar) {
      os << "  const " << ctype(o.dtype) << " x" << j << " = " << bits_fn(o.dtype) << "(p.v["
         << o.slot << "]);\n";
    } else {
      os << "  const " << ctype(o.dtype) << "* __restrict__ in" << j << " = (const "
         << ctype(o.dtype) << "*)p.v[" << o.slot << "];\n";
    }
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.outputs[j];
    os << "  " << ctype(o.dtype) << "* __restrict__ out" << j << " = (" << ctype(o.dtype)
       << "*)p.v[" << o.slot << "];\n";
  }
  for (size_t c = 0; c < constants_.size(); ++c) {
    os << "  const " << ctype(constants_[c].first) << " k" << c << " = "
       << bits_fn(constants_[c].first) << "(p.v[" << k_.constants[c].first << "]);\n";
  }
  os << "  const u32 kzero = (u32)p.v[" << k_.zero_slot << "];  // 0: kopaque's operand\n"
     << "  (void)kzero;\n";
  return os.str();
}

std::string launch_bounds(int threads, int blocks) {
  return blocks > 0 ? absl::StrCat("__launch_bounds__(", threads, ", ", blocks, ")")
                    : absl::StrCat("__launch_bounds__(", threads, ")");
}

// The entry's signature and the decoding of its parameters (pointers, scalars, constants).
std::string Generator::kernel_head(const std::string& entry, int min_blocks) const {
  std::ostringstream os;
  const int64_t n = numel_of(k_.sizes);
  os << "\nextern \"C\" __global__ void " << launch_bounds(256, min_blocks) << " kiln_fused_"
     << entry << "(const Params p) {\n"
     << operand_decls() << "  const long long n = " << n << "LL;\n"
     << "  const long long step = (long long)gridDim.x * blockDim.x;\n";
  return os.str();
}

// kiln_fused_rowvec: where the domain's last dim is a multiple of the pack (rowvec_width), a
// thread takes a pack of that dim: the operands that vary along it move 16 bytes of the
// narrowest one per load or store at the pack's offset (their strides allow it: chosen at
// launch), the others are read once for the pack (constant along that dim).
std::string Generator::rowvec_entry(const std::string& head) const {
  std::ostringstream os;
  const int w = k_.rowvec_width;
  const int64_t d_last = k_.sizes.back();
  auto varies = [&](const FusedKernel::Operand& o) {
    return !o.host_scalar && !o.sizes.empty() && o.sizes.back() == d_last;
  };
  auto pack = [&](ScalarType t) { return absl::StrCat("kpack<", ctype(t), ", ", w, ">"); };
  os << head << "  const long long packs = n / " << w << "LL;\n"
     << "  for (long long v = (long long)blockIdx.x * blockDim.x + threadIdx.x; v < packs; "
        "v += step) {\n"
     << "    const long long i = v * " << w << "LL;  // the pack's first element\n";
  os << coordinates();
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (o.host_scalar) continue;
    if (varies(o)) {
      os << "    const " << pack(o.dtype) << " vx" << j << " = *(const " << pack(o.dtype) << "*)(in"
         << j << " + " << offset(o, false) << ");\n";
    } else {
      os << "    const " << ctype(o.dtype) << " x" << j << " = in" << j << "[" << offset(o, false)
         << "];\n";
    }
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    os << "    " << pack(k_.outputs[j].dtype) << " vy" << j << ";\n";
  }
  os << "#pragma unroll\n"
     << "    for (int e = 0; e < " << w << "; ++e) {\n";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    if (varies(o)) {
      os << "      const " << ctype(o.dtype) << " x" << j << " = vx" << j << ".v[e];\n";
    }
  }
  for (size_t i = 0; i < members_.size(); ++i) {
    os << "      // " << lines_[i] << "\n      " << member_decl(i) << "\n";
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    os << "      vy" << j << ".v[e] = " << var(k_.outputs[j].value) << ";\n";
  }
  os << "    }\n";
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    os << "    *(" << pack(k_.outputs[j].dtype) << "*)(out" << j << " + "
       << offset(k_.outputs[j], false) << ") = vy" << j << ";\n";
  }
  os << "  }\n}\n";
  return os.str();
}

// The tiled entry's coordinates: the tile's row m and column c are the last two, the leading ones
// come from the tile's batch index b (no division for a domain of rank 2).
std::string Generator::tiled_coordinates() const {
  std::ostringstream os;
  const size_t rank = k_.sizes.size();
  os << "    const long long c" << rank - 1 << " = c, c" << rank - 2 << " = m;\n";
  if (rank > 2) os << "    long long r = b;\n";
  for (size_t d = rank - 2; d-- > 0;) {
    if (k_.sizes[d] == 1) continue;
    if (d == 0) {
      os << "    const long long c0 = r;\n";
    } else {
      os << "    const long long c" << d << " = r % " << k_.sizes[d] << "LL;\n"
         << "    r /= " << k_.sizes[d] << "LL;\n";
    }
  }
  return os.str();
}

// The shared memory of a tiled entry's tiles: 32 P rows of `cols` elements for each tiled input.
int64_t Generator::tile_bytes(int P, int64_t cols) const {
  int64_t bytes = 0;
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (k_.tiled[j])
      bytes += 32 * P * cols * static_cast<int64_t>(element_size(k_.inputs[j].dtype));
  }
  return bytes;
}

// The tiled entries: the domain's last two dims (M rows of N) in tiles, one per block of 32 x 8
// threads at a time. Each tiled input is first read into its tile with the threads' x along the
// rows' dim (stride 1 for it: coalesced), then every element of the tile is computed with x along
// the columns' dim, where the other operands are read and the outputs written (coalesced where
// they are contiguous), the tiled inputs from their tiles.
//   - P = 1, kiln_fused_tiled (FusedKernel::tiled): tiles of 32 x 32 elements, an element a
//     thread at a time, every operand through its strides; kt<j>[column][row], 33 wide (no bank
//     conflicts either way in 32-bit types).
//   - P > 1, kiln_fused_tiled_packs (FusedKernel::tiled_pack): tiles of 32 P rows by 32 P
//     columns (`half`: 16 P, kiln_fused_tiled_packs_half). A thread reads P packs of P rows'
//     neighbours (P columns), transposes the P x P block in registers and stores it as P packs
//     of columns' neighbours, kt<j>[row][pack of columns]; then it computes a pack of the last
//     dim, reading the tile a pack at a time, the operands varying along that dim read and the
//     outputs written a pack at a time. The packs of a tile row are stored XOR-swizzled by the
//     row's pack of rows (pack c of row r at c ^ (r / P)), so that neither the stores (one row
//     pack, 32 rows apart) nor the loads (one row) meet a bank twice in a wavefront. The launch
//     takes whichever width fills the GPU's waves better (choose_tile_width).
std::string Generator::tiled_entry(int P, bool half) const {
  std::ostringstream os;
  const size_t rank = k_.sizes.size();
  const int64_t m = k_.sizes[rank - 2], n = k_.sizes[rank - 1];
  const int T = 32 * P;                               // tile rows
  const int TC = P == 1 ? 32 : (half ? 16 : 32) * P;  // tile columns
  const int C = TC / P;                               // packs of columns a tile row holds
  auto pack = [&](ScalarType t) { return absl::StrCat("kpack<", ctype(t), ", ", P, ">"); };
  auto packed = [&](size_t j) {  // an operand other than the tiles read a pack at a time
    const FusedKernel::Operand& o = k_.inputs[j];
    return P > 1 && !o.host_scalar && !o.sizes.empty() && !k_.tiled[j] && o.sizes.back() == n;
  };
  int min_blocks = 0;
  if (P > 1) {
    // As many blocks a multiprocessor as the tiles' shared memory allows (a multiprocessor holds
    // the opt-in limit and the 1 KiB each block reserves: 228 KiB on sm_90), at most 6 of full
    // tiles (40 registers a thread) and 8 of half tiles (32). On an H200 (session 38): bf16 full
    // tiles at no bound took 48 registers, five blocks, and ran 20% slower than at six; half
    // tiles at eight blocks 12% faster than at six; f32 full tiles spilled at eight.
    constexpr int64_t kBlockReserve = 1024;
    min_blocks = static_cast<int>(std::clamp<int64_t>(
        (shared_limit_ + kBlockReserve) / (tile_bytes(P, TC) + kBlockReserve), 1, half ? 8 : 6));
  }
  const std::string name = P == 1 ? "tiled" : half ? "tiled_packs_half" : "tiled_packs";
  os << kernel_head(name, min_blocks) << "  const long long M = " << m << "LL, N = " << n
     << "LL, TM = " << (m + T - 1) / T << "LL, TN = " << (n + TC - 1) / TC << "LL;\n"
     << "  const long long tiles = n / (M * N) * TM * TN;\n"
     << "  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;\n";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (!k_.tiled[j]) continue;
    if (P == 1) {
      os << "  __shared__ " << ctype(k_.inputs[j].dtype) << " kt" << j << "[32][33];\n";
    } else {
      os << "  __shared__ " << pack(k_.inputs[j].dtype) << " kt" << j << "[" << T << "][" << C
         << "];\n";
    }
  }
  std::string coords;
  {
    std::istringstream lines(tiled_coordinates());
    for (std::string line; std::getline(lines, line);) coords += "    " + line + "\n";
  }
  os << "  for (long long t = blockIdx.x; t < tiles; t += gridDim.x) {\n"
     << "    const long long b = t / (TM * TN), m0 = t % (TM * TN) / TN * " << T
     << ", n0 = t % TN * " << TC << ";\n";
  if (P == 1) {
    os << "    for (int q = ty; q < 32; q += 8) {\n"
       << "      const long long m = m0 + tx, c = n0 + q;\n"
       << "      if (m < M && c < N) {\n"
       << coords;
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      if (k_.tiled[j])
        os << "        kt" << j << "[q][tx] = in" << j << "[" << offset(k_.inputs[j], false)
           << "];\n";
    }
    // Each element through body()'s reads and guarded writes.
    os << "      }\n    }\n    __syncthreads();\n"
       << "    for (int q = ty; q < 32; q += 8) {\n"
       << "      const long long m = m0 + q, c = n0 + tx;\n"
       << "      if (m < M && c < N) {\n";
    std::istringstream lines(body(false, false, true));
    for (std::string line; std::getline(lines, line);) os << "    " << line << "\n";
    os << "      }\n    }\n    __syncthreads();\n  }\n}\n";
    return os.str();
  }
  // Into the tiles: 8 warps take 8 P columns at a time, P a thread.
  os << "#pragma unroll\n"
     << "    for (int i = 0; i < " << TC / (8 * P) << "; ++i) {\n"
     << "      const int qb = " << P << " * (ty + 8 * i);  // the thread's first column\n"
     << "      const long long m = m0 + " << P << " * tx;\n";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (k_.tiled[j])
      os << "      " << pack(k_.inputs[j].dtype) << " v" << j << "[" << P << "] = {};\n";
  }
  os << "#pragma unroll\n"
     << "      for (int h = 0; h < " << P << "; ++h) {\n"
     << "        const long long c = n0 + qb + h;\n"
     << "        if (m < M && c < N) {\n";
  {
    std::istringstream lines(coords);
    for (std::string line; std::getline(lines, line);) os << "  " << line << "\n";
  }
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (!k_.tiled[j]) continue;
    os << "          v" << j << "[h] = *(const " << pack(k_.inputs[j].dtype) << "*)(in" << j
       << " + " << offset(k_.inputs[j], false) << ");\n";
  }
  os << "        }\n      }\n"
     << "#pragma unroll\n"
     << "      for (int e = 0; e < " << P << "; ++e) {\n";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (!k_.tiled[j]) continue;
    os << "        " << pack(k_.inputs[j].dtype) << " w" << j << ";\n"
       << "#pragma unroll\n"
       << "        for (int h = 0; h < " << P << "; ++h) w" << j << ".v[h] = v" << j
       << "[h].v[e];\n"
       << "        kt" << j << "[" << P << " * tx + e][(qb / " << P << ") ^ (tx & " << C - 1
       << ")] = w" << j << ";\n";
  }
  os << "      }\n    }\n    __syncthreads();\n";
  // Out of them: a warp takes a row at a time (two of half tiles), a pack of columns a thread.
  const std::string k = half ? "(tx & 15)" : "tx";
  os << "    for (int q = " << (half ? "2 * ty + (tx >> 4)" : "ty") << "; q < " << T
     << "; q += " << (half ? 16 : 8) << ") {\n"
     << "      const long long m = m0 + q, cp = n0 + " << P << " * " << k << ";\n"
     << "      if (m < M && cp < N) {\n"
     << "        const long long c = cp;\n"
     << coords;
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    if (k_.tiled[j]) {
      os << "        const " << pack(k_.inputs[j].dtype) << " tv" << j << " = kt" << j << "[q]["
         << k << " ^ ((q / " << P << ") & " << C - 1 << ")];\n";
    } else if (packed(j)) {
      os << "        const " << pack(k_.inputs[j].dtype) << " vp" << j << " = *(const "
         << pack(k_.inputs[j].dtype) << "*)(in" << j << " + " << offset(k_.inputs[j], false)
         << ");\n";
    }
  }
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    os << "        " << pack(k_.outputs[j].dtype) << " vy" << j << ";\n"
       << "        " << ctype(k_.outputs[j].dtype) << "* const po" << j << " = out" << j << " + "
       << offset(k_.outputs[j], false) << ";\n";
  }
  os << "#pragma unroll\n"
     << "        for (int e = 0; e < " << P << "; ++e) {\n"
     << "          const long long c = cp + e;\n";
  std::istringstream lines(body(false, false, true, true));
  for (std::string line; std::getline(lines, line);) os << "      " << line << "\n";
  os << "        }\n";
  for (size_t j = 0; j < k_.outputs.size(); ++j) {
    os << "        *(" << pack(k_.outputs[j].dtype) << "*)po" << j << " = vy" << j << ";\n";
  }
  os << "      }\n    }\n    __syncthreads();\n  }\n}\n";
  return os.str();
}

// The source's first lines: the headers' digest, the parameter slots and the prelude. The
// constants (every member's expression written) and the opaque zero take their slots here.
std::string Generator::source_prologue() {
  for (size_t c = 0; c < constants_.size(); ++c) {
    k_.constants.emplace_back(k_.slots, constants_[c].second);
    ++k_.slots;
  }
  k_.zero_slot = k_.slots++;
  return absl::StrCat("// Headers ", rtc_headers_digest(), "\n#define KILN_SLOTS ",
                      std::max(k_.slots, 1), "\n", std::string(kPrelude), "\n");
}

void Generator::emit() {
  for (const BoundOp* op : members_) {
    exprs_.push_back(member_expr(*op));
    lines_.push_back(member_line(*op));
  }
  std::ostringstream os;
  os << source_prologue();
  os << "// Domain " << shape_str(k_.sizes) << "; inputs:";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    const FusedKernel::Operand& o = k_.inputs[j];
    os << " x" << j << " " << spec_str(spec(o.value));
  }
  os << "\n";
  // Every operand may be dense (the run decides from the strides): operands of the domain's
  // shape, 0-d inputs, and no output smaller than the domain.
  k_.has_dense = true;
  for (const auto& o : k_.inputs) k_.has_dense &= o.sizes.empty() || o.sizes == k_.sizes;
  for (const auto& o : k_.outputs) k_.has_dense &= o.sizes == k_.sizes;
  // The vector entry: 16 bytes per access of the narrowest operand of the domain's shape.
  if (k_.has_dense) {
    size_t narrowest = 16;
    for (const auto* list : {&k_.inputs, &k_.outputs}) {
      for (const auto& o : *list) {
        if (o.host_scalar || o.sizes.empty()) continue;
        narrowest = std::min(narrowest, element_size(o.dtype));
      }
    }
    k_.vector_width = static_cast<int>(16 / narrowest);
  }
  // The row-vector entry: no dense one, the last dim a multiple of 16 bytes of the narrowest
  // operand varying along it, every output of the domain's shape.
  if (!k_.has_dense && !k_.sizes.empty() && k_.sizes.back() > 1) {
    const int64_t d_last = k_.sizes.back();
    size_t narrowest = 16;
    bool outputs_whole = true;
    for (const auto& o : k_.outputs) outputs_whole &= o.sizes == k_.sizes;
    for (const auto* list : {&k_.inputs, &k_.outputs}) {
      for (const auto& o : *list) {
        if (o.host_scalar || o.sizes.empty() || o.sizes.back() != d_last) continue;
        narrowest = std::min(narrowest, element_size(o.dtype));
      }
    }
    const auto width = static_cast<int64_t>(16 / narrowest);
    if (outputs_whole && width > 1 && d_last % width == 0) {
      k_.rowvec_width = static_cast<int>(width);
    }
  }
  // The tiled entry: inputs the trace records transposed in the domain's last two dims (stride
  // 1 along the second-to-last, not along the last), of the domain's extent in both.
  const size_t rank = k_.sizes.size();
  if (rank >= 2 && k_.sizes[rank - 2] > 1 && k_.sizes[rank - 1] > 1) {
    std::vector<bool> tiled(k_.inputs.size(), false);
    bool any = false;
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      const FusedKernel::Operand& o = k_.inputs[j];
      const TensorSpec& s = spec(o.value);
      const size_t r = o.sizes.size();
      if (o.host_scalar || r < 2 || o.sizes[r - 2] != k_.sizes[rank - 2] ||
          o.sizes[r - 1] != k_.sizes[rank - 1] || s.strides.size() != r) {
        continue;
      }
      tiled[j] = s.strides[r - 2] == 1 && s.strides[r - 1] != 1;
      any = any || tiled[j];
    }
    if (any) k_.tiled = std::move(tiled);
    // In packs of 8 bytes of the narrowest operand (at least 2 elements, at most 4), or of 2 where
    // the tiles would take more than 40 KiB of static shared memory: both dims multiples of the
    // pack, every output of the domain's shape.
    bool outputs_whole = true;
    for (const auto& o : k_.outputs) outputs_whole &= o.sizes == k_.sizes;
    size_t narrowest = 8;
    for (const auto* list : {&k_.inputs, &k_.outputs}) {
      for (const auto& o : *list) {
        if (!o.host_scalar && !o.sizes.empty())
          narrowest = std::min(narrowest, element_size(o.dtype));
      }
    }
    for (int p = static_cast<int>(std::clamp<size_t>(8 / narrowest, 2, 4)); any && p >= 2; p /= 2) {
      if (outputs_whole && k_.sizes[rank - 2] % p == 0 && k_.sizes[rank - 1] % p == 0 &&
          tile_bytes(p, 32 * p) <= 40 * 1024) {
        k_.tiled_pack = p;
        break;
      }
    }
  }
  const int w = k_.vector_width;
  auto pack = [&](ScalarType t) { return absl::StrCat("kpack<", ctype(t), ", ", w, ">"); };
  auto kernel = [&](bool dense, bool vector) {
    os << kernel_head(vector ? "vector" : dense ? "dense" : "strided");
    if (!vector) {
      os << "  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; "
            "i += step) {\n"
         << body(dense) << "  }\n}\n";
      return;
    }
    // Packs of w elements (a grid-stride loop), then the last n % w elements one per thread.
    os << "  const long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;\n"
       << "  const long long packs = n / " << w << "LL;\n";
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      const FusedKernel::Operand& o = k_.inputs[j];
      if (o.host_scalar || o.sizes.empty()) continue;
      os << "  const " << pack(o.dtype) << "* __restrict__ vin" << j << " = (const "
         << pack(o.dtype) << "*)in" << j << ";\n";
    }
    for (size_t j = 0; j < k_.outputs.size(); ++j) {
      os << "  " << pack(k_.outputs[j].dtype) << "* __restrict__ vout" << j << " = ("
         << pack(k_.outputs[j].dtype) << "*)out" << j << ";\n";
    }
    os << "  for (long long v = id; v < packs; v += step) {\n";
    for (size_t j = 0; j < k_.inputs.size(); ++j) {
      const FusedKernel::Operand& o = k_.inputs[j];
      if (o.host_scalar || o.sizes.empty()) continue;
      os << "    const " << pack(o.dtype) << " vx" << j << " = vin" << j << "[v];\n";
    }
    for (size_t j = 0; j < k_.outputs.size(); ++j) {
      os << "    " << pack(k_.outputs[j].dtype) << " vy" << j << ";\n";
    }
    os << "#pragma unroll\n"
       << "    for (int e = 0; e < " << w << "; ++e) {\n";
    std::istringstream lines(body(true, true));
    for (std::string line; std::getline(lines, line);) os << "  " << line << "\n";
    os << "    }\n";
    for (size_t j = 0; j < k_.outputs.size(); ++j) {
      os << "    vout" << j << "[v] = vy" << j << ";\n";
    }
    os << "  }\n"
       << "  const long long i = packs * " << w << "LL + id;\n"
       << "  if (i < n) {\n"
       << body(true) << "  }\n}\n";
  };
  kernel(false, false);
  if (k_.has_dense) kernel(true, false);
  if (w > 0) kernel(true, true);
  if (k_.rowvec_width > 0) os << rowvec_entry(kernel_head("rowvec"));
  if (!k_.tiled.empty()) os << tiled_entry(1);
  if (k_.tiled_pack > 0) os << tiled_entry(k_.tiled_pack) << tiled_entry(k_.tiled_pack, true);
  k_.source = os.str();
}

// The row kernels' source: the dense entry and, where the operands allow it, the vector one
// (each written by fused_cuda_rows.cpp's row_entry).
void Generator::emit_rows() {
  for (size_t i = 0; i < members_.size(); ++i) {
    const BoundOp& op = *members_[i];
    exprs_.push_back(row_members_[i].reduction ? std::string() : member_expr(op));
    lines_.push_back(member_line(op));
  }
  // A mean's 1 / count: eager's scale, in the accumulator's type.
  for (size_t i = 0; i < members_.size(); ++i) {
    if (members_[i]->name() != "mean") continue;
    const double scale = 1.0 / static_cast<double>(k_.cols);
    mean_scale_[static_cast<int>(i)] = spec(members_[i]->outputs[0]).dtype == kDouble
                                           ? constant_of(scale)
                                           : constant_of(static_cast<float>(scale));
  }
  std::ostringstream os;
  os << source_prologue();  // before the entries: the constants' slots
  os << "// Rows " << shape_str(k_.sizes) << " reduced over its last "
     << k_.sizes.size() - static_cast<size_t>(row_dims_) << " dims; inputs:";
  for (size_t j = 0; j < k_.inputs.size(); ++j) {
    os << " x" << j << " " << spec_str(spec(k_.inputs[j].value));
  }
  os << "\n" << row_entry(1);
  if (k_.vector_width > 1) os << row_entry(k_.vector_width);
  k_.source = os.str();
}

}  // namespace kiln::compiler::internal
