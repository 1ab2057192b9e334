// The listings kiln::compile writes where CompileOptions::trace_dir (or KILN_TRACE_DIR) points
// (docs/compiler.md, "traces() and KILN_TRACE_DIR"): each stage's trace as
// <dir>/<stem>.<stage>.txt and, beside the executors' listing, the CUDA source of each fused_cuda
// region as <dir>/<stem>.executors.<region>.cu. Each file is written whole through a temporary of
// the process's own, so the ranks of a job (`kiln run`), which write the same names into one
// directory, never see half a file (the last rename wins).
#pragma once

#include <string>

#include "compiler/trace.h"

namespace kiln::compiler {

// Writes `t`'s listing (and, for the "executors" stage, its generated sources); an error names
// the file it could not write.
void write_trace_listing(const std::string& dir, const std::string& stem, const Trace& t);

}  // namespace kiln::compiler
