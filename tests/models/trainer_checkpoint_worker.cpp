// The process that tests/models/trainer_checkpoint_test.cpp kills while it saves the same step of
// a trainer checkpoint again and again into one directory (issue 21).
//
//   trainer_checkpoint_worker <dir> <step> <keep>
//
// Saves with kiln::models::internal::save_checkpoint, as pretrain does, two states in turn:
// value 1 and value 2 (every element of the model file's "w" and the optimizer file's "m" and
// "v"), keep_checkpoints <keep>. The first save (value 1) is complete before "ready" goes to
// stdout; then the saves alternate, forever, until the process is killed.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>

#include "models/trainer_internal.h"
#include "nn/safetensors.h"
#include "tensor/ops.h"

int main(int argc, char** argv) {
  using namespace kiln;
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s <dir> <step> <keep>\n", argv[0]);
    return 2;
  }
  try {
    const std::string dir = argv[1];
    const int64_t step = std::stoll(argv[2]);
    models::PretrainOptions o;
    o.data_path = "data.txt";
    o.keep_checkpoints = std::stoll(argv[3]);
    // Files of a few MB, so that a save takes long enough to be killed in the middle.
    constexpr int64_t kElements = 1 << 20;
    auto save = [&](double value) {
      const TensorMap model = {{"w", full({kElements}, value)}};
      const TensorMap opt = {{"m", full({kElements}, value)}, {"v", full({kElements}, value)}};
      models::internal::save_checkpoint(
          dir, [&](const std::string& path) { save_safetensors(model, path); },
          [&](const std::string& path) { save_safetensors(opt, path); }, "tiny-llama", o, step,
          {1e-3, 1e-4, 0, 10}, std::nullopt);
    };
    save(1);
    std::printf("ready\n");
    std::fflush(stdout);
    for (int64_t i = 0;; ++i) save(i % 2 == 0 ? 2 : 1);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_checkpoint_worker: %s\n", e.what());
    return 1;
  }
}
