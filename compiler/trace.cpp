#include "compiler/trace.h"

#include <sstream>

namespace kiln::compiler {
namespace {

std::string_view short_dtype(ScalarType t) {
  switch (t) {
    case kBool:
      return "b8";
    case kUInt8:
      return "u8";
    case kInt32:
      return "i32";
    case kInt64:
      return "i64";
    case kHalf:
      return "f16";
    case kBFloat16:
      return "bf16";
    case kFloat:
      return "f32";
    case kDouble:
      return "f64";
  }
  return "?";
}

std::string value_ref(const Trace& t, int id) { return id < 0 ? "_" : t.value(id).name; }

// "t3, t4 = " / "t3 = " / "" (an op without outputs).
std::string lhs(const Trace& t, const BoundOp& op) {
  std::string s;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    if (i > 0) s += ", ";
    s += value_ref(t, op.outputs[i]);
  }
  return s.empty() ? s : s + " = ";
}

std::string op_line(const Trace& t, const BoundOp& op) {
  std::ostringstream os;
  os << lhs(t, op) << op.name() << "(";
  for (size_t i = 0; i < op.inputs.size(); ++i)
    os << (i > 0 ? ", " : "") << value_ref(t, op.inputs[i]);
  if (!op.attrs.empty()) {
    os << (op.inputs.empty() ? "" : "; ");
    for (size_t i = 0; i < op.attrs.size(); ++i) {
      os << (i > 0 ? ", " : "");
      if (op.rng_offset >= 0 && i + 2 >= op.attrs.size()) {
        os << (i + 2 == op.attrs.size() ? (op.rng_seed_from_entry ? "seed" : attr_str(op.attrs[i]))
                                        : "offset+" + std::to_string(op.rng_offset));
      } else {
        os << attr_str(op.attrs[i]);
      }
    }
  }
  os << ")";
  std::string line = os.str();
  std::string comment;
  for (size_t i = 0; i < op.outputs.size(); ++i) {
    if (i > 0) comment += ", ";
    if (op.outputs[i] < 0) {
      comment += "_";
      continue;
    }
    const ValueInfo& v = t.value(op.outputs[i]);
    comment += spec_str(v.spec);
    if (v.arena >= 0) {
      comment += " @" + (v.arena > 0 ? std::to_string(v.arena) + ":" : std::string()) +
                 std::to_string(v.arena_offset);
    }
  }
  if (op.autocast.any()) {
    comment += " autocast(";
    if (op.autocast.cpu)
      comment += std::string("cpu: ") + std::string(short_dtype(op.autocast.cpu_dtype));
    if (op.autocast.cpu && op.autocast.cuda) comment += ", ";
    if (op.autocast.cuda)
      comment += std::string("cuda: ") + std::string(short_dtype(op.autocast.cuda_dtype));
    comment += ")";
  }
  if (op.trusted_indices) comment += (comment.empty() ? "" : " ") + std::string("trusted indices");
  if (!op.executor.empty() && op.region < 0)
    comment += (comment.empty() ? "" : " ") + ("[" + op.executor + "]");
  if (comment.empty()) return line;
  if (line.size() < 52) line.resize(52, ' ');
  return line + "  # " + comment;
}

std::string param_list(const Trace& t, const std::vector<int>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) {
    const ValueInfo& v = t.value(ids[i]);
    s += (i > 0 ? ", " : "") + v.name + ": " + spec_str(v.spec) +
         (v.requires_grad ? " requires_grad" : "");
  }
  return s;
}

}  // namespace

TensorSpec spec_of(const Tensor& t) {
  const TensorImpl* i = t.impl();
  return TensorSpec{i->sizes(), i->dtype(), i->device(), i->strides()};
}

std::string spec_str(const TensorSpec& spec) {
  std::string s(short_dtype(spec.dtype));
  s += shape_str(spec.sizes);
  s += " " + spec.device.str();
  return s;
}

std::string attr_str(const Attr& attr) {
  std::ostringstream os;
  std::visit(
      [&]<typename T>(const T& v) {
        if constexpr (std::is_same_v<T, std::monostate>) {
          os << "none";
        } else if constexpr (std::is_same_v<T, bool>) {
          os << (v ? "true" : "false");
        } else if constexpr (std::is_same_v<T, Shape>) {
          os << shape_str(v);
        } else if constexpr (std::is_same_v<T, ScalarType>) {
          os << short_dtype(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          os << "'" << v << "'";
        } else if constexpr (std::is_same_v<T, Device>) {
          os << v.str();
        } else {
          os << v;
        }
      },
      attr);
  return os.str();
}

std::vector<int> step_positions(const Trace& trace) {
  const size_t n = trace.ops.size();
  std::vector<int> at(n);
  for (size_t i = 0; i < n;) {
    size_t end = i + 1;
    if (trace.ops[i].region >= 0) {
      while (end < n && trace.ops[end].region == trace.ops[i].region) ++end;
    }
    for (size_t k = i; k < end; ++k) at[k] = static_cast<int>(end - 1);
    i = end;
  }
  return at;
}

int Trace::add_value(TensorSpec spec, ValueRole role, bool requires_grad) {
  const int id = static_cast<int>(values.size());
  const char* prefix = role == ValueRole::kArgument   ? "a"
                       : role == ValueRole::kExternal ? "p"
                                                      : "t";
  values.push_back({std::move(spec), requires_grad, prefix + std::to_string(id)});
  roles.push_back(role);
  return id;
}

std::string Trace::str() const {
  std::ostringstream os;
  os << "# " << stage << ": " << ops.size() << " ops";
  if (rng_blocks > 0) os << ", " << rng_blocks << " Philox blocks per run";
  if (!emulate_precision_casts) os << ", precision casts not emulated";
  for (size_t a = 0; a < arenas.size(); ++a) {
    os << ", arena " << (a > 0 ? std::to_string(a) + " " : std::string()) << arenas[a].bytes
       << " bytes on " << arenas[a].device.str();
  }
  os << "\n";
  os << "def " << fn_name << "(" << param_list(*this, arguments);
  if (!externals.empty())
    os << (arguments.empty() ? "; " : ";\n    ") << param_list(*this, externals);
  os << ")\n";
  int open_region = -1;
  for (const BoundOp& op : ops) {
    if (op.region != open_region) {
      if (op.region >= 0) {
        const std::string& n = region_names[static_cast<size_t>(op.region)];
        os << "  " << n << ":  # region";
        if (!op.executor.empty()) os << " [" << op.executor << "]";
        os << "\n";
      }
      open_region = op.region;
    }
    std::string line = op_line(*this, op);
    // A member is indented two more: keep its comment in the column of the others.
    if (op.region >= 0 && line.size() > 54 && line.compare(50, 4, "    ") == 0) line.erase(50, 2);
    os << (op.region >= 0 ? "    " : "  ") << line << "\n";
  }
  os << "  return ";
  for (size_t i = 0; i < outputs.size(); ++i)
    os << (i > 0 ? ", " : "") << value_ref(*this, outputs[i]);
  os << "\n";
  for (const GradEffect& e : grad_effects) {
    os << "  " << value(externals[static_cast<size_t>(e.external)]).name
       << ".grad = " << value_ref(*this, e.value) << "\n";
  }
  return os.str();
}

}  // namespace kiln::compiler
