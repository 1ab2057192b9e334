// Sequential, ModuleList, ModuleDict and Functional.
#include "nn/modules/container.h"

namespace kiln::nn {

namespace internal {
void fail_module_cast(const char* container, const std::string& key, const Module& module,
                      const std::type_info& wanted) {
  KILN_FAIL("[", container, "] module '", key, "' is a ", demangle(typeid(module)), ", not a ",
            demangle(wanted));
}
}  // namespace internal

// --- Functional ----------------------------------------------------------------------------------

FunctionalImpl::FunctionalImpl(Function function) : function_(std::move(function)) {
  KILN_CHECK(function_ != nullptr, "[Functional] the function is empty");
}

Tensor FunctionalImpl::forward(Tensor input) { return function_(std::move(input)); }

void FunctionalImpl::pretty_print(std::ostream& stream) const {
  stream << "kiln::nn::Functional()";
}

// The function is copied; a callable's captured state is shared, as libtorch's Functional.
std::shared_ptr<Module> FunctionalImpl::clone(const std::optional<Device>& device) const {
  return internal::clone_layer(*this, std::make_shared<FunctionalImpl>(function_), device);
}

// --- Sequential ----------------------------------------------------------------------------------

SequentialImpl::SequentialImpl(std::initializer_list<NamedAnyModule> named_modules) {
  for (const NamedAnyModule& m : named_modules) push_back(m.name, m.module);
}

void SequentialImpl::push_back(AnyModule module) {
  push_back(std::to_string(modules_.size()), std::move(module));
}

void SequentialImpl::push_back(std::string name, AnyModule module) {
  KILN_CHECK(!module.is_empty(), "[Sequential] cannot add an empty module");
  register_module(std::move(name), module.ptr());
  modules_.push_back(std::move(module));
}

void SequentialImpl::extend(const SequentialImpl& other) {
  // Copied first: `other` may be this very Sequential.
  const std::vector<AnyModule> more = other.modules_;
  for (const AnyModule& m : more) push_back(m);
}

Tensor SequentialImpl::forward(const Tensor& input) {
  KILN_CHECK(!modules_.empty(), "[Sequential] cannot call forward() on an empty Sequential");
  Tensor x = modules_.front().forward(input);
  for (size_t i = 1; i < modules_.size(); ++i) x = modules_[i].forward(x);
  return x;
}

std::shared_ptr<Module> SequentialImpl::ptr(size_t index) const {
  KILN_CHECK(index < modules_.size(), "[Sequential] index ", index,
             " is out of range for a Sequential of size ", modules_.size());
  return modules_[index].ptr();
}

void SequentialImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::Sequential"; }

// Containers clone their children (each child's own clone(), which names it when it has none)
// under the same names; the mode is set before they are added, as train() would recurse.
std::shared_ptr<Module> SequentialImpl::clone(const std::optional<Device>& device) const {
  auto copy = std::make_shared<SequentialImpl>();
  copy->train(is_training());
  const auto names = named_children().keys();
  for (size_t i = 0; i < modules_.size(); ++i) copy->push_back(names[i], modules_[i].clone(device));
  return copy;
}

// --- ModuleList ----------------------------------------------------------------------------------

void ModuleListImpl::push_back(std::shared_ptr<Module> module) {
  KILN_CHECK(module != nullptr, "[ModuleList] cannot add a null module");
  register_module(std::to_string(modules_.size()), module);
  modules_.push_back(std::move(module));
}

void ModuleListImpl::insert(size_t index, std::shared_ptr<Module> module) {
  KILN_CHECK(index <= modules_.size(), "[ModuleList] insert index ", index,
             " is out of range for a ModuleList of size ", modules_.size());
  KILN_CHECK(module != nullptr, "[ModuleList] cannot add a null module");
  // Children are named by position: re-register everything from `index` on.
  for (size_t i = index; i < modules_.size(); ++i) unregister_module(std::to_string(i));
  modules_.insert(modules_.begin() + static_cast<std::ptrdiff_t>(index), std::move(module));
  for (size_t i = index; i < modules_.size(); ++i) register_module(std::to_string(i), modules_[i]);
}

void ModuleListImpl::extend(const ModuleListImpl& other) {
  const std::vector<std::shared_ptr<Module>> more = other.modules_;
  for (const auto& m : more) push_back(m);
}

std::shared_ptr<Module> ModuleListImpl::ptr(size_t index) const {
  KILN_CHECK(index < modules_.size(), "[ModuleList] index ", index,
             " is out of range for a ModuleList of size ", modules_.size());
  return modules_[index];
}

void ModuleListImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::ModuleList"; }

std::shared_ptr<Module> ModuleListImpl::clone(const std::optional<Device>& device) const {
  auto copy = std::make_shared<ModuleListImpl>();
  copy->train(is_training());
  for (const auto& m : modules_) copy->push_back(m->clone(device));
  return copy;
}

// --- ModuleDict ----------------------------------------------------------------------------------

ModuleDictImpl::ModuleDictImpl(
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules) {
  update(modules);
}

ModuleDictImpl::ModuleDictImpl(const Dict& modules) { update(modules); }

void ModuleDictImpl::insert(const std::string& key, std::shared_ptr<Module> module) {
  KILN_CHECK(module != nullptr, "[ModuleDict] module '", key, "' is null");
  if (modules_.contains(key)) {
    replace_module(key, module);
    modules_[key] = std::move(module);
  } else {
    register_module(key, module);
    modules_.insert(key, std::move(module));
  }
}

void ModuleDictImpl::update(
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules) {
  for (const auto& [key, module] : modules) insert(key, module);
}

void ModuleDictImpl::update(const Dict& modules) {
  for (const auto& item : modules) insert(item.key(), item.value());
}

std::shared_ptr<Module> ModuleDictImpl::pop(const std::string& key) {
  KILN_CHECK(modules_.contains(key), "[ModuleDict] no module named '", key, "'");
  unregister_module(key);
  return modules_.erase(key);
}

void ModuleDictImpl::clear() {
  for (const std::string& key : modules_.keys()) unregister_module(key);
  modules_.clear();
}

std::shared_ptr<Module> ModuleDictImpl::operator[](const std::string& key) const {
  const std::shared_ptr<Module>* m = modules_.find(key);
  KILN_CHECK(m != nullptr, "[ModuleDict] no module named '", key, "'");
  return *m;
}

void ModuleDictImpl::pretty_print(std::ostream& stream) const { stream << "kiln::nn::ModuleDict"; }

std::shared_ptr<Module> ModuleDictImpl::clone(const std::optional<Device>& device) const {
  auto copy = std::make_shared<ModuleDictImpl>();
  copy->train(is_training());
  for (const auto& item : modules_) copy->insert(item.key(), item.value()->clone(device));
  return copy;
}

}  // namespace kiln::nn
