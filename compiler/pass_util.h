// What the passes of compiler/passes.cpp share with its pattern rewrites (compiler/rewrites.cpp):
// renaming values, rewriting a trace op by op, and the dataflow questions a rewrite asks before it
// may fold one op into another. Internal to the compiler's passes.
#pragma once

#include <vector>

#include "compiler/trace.h"

namespace kiln::compiler {

// ids[i] = to[ids[i]] for every value id (negative ids, "none", stay).
void rename(std::vector<int>& ids, const std::vector<int>& to);
// The start of a pass that rewrites the ops one by one: `trace` without its ops, as stage
// `stage`, and `to`, the identity renaming of its values.
Trace without_ops(const Trace& trace, const char* stage, std::vector<int>& to);
// The end of such a pass: the returned values and grad effects renamed.
void rename_results(Trace& out, const std::vector<int>& to);

// Per value: whether an in-place op writes it (directly or through a view).
std::vector<bool> written_values(const Trace& trace);
// Per value: whether the program hands it out (a result, a gradient), directly or through a view.
std::vector<bool> handed_out_values(const Trace& trace);
// Per value: the op that makes it (an index into trace.ops; -1 for an argument or a captured
// tensor), and how many op inputs read it.
struct Dataflow {
  std::vector<int> producer, uses;
};
Dataflow dataflow(const Trace& trace);
// Whether two specs have one layout: sizes, dtype, device, and strides (none recorded meaning
// contiguous).
bool same_layout(const TensorSpec& a, const TensorSpec& b);
// Whether v's memory is read by nothing but v's one reader (compiler/passes.cpp says how).
bool read_once(const Trace& trace, const Dataflow& flow, const std::vector<bool>& written,
               const std::vector<bool>& handed_out, int v);
// Per op index i (and trace.ops.size()): the latest in-place op before i, or -1.
std::vector<int> last_inplace_before(const Trace& trace);

}  // namespace kiln::compiler
