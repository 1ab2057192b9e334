// Containers: Sequential, ModuleList, ModuleDict, and Functional (a function as a module).
//
//   kiln::nn::Sequential mlp(kiln::nn::Linear(4, 16), kiln::nn::Functional(kiln::relu),
//                            kiln::nn::Linear(16, 1));
//   auto y = mlp(x);                               // forward through each in turn
//   kiln::nn::Sequential named({{"fc", kiln::nn::Linear(4, 4)}, {"act", kiln::nn::ReLU()}});
//
//   kiln::nn::ModuleList layers;
//   for (int i = 0; i < 4; ++i) layers->push_back(Block(cfg));   // names "0", "1", ...
//   for (const auto& layer : *layers) x = layer->as<BlockImpl>()->forward(x);
//
//   kiln::nn::ModuleDict heads({{"cls", kiln::nn::Linear(8, 2).ptr()}});
//   heads["cls"];  heads->at<kiln::nn::LinearImpl>("cls").weight;
//
// Sequential takes modules whose forward maps one Tensor to one Tensor (and plain callables
// Tensor(Tensor), wrapped in Functional); ModuleList and ModuleDict take any module and have
// no forward.
#pragma once

#include <concepts>
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "nn/module.h"

namespace kiln::nn {

namespace internal {
[[noreturn]] void fail_module_cast(const char* container, const std::string& key,
                                   const Module& module, const std::type_info& wanted);
// A pointer to T inside `module`, or a clear error naming the container and key.
template <typename T>
std::shared_ptr<T> module_cast(const char* container, const std::string& key,
                               const std::shared_ptr<Module>& module) {
  auto p = std::dynamic_pointer_cast<T>(module);
  if (p == nullptr) fail_module_cast(container, key, *module, typeid(T));
  return p;
}
}  // namespace internal

// --- Functional ----------------------------------------------------------------------------------

// Wraps a function Tensor(Tensor), with trailing arguments bound: Functional(kiln::relu),
// Functional(kiln::gelu, "tanh"), Functional([](kiln::Tensor x) { return x * 2; }).
class FunctionalImpl : public Module {
 public:
  using Function = std::function<Tensor(Tensor)>;

  explicit FunctionalImpl(Function function);
  template <typename F, typename Arg, typename... Args>
  explicit FunctionalImpl(F function, Arg&& arg, Args&&... args)
      : FunctionalImpl(Function([function = std::move(function), arg = std::forward<Arg>(arg),
                                 ... args = std::forward<Args>(args)](Tensor input) {
          return function(std::move(input), arg, args...);
        })) {}

  Tensor forward(Tensor input);
  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

 private:
  Function function_;
};
KILN_MODULE(Functional);

// --- AnyModule -----------------------------------------------------------------------------------

// clang-format off
template <typename M>
concept TensorToTensorModule = std::derived_from<M, Module> && requires(M& m, const Tensor& x) {
  { m.forward(x) } -> std::convertible_to<Tensor>;
};
template <typename H>
concept TensorToTensorHolder = ModuleHolderType<H> &&
                               TensorToTensorModule<typename H::ContainedType>;
class AnyModule;
template <typename F>
concept TensorFunction = !ModuleHolderType<std::decay_t<F>> &&
                         !std::is_same_v<std::decay_t<F>, AnyModule> &&
                         std::is_invocable_r_v<Tensor, F&, Tensor>;
// clang-format on

// A module with a Tensor -> Tensor forward, its type erased (Sequential's element).
class AnyModule {
 public:
  AnyModule() = default;
  template <TensorToTensorModule M>
  AnyModule(std::shared_ptr<M> module)  // NOLINT: implicit
      : module_(module),
        forward_([m = module.get()](const Tensor& x) -> Tensor { return m->forward(x); }),
        retype_([](const std::shared_ptr<Module>& copy) -> AnyModule {
          auto typed = std::dynamic_pointer_cast<M>(copy);
          KILN_CHECK(typed != nullptr, "[clone] the clone of a ", internal::demangle(typeid(M)),
                     " is a ", internal::demangle(typeid(*copy)), ", not a ",
                     internal::demangle(typeid(M)));
          return AnyModule(std::move(typed));
        }) {
    KILN_CHECK(module_ != nullptr, "[AnyModule] the module is null");
  }
  template <TensorToTensorHolder H>
  AnyModule(const H& holder) : AnyModule(holder.ptr()) {}  // NOLINT: implicit
  // A plain callable Tensor(Tensor) becomes a Functional.
  template <TensorFunction F>
  AnyModule(F&& function)  // NOLINT: implicit
      : AnyModule(
            std::make_shared<FunctionalImpl>(FunctionalImpl::Function(std::forward<F>(function)))) {
  }

  Tensor forward(const Tensor& input) const {
    KILN_CHECK(module_ != nullptr, "[AnyModule] calling forward on an empty AnyModule");
    return forward_(input);
  }
  const std::shared_ptr<Module>& ptr() const { return module_; }
  bool is_empty() const noexcept { return module_ == nullptr; }
  // An AnyModule holding a deep copy of the module (its clone()), with the same forward.
  AnyModule clone(const std::optional<Device>& device = std::nullopt) const {
    KILN_CHECK(module_ != nullptr, "[AnyModule] cloning an empty AnyModule");
    return retype_(module_->clone(device));
  }

 private:
  std::shared_ptr<Module> module_;
  std::function<Tensor(const Tensor&)> forward_;
  // Wraps a clone of module_ (a Module pointer) back into an AnyModule of the module's type.
  std::function<AnyModule(const std::shared_ptr<Module>&)> retype_;
};

template <typename M>
concept AnyModuleLike = std::is_constructible_v<AnyModule, M&&>;

struct NamedAnyModule {
  template <typename M>
  NamedAnyModule(std::string name, M&& module)
      : name(std::move(name)), module(AnyModule(std::forward<M>(module))) {}
  std::string name;
  AnyModule module;
};

// --- Sequential ----------------------------------------------------------------------------------

class SequentialImpl : public Module {
 public:
  using iterator = std::vector<AnyModule>::const_iterator;

  SequentialImpl() = default;
  template <AnyModuleLike M, AnyModuleLike... Ms>
  explicit SequentialImpl(M&& module, Ms&&... modules) {
    push_back(AnyModule(std::forward<M>(module)));
    (push_back(AnyModule(std::forward<Ms>(modules))), ...);
  }
  explicit SequentialImpl(std::initializer_list<NamedAnyModule> named_modules);

  // Appends a module named by its position ("0", "1", ...) or by `name`.
  void push_back(AnyModule module);
  void push_back(std::string name, AnyModule module);
  // Appends the modules of `other` (shared, not copied).
  void extend(const SequentialImpl& other);

  // Runs each module on the previous one's output.
  Tensor forward(const Tensor& input);

  std::shared_ptr<Module> operator[](size_t index) const { return ptr(index); }
  std::shared_ptr<Module> ptr(size_t index) const;
  template <typename T>
  std::shared_ptr<T> ptr(size_t index) const {
    return internal::module_cast<T>("Sequential", std::to_string(index), ptr(index));
  }
  template <typename T>
  T& at(size_t index) const {
    return *ptr<T>(index);
  }
  size_t size() const noexcept { return modules_.size(); }
  bool is_empty() const noexcept { return modules_.empty(); }
  iterator begin() const { return modules_.begin(); }
  iterator end() const { return modules_.end(); }

  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

 private:
  std::vector<AnyModule> modules_;
};

class Sequential : public ModuleHolder<SequentialImpl> {
 public:
  using ModuleHolder<SequentialImpl>::ModuleHolder;
  Sequential() = default;
  Sequential(std::initializer_list<NamedAnyModule> named_modules)
      : ModuleHolder(std::make_shared<SequentialImpl>(named_modules)) {}
};

// --- ModuleList ----------------------------------------------------------------------------------

template <typename T>
concept ModuleLike =
    ModuleHolderType<std::decay_t<T>> || std::is_convertible_v<T, std::shared_ptr<Module>>;

class ModuleListImpl : public Module {
 public:
  using iterator = std::vector<std::shared_ptr<Module>>::const_iterator;

  ModuleListImpl() = default;
  template <ModuleLike M, ModuleLike... Ms>
  explicit ModuleListImpl(M&& module, Ms&&... modules) {
    push_back(std::forward<M>(module));
    (push_back(std::forward<Ms>(modules)), ...);
  }

  void push_back(std::shared_ptr<Module> module);
  template <ModuleHolderType H>
  void push_back(const H& holder) {
    push_back(std::static_pointer_cast<Module>(holder.ptr()));
  }
  // Inserts before position `index` (0 <= index <= size()); later modules are renamed.
  void insert(size_t index, std::shared_ptr<Module> module);
  template <ModuleHolderType H>
  void insert(size_t index, const H& holder) {
    insert(index, std::static_pointer_cast<Module>(holder.ptr()));
  }
  void extend(const ModuleListImpl& other);

  std::shared_ptr<Module> operator[](size_t index) const { return ptr(index); }
  std::shared_ptr<Module> ptr(size_t index) const;
  template <typename T>
  std::shared_ptr<T> ptr(size_t index) const {
    return internal::module_cast<T>("ModuleList", std::to_string(index), ptr(index));
  }
  template <typename T>
  T& at(size_t index) const {
    return *ptr<T>(index);
  }
  size_t size() const noexcept { return modules_.size(); }
  bool is_empty() const noexcept { return modules_.empty(); }
  iterator begin() const { return modules_.begin(); }
  iterator end() const { return modules_.end(); }

  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

 private:
  std::vector<std::shared_ptr<Module>> modules_;
};
KILN_MODULE(ModuleList);

// --- ModuleDict ----------------------------------------------------------------------------------

class ModuleDictImpl : public Module {
 public:
  using Dict = OrderedDict<std::string, std::shared_ptr<Module>>;
  using iterator = Dict::const_iterator;

  ModuleDictImpl() = default;
  explicit ModuleDictImpl(
      const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules);
  explicit ModuleDictImpl(const Dict& modules);

  // Adds or replaces (keeping its position) the module under `key`.
  void insert(const std::string& key, std::shared_ptr<Module> module);
  template <ModuleHolderType H>
  void insert(const std::string& key, const H& holder) {
    insert(key, std::static_pointer_cast<Module>(holder.ptr()));
  }
  void update(const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules);
  void update(const Dict& modules);
  // Removes `key` and returns its module.
  std::shared_ptr<Module> pop(const std::string& key);
  void clear();

  std::shared_ptr<Module> operator[](const std::string& key) const;
  template <typename T>
  std::shared_ptr<T> ptr(const std::string& key) const {
    return internal::module_cast<T>("ModuleDict", key, (*this)[key]);
  }
  template <typename T>
  T& at(const std::string& key) const {
    return *ptr<T>(key);
  }
  bool contains(const std::string& key) const noexcept { return modules_.contains(key); }
  size_t size() const noexcept { return modules_.size(); }
  bool is_empty() const noexcept { return modules_.is_empty(); }
  std::vector<std::string> keys() const { return modules_.keys(); }
  std::vector<std::shared_ptr<Module>> values() const { return modules_.values(); }
  const std::vector<Dict::Item>& items() const noexcept { return modules_.items(); }
  iterator begin() const { return modules_.begin(); }
  iterator end() const { return modules_.end(); }

  void pretty_print(std::ostream& stream) const override;
  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override;

 private:
  Dict modules_{"Module"};
};

class ModuleDict : public ModuleHolder<ModuleDictImpl> {
 public:
  using ModuleHolder<ModuleDictImpl>::ModuleHolder;
  ModuleDict() = default;
  ModuleDict(std::initializer_list<std::pair<std::string, std::shared_ptr<Module>>> modules)
      : ModuleHolder(std::make_shared<ModuleDictImpl>(
            std::vector<std::pair<std::string, std::shared_ptr<Module>>>(modules))) {}
};

}  // namespace kiln::nn
