// `kiln prepare` (models/cli/prepare.cpp), dispatched from the tool's main.
#pragma once

#include <string>
#include <vector>

namespace kiln::cli {

// Runs `kiln prepare ARGS...`: returns 0, or 2 after printing the usage for bad flags; errors of
// the work itself (a missing file, a bad tokenizer.json) are thrown as kiln::Error.
int run_prepare_command(const std::vector<std::string>& args);
// The command's usage text.
const char* prepare_usage();

}  // namespace kiln::cli
