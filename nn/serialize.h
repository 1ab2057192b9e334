// kiln::save / kiln::load: checkpoints of modules and tensor maps as safetensors files, with
// the dotted Hugging Face-style names of state_dict() ("layers.0.attn.q_proj.weight").
//
//   kiln::save(model, "model.safetensors");          // parameters + persistent buffers
//   kiln::load(model, "model.safetensors");          // strict: every key must match
//   auto r = kiln::load(model, "base.safetensors", /*strict=*/false);
//   for (auto& k : r.missing_keys) std::cout << "not in the file: " << k << "\n";
//
//   kiln::save(kiln::TensorMap{{"step", step}}, "extra.safetensors");
//   kiln::TensorMap extra;  kiln::load(extra, "extra.safetensors");
//
// Writes are atomic (save_safetensors: temporary file, fsync, rename) and carry the metadata
// {"format": "pt"} that Hugging Face's loaders look for. load copies into the module's
// existing tensors (on their device); every tensor of the file must have the dtype of the
// module's tensor of that name, or the error names the file, the tensor and both dtypes (an I32
// tensor where the module has F32 is another file, not something to convert). To convert, as
// torch's load_state_dict does, say so: `module->load_state_dict(kiln::load_safetensors(path))`
// (a bf16 checkpoint into an f32 model). Nothing is copied unless every dtype and shape
// matches, and the error lists all missing keys, unexpected keys and shape mismatches at once.
#pragma once

#include <concepts>
#include <memory>
#include <string>
#include <vector>

#include "nn/module.h"
#include "nn/safetensors.h"

namespace kiln {

void save(const nn::Module& module, const std::string& path);
nn::LoadStateDictResult load(nn::Module& module, const std::string& path, bool strict = true);

template <std::derived_from<nn::Module> M>
void save(const std::shared_ptr<M>& module, const std::string& path) {
  KILN_CHECK(module != nullptr, "[save] the module is null");
  save(static_cast<const nn::Module&>(*module), path);
}
template <typename M>
void save(const nn::ModuleHolder<M>& module, const std::string& path) {
  save(static_cast<const nn::Module&>(*module), path);
}
template <std::derived_from<nn::Module> M>
nn::LoadStateDictResult load(const std::shared_ptr<M>& module, const std::string& path,
                             bool strict = true) {
  KILN_CHECK(module != nullptr, "[load] the module is null");
  return load(static_cast<nn::Module&>(*module), path, strict);
}
template <typename M>
nn::LoadStateDictResult load(const nn::ModuleHolder<M>& module, const std::string& path,
                             bool strict = true) {
  return load(static_cast<nn::Module&>(*module), path, strict);
}

// A map of named tensors. load replaces the contents of `tensors` with the file's (CPU tensors
// of their own, as load_safetensors reads them).
void save(const TensorMap& tensors, const std::string& path);
void load(TensorMap& tensors, const std::string& path);

// One tensor (stored under the name "tensor") or a list of tensors (under "0", "1", ...), as
// torch::save(tensor, path) and torch::save(tensors, path). load replaces `tensor` (`tensors`)
// with the file's, on the CPU; a file of the other kind is an error that names it.
void save(const Tensor& tensor, const std::string& path);
void load(Tensor& tensor, const std::string& path);
void save(const std::vector<Tensor>& tensors, const std::string& path);
void load(std::vector<Tensor>& tensors, const std::string& path);

// An optimizer's state and options (Optimizer::save / load), as torch::save(optimizer, path).
template <typename O>
  requires requires(const O& o, O& m, const std::string& p) {
    o.save(p);
    m.load(p);
    o.param_groups();
  }
void save(const O& optimizer, const std::string& path) {
  optimizer.save(path);
}
template <typename O>
  requires requires(const O& o, O& m, const std::string& p) {
    o.save(p);
    m.load(p);
    o.param_groups();
  }
void load(O& optimizer, const std::string& path) {
  optimizer.load(path);
}

}  // namespace kiln
