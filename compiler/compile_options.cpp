// CompileOptions (compiler/compile.h): the setters, which check what they are given.
#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <utility>

#include "compiler/compile.h"
#include "compiler/executor.h"
#include "tensor/error.h"
#include "tensor/registry.h"

namespace kiln {

CompileOptions& CompileOptions::executors(std::vector<std::string> names) {
  for (const std::string& n : names) (void)compiler::find_executor(n);  // fails for unknown
  executors_ = std::move(names);
  if (std::find(executors_.begin(), executors_.end(), "eager") == executors_.end()) {
    executors_.push_back("eager");
  }
  return *this;
}
CompileOptions& CompileOptions::skip_pass(std::string name) {
  // The passes compile runs, in order (CompiledCore::call).
  static constexpr std::array<std::string_view, 12> kPasses = {
      "autocast", "decompose",          "functionalize",  "simplify",        "dce",
      "cse",      "fuse_norm_residual", "fold_index_add", "fuse_qkv_rotary", "fold_copy_into_mm",
      "fuse",     "plan_memory"};
  if (std::find(kPasses.begin(), kPasses.end(), name) == kPasses.end()) {
    std::string known;
    for (std::string_view p : kPasses)
      known += std::string(known.empty() ? "" : ", ") + std::string(p);
    KILN_FAIL("[CompileOptions] no pass is named '", name, "' (passes that can be skipped: ", known,
              ")");
  }
  skipped_.push_back(std::move(name));
  return *this;
}
CompileOptions& CompileOptions::decompose(std::vector<std::string> op_names) {
  for (const std::string& n : op_names) {
    KILN_CHECK(Registry::get().op(n).decomposition != nullptr, "[CompileOptions] ", n,
               " has no decomposition to expand");
  }
  decomposed_ = std::move(op_names);
  return *this;
}
CompileOptions& CompileOptions::dynamic(int argument, int64_t dim) {
  KILN_CHECK(argument >= 0 && dim >= 0, "[CompileOptions] dynamic(", argument, ", ", dim,
             "): the argument and dimension must be non-negative");
  dynamic_.emplace_back(argument, dim);
  return *this;
}
CompileOptions& CompileOptions::debug(bool on) {
  debug_ = on;
  return *this;
}
CompileOptions& CompileOptions::trace_dir(std::string dir) {
  trace_dir_ = std::move(dir);
  return *this;
}
CompileOptions& CompileOptions::recompile_limit(int limit) {
  KILN_CHECK(limit >= 1, "[CompileOptions] recompile_limit must be at least 1, got ", limit);
  recompile_limit_ = limit;
  return *this;
}
CompileOptions& CompileOptions::name(std::string name) {
  name_ = std::move(name);
  return *this;
}
CompileOptions& CompileOptions::remat(compiler::RematPolicy policy) {
  partition_.policy = policy;
  return *this;
}
CompileOptions& CompileOptions::cuda_graphs(bool on) {
  cuda_graphs_ = on;
  return *this;
}
CompileOptions& CompileOptions::emulate_precision_casts(bool on) {
  emulate_precision_casts_ = on;
  return *this;
}
CompileOptions& CompileOptions::activation_budget(int64_t bytes) {
  KILN_CHECK(bytes >= 0,
             "[CompileOptions] activation_budget must be a non-negative byte count, got ", bytes);
  partition_.activation_budget = bytes;
  return *this;
}

}  // namespace kiln
