// libFuzzer target for the safetensors reader: arbitrary bytes must be either rejected with
// kiln::Error or loaded, and whatever loads must survive a write and a second read unchanged.
// Any crash, over-read (AddressSanitizer) or mismatch (abort) is a finding.
//
//   tools/fuzz.sh 1     # builds build-fuzz/ (docs/testing.md)
//   D=tests/nn/data F=build-fuzz/safetensors_fuzz
//   $F -max_total_time=60 -dict=$D/safetensors.dict -seed_inputs=$D/fixture.safetensors
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "nn/safetensors.h"

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "safetensors_fuzz: %s\n", what);
    std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kiln;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  TensorMap tensors;
  SafetensorsMetadata metadata;
  try {
    const SafetensorsFile f = SafetensorsFile::from_bytes(bytes, "<fuzz>");
    metadata = f.metadata();
    tensors = f.get_all();
  } catch (const Error&) {
    return 0;  // rejected cleanly
  }
  const std::string again = save_safetensors_to_bytes(tensors, metadata);
  const SafetensorsFile g = SafetensorsFile::from_bytes(again, "<fuzz rewrite>");
  check(g.metadata() == metadata, "metadata changed in a round trip");
  check(g.keys().size() == tensors.size(), "tensor count changed in a round trip");
  for (const auto& [name, t] : tensors) {
    const Tensor u = g.get(name);
    check(u.dtype() == t.dtype() && u.sizes() == t.sizes(), "dtype or shape changed");
    check(t.nbytes() == 0 || std::memcmp(u.data_ptr(), t.data_ptr(), t.nbytes()) == 0,
          "data changed in a round trip");
  }
  return 0;
}
