// kiln::save / kiln::load on top of the safetensors reader and writer.
#include "nn/serialize.h"

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

}  // namespace kiln
