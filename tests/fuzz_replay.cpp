// A libFuzzer target's main where libFuzzer is not available (a g++ build): runs the target's
// LLVMFuzzerTestOneInput once on each of its seeds and regression inputs, so that every build
// replays them (tests/CMakeLists.txt, kiln_add_fuzz). It takes libFuzzer's command line:
// -seed_inputs=a,b adds files, other -flags are ignored, and each other argument is a file or a
// folder of inputs.
//
//   build/tests/json_fuzz -seed_inputs=tests/nn/data/json_fuzz/document.json
//   tests/nn/data/json_fuzz
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

namespace fs = std::filesystem;

void add_path(const fs::path& p, std::vector<fs::path>& inputs) {
  if (fs::is_directory(p)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(p)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    inputs.insert(inputs.end(), files.begin(), files.end());
  } else {
    inputs.push_back(p);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  std::vector<fs::path> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.starts_with("-seed_inputs=")) {
      std::stringstream list(a.substr(a.find('=') + 1));
      std::string item;
      while (std::getline(list, item, ',')) inputs.emplace_back(item);
    } else if (!a.starts_with("-")) {
      add_path(a, inputs);
    }
  }
  for (const fs::path& p : inputs) {
    std::ifstream in(p, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "%s: cannot read %s\n", argv[0], p.c_str());
      return 1;
    }
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string bytes = ss.str();
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("%s: replayed %zu inputs (no libFuzzer in this build: clang fuzzes them)\n", argv[0],
              inputs.size());
  return inputs.empty() ? 1 : 0;
}
