// kiln's disk cache: what is slow to make and the same from one run to the next on one machine.
// Generated kernels' cubins (compiler/fused_cuda.cpp) and the kernels' measured choices
// (cuBLASLt's algorithms, cuDNN's attention engines: kernels/cuda/choices.h) are stored there, so
// that a program's first step does not compile or time them again.
//
//   kiln::disk_cache::Key key{{"kind", "what it depends on", "..."}, ".cubin"};
//   if (auto payload = kiln::disk_cache::read(kiln::disk_cache::dir(), key)) use(*payload);
//   else kiln::disk_cache::write(kiln::disk_cache::dir(), key, make());
//
// A file holds a header (magic, format version, every part of its key, the payload's size and
// checksum), then the payload; a read checks all of them, so a file of another key (a hash
// collision), a truncated or a corrupted one is rejected, never used. Writes go to a temporary
// file renamed into place: a reader sees a whole file or none, and concurrent writers of one key
// (the ranks of a job) leave one whole file. Plain files: CPU code, testable without a GPU.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace kiln::disk_cache {

// The cache's directory: set_dir's, else KILN_KERNEL_CACHE, else $XDG_CACHE_HOME/kiln/kernels,
// else $HOME/.cache/kiln/kernels, else "none". An empty string restores the default; "none"
// turns the disk cache off.
std::string dir();
void set_dir(std::string dir);

struct Key {
  std::vector<std::string> parts;  // everything the payload depends on
  std::string suffix;              // the file name's ending, e.g. ".cubin"
  std::string file_name() const;   // a hash of the parts, in hex, + suffix
};

// The payload stored under `key` in `dir`, or nullopt: missing, or rejected (`rejected` set).
std::optional<std::string> read(const std::string& dir, const Key& key, bool* rejected = nullptr);
// Writes atomically (a temporary file renamed); false when `dir` is "none" or not writable.
bool write(const std::string& dir, const Key& key, const std::string& payload);

}  // namespace kiln::disk_cache
