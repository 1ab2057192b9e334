// Run configuration files (models/run_config.h): the settings table that both the reader and
// to_toml walk, so that a key is described once; toml++ parses, and formats the strings.
// Tests: tests/models/run_config_test.cpp. Docs: docs/models.md ("Run configuration files").
#include "models/run_config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "models/config.h"
#include "nn/safetensors.h"
#include "tensor/edit_distance.h"
#include "tensor/error.h"

namespace kiln::models {
namespace {

namespace fs = std::filesystem;

// "an integer 3", "a string \"x\"": what a node holds, for errors.
std::string describe(const toml::node& node) {
  std::ostringstream s;
  switch (node.type()) {
    case toml::node_type::table:
      return "a table";
    case toml::node_type::array:
      s << "an array ";
      break;
    case toml::node_type::string:
      s << "a string ";
      break;
    case toml::node_type::integer:
      s << "an integer ";
      break;
    case toml::node_type::floating_point:
      s << "a float ";
      break;
    case toml::node_type::boolean:
      s << "a boolean ";
      break;
    default:
      s << "a date or time ";
      break;
  }
  node.visit(
      [&](auto&& v) { s << toml::toml_formatter(v, toml::format_flags::allow_unicode_strings); });
  return s.str();
}

// The shortest text that reads back as exactly `v` ("0.003", "1e-08", "3.0": TOML floats need a
// fraction or an exponent).
std::string format_double(double v) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), v);
  std::string s(buf, end);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// A TOML basic string ("...", escapes as needed; toml++'s default would pick '...' where it can).
std::string format_string(const std::string& v) {
  std::ostringstream s;
  s << toml::toml_formatter(toml::value<std::string>(v), toml::format_flags::allow_unicode_strings);
  return s.str();
}

// Reads a node into the options; returns what is wrong (after the key's name: "must be ...")
// or "" when it is fine.
using Reader = std::function<std::string(const toml::node&, PretrainOptions&)>;
// The option as a TOML value; nullopt when it is unset (an optional option).
using Writer = std::function<std::optional<std::string>(const PretrainOptions&)>;

struct Setting {
  const char* table;
  const char* key;
  const char* comment;  // written after the value by to_toml; "" for none
  Reader read;
  Writer write;
};

std::string expected(const char* what, const toml::node& node) {
  return kiln::str("must be ", what, ", got ", describe(node));
}

std::optional<int64_t> as_int(const toml::node& node) {
  if (const auto* v = node.as_integer()) return v->get();
  return std::nullopt;
}

// A float, or an integer (weight_decay = 0).
std::optional<double> as_double(const toml::node& node) {
  if (const auto* v = node.as_floating_point()) return v->get();
  if (const auto* v = node.as_integer()) return static_cast<double>(v->get());
  return std::nullopt;
}

Setting int_setting(const char* table, const char* key, int64_t PretrainOptions::*member,
                    int64_t min, const char* comment) {
  return {table, key, comment,
          [member, min](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto v = as_int(node);
            if (!v) return expected("an integer", node);
            if (*v < min) {
              return kiln::str("must be ", min == 1 ? "positive" : ">= " + std::to_string(min),
                               ", got ", *v);
            }
            o.*member = *v;
            return "";
          },
          [member](const PretrainOptions& o) { return std::to_string(o.*member); }};
}

// A finite number >= min, or > min when `above`.
Setting double_setting(const char* table, const char* key, double PretrainOptions::*member,
                       double min, bool above, const char* comment) {
  return {table, key, comment,
          [member, min, above](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto v = as_double(node);
            if (!v) return expected("a number", node);
            if (!std::isfinite(*v) || *v < min || (above && *v == min)) {
              return kiln::str("must be a finite number ", above ? "> " : ">= ", min, ", got ",
                               describe(node));
            }
            o.*member = *v;
            return "";
          },
          [member](const PretrainOptions& o) { return format_double(o.*member); }};
}

Setting bool_setting(const char* table, const char* key, bool PretrainOptions::*member,
                     const char* comment) {
  return {table, key, comment,
          [member](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_boolean();
            if (v == nullptr) return expected("true or false", node);
            o.*member = v->get();
            return "";
          },
          [member](const PretrainOptions& o) { return std::string(o.*member ? "true" : "false"); }};
}

// One of `choices`.
Setting choice_setting(const char* table, const char* key, std::string PretrainOptions::*member,
                       std::vector<std::string> choices, const char* comment) {
  return {
      table, key, comment,
      [member, choices](const toml::node& node, PretrainOptions& o) -> std::string {
        std::string list;
        for (const auto& c : choices) list += (list.empty() ? "" : ", ") + format_string(c);
        const auto* v = node.as_string();
        if (v == nullptr || std::find(choices.begin(), choices.end(), v->get()) == choices.end()) {
          return kiln::str("must be one of ", list, ", got ", describe(node));
        }
        o.*member = v->get();
        return "";
      },
      [member](const PretrainOptions& o) { return format_string(o.*member); }};
}

Setting string_setting(const char* table, const char* key, std::string PretrainOptions::*member,
                       bool allow_empty, const char* comment) {
  return {table, key, comment,
          [member, allow_empty](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_string();
            if (v == nullptr) return expected("a string", node);
            if (!allow_empty && v->get().empty()) return "must not be empty";
            o.*member = v->get();
            return "";
          },
          [member, allow_empty](const PretrainOptions& o) -> std::optional<std::string> {
            if (!allow_empty && (o.*member).empty()) return std::nullopt;  // unset
            return format_string(o.*member);
          }};
}

// The model: a registered config's name. A hand-built config is written by its name.
Setting model_name_setting() {
  return {"model", "name", "a registered config (`kiln configs` lists them)",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_string();
            if (v == nullptr) return expected("a config name", node);
            const auto names = config_names();
            if (std::find(names.begin(), names.end(), v->get()) == names.end()) {
              std::string list;
              for (const auto& n : names) list += (list.empty() ? "" : ", ") + n;
              return kiln::str("must be a registered config (", list, "), got ", describe(node));
            }
            o.config_name = v->get();
            o.config.reset();
            o.hf_dir.clear();
            return "";
          },
          [](const PretrainOptions& o) -> std::optional<std::string> {
            if (!o.hf_dir.empty()) return std::nullopt;  // the model is model.hf's
            return format_string(o.config ? o.config->name : o.config_name);
          }};
}

// Or a Hugging Face checkpoint directory: its config, weights and tokenizer.
Setting model_hf_setting() {
  return {"model", "hf", "a Hugging Face checkpoint directory (instead of name)",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_string();
            if (v == nullptr) return expected("a directory", node);
            if (v->get().empty()) return "must not be empty";
            o.hf_dir = v->get();
            o.config.reset();
            return "";
          },
          [](const PretrainOptions& o) -> std::optional<std::string> {
            if (o.hf_dir.empty()) return std::nullopt;
            return format_string(o.hf_dir);
          }};
}

Setting device_setting() {
  return {"training", "device", "cpu | cuda | cuda:N; unset: cuda when available",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_string();
            const std::string bad = "must be \"cpu\", \"cuda\" or \"cuda:N\", got ";
            if (v == nullptr) return bad + describe(node);
            try {
              const Device d(std::string_view(v->get()));
              if (d.is_meta()) return bad + describe(node);
              o.device = d;
            } catch (const Error&) {
              return bad + describe(node);
            }
            return "";
          },
          [](const PretrainOptions& o) -> std::optional<std::string> {
            if (!o.device) return std::nullopt;
            return format_string(o.device->str());
          }};
}

// TOML integers are int64: a seed above that is written as a string of digits.
Setting seed_setting() {
  return {"training", "seed", "of the initialisation and the batches",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const std::string bad = "must be an integer in [0, 2^64), got ";
            if (const auto v = as_int(node)) {
              if (*v < 0) return bad + describe(node);
              o.seed = static_cast<uint64_t>(*v);
              return "";
            }
            if (const auto* v = node.as_string()) {
              const std::string& s = v->get();
              uint64_t seed = 0;
              const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), seed);
              if (s.empty() || ec != std::errc() || p != s.data() + s.size()) {
                return bad + describe(node);
              }
              o.seed = seed;
              return "";
            }
            return bad + describe(node);
          },
          [](const PretrainOptions& o) {
            if (o.seed > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
              return format_string(std::to_string(o.seed));
            }
            return std::to_string(o.seed);
          }};
}

Setting betas_setting() {
  return {"optimizer", "betas", "AdamW's [beta1, beta2], each in [0, 1)",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* a = node.as_array();
            const auto at = [&](size_t i) {
              return a != nullptr ? as_double(*a->get(i)) : std::nullopt;
            };
            if (a == nullptr || a->size() != 2 || !at(0) || !at(1)) {
              return expected("an array of two numbers", node);
            }
            const double b1 = *at(0), b2 = *at(1);
            if (!(b1 >= 0 && b1 < 1 && b2 >= 0 && b2 < 1)) {
              return kiln::str("must each be in [0, 1), got ", describe(node));
            }
            o.betas = {b1, b2};
            return "";
          },
          [](const PretrainOptions& o) {
            return "[" + format_double(std::get<0>(o.betas)) + ", " +
                   format_double(std::get<1>(o.betas)) + "]";
          }};
}

Setting adam_state_setting() {
  return {"optimizer", "adam_state",
          "AdamW's moments in \"f32\" or in the parameters' dtype (\"param\")",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_string();
            if (v == nullptr || (v->get() != "f32" && v->get() != "param")) {
              return "must be \"f32\" or \"param\", got " + describe(node);
            }
            o.adam_state_in_param_dtype = v->get() == "param";
            return "";
          },
          [](const PretrainOptions& o) {
            return format_string(o.adam_state_in_param_dtype ? "param" : "f32");
          }};
}

Setting progress_bar_setting() {
  return {"metrics", "progress_bar", "unset: a bar on a terminal, plain lines otherwise",
          [](const toml::node& node, PretrainOptions& o) -> std::string {
            const auto* v = node.as_boolean();
            if (v == nullptr) return expected("true or false", node);
            o.progress_bar = v->get();
            return "";
          },
          [](const PretrainOptions& o) -> std::optional<std::string> {
            if (!o.progress_bar) return std::nullopt;
            return std::string(*o.progress_bar ? "true" : "false");
          }};
}

// Every key, in the order to_toml writes them (tables contiguous).
const std::vector<Setting>& settings() {
  using P = PretrainOptions;
  static const std::vector<Setting> all = {
      model_name_setting(),
      model_hf_setting(),
      string_setting("data", "path", &P::data_path, false,
                     "text, .bin/.u16/.u32 tokens, or token shards (docs/data.md)"),
      int_setting("data", "batch_size", &P::batch_size, 1, "sequences per step (per rank)"),
      int_setting("data", "seq_len", &P::seq_len, 1, "tokens per sequence"),
      int_setting("training", "steps", &P::max_steps, 1, "the run ends after this step"),
      choice_setting("training", "precision", &P::precision, {"f32", "bf16-true", "bf16-mixed"},
                     "f32 | bf16-true | bf16-mixed"),
      device_setting(),
      bool_setting("training", "compile", &P::compile, "the step through kiln::compile"),
      choice_setting("training", "dist", &P::dist, {"", "ddp", "zero2", "zero3", "fsdp"},
                     "under `kiln run`; \"\" = one process"),
      int_setting("training", "grad_accum_steps", &P::grad_accum_steps, 1,
                  "micro-batches per step"),
      seed_setting(),
      bool_setting("training", "deterministic", &P::deterministic,
                   "deterministic algorithms: bit-exact runs and resumes on CUDA (slower)"),
      bool_setting("training", "skip_nonfinite", &P::skip_nonfinite,
                   "skip a step with a NaN or infinite loss or norm instead of stopping"),
      double_setting("optimizer", "lr", &P::lr, 0, true, "the peak learning rate"),
      double_setting("optimizer", "weight_decay", &P::weight_decay, 0, false,
                     "decoupled, on the 2-D weights only"),
      betas_setting(),
      double_setting("optimizer", "eps", &P::eps, 0, false, "AdamW's epsilon"),
      double_setting("optimizer", "grad_clip", &P::grad_clip, 0, false,
                     "the gradients' total norm; 0 = no clipping"),
      adam_state_setting(),
      int_setting("schedule", "warmup_steps", &P::warmup_steps, 0, "linear warm-up"),
      int_setting("schedule", "lr_decay_steps", &P::lr_decay_steps, 0,
                  "the cosine's length; 0 = training.steps"),
      double_setting("schedule", "min_lr", &P::min_lr, 0, false, "the cosine's floor, <= lr"),
      int_setting("metrics", "log_interval", &P::log_interval, 1, "a line every N steps"),
      int_setting("metrics", "eval_interval", &P::eval_interval, 0,
                  "validation every N steps; 0 = at the end only"),
      int_setting("metrics", "eval_batches", &P::eval_batches, 1, "validation batches"),
      progress_bar_setting(),
      string_setting("checkpoint", "out_dir", &P::out_dir, true, "\"\" = no checkpoints"),
      int_setting("checkpoint", "interval", &P::checkpoint_interval, 0,
                  "a checkpoint every N steps too; 0 = at the end only"),
      int_setting("checkpoint", "keep", &P::keep_checkpoints, 1, "checkpoints kept, the newest"),
  };
  return all;
}

const Setting* find_setting(const std::string& table, const std::string& key) {
  for (const Setting& s : settings()) {
    if (table == s.table && key == s.key) return &s;
  }
  return nullptr;
}

std::vector<std::string> table_names() {
  std::vector<std::string> names;
  for (const Setting& s : settings()) {
    if (names.empty() || names.back() != s.table) names.emplace_back(s.table);
  }
  return names;
}

std::string keys_of(const std::string& table) {
  std::string list;
  for (const Setting& s : settings()) {
    if (table == s.table) list += (list.empty() ? "" : ", ") + std::string(s.key);
  }
  return list;
}

// The tables that have a key of this name ("[optimizer]"), for a key put in the wrong place.
std::string tables_with(const std::string& key) {
  std::string list;
  for (const Setting& s : settings()) {
    if (key == s.key) list += (list.empty() ? "[" : " or [") + std::string(s.table) + "]";
  }
  return list;
}

// The closest of `names` to a misspelt `name` (at most 2 edits away), or "".
std::string closest(const std::string& name, const std::vector<std::string>& names) {
  std::string best;
  size_t best_distance = 3;
  for (const auto& n : names) {
    if (const size_t d = internal::edit_distance(name, n); d < best_distance)
      best = n, best_distance = d;
  }
  return best;
}

// What to say of a key that is no setting of its table.
std::string unknown_key(const std::string& table, const std::string& key) {
  if (key == "resume" || key == "allow_resume_changes") {
    std::string flag = key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    return kiln::str(table.empty() ? "" : table + ".", key, ": not a setting of the file; --", flag,
                     " is given on the command line");
  }
  const std::string elsewhere = tables_with(key);
  if (table.empty()) {
    if (!elsewhere.empty()) {
      return kiln::str(key, ": a key outside any table; it goes in ", elsewhere);
    }
    if (const std::string t = closest(key, table_names()); !t.empty()) {
      return kiln::str("unknown table [", key, "] (did you mean [", t, "]?)");
    }
    std::string list;
    for (const auto& t : table_names()) list += (list.empty() ? "[" : ", [") + t + "]";
    return kiln::str("unknown table [", key, "] (the tables: ", list, ")");
  }
  if (!elsewhere.empty()) {
    return kiln::str("unknown key ", table, ".", key, ": it goes in ", elsewhere);
  }
  std::vector<std::string> keys;
  for (const Setting& s : settings()) {
    if (table == s.table) keys.emplace_back(s.key);
  }
  if (const std::string k = closest(key, keys); !k.empty()) {
    return kiln::str("unknown key ", table, ".", key, " (did you mean ", k, "?)");
  }
  return kiln::str("unknown key ", table, ".", key, " (the keys of [", table, "]: ", keys_of(table),
                   ")");
}

struct Issue {
  int64_t line;
  std::string message;
};

}  // namespace

RunConfig parse_run_config(std::string_view text, const std::string& source,
                           const PretrainOptions& base) {
  toml::table doc;
  try {
    doc = toml::parse(text, std::string_view(source));
  } catch (const toml::parse_error& e) {
    KILN_FAIL("[run_config] ", source, ":", e.source().begin.line, ":", e.source().begin.column,
              ": ", e.description());
  }
  RunConfig rc{base, {}};
  std::vector<Issue> issues;
  std::map<std::string, int64_t> lines;  // of the keys set
  for (auto&& [table_key, table_node] : doc) {
    const std::string table(table_key.str());
    const int64_t table_line = table_node.source().begin.line;
    const auto names = table_names();
    if (std::find(names.begin(), names.end(), table) == names.end()) {
      issues.push_back({table_line, unknown_key("", table)});
      continue;
    }
    const toml::table* t = table_node.as_table();
    if (t == nullptr) {
      issues.push_back({table_line, kiln::str(table, " must be a table ([", table, "]), got ",
                                              describe(table_node))});
      continue;
    }
    for (auto&& [key_key, node] : *t) {
      const std::string key(key_key.str());
      const int64_t line = node.source().begin.line;
      const Setting* setting = find_setting(table, key);
      if (setting == nullptr) {
        issues.push_back({line, unknown_key(table, key)});
        continue;
      }
      const std::string full = table + "." + key;
      if (std::string error = setting->read(node, rc.options); !error.empty()) {
        issues.push_back({line, full + " " + error});
        continue;
      }
      rc.keys.insert(full);
      lines[full] = line;
    }
  }
  // Between keys: the schedule's floor is at most its peak (when the file sets both; otherwise
  // PretrainOptions::validate checks the options that the flags complete).
  if (rc.has("optimizer.lr") && rc.has("schedule.min_lr") && rc.options.min_lr > rc.options.lr) {
    issues.push_back({lines["schedule.min_lr"],
                      kiln::str("schedule.min_lr ", rc.options.min_lr, " exceeds optimizer.lr ",
                                rc.options.lr, " (line ", lines["optimizer.lr"], ")")});
  }
  if (rc.has("model.name") && rc.has("model.hf")) {
    issues.push_back(
        {lines["model.hf"], kiln::str("model.hf and model.name (line ", lines["model.name"],
                                      ") both name the model: give one")});
  }
  if (!issues.empty()) {
    std::stable_sort(issues.begin(), issues.end(),
                     [](const Issue& a, const Issue& b) { return a.line < b.line; });
    std::string message;
    for (const Issue& i : issues) {
      message += kiln::str(message.empty() ? "" : "\n", "[run_config] ", source, ":", i.line, ": ",
                           i.message);
    }
    KILN_FAIL(message);
  }
  return rc;
}

RunConfig read_run_config(const std::string& path, const PretrainOptions& base) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  KILN_CHECK(fs::exists(status), "[run_config] ", path, ": no such file");
  KILN_CHECK(!fs::is_directory(status), "[run_config] ", path,
             ": is a directory, not a TOML file (its run configuration is ", path, "/",
             kRunConfigFile, " if it is a checkpoint directory)");
  // A FIFO or a device would block or never end.
  KILN_CHECK(fs::is_regular_file(status), "[run_config] ", path, ": not a regular file");
  return parse_run_config(read_file(path, "run_config"), path, base);
}

std::string to_toml(const PretrainOptions& options) {
  std::ostringstream s;
  s << "# kiln pretrain's run configuration (docs/models.md, \"Run configuration files\").\n"
       "# `kiln pretrain --config <this file>` repeats the run; flags given with it override it.\n";
  if (options.config) {
    const auto names = config_names();
    if (std::find(names.begin(), names.end(), options.config->name) == names.end()) {
      s << "# The model was a hand-built config named \"" << options.config->name
        << "\": register it (register_config) to read this file.\n";
    }
  }
  std::string table;
  for (const Setting& setting : settings()) {
    if (table != setting.table) {
      table = setting.table;
      s << "\n[" << table << "]\n";
    }
    const std::optional<std::string> value = setting.write(options);
    std::string line = value ? std::string(setting.key) + " = " + *value
                             : "# " + std::string(setting.key) + " unset";
    if (*setting.comment != '\0') {
      line.resize(std::max<size_t>(line.size(), 28), ' ');
      line += std::string("  # ") + setting.comment;
    }
    s << line << "\n";
  }
  return s.str();
}

void write_run_config(const std::string& dir, const PretrainOptions& options) {
  write_file_atomically((fs::path(dir) / kRunConfigFile).string(), to_toml(options), "pretrain");
}

}  // namespace kiln::models
