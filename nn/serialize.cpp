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
  // The file's tensors alias its mapping; load_state_dict copies them into the module.
  const TensorMap tensors = file.get_all();
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
             " tensors", tensors.empty() ? "" : " such as '", tensors.empty() ? "" : tensors.begin()->first,
             tensors.empty() ? "" : "'");
  tensor = tensors.begin()->second.clone();
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
    out[i] = t.clone();
  }
  tensors = std::move(out);
}

}  // namespace kiln
