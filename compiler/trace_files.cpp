#include "compiler/trace_files.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <system_error>

#include "compiler/fused_cuda.h"
#include "tensor/error.h"

namespace kiln::compiler {
namespace {

void write_whole(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    out << text;
    out.close();
    KILN_CHECK(out, "[compile] cannot write the trace to ", path,
               " (trace_dir / KILN_TRACE_DIR): write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  KILN_CHECK(!ec, "[compile] cannot write the trace to ", path, ": ", ec.message());
}

// The CUDA source of each fused_cuda region beside the listing: <listing>.<region>.cu.
void write_generated_sources(const Trace& t, const std::string& stem) {
  for (size_t i = 0; i < t.ops.size();) {
    size_t end = i + 1;
    if (t.ops[i].region < 0 || t.ops[i].executor != "fused_cuda") {
      i = end;
      continue;
    }
    while (end < t.ops.size() && t.ops[end].region == t.ops[i].region) ++end;
    const std::optional<std::string> source = fused_cuda_source(t, i, end);
    const std::string& region = t.region_names[static_cast<size_t>(t.ops[i].region)];
    if (source) write_whole(stem + "." + region + ".cu", *source);
    i = end;
  }
}

}  // namespace

void write_trace_listing(const std::string& dir, const std::string& stem, const Trace& t) {
  const std::string base = dir + "/" + stem + "." + t.stage;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KILN_CHECK(!ec, "[compile] cannot write the trace to ", base,
             ".txt (trace_dir / KILN_TRACE_DIR): ", ec.message());
  write_whole(base + ".txt", t.str());
  if (t.stage == "executors") write_generated_sources(t, base);
}

}  // namespace kiln::compiler
