// kiln::nn::Module: the base of every layer and model, and the holders that users pass around,
// in libtorch's spelling (a libtorch model ports by renaming torch:: to kiln::).
//
//   struct NetImpl : kiln::nn::Module {
//     NetImpl(int64_t in, int64_t out) {
//       fc = register_module("fc", kiln::nn::Linear(in, out));
//       scale = register_parameter("scale", kiln::ones({out}));
//       register_buffer("steps", kiln::zeros({}, kiln::kInt64));
//     }
//     kiln::Tensor forward(const kiln::Tensor& x) { return fc(x) * scale; }
//     kiln::nn::Linear fc{nullptr};
//     kiln::Tensor scale;
//   };
//   KILN_MODULE(Net);   // Net holds a std::shared_ptr<NetImpl>
//
//   Net net(4, 2);
//   auto y = net(x);                       // NetImpl::forward
//   for (auto& p : net->named_parameters()) std::cout << p.key() << "\n";  // fc.weight, ...
//   net->to(kiln::kBFloat16);
//   kiln::save(net, "net.safetensors");    // nn/serialize.h
//   std::cout << *net;                     // the module tree
//
// Parameters, buffers and children are kept in registration order; names are dotted paths
// ("layers.0.weight") as PyTorch's and Hugging Face's state dicts.
//
// Pitfalls:
// - Modules live in std::shared_ptr (holders make them so): modules() and named_modules()
//   with include_self need shared_from_this().
// - register_parameter returns a reference into the module's table: copy it into a member
//   (`w = register_parameter(...)`) before registering the next one.
// - to(dtype) converts floating-point parameters and buffers only (integer buffers such as
//   BatchNorm's num_batches_tracked stay integers), as PyTorch's Module.to.
// - to() keeps each parameter's identity: it swaps the data under the same tensor, so members
//   holding parameters and optimizers built before the call see the converted values.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "tensor/error.h"
#include "tensor/tensor.h"

namespace kiln {

// A map that remembers insertion order, as torch::OrderedDict. Items are key() / value()
// pairs; iteration is in insertion order. Inserting an existing key fails.
template <typename Key, typename Value>
class OrderedDict {
 public:
  class Item {
   public:
    Item(Key key, Value value) : key_(std::move(key)), value_(std::move(value)) {}
    const Key& key() const noexcept { return key_; }
    Value& value() noexcept { return value_; }
    const Value& value() const noexcept { return value_; }
    Value& operator*() noexcept { return value_; }
    const Value& operator*() const noexcept { return value_; }
    Value* operator->() noexcept { return &value_; }
    const Value* operator->() const noexcept { return &value_; }
    std::pair<Key, Value> pair() const { return {key_, value_}; }

   private:
    Key key_;
    Value value_;
  };
  using iterator = typename std::vector<Item>::iterator;
  using const_iterator = typename std::vector<Item>::const_iterator;

  // `key_description` names the keys in errors ("Parameter", "Buffer", ...).
  explicit OrderedDict(std::string key_description = "Key")
      : key_description_(std::move(key_description)) {}

  Value& insert(Key key, Value value) {
    KILN_CHECK(!index_.contains(key), "[OrderedDict] ", key_description_, " '", key,
               "' already defined");
    index_.emplace(key, items_.size());
    items_.emplace_back(std::move(key), std::move(value));
    return items_.back().value();
  }
  // Inserts or replaces, keeping the original position of an existing key.
  Value& update(Key key, Value value) {
    if (Value* v = find(key)) return *v = std::move(value);
    return insert(std::move(key), std::move(value));
  }
  Value* find(const Key& key) noexcept {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].value();
  }
  const Value* find(const Key& key) const noexcept {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].value();
  }
  bool contains(const Key& key) const noexcept { return index_.contains(key); }
  Value& operator[](const Key& key) {
    Value* v = find(key);
    KILN_CHECK(v != nullptr, "[OrderedDict] ", key_description_, " '", key, "' is not defined");
    return *v;
  }
  const Value& operator[](const Key& key) const {
    const Value* v = find(key);
    KILN_CHECK(v != nullptr, "[OrderedDict] ", key_description_, " '", key, "' is not defined");
    return *v;
  }
  // Removes `key` and returns its value; later items keep their order.
  Value erase(const Key& key) {
    auto it = index_.find(key);
    KILN_CHECK(it != index_.end(), "[OrderedDict] ", key_description_, " '", key,
               "' is not defined");
    const size_t pos = it->second;
    Value v = std::move(items_[pos].value());
    items_.erase(items_.begin() + static_cast<std::ptrdiff_t>(pos));
    index_.erase(it);
    for (auto& [k, i] : index_) {
      if (i > pos) --i;
    }
    return v;
  }
  void clear() {
    items_.clear();
    index_.clear();
  }

  size_t size() const noexcept { return items_.size(); }
  bool is_empty() const noexcept { return items_.empty(); }
  bool empty() const noexcept { return items_.empty(); }
  iterator begin() { return items_.begin(); }
  iterator end() { return items_.end(); }
  const_iterator begin() const { return items_.begin(); }
  const_iterator end() const { return items_.end(); }
  Item& front() { return items_.front(); }
  Item& back() { return items_.back(); }
  const std::vector<Item>& items() const noexcept { return items_; }
  std::vector<Key> keys() const {
    std::vector<Key> out;
    out.reserve(items_.size());
    for (const Item& i : items_) out.push_back(i.key());
    return out;
  }
  std::vector<Value> values() const {
    std::vector<Value> out;
    out.reserve(items_.size());
    for (const Item& i : items_) out.push_back(i.value());
    return out;
  }

 private:
  std::string key_description_;
  std::vector<Item> items_;
  absl::flat_hash_map<Key, size_t> index_;
};

namespace nn {

template <typename Contained>
class ModuleHolder;

// What load_state_dict(strict = false) could not match, as PyTorch's _IncompatibleKeys.
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

namespace internal {
// The demangled name of a type, without "(anonymous namespace)::".
std::string demangle(const std::type_info& type);
// "Linear" for kiln::nn::LinearImpl: the holder's name in its errors.
std::string holder_name(const std::type_info& contained);
[[noreturn]] void fail_empty_holder(const std::type_info& contained);
}  // namespace internal

// clang-format off
template <typename T>
concept ModuleHolderType = requires { typename T::ContainedType; } &&
                           std::is_base_of_v<ModuleHolder<typename T::ContainedType>, T>;
// clang-format on

class Module : public std::enable_shared_from_this<Module> {
 public:
  using ModuleApplyFunction = std::function<void(Module&)>;
  using ConstModuleApplyFunction = std::function<void(const Module&)>;
  using NamedModuleApplyFunction = std::function<void(const std::string&, Module&)>;

  // `name` replaces the type name that name() and printing show.
  explicit Module(std::string name);
  Module();
  virtual ~Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The type's name (demangled, e.g. "NetImpl"), or the one given to the constructor.
  const std::string& name() const noexcept;

  // --- The tree ---------------------------------------------------------------------------
  // Defined parameters of this module (and its descendants when recurse), each once even
  // when shared, in registration order (depth first).
  std::vector<Tensor> parameters(bool recurse = true) const;
  OrderedDict<std::string, Tensor> named_parameters(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  OrderedDict<std::string, Tensor> named_buffers(bool recurse = true) const;
  std::vector<std::shared_ptr<Module>> children() const;
  OrderedDict<std::string, std::shared_ptr<Module>> named_children() const;
  // This module (unless !include_self) and all descendants, each once, depth first.
  std::vector<std::shared_ptr<Module>> modules(bool include_self = true) const;
  OrderedDict<std::string, std::shared_ptr<Module>> named_modules(
      const std::string& name_prefix = "", bool include_self = true) const;

  // Calls fn on this module, then on every descendant (pre-order, as libtorch).
  void apply(const ModuleApplyFunction& fn);
  void apply(const ConstModuleApplyFunction& fn) const;
  void apply(const NamedModuleApplyFunction& fn, const std::string& name_prefix = "");

  // --- Modes, devices, dtypes, gradients --------------------------------------------------
  // Sets training mode on this module and all descendants.
  virtual void train(bool on = true);
  void eval() { train(false); }
  virtual bool is_training() const noexcept { return is_training_; }

  virtual void to(Device device, ScalarType dtype, bool non_blocking = false);
  virtual void to(ScalarType dtype, bool non_blocking = false);
  virtual void to(Device device, bool non_blocking = false);

  // Drops (set_to_none) or zeroes the gradient of every parameter.
  virtual void zero_grad(bool set_to_none = true);

  // A deep copy (new parameters and buffers with the same values, on `device` when given), as
  // libtorch's: every built-in layer and container has it (containers clone their children), as
  // do modules that derive from Cloneable<Self>; others fail naming the type.
  virtual std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const;

  // --- State dict -------------------------------------------------------------------------
  // Parameters and persistent buffers by dotted name, detached (sharing storage).
  std::map<std::string, Tensor> state_dict() const;
  // Copies `state_dict` into the parameters and buffers (converting dtype and device).
  // Nothing is copied unless every shape matches; strict also fails on missing and unexpected
  // keys. The error lists every problem at once.
  LoadStateDictResult load_state_dict(const std::map<std::string, Tensor>& state_dict,
                                      bool strict = true);

  // --- Printing ---------------------------------------------------------------------------
  // One line describing this module alone ("kiln::nn::Linear(in_features=4, ...)"); the
  // default prints name(). operator<< adds the children, indented.
  virtual void pretty_print(std::ostream& stream) const;

  // --- Registration -----------------------------------------------------------------------
  // Registers `tensor` (a leaf; a non-leaf is detached first) as a parameter. An undefined
  // tensor reserves the name (as Linear's absent bias) and is skipped by parameters().
  Tensor& register_parameter(std::string name, Tensor tensor, bool requires_grad = true);
  // Buffers are state that is not trained (running statistics). Non-persistent buffers are
  // moved by to() but left out of state_dict().
  Tensor& register_buffer(std::string name, Tensor tensor, bool persistent = true);

  template <std::derived_from<Module> M>
  std::shared_ptr<M> register_module(std::string name, std::shared_ptr<M> module) {
    add_child(std::move(name), module);
    return module;
  }
  template <ModuleHolderType H>
  H register_module(std::string name, H holder) {
    add_child(std::move(name), holder.ptr());
    return holder;
  }
  // Replaces an existing child (for instance to swap a layer of a pretrained model).
  template <std::derived_from<Module> M>
  std::shared_ptr<M> replace_module(const std::string& name, std::shared_ptr<M> module) {
    replace_child(name, module);
    return module;
  }
  template <ModuleHolderType H>
  H replace_module(const std::string& name, H holder) {
    replace_child(name, holder.ptr());
    return holder;
  }
  void unregister_module(const std::string& name);

  // This module as a T (a module type, or a holder type meaning its module), or null when it
  // is not one: `if (auto* fc = m->as<kiln::nn::Linear>()) ...`.
  template <typename T>
  auto* as() noexcept {
    if constexpr (ModuleHolderType<T>) {
      return dynamic_cast<typename T::ContainedType*>(this);
    } else {
      return dynamic_cast<T*>(this);
    }
  }
  template <typename T>
  const auto* as() const noexcept {
    return const_cast<Module*>(this)->as<T>();
  }

  // This module's own tables (what named_* return without recursion).
  const OrderedDict<std::string, Tensor>& local_parameters() const { return parameters_; }
  const OrderedDict<std::string, Tensor>& local_buffers() const { return buffers_; }
  bool is_persistent_buffer(const std::string& name) const {
    return !non_persistent_buffers_.contains(name);
  }

  friend std::ostream& operator<<(std::ostream& stream, const Module& module);

 private:
  void add_child(std::string name, std::shared_ptr<Module> module);
  void replace_child(const std::string& name, std::shared_ptr<Module> module);
  void check_new_name(const std::string& name, const char* what) const;
  void pretty_print_recursive(std::ostream& stream, const std::string& indentation) const;
  template <typename Fn>
  void visit(const std::string& prefix, Fn&& fn) const;
  void convert(const std::function<Tensor(const Tensor&)>& fn,
               const std::function<bool(const Tensor&)>& applies);

  OrderedDict<std::string, Tensor> parameters_{"Parameter"};
  OrderedDict<std::string, Tensor> buffers_{"Buffer"};
  std::set<std::string> non_persistent_buffers_;
  OrderedDict<std::string, std::shared_ptr<Module>> children_{"Submodule"};
  mutable std::optional<std::string> name_;
  bool is_training_ = true;
};

// The base of modules that clone(), as torch::nn::Cloneable: `struct NetImpl :
// kiln::nn::Cloneable<NetImpl>`, whose reset() (re)creates every parameter, buffer and submodule
// from the module's plain members (its constructor calls reset() too). clone() copies the module
// (its plain members; holders and tensors are then replaced), calls reset() on the copy, and copies
// the values of every parameter and buffer into it, with this module's dtype, device (or
// `device`) and training mode:
//
//   struct NetImpl : kiln::nn::Cloneable<NetImpl> {
//     explicit NetImpl(int64_t n) : n(n) { reset(); }
//     void reset() override { fc = register_module("fc", kiln::nn::Linear(n, n)); }
//     kiln::Tensor forward(const kiln::Tensor& x) { return fc(x); }
//     int64_t n;
//     kiln::nn::Linear fc{nullptr};
//   };
//   auto copy = std::dynamic_pointer_cast<NetImpl>(net->clone());
namespace internal {
// Makes `target` (a registered parameter or buffer) hold `value`'s data, keeping its identity.
void set_module_tensor(const Tensor& target, const Tensor& value, bool requires_grad);
// Gives `copy`, a module freshly built with `from`'s structure (by reset() or by its constructor,
// as `built_by` says in errors), copies of `from`'s parameters and buffers, matched by dotted name:
// new storage on `device` (or each tensor's own), the same dtype and requires_grad, no gradient;
// and the training mode of every submodule. Fails naming the module when the structures differ.
void copy_module_state(const Module& from, Module& copy, const std::optional<Device>& device,
                       const char* built_by);

// The clone() of a built-in layer: `copy` is a new module made from `from`'s options (the
// constructor creates every parameter and buffer, drawing a fresh initialisation), then given
// `from`'s values.
template <std::derived_from<Module> M>
std::shared_ptr<Module> clone_layer(const M& from, std::shared_ptr<M> copy,
                                    const std::optional<Device>& device) {
  copy_module_state(from, *copy, device, "its constructor");
  return copy;
}
}  // namespace internal

template <typename Derived>
class Cloneable : public Module {
 public:
  using Module::Module;
  Cloneable() = default;
  // A copy starts as an empty module (no parameters, buffers or children) of the same name:
  // reset() fills it.
  Cloneable(const Cloneable& other) : Module(other.name()) {}
  Cloneable& operator=(const Cloneable&) = delete;

  // (Re)creates the parameters, buffers and submodules.
  virtual void reset() = 0;

  std::shared_ptr<Module> clone(const std::optional<Device>& device = std::nullopt) const override {
    auto copy = std::make_shared<Derived>(static_cast<const Derived&>(*this));
    copy->reset();
    internal::copy_module_state(*this, *copy, device, "reset()");
    return copy;
  }
};

// A shared_ptr to a module with the module's call syntax, as torch::nn::ModuleHolder:
// `fc(x)` calls fc->forward(x), `fc->weight` reaches the module. Constructed with nullptr it
// is empty; using an empty holder fails with "[Linear] accessing an empty module holder".
template <typename Contained>
class ModuleHolder {
 public:
  using ContainedType = Contained;

  // Default-constructs the module when it can be (Sequential seq;); otherwise there is no
  // default constructor: write `Linear fc{nullptr}` for an empty holder.
  ModuleHolder() requires std::is_default_constructible_v<Contained>
      : impl_(std::make_shared<Contained>()) {}
  ModuleHolder(std::nullptr_t) {}                                                // NOLINT
  ModuleHolder(std::shared_ptr<Contained> module) : impl_(std::move(module)) {}  // NOLINT
  // Forwards the arguments to Contained's constructor: Linear(4, 1), Linear(LinearOptions(..)).
  // clang-format off
  template <typename Head, typename... Tail>
    requires(!(sizeof...(Tail) == 0 &&
               (std::is_convertible_v<Head, std::shared_ptr<Contained>> ||
                std::is_base_of_v<ModuleHolder, std::decay_t<Head>>)))
  explicit ModuleHolder(Head&& head, Tail&&... tail)
      : impl_(std::make_shared<Contained>(std::forward<Head>(head), std::forward<Tail>(tail)...)) {}
  // clang-format on

  Contained* operator->() const { return get(); }
  Contained& operator*() const { return *get(); }
  Contained* get() const {
    if (impl_ == nullptr) [[unlikely]]
      internal::fail_empty_holder(typeid(Contained));
    return impl_.get();
  }
  const std::shared_ptr<Contained>& ptr() const {
    if (impl_ == nullptr) [[unlikely]]
      internal::fail_empty_holder(typeid(Contained));
    return impl_;
  }
  bool is_empty() const noexcept { return impl_ == nullptr; }
  explicit operator bool() const noexcept { return impl_ != nullptr; }

  // Calls the module's forward.
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) const {
    return get()->forward(std::forward<Args>(args)...);
  }
  // Indexes containers: seq[0], dict["fc"].
  template <typename Arg>
  decltype(auto) operator[](Arg&& arg) const {
    return (*get())[std::forward<Arg>(arg)];
  }

 private:
  std::shared_ptr<Contained> impl_;
};

template <typename Contained>
std::ostream& operator<<(std::ostream& stream, const ModuleHolder<Contained>& holder) {
  return stream << *holder;
}

}  // namespace nn
}  // namespace kiln

// Declares `Name`, a holder of `Name##Impl`, as TORCH_MODULE: `struct NetImpl : Module {...};
// KILN_MODULE(Net);` then `Net net(args...)`, `Net empty{nullptr}`, `net->member`, `net(x)`.
#define KILN_MODULE_IMPL(Name, ImplType)                    \
  class Name : public ::kiln::nn::ModuleHolder<ImplType> {  \
   public:                                                  \
    using ::kiln::nn::ModuleHolder<ImplType>::ModuleHolder; \
    using Impl = ImplType;                                  \
  }
#define KILN_MODULE(Name) KILN_MODULE_IMPL(Name, Name##Impl)
