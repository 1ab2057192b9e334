// kiln::save / kiln::load on top of the safetensors reader and writer.
#include "nn/serialize.h"

#include <exception>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

namespace {

const SafetensorsMetadata& pt_metadata() {
  static const SafetensorsMetadata kMetadata{{"format", "pt"}};
  return kMetadata;
}

}  // namespace

void save(const nn::Module& module, const std::string& path) {
  save_safetensors(module.state_dict(), path, pt_metadata());
}

nn::LoadStateDictResult load(nn::Module& module, const std::string& path, bool strict) {
  const SafetensorsFile file(path);
  // A checkpoint of this module holds its dtypes: another dtype means another file (I32 where
  // the module has F32), which the copy into the module would convert without a word. Checked
  // from the header, before any tensor is read. module.load_state_dict(load_safetensors(path))
  // converts, as torch's load_state_dict does.
  std::string mismatches;
  for (const auto& [name, t] : module.state_dict()) {
    if (!file.contains(name) || file.info(name).dtype == t.dtype()) continue;
    mismatches += std::string(mismatches.empty() ? "" : "; ") + "tensor \"" + name + "\" is " +
                  std::string(dtype_name(file.info(name).dtype)) + " in the file but " +
                  std::string(dtype_name(t.dtype())) + " in the module";
  }
  KILN_CHECK(mismatches.empty(), "[load] ", path, ": ", mismatches,
             " (kiln::load does not convert; module.load_state_dict(load_safetensors(path)) does)");
  // Copies read with pread (a file truncated meanwhile is an error, not SIGBUS); load_state_dict
  // copies them into the module.
  const TensorMap tensors = file.read_all();
  try {
    return module.load_state_dict(tensors, strict);
  } catch (const Error& e) {
    KILN_FAIL("[load] ", path, ": ", e.what());
  }
}

void save(const TensorMap& tensors, const std::string& path) {
  save_safetensors(tensors, path, pt_metadata());
}

void load(TensorMap& tensors, const std::string& path) { tensors = load_safetensors(path); }

void save(const Tensor& tensor, const std::string& path) {
  KILN_CHECK(tensor.defined(), "[save] ", path, ": the tensor is undefined");
  save(TensorMap{{"tensor", tensor}}, path);
}

void load(Tensor& tensor, const std::string& path) {
  TensorMap tensors = load_safetensors(path);
  KILN_CHECK(tensors.size() == 1 && tensors.begin()->first == "tensor", "[load] ", path,
             ": expected a file of one tensor (kiln::save(tensor, path)), found ", tensors.size(),
             " tensors", tensors.empty() ? "" : " such as '",
             tensors.empty() ? "" : tensors.begin()->first, tensors.empty() ? "" : "'");
  tensor = tensors.begin()->second;  // load_safetensors's tensors own their memory
}

void save(const std::vector<Tensor>& tensors, const std::string& path) {
  TensorMap map;
  for (size_t i = 0; i < tensors.size(); ++i) {
    KILN_CHECK(tensors[i].defined(), "[save] ", path, ": tensor ", i, " is undefined");
    map.emplace(std::to_string(i), tensors[i]);
  }
  save(map, path);
}

void load(std::vector<Tensor>& tensors, const std::string& path) {
  TensorMap map = load_safetensors(path);
  std::vector<Tensor> out(map.size());
  for (auto& [name, t] : map) {
    size_t i = 0;
    size_t used = 0;
    try {
      i = std::stoul(name, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KILN_CHECK(used == name.size() && i < out.size() && !out[i].defined(), "[load] ", path,
               ": expected a list of tensors (kiln::save(tensors, path)) named 0..", out.size() - 1,
               ", found '", name, "'");
    out[i] = t;
  }
  tensors = std::move(out);
}

}  // namespace kiln
