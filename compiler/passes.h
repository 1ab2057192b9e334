// Trace transforms: each takes a Trace and returns a new one (the input is left as it was), so
// that CompiledFunction::traces() can show every stage.
//
//   Trace t1 = compiler::dce(traced);     // drops ops whose results nothing uses
//   Trace t2 = compiler::cse(t1);         // merges repeated pure ops
//
// What the passes assume about in-place ops (OpKind::kInplace, kept in program order): an
// in-place op writes memory that other values may alias, so dce keeps every in-place op and
// what it reads, and cse forgets everything it has seen at each in-place op. Random ops are
// never merged (two draws differ).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "compiler/executor.h"
#include "compiler/trace.h"

namespace kiln::compiler {

// Dead-code elimination: keeps the ops that produce the outputs and grad effects, every
// in-place op, and what they read.
Trace dce(const Trace& trace);

// Common-subexpression elimination over functional, non-random ops: a second op with the same
// inputs and attributes is dropped and its outputs renamed to the first one's.
Trace cse(const Trace& trace);

// Executor assignment: each op goes to the first executor in `executors` that claims it (the
// last should be "eager", which claims everything). Sets BoundOp::executor.
Trace assign_executors(const Trace& trace,
                       const std::vector<std::shared_ptr<const Executor>>& executors);

}  // namespace kiln::compiler
