// What models/hf_config.cpp and models/hf_weights.cpp share; not part of kiln's API (that is
// models/hf.h).
#pragma once

#include <string>

namespace kiln::models::internal {

// The whole file at `path`. Throws "[<op>] <path>: cannot open the file" (or "cannot read").
std::string read_text_file(const std::string& path, const char* op);

}  // namespace kiln::models::internal
