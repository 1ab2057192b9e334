// Internals of fused_cuda's code generator (compiler/fused_cuda.h), shared by its parts. Plain
// C++ (no CUDA header): it runs, and is tested, on machines without a GPU.
//
//   fused_cuda_prelude.cpp  the text every kernel starts with (types, conversions, parameters)
//   fused_cuda_headers.cpp  kernels/scalar_fn.h for NVRTC, embedded at build time
//   fused_cuda_codegen.cpp  the type helpers and the lists of the ops it writes
//   fused_cuda_plan.cpp     the planner: which regions, their operands, domain and slots
//   fused_cuda_expr.cpp     each member as an expression
//   fused_cuda_emit.cpp     the kernels' source (strided, dense and vector entries)
//   fused_cuda_rows_plan.cpp  the row kernels' planner (regions with reductions)
//   fused_cuda_rows.cpp     the row kernels' source
//
// Each member is written the way its eager CUDA kernel computes it (kernels/unary_fn.h,
// binary_fn.h and the formulas of kernels/scalar_fn.h, through loops::elementwise):
//   - its inputs converted to the dtype the kernel reads them in (as_dtype: scalar::convert),
//     a 0-d operand of an arithmetic binary op read in opmath, of a comparison rounded first;
//   - the formula in opmath (float for bf16/f16), with the same expression, so that the device
//     compiler contracts the same multiply-adds within it;
//   - the result cast to the member's dtype (static_cast, or a round-to-nearest-even cvt for
//     bf16/f16), then passed through an empty asm barrier (kopaque) so that nothing contracts
//     across members.
// Attribute values (alpha, clamp bounds, exponents) are kernel parameters, as in eager kernels,
// so regions that differ only in them share one kernel.
#pragma once

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "compiler/fused_cuda.h"
#include "compiler/trace.h"

namespace kiln::compiler::internal {

constexpr int kMaxRank = 8;
constexpr int kMaxSlots = 512;  // 4 KiB of kernel parameters

// The helpers every generated kernel starts with (fused_cuda_prelude.cpp); KILN_SLOTS is defined
// before it. It includes kernels/scalar_fn.h, eager's formulas, which NVRTC gets as a named
// header (rtc_headers).
extern const std::string_view kPrelude;

// The headers given to NVRTC with every kernel (fused_cuda_headers.cpp): kernels/scalar_fn.h and
// compiler/fused_cuda_rtc.h, as embedded at build time, and a digest of their text, which each
// generated source names (the kernel caches are keyed by the source).
struct RtcHeader {
  const char* name;
  const char* text;
};
const std::vector<RtcHeader>& rtc_headers();
const std::string& rtc_headers_digest();

// --- Types (fused_cuda_codegen.cpp) -------------------------------------------------------------

std::string ctype(ScalarType t);    // the device type of a storage dtype: "bf16", "float", ...
std::string bits_fn(ScalarType t);  // the prelude's function reading a parameter slot as t
ScalarType opmath(ScalarType t);
bool is_float(ScalarType t);
// A storage value as its opmath value (static_cast<opmath_t<T>>).
std::string to_m(const std::string& x, ScalarType t);
// An opmath-typed (or promoted) expression cast to storage type t (static_cast<T>, T(float)).
std::string from_m(const std::string& e, ScalarType t);
// scalar::convert<D, S>: through S's opmath type. The identity when S == D (as_dtype's no-op).
std::string convert(const std::string& x, ScalarType from, ScalarType to);

// Bits of a host value of opmath type (or storage type) `t` in a 64-bit parameter slot.
template <typename V>
uint64_t bits_of(V v) {
  uint64_t b = 0;
  if constexpr (std::is_same_v<V, bool>) {
    b = v ? 1 : 0;
  } else if constexpr (std::is_integral_v<V>) {
    b = static_cast<uint64_t>(static_cast<int64_t>(v));
  } else if constexpr (std::is_same_v<V, float>) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    b = u;
  } else if constexpr (std::is_same_v<V, double>) {
    std::memcpy(&b, &v, 8);
  } else {  // Half, BFloat16
    b = v.x;
  }
  return b;
}

// torch.result_type of two values (tensor/ops/binary.cpp's ResultTypeBuilder).
ScalarType result_type_of(const Trace& t, int a, int b);
bool has_attr(const BoundOp& op, size_t i);
template <typename T>
const T* attr_if(const BoundOp& op, size_t i) {
  return i < op.attrs.size() ? std::get_if<T>(&op.attrs[i]) : nullptr;
}
// The common dtype of a binary op (binary_common_dtype): attribute `at` or the result type.
ScalarType common_dtype(const Trace& t, const BoundOp& op, size_t at);

const absl::flat_hash_set<std::string_view>& float_unary_ops();
const absl::flat_hash_set<std::string_view>& numeric_unary_ops();
const absl::flat_hash_set<std::string_view>& arithmetic_ops();
const absl::flat_hash_map<std::string_view, std::string_view>& compare_ops();
const absl::flat_hash_set<std::string_view>& logical_ops();

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Value `v` of spec `s` as a kernel operand, a region's input (a 0-d CPU tensor passed by value;
// the planners refuse a CPU input with dimensions) or output.
inline FusedKernel::Operand operand_of(int v, const TensorSpec& s) {
  FusedKernel::Operand o;
  o.value = v;
  o.dtype = s.dtype;
  o.host_scalar = s.device.is_cpu();
  o.sizes = s.sizes;
  return o;
}

// Whether the row generator writes this reduction (sum, mean, amax, amin of floats over
// trailing dims).
bool row_op_generated(const Trace& t, const BoundOp& op);

// An entry's launch bounds: `threads` a block and the `blocks` a multiprocessor is to hold (0: not
// given): the row entries with the shared-memory row cache, the tiled entries in packs.
std::string launch_bounds(int threads, int blocks);
// A row kernel's source planned for three blocks a multiprocessor with the shared-memory row
// cache (42 registers a thread), written for two (64), or nullopt where it is not at three. The
// executor builds a kernel whose registers spill at three so (fused_cuda.cpp).
std::optional<std::string> row_source_at_two_blocks(const std::string& source);

// --- The generator
// ---------------------------------------------------------------------------------

// Lowers the region trace.ops[begin, end): plan() (fused_cuda_plan.cpp) names the operands and
// checks the region, member_expr() (fused_cuda_expr.cpp) writes each member, emit()
// (fused_cuda_emit.cpp) writes the entries.
class Generator {
 public:
  // `fast`: the values computed in float for 16-bit ones (Trace::emulate_precision_casts off,
  // fused_cuda_plan.cpp's upcast_region), which may be computed as torch.compile's kernels do.
  Generator(const Trace& t, size_t begin, size_t end, int64_t shared_limit = kDefaultSharedLimit,
            const RowPlanOptions& rows = {}, absl::flat_hash_set<int> fast = {})
      : t_(t),
        begin_(begin),
        end_(end),
        shared_limit_(shared_limit),
        row_plan_(rows),
        fast_(std::move(fast)) {}
  std::optional<FusedKernel> run(std::string* why);

 private:
  bool plan(std::string* why);

  // A constant of dtype `t` (the value's bits): a kernel parameter, read once per thread.
  std::string constant(ScalarType t, uint64_t bits);
  template <typename V>
  std::string constant_of(V v) {
    return constant(dtype_of<V>(), bits_of(v));
  }
  const TensorSpec& spec(int v) const { return t_.value(v).spec; }
  std::string var(int v) const { return name_.at(v); }
  std::string read_as(const BoundOp& op, size_t j, ScalarType as);
  std::string member_expr(const BoundOp& op);
  std::string binary_expr(const BoundOp& op, ScalarType out);

  // Member i (of bf16 result, its expression eager's "kbf(f)") for the two halves of a pair:
  // "kbf2(f_lo, f_hi)", f with each name of `lo` or `hi` read as its text, both rounded by one
  // conversion; empty where the expression is not of that form.
  std::string pair_expr(size_t i, const absl::flat_hash_map<std::string, std::string>& lo,
                        const absl::flat_hash_map<std::string, std::string>& hi) const;
  std::string member_line(const BoundOp& op) const;  // the member as the listing prints it
  // Member i's declaration: `const T y<i> = <expr>;`, a float or double result behind kopaque
  // (no contraction with the next member, as eager rounds in between) unless it is in fast_.
  std::string member_decl(size_t i) const;
  // `min_blocks`: the blocks a multiprocessor is to hold (__launch_bounds__), 0: not given.
  std::string kernel_head(const std::string& entry, int min_blocks = 0) const;
  // The decoding of an entry's parameters (pointers, scalars, constants, the opaque zero) that
  // opens every kernel's body, the pointwise and the row kernels alike.
  std::string operand_decls() const;
  std::string rowvec_entry(const std::string& head) const;
  std::string offset(const FusedKernel::Operand& o, bool dense) const;
  std::string coordinates() const;  // element i's coordinates c<d> in the domain
  // `tiled`: the tiled entry's body, where the inputs of FusedKernel::tiled come from their tiles
  // (kt<j>[tx][q]); `packs`: element e of a pack of the tiled entry in packs (kt<j>[P * tx +
  // e][q], the packs vp<j> and vy<j> of the operands varying along the last dim and outputs).
  std::string body(bool dense, bool vector = false, bool tiled = false, bool packs = false) const;
  // The tiled entry in packs of P elements (1: kiln_fused_tiled, else kiln_fused_tiled_packs).
  std::string tiled_entry(int P, bool half = false) const;
  // The tiles' shared memory: 32 P rows of `cols` elements for each tiled input.
  int64_t tile_bytes(int P, int64_t cols) const;
  std::string tiled_coordinates() const;
  std::string source_prologue();  // fused_cuda_emit.cpp
  void emit();

  // Row kernels: regions with reductions (planned in fused_cuda_rows_plan.cpp, each entry
  // written in fused_cuda_rows.cpp, the source assembled by emit_rows in fused_cuda_emit.cpp).
  struct RowMember {
    bool reduction = false;
    bool full = false;  // varies along the columns (else one value per row)
    int level = 0;      // how many reductions it depends on, in a chain
  };
  bool plan_rows(std::string* why);
  void plan_row_cache(const absl::flat_hash_set<int>& read_outside,
                      const absl::flat_hash_map<int, bool>& full);
  // The blocks a multiprocessor is to hold with the shared-memory row cache taking `row_bytes`
  // a block (two or three), for rows written out element by element (`written`) or not.
  int row_cache_blocks(int64_t row_bytes, bool written) const;
  void emit_rows();
  std::string row_entry(int width);
  // A row entry's element passes (row_passes): one per level of the reductions' inputs, then one
  // for the full outputs; pass l computes the members of level l (those that read l reductions in
  // a chain).
  struct RowPasses {
    int passes = 0;    // 1 + the members' highest level
    int n_passes = 0;  // the element passes
    // Outputs written per element (else once per row: one-element rows have both of S's shape).
    bool full_outputs = false;
    std::vector<bool> output_member;            // [member]: an output of the region
    std::vector<bool> out_full;                 // [output]: written per element
    absl::flat_hash_map<int, int> member_of;    // value -> member
    absl::flat_hash_map<int, size_t> input_of;  // value -> input
    bool writes(int pass) const { return full_outputs && pass == passes - 1; }
  };
  // Which members each pass computes and which inputs it reads (plan_passes).
  struct PassPlan {
    std::vector<std::vector<bool>> computes;  // [pass][member]
    std::vector<std::vector<bool>> reads;     // [pass][input]: full inputs
    std::vector<int> kept_until;              // [member]: the last pass reading it kept, or -1
    std::vector<int> read_until;              // [input]: the last pass reading it, or -1
    // [member]: the input whose place in the shared-memory row cache keeps it, or -1 (placed by
    // row_entry).
    std::vector<int> kept_in;
  };
  RowPasses row_passes() const;
  PassPlan plan_passes(const RowPasses& rp, const std::vector<bool>& keep) const;
  // The registers the register cache takes a thread (`iters` accesses of `width` elements).
  int64_t row_cache_registers(const PassPlan& pp, int width, int64_t iters) const;
  // A kept 16-bit member: two to a 32-bit register.
  static bool two_to_register(ScalarType t, int width);
  // Operand classes: an input of the domain's shape, an operand varying along the columns.
  bool row_input_full(size_t j) const;
  bool row_varies(const FusedKernel::Operand& o) const;
  // Member i read back from its place in shared memory by this pass, or stored there by it.
  bool reads_kept(const PassPlan& pp, int i, int pass) const;
  bool keeps_shared(const PassPlan& pp, int i, int pass) const;
  // The members of a pass computed two bf16 elements at a time (fused_cuda_rows.cpp). Per member:
  // the expression of pair h (`member`), or for such a reduction its operand's pair h (`fold`), or
  // empty.
  struct Pairs {
    std::vector<std::string> member, fold;
  };
  Pairs bf16_pairs(const RowPasses& rp, const PassPlan& pp, int width, int pass,
                   const std::vector<int>& reductions, const std::string& arr,
                   const std::string& idx) const;
  // The row generator's member and pass numbers (ints) as indices.
  static size_t sz(int i) { return static_cast<size_t>(i); }
  int row_dims_ = 0;              // the domain's leading dims that are not reduced
  std::vector<bool> row_stored_;  // [input]: in the shared-memory row cache
  int row_blocks_ = 0;            // with the cache: the blocks a multiprocessor is to hold
  std::vector<RowMember> row_members_;
  // Values with one value per row (a row kernel's per-row inputs and members): a bf16 division by
  // one goes through the row's reciprocal (kdiv_row_bf16).
  absl::flat_hash_set<int> per_row_;
  absl::flat_hash_map<int, std::string> mean_scale_;  // member -> the constant 1 / count

  const Trace& t_;
  size_t begin_, end_;
  int64_t shared_limit_;  // the dynamic shared memory a block may opt in to, in bytes
  RowPlanOptions row_plan_;
  // Values kept in float for 16-bit ones: no kopaque (multiplies and adds may contract into
  // FMAs), exp as __expf, a division by a row's value as a multiply by its reciprocal.
  absl::flat_hash_set<int> fast_;
  FusedKernel k_;
  absl::flat_hash_map<int, std::string> name_;
  std::vector<const BoundOp*> members_;
  std::vector<std::string> exprs_, lines_;
  std::vector<std::pair<ScalarType, uint64_t>> constants_;
};

}  // namespace kiln::compiler::internal
