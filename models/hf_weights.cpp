// Hugging Face weights: the HF <-> kiln tensor name plan (q/k/v rows, per-family norms, padded
// vocab rows), the state-dict conversions, and the single-file / sharded safetensors
// checkpoints of transformers (the index on load, greedy shards on save). config.json:
// models/hf_config.cpp; API: models/hf.h.
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "autograd/grad_mode.h"
#include "models/hf.h"
#include "nn/json.h"
#include "nn/safetensors.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;
using nn::json_string;
using nn::JsonError;
using nn::JsonReader;

// ================================ tensor names ================================

// One kiln tensor and the HF tensors it is made of (row blocks, in order). A vocab entry has
// vocab_size rows in HF and padded_vocab rows in kiln.
struct Entry {
  std::string kiln;
  std::vector<std::string> hf;
  std::vector<Shape> hf_shapes;
  bool vocab_rows = false;
};

std::vector<Entry> name_plan(const ModelConfig& cfg, const char* op) {
  KILN_CHECK(cfg.post_attention_norm == cfg.post_mlp_norm, "[", op, "] ", cfg.name,
             ": Hugging Face checkpoints have both post norms (Gemma 2) or neither");
  const int64_t d = cfg.n_embd, hs = cfg.head_dim(), ffn = cfg.intermediate_size;
  const Shape vec{d};
  std::vector<Entry> plan;
  plan.push_back(
      {"transformer.wte.weight", {"model.embed_tokens.weight"}, {{cfg.vocab_size, d}}, true});
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    const std::string k = "transformer.h." + std::to_string(i) + ".";
    const std::string h = "model.layers." + std::to_string(i) + ".";
    plan.push_back({k + "norm_1.weight", {h + "input_layernorm.weight"}, {vec}});
    plan.push_back(
        {k + "attn.qkv.weight",
         {h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight",
          h + "self_attn.v_proj.weight"},
         {{cfg.n_head * hs, d}, {cfg.n_query_groups * hs, d}, {cfg.n_query_groups * hs, d}}});
    plan.push_back(
        {k + "attn.proj.weight", {h + "self_attn.o_proj.weight"}, {{d, cfg.n_head * hs}}});
    if (cfg.post_attention_norm) {
      plan.push_back(
          {k + "post_attention_norm.weight", {h + "post_attention_layernorm.weight"}, {vec}});
      plan.push_back({k + "norm_2.weight", {h + "pre_feedforward_layernorm.weight"}, {vec}});
      plan.push_back(
          {k + "post_mlp_norm.weight", {h + "post_feedforward_layernorm.weight"}, {vec}});
    } else {
      plan.push_back({k + "norm_2.weight", {h + "post_attention_layernorm.weight"}, {vec}});
    }
    plan.push_back({k + "mlp.fc_1.weight", {h + "mlp.gate_proj.weight"}, {{ffn, d}}});
    plan.push_back({k + "mlp.fc_2.weight", {h + "mlp.up_proj.weight"}, {{ffn, d}}});
    plan.push_back({k + "mlp.proj.weight", {h + "mlp.down_proj.weight"}, {{d, ffn}}});
  }
  plan.push_back({"transformer.ln_f.weight", {"model.norm.weight"}, {vec}});
  if (!cfg.tie_embeddings) {
    plan.push_back({"lm_head.weight", {"lm_head.weight"}, {{cfg.vocab_size, d}}, true});
  }
  return plan;
}

// Tensors a checkpoint may carry that kiln does not need.
bool ignorable(const std::string& hf_name, const ModelConfig& cfg) {
  const std::string inv = "rotary_emb.inv_freq";
  if (hf_name.size() >= inv.size() && hf_name.ends_with(inv)) return true;
  return cfg.tie_embeddings && hf_name == "lm_head.weight";
}

// Checks a checkpoint's names and shapes against the plan; "" when it fits, else a message
// listing every problem.
std::string check_names(const std::vector<Entry>& plan, const std::map<std::string, Shape>& have,
                        const ModelConfig& cfg) {
  std::vector<std::string> missing, mis_shaped, unexpected;
  std::set<std::string> used;
  for (const Entry& e : plan) {
    for (size_t j = 0; j < e.hf.size(); ++j) {
      used.insert(e.hf[j]);
      auto it = have.find(e.hf[j]);
      if (it == have.end()) {
        missing.push_back(e.hf[j]);
      } else if (it->second != e.hf_shapes[j]) {
        mis_shaped.push_back(e.hf[j] + " is " + shape_str(it->second) + ", expected " +
                             shape_str(e.hf_shapes[j]));
      }
    }
  }
  for (const auto& [name, shape] : have) {
    if (!used.contains(name) && !ignorable(name, cfg)) unexpected.push_back(name);
  }
  std::string msg;
  auto list = [&](const char* what, const std::vector<std::string>& names) {
    if (names.empty()) return;
    msg +=
        std::string(msg.empty() ? "" : "; ") + what + " (" + std::to_string(names.size()) + "): ";
    for (size_t i = 0; i < names.size(); ++i) msg += (i ? ", " : "") + names[i];
  };
  list("missing tensors", missing);
  list("unexpected tensors", unexpected);
  list("mis-shaped tensors", mis_shaped);
  return msg;
}

std::map<std::string, Tensor> parameters_of(const GPTImpl& model) {
  std::map<std::string, Tensor> params;
  for (const auto& item : model.named_parameters()) params.emplace(item.key(), item.value());
  return params;
}

// The model's tensors under HF names, in plan order (layer by layer, for contiguous shards).
std::vector<std::pair<std::string, Tensor>> hf_tensors(const GPTImpl& model, const char* op) {
  const ModelConfig& cfg = model.config();
  const std::map<std::string, Tensor> params = parameters_of(model);
  std::vector<std::pair<std::string, Tensor>> out;
  for (const Entry& e : name_plan(cfg, op)) {
    auto it = params.find(e.kiln);
    KILN_CHECK(it != params.end(), "[", op, "] ", cfg.name, ": the model has no parameter ",
               e.kiln);
    const Tensor t = it->second.detach();
    int64_t row = 0;
    for (size_t j = 0; j < e.hf.size(); ++j) {
      const int64_t rows = e.hf_shapes[j][0];
      out.emplace_back(e.hf[j], t.narrow(0, row, rows));
      row += rows;
    }
  }
  return out;
}

// ================================ checkpoint files ================================

struct IndexJson {
  std::vector<std::pair<std::string, std::string>> weight_map;  // tensor -> shard file
};

IndexJson parse_index(const std::string& text) {
  IndexJson index;
  bool has_map = false;
  JsonReader r(text);
  r.begin_object();
  while (auto key = r.next_key()) {
    if (*key != "weight_map") {
      r.skip_value();
      continue;
    }
    has_map = true;
    r.begin_object();
    while (auto name = r.next_key()) {
      if (r.peek_kind() != '"') r.fail("weight_map['" + *name + "'] is not a string");
      index.weight_map.emplace_back(*name, r.read_string());
    }
  }
  r.end_document();
  if (!has_map) r.fail("no 'weight_map' object");
  return index;
}

// The safetensors files of a checkpoint and which tensor lives where.
struct Checkpoint {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> where;  // tensor -> index into files
};

Checkpoint open_checkpoint(const std::string& path) {
  constexpr const char* op = "load_hf_weights";
  fs::path p(path);
  std::error_code ec;
  std::optional<fs::path> index_path;
  Checkpoint ck;
  if (fs::is_directory(p, ec)) {
    if (fs::exists(p / "model.safetensors", ec)) {
      p = p / "model.safetensors";
    } else if (fs::exists(p / "model.safetensors.index.json", ec)) {
      index_path = p / "model.safetensors.index.json";
    } else {
      KILN_FAIL("[", op, "] ", path,
                ": no model.safetensors or model.safetensors.index.json in this directory");
    }
  } else if (p.extension() == ".json") {
    index_path = p;
  }
  if (!index_path) {
    KILN_CHECK(fs::exists(p, ec), "[", op, "] ", p.string(), ": no such file");
    ck.files.emplace_back(p.string());
    for (const std::string& k : ck.files[0].keys()) ck.where.emplace(k, 0);
    return ck;
  }

  const std::string ipath = index_path->string();
  IndexJson index;
  try {
    index = parse_index(read_file(ipath, op));
  } catch (const JsonError& e) {
    KILN_FAIL("[", op, "] ", ipath, ": malformed index: ", e.what());
  }
  std::map<std::string, size_t> file_of_name;
  for (const auto& [tensor, file] : index.weight_map) {
    // Shards live beside the index: a hostile index must not name files elsewhere.
    KILN_CHECK(!file.empty() && file.find('/') == std::string::npos &&
                   file.find('\\') == std::string::npos && file != "." && file != "..",
               "[", op, "] ", ipath, ": weight_map['", tensor, "'] names '", file,
               "', which is not a file name beside the index");
    if (!file_of_name.contains(file)) {
      const fs::path shard = index_path->parent_path() / file;
      KILN_CHECK(fs::exists(shard, ec), "[", op, "] ", ipath, ": names the shard '", file,
                 "', which does not exist");
      file_of_name.emplace(file, ck.files.size());
      ck.files.emplace_back(shard.string());
    }
  }
  KILN_CHECK(!ck.files.empty(), "[", op, "] ", ipath, ": the weight_map is empty");
  for (size_t f = 0; f < ck.files.size(); ++f) {
    for (const std::string& k : ck.files[f].keys()) {
      auto [it, fresh] = ck.where.emplace(k, f);
      KILN_CHECK(fresh, "[", op, "] ", ipath, ": tensor ", k, " is in both ",
                 ck.files[it->second].name(), " and ", ck.files[f].name());
    }
  }
  for (const auto& [tensor, file] : index.weight_map) {
    const size_t f = file_of_name.at(file);
    KILN_CHECK(ck.files[f].contains(tensor), "[", op, "] ", ipath, ": weight_map puts ", tensor,
               " in ", file, ", which does not contain it");
  }
  return ck;
}

// ================================ publishing ================================
//
// A save replaces the checkpoint directory `dir` as a whole, so that a save killed at any point
// leaves the previous checkpoint or the new one, never a mix of their files:
//  1. the new checkpoint is written into a sibling ".<name>.kiln-new-<pid>-<nonce>" (each file
//     fsynced, then the directory), with the files of `dir` that are not checkpoint files
//     (tokenizer.json, README.md, ...) hard-linked or copied in;
//  2. one renameat2(RENAME_EXCHANGE) swaps it with `dir`: `dir` holds the old checkpoint, then
//     the new one, at every instant; the sibling, which now holds the old one, is removed.
// Where the file system cannot exchange two directories (NFS, some FUSE file systems), two
// renames: `dir` -> ".<name>.kiln-old-<pid>-<nonce>", then the new one -> `dir`. Between them
// `dir` is missing, and loads read the aside copy (readable_dir).
// The next save into `dir` removes the siblings a killed save left (or renames an aside copy back
// when `dir` is missing), once the process that made them is gone.

internal::HfPublishHooks g_publish_hooks;

void publish_step(const char* step) {
  if (g_publish_hooks.at_step) g_publish_hooks.at_step(step);
}

// The files a save writes (and their write_file_atomically temporaries): not carried over from
// the previous checkpoint.
bool is_checkpoint_file(std::string name) {
  if (const size_t tmp = name.find(".tmp."); tmp != std::string::npos) name.resize(tmp);
  return name == "config.json" || name == "model.safetensors" ||
         name == "model.safetensors.index.json" ||
         (name.starts_with("model-") && name.ends_with(".safetensors") &&
          name.find("-of-") != std::string::npos);
}

std::string sibling_prefix(const fs::path& dir, const char* kind) {
  return "." + dir.filename().string() + ".kiln-" + kind + "-";
}

fs::path sibling(const fs::path& dir, const char* kind) {
  std::random_device rd;
  char nonce[32];
  std::snprintf(nonce, sizeof(nonce), "%ld-%08x%08x", static_cast<long>(::getpid()), rd(), rd());
  return dir.parent_path() / (sibling_prefix(dir, kind) + nonce);
}

// The pid in a sibling's name ("<prefix><pid>-<nonce>"), or -1.
long sibling_pid(const std::string& name, const std::string& prefix) {
  if (!name.starts_with(prefix)) return -1;
  const char* begin = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  long pid = -1;
  const auto [p, ec] = std::from_chars(begin, end, pid);
  return ec == std::errc() && p != begin && p != end && *p == '-' && pid > 0 ? pid : -1;
}

// Siblings of this process are in use by a save running in another thread (a failed save removes
// its own); those of a live process may be too.
bool process_is_gone(long pid) {
  return pid != ::getpid() && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

void fsync_path(const fs::path& p, bool directory, const char* op) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  KILN_CHECK(fd >= 0, "[", op, "] ", p.string(), ": cannot open to fsync: ", std::strerror(errno));
  // Some file systems cannot fsync a directory (EINVAL); the data is as durable as they allow.
  const bool ok = ::fsync(fd) == 0 || (directory && errno == EINVAL);
  const int err = errno;
  ::close(fd);
  KILN_CHECK(ok, "[", op, "] ", p.string(), ": cannot fsync: ", std::strerror(err));
}

// Removes what killed saves into `dir` left beside it; an aside copy of the previous checkpoint
// goes back into place when `dir` is missing.
void recover_interrupted_saves(const fs::path& dir, const char* op) {
  std::error_code ec;
  const std::string new_prefix = sibling_prefix(dir, "new"),
                    old_prefix = sibling_prefix(dir, "old");
  std::vector<fs::path> fresh, aside;
  for (const auto& e : fs::directory_iterator(dir.parent_path(), ec)) {
    const std::string n = e.path().filename().string();
    if (long pid = sibling_pid(n, new_prefix); pid >= 0 && process_is_gone(pid)) {
      fresh.push_back(e.path());
    } else if (long pid2 = sibling_pid(n, old_prefix); pid2 >= 0 && process_is_gone(pid2)) {
      aside.push_back(e.path());
    }
  }
  for (const fs::path& p : fresh) fs::remove_all(p, ec);
  // The newest aside copy is the one to put back, should there be several.
  std::sort(aside.begin(), aside.end(), [](const fs::path& a, const fs::path& b) {
    std::error_code e;
    return fs::last_write_time(a, e) > fs::last_write_time(b, e);
  });
  for (const fs::path& p : aside) {
    if (!fs::exists(fs::symlink_status(dir, ec))) {
      KILN_CHECK(::rename(p.c_str(), dir.c_str()) == 0, "[", op, "] ", dir.string(),
                 ": cannot put back the previous checkpoint from ", p.string(), ": ",
                 std::strerror(errno));
      fsync_path(dir.parent_path(), true, op);
    } else {
      fs::remove_all(p, ec);
    }
  }
}

// Carries `src` (a file, link or directory of the previous checkpoint that is not one of its
// weight files) into the new one: a hard link where possible, else a copy.
void carry_over(const fs::path& src, const fs::path& dst, const char* op) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(src, ec);
  if (fs::is_directory(st)) {
    fs::create_directory(dst, src, ec);
    KILN_CHECK(!ec, "[", op, "] cannot create ", dst.string(), ": ", ec.message());
    for (const auto& e : fs::directory_iterator(src, ec)) {
      carry_over(e.path(), dst / e.path().filename(), op);
    }
    KILN_CHECK(!ec, "[", op, "] cannot list ", src.string(), ": ", ec.message());
    fsync_path(dst, true, op);
    return;
  }
  fs::create_hard_link(src, dst, ec);
  if (!ec) return;
  if (fs::is_symlink(st)) {
    fs::copy_symlink(src, dst, ec);
  } else {
    fs::copy_file(src, dst, ec);
    if (!ec) fsync_path(dst, false, op);
  }
  KILN_CHECK(!ec, "[", op, "] cannot carry ", src.string(),
             " over into the new checkpoint: ", ec.message());
}

// Puts the complete directory `staged` in the place of `dir` (see the top of this section).
void publish(const fs::path& staged, const fs::path& dir, const char* op) {
  std::error_code ec;
  const fs::path parent = dir.parent_path();
  if (!fs::exists(fs::symlink_status(dir, ec))) {
    KILN_CHECK(::rename(staged.c_str(), dir.c_str()) == 0, "[", op, "] ", dir.string(),
               ": cannot rename ", staged.string(), " into place: ", std::strerror(errno));
    fsync_path(parent, true, op);
    publish_step("published");
    return;
  }
  bool exchanged = false;
#ifdef RENAME_EXCHANGE
  if (!g_publish_hooks.two_renames) {
    exchanged = ::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0;
    KILN_CHECK(exchanged || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP, "[", op,
               "] ", dir.string(), ": cannot swap in ", staged.string(), ": ",
               std::strerror(errno));
  }
#endif
  if (exchanged) {
    fsync_path(parent, true, op);
    publish_step("published");
    fs::remove_all(staged, ec);  // the previous checkpoint; a later save retries on failure
    publish_step("cleaned");
    return;
  }
  const fs::path old = sibling(dir, "old");
  KILN_CHECK(::rename(dir.c_str(), old.c_str()) == 0, "[", op, "] ", dir.string(),
             ": cannot move the previous checkpoint aside to ", old.string(), ": ",
             std::strerror(errno));
  fsync_path(parent, true, op);
  publish_step("moved-aside");
  if (::rename(staged.c_str(), dir.c_str()) != 0) {
    const int err = errno;
    if (::rename(old.c_str(), dir.c_str()) == 0) fsync_path(parent, true, op);
    KILN_FAIL("[", op, "] ", dir.string(), ": cannot rename ", staged.string(),
              " into place: ", std::strerror(err));
  }
  fsync_path(parent, true, op);
  publish_step("published");
  fs::remove_all(old, ec);
  publish_step("cleaned");
}

// `dir`, or while a save in two-renames mode is between its renames (or was killed there), the
// aside copy of the previous checkpoint.
fs::path readable_dir(const fs::path& dir) {
  std::error_code ec;
  if (dir.empty() || fs::exists(dir, ec)) return dir;
  const fs::path abs = fs::absolute(dir, ec).lexically_normal();
  const fs::path d = abs.has_filename() ? abs : abs.parent_path();
  const std::string prefix = sibling_prefix(d, "old");
  std::optional<fs::path> newest;
  fs::file_time_type newest_time{};
  for (const auto& e : fs::directory_iterator(d.parent_path(), ec)) {
    if (sibling_pid(e.path().filename().string(), prefix) < 0) continue;
    const fs::file_time_type t = fs::last_write_time(e.path(), ec);
    if (!ec && (!newest || t > newest_time)) newest = e.path(), newest_time = t;
  }
  return newest.value_or(dir);
}

}  // namespace

// ================================ public API ================================

TensorMap from_hf_state_dict(const TensorMap& hf, const ModelConfig& config) {
  config.validate();
  const std::vector<Entry> plan = name_plan(config, "from_hf_state_dict");
  std::map<std::string, Shape> have;
  for (const auto& [name, t] : hf) have.emplace(name, to_shape(t.sizes()));
  const std::string problems = check_names(plan, have, config);
  KILN_CHECK(problems.empty(), "[from_hf_state_dict] ", config.name, ": ", problems);
  TensorMap out;
  for (const Entry& e : plan) {
    Tensor t;
    if (e.hf.size() == 1) {
      t = hf.at(e.hf[0]);
    } else {
      std::vector<Tensor> parts;
      for (const std::string& n : e.hf) parts.push_back(hf.at(n).to(hf.at(e.hf[0]).dtype()));
      t = cat(parts, 0);
    }
    if (e.vocab_rows && config.padded_vocab() > config.vocab_size) {
      t = cat({t, zeros({config.padded_vocab() - config.vocab_size, config.n_embd}, t.options())},
              0);
    }
    out.emplace(e.kiln, t);
  }
  return out;
}

TensorMap to_hf_state_dict(const GPTImpl& model) {
  TensorMap out;
  for (auto& [name, t] : hf_tensors(model, "to_hf_state_dict")) out.emplace(name, t);
  return out;
}

void load_hf_weights(GPTImpl& model, const std::string& path) {
  constexpr const char* op = "load_hf_weights";
  const ModelConfig& cfg = model.config();
  const std::vector<Entry> plan = name_plan(cfg, op);
  Checkpoint ck = open_checkpoint(readable_dir(path).string());
  std::map<std::string, Shape> have;
  for (const auto& [name, f] : ck.where) have.emplace(name, ck.files[f].info(name).shape);
  const std::string problems = check_names(plan, have, cfg);
  KILN_CHECK(problems.empty(), "[", op, "] ", path, ": does not fit ", cfg.name, ": ", problems);
  // Weights are floating point: an integer tensor would convert without a word.
  std::string not_float;
  for (const Entry& e : plan) {
    for (const std::string& n : e.hf) {
      const ScalarType t = ck.files[ck.where.at(n)].info(n).dtype;
      if (!is_floating_point(t))
        not_float += kiln::str(not_float.empty() ? "" : ", ", n, " (", dtype_name(t), ")");
    }
  }
  KILN_CHECK(not_float.empty(), "[", op, "] ", path,
             ": weights that are not floating point: ", not_float);

  std::map<std::string, Tensor> params = parameters_of(model);
  // Where each HF tensor goes: a row block of one parameter.
  struct Target {
    Tensor dst;
    std::string hf;
  };
  std::vector<std::vector<Target>> by_file(ck.files.size());
  for (const Entry& e : plan) {
    auto it = params.find(e.kiln);
    KILN_CHECK(it != params.end(), "[", op, "] ", cfg.name, ": the model has no parameter ",
               e.kiln);
    const Tensor& p = it->second;
    int64_t row = 0;
    for (size_t j = 0; j < e.hf.size(); ++j) {
      const int64_t rows = e.hf_shapes[j][0];
      by_file[ck.where.at(e.hf[j])].push_back({p.narrow(0, row, rows), e.hf[j]});
      row += rows;
    }
  }
  NoGradGuard no_grad;
  for (size_t f = 0; f < ck.files.size(); ++f) {
    for (Target& t : by_file[f]) {
      // read, not get: a copy anyway, and a shard truncated meanwhile is an error, not SIGBUS.
      t.dst.copy_(ck.files[f].read(t.hf).to(t.dst.device(), t.dst.dtype()));
    }
  }
  if (cfg.padded_vocab() > cfg.vocab_size) {
    const int64_t pad = cfg.padded_vocab() - cfg.vocab_size;
    params.at("transformer.wte.weight").narrow(0, cfg.vocab_size, pad).zero_();
    if (!cfg.tie_embeddings) params.at("lm_head.weight").narrow(0, cfg.vocab_size, pad).zero_();
  }
}

GPT load_hf_checkpoint(const std::string& dir, const TensorOptions& options) {
  const fs::path d = readable_dir(dir);
  const ModelConfig cfg = ModelConfig::from_hf_config((d / "config.json").string());
  GPT model(cfg, options);
  load_hf_weights(*model, d.string());
  return model;
}

void save_hf_checkpoint(const GPTImpl& model, const std::string& dir, int64_t max_shard_bytes) {
  constexpr const char* op = "save_hf_checkpoint";
  KILN_CHECK(max_shard_bytes > 0, "[", op, "] max_shard_bytes must be positive, got ",
             max_shard_bytes);
  KILN_CHECK(!dir.empty(), "[", op, "] the directory name is empty");
  const std::vector<std::pair<std::string, Tensor>> tensors = hf_tensors(model, op);
  const ScalarType dtype = tensors.front().second.dtype();
  const std::string config_json = to_hf_config_json(model.config(), dtype);
  std::error_code ec;
  // The directory itself is replaced, so its name must be its own: "out/ckpt/." is "out/ckpt",
  // and a symbolic link is followed to the directory it names.
  fs::path d = fs::absolute(dir).lexically_normal();
  if (!d.has_filename()) d = d.parent_path();
  if (fs::is_symlink(fs::symlink_status(d, ec))) {
    d = fs::canonical(d, ec);
    KILN_CHECK(!ec, "[", op, "] ", dir, ": a symbolic link to nothing (", ec.message(), ")");
  }
  KILN_CHECK(d != d.root_path(), "[", op, "] ", dir, ": cannot replace the root directory");
  fs::create_directories(d.parent_path(), ec);
  KILN_CHECK(fs::is_directory(d.parent_path(), ec), "[", op, "] ", dir,
             ": cannot create the parent directory ", d.parent_path().string());
  recover_interrupted_saves(d, op);
  const bool replacing = fs::exists(d, ec);
  KILN_CHECK(!replacing || fs::is_directory(d, ec), "[", op, "] ", dir,
             ": exists and is not a directory");

  const fs::path staged = sibling(d, "new");
  fs::create_directory(staged, ec);
  KILN_CHECK(!ec, "[", op, "] cannot create ", staged.string(), ": ", ec.message());
  // Whatever happens, `staged` goes: it holds the new checkpoint until it is in place, and after
  // an exchange the previous one.
  struct RemoveOnExit {
    fs::path p;
    ~RemoveOnExit() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } guard{staged};
  if (replacing) {
    // The replacement keeps the permissions of the directory it replaces.
    fs::permissions(staged, fs::status(d).permissions(), ec);
    for (const auto& e : fs::directory_iterator(d)) {
      if (!is_checkpoint_file(e.path().filename().string())) {
        carry_over(e.path(), staged / e.path().filename(), op);
      }
    }
  }

  // Greedy shards in layer order, as transformers' save_pretrained: a tensor larger than
  // max_shard_bytes gets a shard of its own.
  std::vector<TensorMap> shards(1);
  int64_t shard_bytes = 0, total = 0;
  for (const auto& [name, t] : tensors) {
    const auto bytes = static_cast<int64_t>(t.nbytes());
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().emplace(name, t);
    shard_bytes += bytes;
    total += bytes;
  }
  const SafetensorsMetadata meta{{"format", "pt"}};
  if (shards.size() == 1) {
    save_safetensors(shards[0], (staged / "model.safetensors").string(), meta);
  } else {
    std::map<std::string, std::string> weight_map;
    char buf[64];
    for (size_t s = 0; s < shards.size(); ++s) {
      std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
      save_safetensors(shards[s], (staged / buf).string(), meta);
      for (const auto& [name, t] : shards[s]) weight_map.emplace(name, buf);
    }
    std::string index = "{\n  \"metadata\": {\n    \"total_size\": " + std::to_string(total) +
                        "\n  },\n  \"weight_map\": {";
    bool first = true;
    for (const auto& [name, file] : weight_map) {
      index +=
          std::string(first ? "" : ",") + "\n    " + json_string(name) + ": " + json_string(file);
      first = false;
    }
    index += "\n  }\n}\n";
    write_file_atomically((staged / "model.safetensors.index.json").string(), index, op);
  }
  write_file_atomically((staged / "config.json").string(), config_json, op);
  fsync_path(staged, true, op);
  publish_step("staged");
  // A process whose working directory is `dir` would stay in the replaced one, removed: it
  // follows the name instead, so that "." keeps meaning the checkpoint.
  const bool in_dir = fs::current_path(ec) == d;
  publish(staged, d, op);
  if (in_dir) fs::current_path(d, ec);
}

namespace internal {

void set_hf_publish_hooks(const HfPublishHooks& hooks) { g_publish_hooks = hooks; }

}  // namespace internal

}  // namespace kiln::models
