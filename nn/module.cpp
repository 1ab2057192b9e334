// kiln::nn::Module: registration, traversal, modes, conversion, state dicts and printing.
#include "nn/module.h"

#include <cxxabi.h>

#include <cstdlib>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "autograd/grad_mode.h"

namespace kiln::nn {

namespace internal {

std::string demangle(const std::type_info& type) {
  int status = 0;
  char* raw = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string name = (status == 0 && raw != nullptr) ? raw : type.name();
  std::free(raw);
  static constexpr std::string_view kAnon = "(anonymous namespace)::";
  for (size_t pos; (pos = name.find(kAnon)) != std::string::npos;) name.erase(pos, kAnon.size());
  return name;
}

std::string holder_name(const std::type_info& contained) {
  std::string name = demangle(contained);
  if (const size_t colon = name.rfind("::"); colon != std::string::npos) {
    name.erase(0, colon + 2);
  }
  if (name.size() > 4 && name.ends_with("Impl")) name.resize(name.size() - 4);
  return name;
}

void fail_empty_holder(const std::type_info& contained) {
  KILN_FAIL("[", holder_name(contained),
            "] accessing an empty module holder (it was constructed with nullptr); assign a "
            "module to it first");
}

// Swaps the data under `t` for `value`'s while keeping `t`'s identity (its TensorImpl, so every
// handle to the parameter sees the new data) and its autograd state, as libtorch's set_data. The
// gradient is converted alongside so that it keeps matching the parameter.
void set_data(const Tensor& t, const Tensor& value,
              const std::function<Tensor(const Tensor&)>& fn) {
  t.impl()->set_data(*value.impl());
  if (t.grad().defined()) {
    Tensor& g = const_cast<Tensor&>(t).mutable_grad();
    g = fn(g);
  }
}

void set_module_tensor(const Tensor& target, const Tensor& value, bool requires_grad) {
  target.impl()->set_data(*value.impl());
  if (target.requires_grad() != requires_grad) {
    const_cast<Tensor&>(target).requires_grad_(requires_grad);
  }
}

void copy_module_state(const Module& from, Module& copy, const std::optional<Device>& device,
                       const char* built_by) {
  NoGradGuard no_grad;
  auto assign = [&](const OrderedDict<std::string, Tensor>& mine,
                    const OrderedDict<std::string, Tensor>& theirs, const char* what) {
    KILN_CHECK(mine.size() == theirs.size(), "[clone] ", from.name(), ": ", built_by, " made ",
               theirs.size(), " ", what, "s, the module has ", mine.size());
    for (const auto& item : mine) {
      const Tensor* target = theirs.find(item.key());
      KILN_CHECK(target != nullptr, "[clone] ", from.name(), ": ", built_by, " made no ", what,
                 " '", item.key(), "'");
      const Tensor& src = item.value();
      KILN_CHECK(target->defined() && target->sizes() == src.sizes(), "[clone] ", from.name(), ": ",
                 what, " '", item.key(), "' has shape ", shape_str(src.sizes()), " but ", built_by,
                 " made ", target->defined() ? shape_str(target->sizes()) : std::string("none"));
      // A tensor shared with the original would be overwritten in both: the copy is not deep.
      KILN_CHECK(!target->is_same(src), "[clone] ", from.name(), ": ", what, " '", item.key(),
                 "' of the copy is the original's tensor");
      set_module_tensor(*target,
                        src.detach().to(device.value_or(src.device()), src.dtype(),
                                        /*non_blocking=*/false, /*copy=*/true),
                        src.requires_grad());
    }
  };
  // named_* skip undefined entries (an absent bias), so both sides list the defined ones.
  assign(from.named_parameters(), copy.named_parameters(), "parameter");
  assign(from.named_buffers(), copy.named_buffers(), "buffer");
  // train() is recursive: set the root, then every descendant in pre-order, so that each module
  // ends with its original's mode.
  copy.train(from.is_training());
  const auto copies = copy.named_modules("", /*include_self=*/false);
  for (const auto& item : from.named_modules("", /*include_self=*/false)) {
    if (const auto* c = copies.find(item.key())) (*c)->train(item.value()->is_training());
  }
}

}  // namespace internal

namespace {

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

Module::Module(std::string name) : name_(std::move(name)) {}
Module::Module() = default;

std::shared_ptr<Module> Module::clone(const std::optional<Device>& /*device*/) const {
  KILN_FAIL("[clone] ", name(), " does not support clone(): derive it from kiln::nn::Cloneable<",
            name(), "> and give it a reset() that creates its parameters and submodules");
}

const std::string& Module::name() const noexcept {
  if (!name_) name_ = internal::demangle(typeid(*this));
  return *name_;
}

// --- Registration --------------------------------------------------------------------------------

void Module::check_new_name(const std::string& name, const char* what) const {
  KILN_CHECK(!name.empty(), "[", what, "] the name must not be empty (in ", this->name(), ")");
  KILN_CHECK(name.find('.') == std::string::npos, "[", what, "] the name '", name,
             "' must not contain a dot (in ", this->name(), ")");
  const char* taken = parameters_.contains(name) ? "a parameter"
                      : buffers_.contains(name)  ? "a buffer"
                      : children_.contains(name) ? "a submodule"
                                                 : nullptr;
  KILN_CHECK(taken == nullptr, "[", what, "] ", this->name(), " already has ", taken, " named '",
             name, "'");
}

Tensor& Module::register_parameter(std::string name, Tensor tensor, bool requires_grad) {
  check_new_name(name, "register_parameter");
  if (tensor.defined()) {
    if (!tensor.is_leaf()) tensor = tensor.detach();
    if (requires_grad || tensor.requires_grad()) tensor.requires_grad_(requires_grad);
  }
  return parameters_.insert(std::move(name), std::move(tensor));
}

Tensor& Module::register_buffer(std::string name, Tensor tensor, bool persistent) {
  check_new_name(name, "register_buffer");
  if (!persistent) non_persistent_buffers_.insert(name);
  return buffers_.insert(std::move(name), std::move(tensor));
}

void Module::add_child(std::string name, std::shared_ptr<Module> module) {
  check_new_name(name, "register_module");
  KILN_CHECK(module != nullptr, "[register_module] submodule '", name, "' of ", this->name(),
             " is null");
  children_.insert(std::move(name), std::move(module));
}

void Module::replace_child(const std::string& name, std::shared_ptr<Module> module) {
  KILN_CHECK(children_.contains(name), "[replace_module] ", this->name(),
             " has no submodule named '", name, "'");
  KILN_CHECK(module != nullptr, "[replace_module] submodule '", name, "' of ", this->name(),
             " is null");
  children_[name] = std::move(module);
}

void Module::unregister_module(const std::string& name) {
  KILN_CHECK(children_.contains(name), "[unregister_module] ", this->name(),
             " has no submodule named '", name, "'");
  children_.erase(name);
}

// --- Traversal -----------------------------------------------------------------------------------

// Calls fn(prefix, module) on this module and its descendants, depth first, each module once.
template <typename Fn>
void Module::visit(const std::string& prefix, Fn&& fn) const {
  absl::flat_hash_set<const Module*> seen;
  std::function<void(const std::string&, const Module&)> rec = [&](const std::string& p,
                                                                   const Module& m) {
    if (!seen.insert(&m).second) return;
    fn(p, m);
    for (const auto& child : m.children_) rec(join_name(p, child.key()), *child.value());
  };
  rec(prefix, *this);
}

OrderedDict<std::string, Tensor> Module::named_parameters(bool recurse) const {
  OrderedDict<std::string, Tensor> out("Parameter");
  absl::flat_hash_set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const auto& p : m.parameters_) {
      if (p.value().defined() && seen.insert(p.value().impl()).second) {
        out.insert(join_name(prefix, p.key()), p.value());
      }
    }
  };
  if (recurse) {
    visit("", add);
  } else {
    add("", *this);
  }
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  return named_parameters(recurse).values();
}

OrderedDict<std::string, Tensor> Module::named_buffers(bool recurse) const {
  OrderedDict<std::string, Tensor> out("Buffer");
  absl::flat_hash_set<const TensorImpl*> seen;
  auto add = [&](const std::string& prefix, const Module& m) {
    for (const auto& b : m.buffers_) {
      if (b.value().defined() && seen.insert(b.value().impl()).second) {
        out.insert(join_name(prefix, b.key()), b.value());
      }
    }
  };
  if (recurse) {
    visit("", add);
  } else {
    add("", *this);
  }
  return out;
}

std::vector<Tensor> Module::buffers(bool recurse) const { return named_buffers(recurse).values(); }

OrderedDict<std::string, std::shared_ptr<Module>> Module::named_children() const {
  return children_;
}

std::vector<std::shared_ptr<Module>> Module::children() const { return children_.values(); }

OrderedDict<std::string, std::shared_ptr<Module>> Module::named_modules(
    const std::string& name_prefix, bool include_self) const {
  OrderedDict<std::string, std::shared_ptr<Module>> out("Module");
  if (include_self) {
    auto self = std::const_pointer_cast<Module>(weak_from_this().lock());
    KILN_CHECK(self != nullptr, "[named_modules] ", name(),
               " is not held by a std::shared_ptr (construct it through its holder or "
               "std::make_shared), so it cannot be returned; pass include_self = false");
  }
  visit(name_prefix, [&](const std::string& prefix, const Module& m) {
    if (&m == this) {
      if (include_self) out.insert(prefix, std::const_pointer_cast<Module>(m.shared_from_this()));
      return;
    }
    out.insert(prefix, std::const_pointer_cast<Module>(m.shared_from_this()));
  });
  return out;
}

std::vector<std::shared_ptr<Module>> Module::modules(bool include_self) const {
  return named_modules("", include_self).values();
}

void Module::apply(const ModuleApplyFunction& fn) {
  visit("", [&](const std::string&, const Module& m) { fn(const_cast<Module&>(m)); });
}

void Module::apply(const ConstModuleApplyFunction& fn) const {
  visit("", [&](const std::string&, const Module& m) { fn(m); });
}

void Module::apply(const NamedModuleApplyFunction& fn, const std::string& name_prefix) {
  visit(name_prefix,
        [&](const std::string& prefix, const Module& m) { fn(prefix, const_cast<Module&>(m)); });
}

// --- Modes, conversion, gradients ----------------------------------------------------------------

void Module::train(bool on) {
  is_training_ = on;
  for (auto& child : children_) child.value()->train(on);
}

void Module::convert(const std::function<Tensor(const Tensor&)>& fn,
                     const std::function<bool(const Tensor&)>& applies) {
  NoGradGuard no_grad;
  absl::flat_hash_set<const TensorImpl*> done;  // a shared parameter converts once
  visit("", [&](const std::string&, const Module& m) {
    for (const auto* table : {&m.parameters_, &m.buffers_}) {
      for (const auto& item : *table) {
        const Tensor& t = item.value();
        if (!t.defined() || !applies(t) || !done.insert(t.impl()).second) continue;
        const Tensor converted = fn(t);
        if (!converted.is_same(t)) internal::set_data(t, converted, fn);
      }
    }
  });
}

void Module::to(Device device, ScalarType dtype, bool /*non_blocking*/) {
  convert(
      [&](const Tensor& t) { return t.is_floating_point() ? t.to(device, dtype) : t.to(device); },
      [](const Tensor&) { return true; });
}

void Module::to(ScalarType dtype, bool /*non_blocking*/) {
  KILN_CHECK(is_floating_point(dtype), "[Module::to] expected a floating-point dtype, got ",
             dtype_name(dtype));
  convert([&](const Tensor& t) { return t.to(dtype); },
          [](const Tensor& t) { return t.is_floating_point(); });
}

void Module::to(Device device, bool /*non_blocking*/) {
  convert([&](const Tensor& t) { return t.to(device); }, [](const Tensor&) { return true; });
}

void Module::zero_grad(bool set_to_none) {
  NoGradGuard no_grad;
  for (Tensor& p : parameters()) {
    if (!p.grad().defined()) continue;
    Tensor& g = p.mutable_grad();
    if (set_to_none) {
      g = Tensor();
    } else {
      if (g.grad_fn() != nullptr) g = g.detach();
      g.zero_();
    }
  }
}

// --- State dict ----------------------------------------------------------------------------------

std::map<std::string, Tensor> Module::state_dict() const {
  std::map<std::string, Tensor> out;
  visit("", [&](const std::string& prefix, const Module& m) {
    for (const auto& p : m.parameters_) {
      if (p.value().defined()) out.emplace(join_name(prefix, p.key()), p.value().detach());
    }
    for (const auto& b : m.buffers_) {
      if (b.value().defined() && m.is_persistent_buffer(b.key())) {
        out.emplace(join_name(prefix, b.key()), b.value().detach());
      }
    }
  });
  return out;
}

LoadStateDictResult Module::load_state_dict(const std::map<std::string, Tensor>& state_dict,
                                            bool strict) {
  // The module's entries, not detached: the copies below write through them.
  std::map<std::string, Tensor> own;
  visit("", [&](const std::string& prefix, const Module& m) {
    for (const auto& p : m.parameters_) {
      if (p.value().defined()) own.emplace(join_name(prefix, p.key()), p.value());
    }
    for (const auto& b : m.buffers_) {
      if (b.value().defined() && m.is_persistent_buffer(b.key())) {
        own.emplace(join_name(prefix, b.key()), b.value());
      }
    }
  });
  LoadStateDictResult result;
  std::vector<std::string> mismatches;
  for (const auto& [key, t] : own) {
    auto it = state_dict.find(key);
    if (it == state_dict.end()) {
      result.missing_keys.push_back(key);
    } else if (!it->second.defined()) {
      mismatches.push_back(key + ": the given tensor is undefined");
    } else if (it->second.sizes() != t.sizes()) {
      mismatches.push_back(key + ": copying a tensor of shape " + shape_str(it->second.sizes()) +
                           " from the state dict, the shape in the current model is " +
                           shape_str(t.sizes()));
    }
  }
  for (const auto& [key, t] : state_dict) {
    if (!own.contains(key)) result.unexpected_keys.push_back(key);
  }
  const bool fail = !mismatches.empty() ||
                    (strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty()));
  if (fail) {
    std::ostringstream msg;
    msg << "[load_state_dict] error(s) in loading the state dict for " << name() << ":";
    auto list = [&](const char* title, const std::vector<std::string>& keys) {
      if (keys.empty()) return;
      msg << "\n  " << title << ":";
      for (size_t i = 0; i < keys.size(); ++i) msg << (i ? ", \"" : " \"") << keys[i] << '"';
    };
    if (strict) {
      list("missing key(s)", result.missing_keys);
      list("unexpected key(s)", result.unexpected_keys);
    }
    for (const std::string& m : mismatches) msg << "\n  size mismatch for " << m;
    KILN_FAIL(msg.str());
  }
  NoGradGuard no_grad;
  for (auto& [key, t] : own) {
    auto it = state_dict.find(key);
    if (it != state_dict.end() && !it->second.is_same(t)) t.copy_(it->second);
  }
  return result;
}

// --- Printing ------------------------------------------------------------------------------------

void Module::pretty_print(std::ostream& stream) const { stream << name(); }

void Module::pretty_print_recursive(std::ostream& stream, const std::string& indentation) const {
  pretty_print(stream);
  if (children_.is_empty()) return;
  stream << "(\n";
  const std::string next = indentation + "  ";
  for (const auto& child : children_) {
    stream << next << "(" << child.key() << "): ";
    child.value()->pretty_print_recursive(stream, next);
    stream << "\n";
  }
  stream << indentation << ")";
}

std::ostream& operator<<(std::ostream& stream, const Module& module) {
  module.pretty_print_recursive(stream, "");
  return stream;
}

}  // namespace kiln::nn
