// safetensors: reading and writing named tensors in Hugging Face's safetensors format.
//
// The file is an 8-byte little-endian header length N, N bytes of JSON describing each tensor
// ({"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...} plus an
// optional "__metadata__" string map), then the raw row-major tensor data. Files written here
// load in Python's safetensors library and the reverse.
//
//   kiln::save_safetensors({{"w", w}, {"b", b}}, "model.safetensors", {{"format", "pt"}});
//   kiln::TensorMap m = kiln::load_safetensors("model.safetensors");   // reads every tensor
//
//   kiln::SafetensorsFile f("model.safetensors");      // maps the file, validates the header
//   for (const std::string& name : f.keys()) std::cout << name << f.get(name).sizes() << "\n";
//   kiln::Tensor w = f.get("w");                       // zero-copy: a view of the mapping
//   kiln::Tensor b = f.read("b");                      // a copy, read with pread
//
// Writing is atomic: the data goes to a temporary file in the same directory, which is fsynced
// and renamed over the target, so a crash leaves the old file or the new one, never half.
// Supported dtypes: F64, F32, F16, BF16, I64, I32, BOOL; others (U8, I8, F8_E4M3, ...) are
// rejected by name. Any malformed or hostile file is rejected with a kiln::Error starting
// "[load_safetensors] <file>: ..." before a single tensor byte is read.
//
// Pitfalls:
// - Tensors from SafetensorsFile::get alias the file's mapping (copy-on-write, private to this
//   process) when their data is aligned to the element size; they keep the mapping alive.
//   Truncating the file in place while they live kills the process with SIGBUS when a page past
//   the new end is touched; get() checks the size first, but nothing can check later accesses.
//   Writing with save_safetensors is safe, since it replaces the file instead of changing it.
// - Everything else reads with pread into memory of its own (load_safetensors, read, read_all,
//   kiln::load, the header): a file truncated while open gives a kiln::Error "[load_safetensors]
//   <file>: truncated to N bytes since it was opened ...", and the tensors do not depend on the
//   file afterwards.
// - The file stores no strides: non-contiguous tensors are written in row-major order.
// - BOOL bytes other than 0 and 1 are rejected on load (they are not valid C++ bools).
#pragma once

#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "tensor/tensor.h"

namespace kiln {

// Tensors by name, ordered by name (the order of SafetensorsFile::keys() and of Python's
// safe_open(...).keys()); the order inside the file is not kept, as it carries no meaning.
using TensorMap = std::map<std::string, Tensor>;
using SafetensorsMetadata = std::map<std::string, std::string>;

// Writes `tensors` (any device; copied to the CPU and made contiguous one at a time) to `path`
// atomically. Throws kiln::Error "[save_safetensors] <path>: ..." on failure, leaving no
// temporary file behind and any previous file at `path` untouched.
void save_safetensors(const TensorMap& tensors, const std::string& path,
                      const SafetensorsMetadata& metadata = {});

// Writes `bytes` to `path` the same atomic way (temporary file beside it, fsync, rename,
// fsync of the directory); for the JSON files that accompany safetensors checkpoints. Errors
// start with "[<op>] <path>: ".
void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& op = "write_file_atomically");

// Reads the whole file at `path`. Errors start with "[<op>] <path>: " (cannot open, cannot
// read); for the JSON files read beside checkpoints and tokenizers.
std::string read_file(const std::string& path, const std::string& op = "read_file");

// Reads every tensor of the file at `path` onto `device` (SafetensorsFile::read_all: copies that
// do not depend on the file); fills `*metadata` when given.
TensorMap load_safetensors(const std::string& path, SafetensorsMetadata* metadata = nullptr,
                           Device device = kCPU);

// The same two in memory: the exact bytes a file would hold.
std::string save_safetensors_to_bytes(const TensorMap& tensors,
                                      const SafetensorsMetadata& metadata = {});
TensorMap load_safetensors_from_bytes(std::string_view bytes,
                                      SafetensorsMetadata* metadata = nullptr,
                                      Device device = kCPU);

// What the header says about one tensor, without reading its data.
struct SafetensorsTensorInfo {
  ScalarType dtype;
  Shape shape;
  uint64_t data_begin;  // byte offsets into the data buffer (after the header)
  uint64_t data_end;
};

// An open safetensors file: the header is parsed and validated on construction; tensors are
// read lazily by get() (zero-copy) or read() (a copy). Copies of the object share the open file
// and its mapping; tensors from get() outlive the object and share memory with each other
// (getting one key twice gives two views of the same bytes).
class SafetensorsFile {
 public:
  // Opens `path` read-only, keeps it open, reads the header with pread and maps the file (POSIX
  // mmap, private: writes to tensors from get() copy the touched pages and never reach the file).
  explicit SafetensorsFile(const std::string& path);
  // Copies `bytes` into an owned buffer; `name` stands for the file name in errors.
  static SafetensorsFile from_bytes(std::string_view bytes, std::string name = "<memory>");

  const std::string& name() const;
  // Tensor names in ascending order.
  const std::vector<std::string>& keys() const;
  bool contains(const std::string& key) const;
  const SafetensorsMetadata& metadata() const;
  const SafetensorsTensorInfo& info(const std::string& key) const;
  // The whole file as mapped (or copied by from_bytes): length, header, data.
  std::string_view bytes() const;

  // The tensor `key` on `device`. On the CPU it aliases the mapping when the data is aligned
  // to its element size, and is a copy otherwise. An unknown key fails listing the nearest.
  Tensor get(const std::string& key, Device device = kCPU) const;
  TensorMap get_all(Device device = kCPU) const;
  // The tensor `key` on `device`, always a copy read with pread: never touches the mapping, so
  // a file truncated since it was opened is an error naming the file and the tensor, not SIGBUS.
  // For callers that copy the data anyway (into a module, to another dtype or device).
  Tensor read(const std::string& key, Device device = kCPU) const;
  TensorMap read_all(Device device = kCPU) const;

 private:
  struct Impl;
  explicit SafetensorsFile(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace kiln
